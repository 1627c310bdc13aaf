"""The static-buffer decode engine (generate.py's StaticDecoder) against the eager loop and the no-cache reference:
greedy generations token for token equal across ragged prompts, several batch buckets (padding rows included), a
sequence ending mid-batch on end-of-text, prompts waiting for a row (continuous batching), contiguous and paged
caches, GQA-family and MLA models. On the CPU the static step runs without capture (engine="static"): the bucket
padding, the in-place position and table updates and the device-side sampling are what these tests check. The
tests marked gpu replay the same step from CUDA graphs (engine="graphs"), which exist only on a GPU."""

import pytest
import torch
from conftest import DEVICE, TOLERANCES
from test_generation import CACHES, LOGIT_TOLERANCES, TRITON_DTYPE, _checkpoint, prompts, tiny_model

import sample
from generate import batch_buckets, compile_model, generate, sample_next

PROMPT_LENS = (7, 3, 12, 5, 9, 1, 4)  # ragged, with a one-token prompt
MAX_NEW = [8, 5, 8, 3, 8, 6, 2]  # one per prompt: rows end at different steps
GPU = DEVICE == "cuda"
NEEDS_GRAPHS = "CUDA graphs need a CUDA device; the static-engine tests run the same step on the CPU"


def model(variant: str, backend: str = "torch", dtype=torch.float32, head: str = "random", n_layer: int = 2):
    """test_generation's tiny model with an output head of its own (untied), so that greedy tokens depend on the
    context. "random" for fp32 runs (the smallest top-2 logit margin in the runs below is ~3e-3, far above fp32
    rounding); "permuted", wte's rows in another order, for fp16 runs: the next token is then a fixed function of
    the last one with margins of several units, which rounding never decides (the logit tests check the cache)."""
    net = tiny_model(variant, backend, dtype, n_layer=n_layer)
    g = torch.Generator().manual_seed(1)
    shape = net.lm_head.weight.shape
    if head == "random":
        w = torch.randn(shape, generator=g) * 0.5
    else:
        w = net.transformer.wte.weight.detach().float().cpu()[torch.randperm(shape[0], generator=g)]
    net.lm_head.weight = torch.nn.Parameter(w.to(DEVICE, dtype))
    return net


def _reference(variant: str, head: str = "random", dtype=torch.float32):
    """The no-cache reference (the plain PyTorch model, full forward every step) and an end-of-text token taken
    from its own output, so that a sequence stops on it mid-batch after a decode step (others may stop on it too,
    wherever it occurs first)."""
    plain = model(variant, "torch", dtype, head)
    ps = prompts(PROMPT_LENS, seed=2)
    free, _ = generate(plain, ps, "none", max_new_tokens=MAX_NEW)
    eot = next(o[2] for o in free if len(o) > 2 and o[2] not in o[:2])
    ref, _ = generate(plain, ps, "none", max_new_tokens=MAX_NEW, eot_token=eot)
    assert any(0 < len(o) < m for o, m in zip(ref, MAX_NEW)), "a sequence must stop on end-of-text, mid-batch"
    return ps, eot, ref


def _cases():
    for variant, kinds in CACHES.items():
        for kind in kinds:
            yield pytest.param(variant, kind, id=f"{variant}-{kind}")


@pytest.mark.parametrize("variant,kind", list(_cases()))
def test_static_greedy_equals_eager_and_reference(variant, kind):
    """Seven ragged prompts in 7 rows (buckets 1, 2, 4, 7: padded steps), in 3 rows (prompts waiting for a row)
    and in 1; the tokens read back every step and every 3 steps: the static engine's tokens equal the eager
    engine's and the reference's, and the batch really ran padded."""
    ps, eot, ref = _reference(variant)
    net = model(variant)
    common = dict(max_new_tokens=MAX_NEW, eot_token=eot, page_size=8)
    for max_batch in (None, 3, 1):
        eager, _ = generate(net, ps, kind, engine="eager", max_batch=max_batch, **common)
        assert eager == ref, f"eager {kind} max_batch={max_batch}"
        for sync_every in (1, 3):
            out, stats = generate(net, ps, kind, engine="static", max_batch=max_batch, sync_every=sync_every, **common)
            assert out == ref, f"static {kind} max_batch={max_batch} sync_every={sync_every}: {out} != {ref}"
            # a decode step per token after the first, and one for each end-of-text that a decode step emitted
            assert stats.decode_tokens == sum(len(o) - (len(o) == m) for o, m in zip(ref, MAX_NEW))
    _, stats = generate(net, ps, kind, engine="static", sync_every=1, **common)
    assert stats.extra["buckets"] == [1, 2, 4, 7]
    used = stats.extra["steps_per_bucket"]  # read back every step, the batch shrinks to smaller buckets
    assert 4 in used and 7 in used, f"rows ran in buckets {used}: the test wants padded ones"


@pytest.mark.parametrize(
    "variant,kind",
    [("mha", "grouped"), ("gqa", "grouped"), ("gqa", "paged"), ("mqa", "paged"), ("mla", "mla"), ("mla", "paged_mla")],
)
def test_static_engine_on_the_triton_kernels(variant, kind):
    """The same through our decode kernels (under the interpreter on the CPU), with waiting prompts and padding; MHA
    and MQA are the grouped kernel's groups of one and of every head."""
    head = "random" if TRITON_DTYPE == torch.float32 else "permuted"
    ps, eot, ref = _reference(variant, head, TRITON_DTYPE)
    net = model(variant, "triton", TRITON_DTYPE, head)
    out, _ = generate(net, ps, kind, engine="static", max_new_tokens=MAX_NEW, eot_token=eot, page_size=8, max_batch=3)
    assert out == ref


@pytest.mark.parametrize("variant,kind", [("gqa", "paged"), ("mla", "mla")])
def test_compiled_blocks_equal_the_uncompiled_engine(variant, kind):
    """generate.compile_model (sample.py --compile=True): every block compiled around its cache call. Its tokens
    and logits equal the uncompiled engine's on ragged prompts with waiting prompts and padded buckets (the graphs
    on a GPU, the static step on the CPU), and one compile serves every layer: ten blocks stay within dynamo's
    recompile limit of 8, which a compile specialized per layer would pass (and fail here). The cache call is the
    only graph break (MLA's folded weights are checked before the blocks, not inside them, where a break would
    split the block's graph), and a weight changed between two generations reaches the compiled step."""
    from torch._dynamo.utils import counters

    engine = "graphs" if GPU else "static"
    net = model(variant, "triton" if GPU else "torch", n_layer=10)
    ps = prompts(PROMPT_LENS, seed=2)
    common = dict(max_new_tokens=MAX_NEW, page_size=8, max_batch=4, engine=engine)
    seen, record = _record()
    ref, _ = generate(net, ps, kind, on_logits=record, **common)
    compiled_seen, compiled_record = _record()
    torch._dynamo.reset()
    # the flag compile_model sets goes back to its value afterwards, for the other tests of this process
    counters.clear()
    with torch._dynamo.config.patch(allow_unspec_int_on_nn_module=False, fail_on_recompile_limit_hit=True):
        try:
            compile_model(net)
            out, _ = generate(net, ps, kind, on_logits=compiled_record, **common)
            again, _ = generate(net, ps[:3], kind, **{**common, "max_new_tokens": MAX_NEW[:3]})  # no logits read
            breaks = dict(counters["graph_break"])
            _perturb_attention(net)
            changed, _ = generate(net, ps[:3], kind, **{**common, "max_new_tokens": MAX_NEW[:3]})
        finally:
            torch._dynamo.reset()
    assert out == ref and again == ref[:3]
    tol = TOLERANCES[torch.float32]  # the same fp32 math, fused by Inductor: only the order of the sums differs
    for i in seen:
        for want, got in zip(seen[i], compiled_seen[i]):
            torch.testing.assert_close(got, want, **tol)
    cache_call = ("attend_latent_inputs" if GPU else "attend_latent") if variant == "mla" else "attend"
    assert breaks and all(f".{cache_call} at" in reason for reason in breaks), breaks
    uncompiled = _perturb_attention(model(variant, "triton" if GPU else "torch", n_layer=10))
    expected, _ = generate(uncompiled, ps[:3], kind, **{**common, "max_new_tokens": MAX_NEW[:3]})
    assert changed == expected and changed != ref[:3], "the compiled step decoded with the weights before the change"


SLOW_COMPILE_S = 0.1


def _slow_compile(monkeypatch):
    """torch.compile through a backend that takes SLOW_COMPILE_S a graph and runs it as traced: compiling is then
    long against a tiny model's steps, at no Inductor cost, and the numbers stay the eager ones."""
    import time

    real = torch.compile

    def backend(gm, example_inputs):
        time.sleep(SLOW_COMPILE_S)
        return gm.forward

    monkeypatch.setattr(
        torch, "compile", lambda fn, dynamic=None, options=None: real(fn, dynamic=dynamic, backend=backend)
    )


def test_compile_time_stays_out_of_the_prefill_and_decode_rates(monkeypatch, capsys, tmp_path):
    """A compiled model compiles in its first calls, inside the prefill and decode steps that make them: those
    seconds are in compile_s and on stderr, not in prefill_s or decode_s; the tokens are the uncompiled model's, and
    a second generation compiles nothing and says nothing. sample.py's line says the decode is compiled."""
    net = model("gqa", n_layer=1)
    ps = [[5]]  # one token: its prefill runs the compiled step (sample.py's default prompt)
    common = dict(max_new_tokens=4, temperature=0.8, engine="eager")
    ref, _ = generate(net, ps, "paged", generator=torch.Generator(DEVICE).manual_seed(0), **common)
    _slow_compile(monkeypatch)
    torch._dynamo.reset()
    with torch._dynamo.config.patch(allow_unspec_int_on_nn_module=False):
        try:
            compile_model(net)
            out, stats = generate(net, ps, "paged", generator=torch.Generator(DEVICE).manual_seed(0), **common)
            err = capsys.readouterr().err
            _, again = generate(net, ps, "paged", generator=torch.Generator(DEVICE).manual_seed(0), **common)
            assert capsys.readouterr().err == "" and again.extra["compiled_graphs"] == 0
            _checkpoint(tmp_path, "gqa")
            sample.main(
                [f"--init_from={tmp_path}", "--device=cpu", "--compile=True", "--start=HI", "--max_new_tokens=3"]
            )
            sample_err = capsys.readouterr().err
        finally:
            torch._dynamo.reset()
    assert out == ref
    graphs, compile_s = stats.extra["compiled_graphs"], stats.extra["compile_s"]
    assert graphs >= 2 and compile_s >= graphs * SLOW_COMPILE_S, stats.extra
    assert stats.prefill_s < SLOW_COMPILE_S and stats.decode_s < SLOW_COMPILE_S, stats
    assert f"torch.compile: compiled the decode step ({graphs} graphs) in {compile_s:.2f} s, outside the" in err
    assert "decode=eager loop, compiled" in sample_err and "torch.compile: compiled the decode step" in sample_err


def _perturb_attention(net):
    """Attention output weights large enough to change the greedy tokens, written in place (the version counter
    moves, the storage stays), as an optimizer step writes them."""
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for block in net.transformer.h:
            w = block.attn.c_proj.weight
            w.copy_(torch.randn(w.shape, generator=g).to(w.device, w.dtype) * 0.5)
    return net


def _record():
    seen: dict[int, list[torch.Tensor]] = {}
    return seen, lambda i, x: seen.setdefault(i, []).append(x.float().cpu().clone())


def _check_logits(plain, ps, out, seen, tol, top_k=None):
    """Each new token's logits equal the plain model's full forward over the prompt and the tokens before it; a
    sampled token is one of the top_k of its logits."""
    for i, (p, o) in enumerate(zip(ps, out)):
        with torch.no_grad():
            full = plain(torch.tensor([p + o[:-1]], device=DEVICE))[0][0].float().cpu()[len(p) - 1 :]
        assert len(seen[i]) == len(o)
        for step, got in enumerate(seen[i]):
            err = (got - full[step]).abs()
            assert (err <= tol["atol"] + tol["rtol"] * full[step].abs()).all(), (
                f"sequence {i} step {step}: max err {err.max():.3e}"
            )
            if top_k:
                assert o[step] in got.topk(top_k).indices.tolist(), f"sequence {i} step {step}: not in the top-k"


def test_static_engine_logits_equal_the_full_forward():
    """on_logits under the static engine (it then reads back every step), with sampled tokens (temperature 1,
    top-k 4, a generator): every token's logits equal the full forward's, and the token is in their top 4."""
    net = model("gqa")
    ps = prompts((6, 1, 11))
    seen, hook = _record()
    gen = torch.Generator(device=DEVICE).manual_seed(3)
    out, _ = generate(
        net,
        ps,
        "paged",
        engine="static",
        max_new_tokens=5,
        temperature=1.0,
        top_k=4,
        generator=gen,
        page_size=8,
        on_logits=hook,
    )
    assert [len(o) for o in out] == [5, 5, 5]
    _check_logits(net, ps, out, seen, TOLERANCES[torch.float32], top_k=4)


def test_static_engine_reads_back_every_sync_every_steps():
    """One prompt, 17 new tokens: the 16 decode steps are read back in 2 runs of 8 (no host sync per token);
    on_token still sees every token, in order."""
    net = model("mqa")
    ps = prompts((5,))
    streamed = []
    on_token = lambda i, t: streamed.append(t)  # noqa: E731
    out, stats = generate(net, ps, "grouped", engine="static", max_new_tokens=17, sync_every=8, on_token=on_token)
    ref, _ = generate(net, ps, "grouped", engine="eager", max_new_tokens=17)
    assert out == ref and streamed == ref[0]
    assert stats.decode_steps == 16 and stats.extra["reads"] == 2


@pytest.mark.parametrize("engine", ["eager", "static"])
def test_a_waiting_prompt_takes_the_first_free_row(engine):
    """Two rows, three prompts: prompt 0 ends after 2 tokens and prompt 2 starts at once, while prompt 1 is still
    running (continuous batching), in the row and pages that prompt 0 gave back."""
    net = model("gqa")
    ps = prompts((4, 6, 3))
    events = []
    new = [2, 9, 4]
    out, stats = generate(
        net,
        ps,
        "paged",
        engine=engine,
        max_new_tokens=new,
        max_batch=2,
        page_size=8,
        on_token=lambda i, t: events.append(i),
    )
    ref, _ = generate(net, ps, "none", max_new_tokens=new)
    assert out == ref
    last_of_1 = len(events) - 1 - events[::-1].index(1)
    assert events.index(2) < last_of_1, f"prompt 2 waited for prompt 1 to end: {events}"
    scratch = 1 if engine == "static" else 0  # the static engine's scratch page, where padding rows write
    assert stats.cache_bytes_allocated == (2 * 2 + scratch) * 8 * stats.cache_bytes_per_token


@pytest.mark.parametrize("engine", ["eager", "static"])
def test_waiting_prompts_are_admitted_in_batches(engine):
    """Four rows, ten prompts ending at different steps: with admit_batch=3 waiting prompts go in only once three
    rows are free (or as many as still wait), where admit_batch=1 admits each freed row's prompt alone; fewer
    prefill forwards, and the tokens are the reference's either way."""
    net = model("gqa")
    ps = prompts((4, 6, 3, 5, 2, 7, 4, 3, 6, 5), seed=3)
    new = [2, 9, 4, 6, 3, 5, 8, 2, 4, 6]
    ref, _ = generate(net, ps, "none", max_new_tokens=new)
    admissions, forwards = {}, {}
    for admit_batch in (1, 3):
        events = []  # (sequence, is its first token): a run of first tokens is one admission's prompts
        out, stats = generate(
            net,
            ps,
            "grouped",
            engine=engine,
            max_new_tokens=new,
            max_batch=4,
            admit_batch=admit_batch,
            on_token=lambda i, t: events.append((i, all(j != i for j, _ in events))),
        )
        assert out == ref, f"admit_batch={admit_batch}"
        runs, before = [], False
        for _, first in events:
            if first and before:
                runs[-1] += 1
            elif first:
                runs.append(1)
            before = first
        admissions[admit_batch], forwards[admit_batch] = runs, stats.prefill_forwards
    assert sum(admissions[3]) == len(ps) and admissions[3][0] == 4, admissions
    waiting = len(ps) - 4
    for size in admissions[3][1:]:
        assert size >= min(3, waiting), f"an admission of {size} with {waiting} waiting: {admissions}"
        waiting -= size
    assert 1 in admissions[1][1:-1], f"admit_batch=1 should admit a prompt alone: {admissions}"
    assert forwards[3] < forwards[1], forwards


def test_batch_buckets():
    assert batch_buckets(1) == [1]
    assert batch_buckets(3) == [1, 2, 3]
    assert batch_buckets(8) == [1, 2, 4, 8]
    assert batch_buckets(40) == [1, 2, 4, 8, 16, 32, 40]
    assert batch_buckets(64) == [1, 2, 4, 8, 16, 32, 48, 64]


def test_sample_next_draws_from_the_filtered_distribution():
    """The exponential race samples each token with its probability: 40,000 draws of a 4-token distribution land
    within 0.015 of it (about 6 standard deviations); top_k and top_p drop the tail; greedy is the argmax."""
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    logits = probs.log()[None].expand(40_000, 4).contiguous()
    g = torch.Generator().manual_seed(0)
    freq = torch.bincount(sample_next(logits, 1.0, generator=g), minlength=4).float() / 40_000
    assert (freq - probs).abs().max() < 0.015, freq
    top2 = torch.bincount(sample_next(logits, 1.0, top_k=2, generator=g), minlength=4).float() / 40_000
    assert top2[2:].sum() == 0 and abs(top2[0] - 0.5 / 0.8) < 0.015, top2
    nucleus = torch.bincount(sample_next(logits, 1.0, top_p=0.7, generator=g), minlength=4)
    assert nucleus[2:].sum() == 0 and nucleus[1] > 0
    assert sample_next(logits[:3]).tolist() == [0, 0, 0]


def test_engine_choices_fail_at_start():
    net = model("gqa")
    with pytest.raises(ValueError, match=r"engine: got 'fast'; valid: auto, eager, static, graphs"):
        generate(net, [[1, 2]], "grouped", max_new_tokens=2, engine="fast")
    with pytest.raises(ValueError, match=r"engine: got 'static' with cache 'none'; valid: eager"):
        generate(net, [[1, 2]], "none", max_new_tokens=2, engine="static")
    if not GPU:
        with pytest.raises(ValueError, match=r"engine: got 'graphs' on cpu; valid: eager or static"):
            generate(net, [[1, 2]], "grouped", max_new_tokens=2, engine="graphs")
    with pytest.raises(ValueError, match=r"admit_batch: got 0; valid: None \(a quarter of the rows\) or an int >= 1"):
        generate(net, [[1, 2]], "grouped", max_new_tokens=2, admit_batch=0)
    with pytest.raises(ValueError, match=r"sync_every: got 0; valid: an int >= 1"):
        generate(net, [[1, 2]], "grouped", max_new_tokens=2, sync_every=0)
    with pytest.raises(ValueError, match=r"max_new_tokens: got \[2\]; valid: an int >= 1, or one per prompt \(2\)"):
        generate(net, [[1, 2], [3]], "grouped", max_new_tokens=[2])


# ------------------------------------------------------------------------------------ CUDA graphs (GPU only)


@pytest.mark.gpu
@pytest.mark.skipif(not GPU, reason=NEEDS_GRAPHS)
@pytest.mark.parametrize("variant,kind", list(_cases()))
@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_graphs_equal_eager_and_reference(variant, kind, backend, capsys):
    """The captured graphs against the eager engine and the reference: ragged prompts in 7 rows (buckets 1, 2, 4,
    7) and in 3 (prompts waiting for a row), end-of-text mid-batch; on the PyTorch attention (fp32, the random
    head) and on our kernels (fp16, the permuted head). The capture is reported on stderr."""
    dtype, head = (torch.float32, "random") if backend == "torch" else (torch.float16, "permuted")
    ps, eot, ref = _reference(variant, head, dtype)
    net = model(variant, backend, dtype, head)
    common = dict(max_new_tokens=MAX_NEW, eot_token=eot, page_size=8)
    for max_batch in (None, 3):
        eager, _ = generate(net, ps, kind, engine="eager", max_batch=max_batch, **common)
        out, stats = generate(net, ps, kind, engine="graphs", max_batch=max_batch, **common)
        assert out == eager == ref, f"{kind} max_batch={max_batch}"
        assert stats.extra["capture_s"] > 0 and stats.extra["engine"] == "graphs"
    err = capsys.readouterr().err
    assert "cuda graphs: captured the decode step for 4 batch sizes (1, 2, 4, 7)" in err, err


@pytest.mark.parametrize("kind", ["paged", "paged_mla"])
@pytest.mark.parametrize(
    "engine_name",
    ["static", pytest.param("graphs", marks=(pytest.mark.gpu, pytest.mark.skipif(not GPU, reason=NEEDS_GRAPHS)))],
)
def test_sampling_draws_from_the_generator_and_matches_logits(engine_name, kind):
    """Sampling in the static step draws from the caller's generator (the graphs: registered with every graph, so
    each replay advances it): the same seed gives the same tokens, another seed others; the logits behind every
    token equal the full forward's. The graphs run our kernels in the kernels' dtype, the static step (on the CPU
    too) the plain PyTorch attention in fp32."""
    variant = "mla" if kind == "paged_mla" else "gqa"
    graphs = engine_name == "graphs"
    dtype = TRITON_DTYPE if graphs else torch.float32
    net = model(variant, "triton" if graphs else "torch", dtype)
    plain = model(variant, "torch", dtype)
    ps = prompts((6, 1, 11))

    def run(seed, on_logits=None):
        gen = torch.Generator(device=DEVICE).manual_seed(seed)
        return generate(
            net,
            ps,
            kind,
            engine=engine_name,
            max_new_tokens=12,
            temperature=1.0,
            top_p=0.9,
            generator=gen,
            page_size=8,
            on_logits=on_logits,
        )[0]

    a, b, c = run(1), run(1), run(2)
    assert a == b and a != c
    seen, hook = _record()
    out = run(1, hook)
    assert out == a  # reading back every step (on_logits) samples the same tokens
    _check_logits(plain, ps, out, seen, LOGIT_TOLERANCES[TRITON_DTYPE] if graphs else TOLERANCES[torch.float32])


@pytest.mark.parametrize(
    "engine_name",
    ["static", pytest.param("graphs", marks=(pytest.mark.gpu, pytest.mark.skipif(not GPU, reason=NEEDS_GRAPHS)))],
)
def test_a_queue_longer_than_the_batch_waits_for_pages(engine_name):
    """Continuous batching in the static engine and the graphed path: 40 ragged prompts through 16 rows of a paged
    pool that waits for pages; the tokens equal the eager engine's, and every prompt's tokens were decoded."""
    net = model("gqa", "triton", torch.float16, "permuted") if engine_name == "graphs" else model("gqa")
    g = torch.Generator().manual_seed(7)
    lens = torch.randint(1, 20, (40,), generator=g).tolist()
    new = torch.randint(1, 12, (40,), generator=g).tolist()
    ps = [torch.randint(0, 65, (n,), generator=g).tolist() for n in lens]
    # 16 pages: the 16 rows' sequences want up to 51 together, so prompts wait for pages (without the wait the pool
    # runs out); the longest sequence needs 4
    common = dict(max_new_tokens=new, page_size=8, max_batch=16, num_pages=16, wait_for_pages=True)
    eager, _ = generate(net, ps, "paged", engine="eager", **common)
    out, stats = generate(net, ps, "paged", engine=engine_name, **common)
    assert out == eager and [len(o) for o in out] == new
    assert stats.decode_tokens == sum(new) - len(new)


@pytest.mark.gpu
@pytest.mark.skipif(not GPU, reason=NEEDS_GRAPHS)
def test_sample_py_graphs_and_compile_print_what_the_eager_loop_prints(tmp_path, capsys):
    """sample.py on a GPU: the default (CUDA graphs), with --compile=True, and --cuda_graphs=False print the same
    greedy samples; the capture is reported on stderr."""
    _checkpoint(tmp_path, "gqa")
    common = [f"--init_from={tmp_path}", "--device=cuda", "--dtype=float16", "--temperature=0", "--start=HELLO, "]
    common += ["--max_new_tokens=20", "--num_samples=3"]
    texts = []
    for extra in ([], ["--compile=True"], ["--cuda_graphs=False"]):
        sample.main([*common, *extra])
        captured = capsys.readouterr()
        texts.append(captured.out)
        assert ("cuda graphs: captured" in captured.err) == (extra != ["--cuda_graphs=False"]), captured.err
    assert texts[0] == texts[1] == texts[2] and texts[0].count("HELLO, ") == 3
