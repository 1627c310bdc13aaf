"""Generation through the caches against the plain PyTorch model: the logits of every step equal a full forward
over the same tokens (torch reference and Triton kernels), greedy generations agree token for token across
none / grouped / paged / mla, ragged batches equal their sequences run alone, the paged scheduler waits for pages,
and sample.py runs end to end on a tiny checkpoint."""

import os
import signal
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch
from conftest import DEVICE, KERNEL_DTYPES, TOLERANCES, read_wandb_records

import generate as engine
import sample
from generate import check_length, generate, resolve_cache_kind, sample_next
from model import GPT, GPTConfig

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

VARIANTS = {
    "mha": dict(attention="mha", pos_embedding="learned"),
    "gqa": dict(attention="gqa", n_kv_head=2, pos_embedding="rope"),
    "mqa": dict(attention="mqa", pos_embedding="learned"),
    "mla": dict(
        attention="mla",
        kv_lora_rank=32,
        q_lora_rank=24,
        qk_nope_head_dim=16,
        qk_rope_head_dim=8,
        v_head_dim=24,
        pos_embedding="rope",
    ),
}
CACHES = {
    "mha": ("grouped", "paged"),
    "gqa": ("grouped", "paged"),
    "mqa": ("grouped", "paged"),
    "mla": ("mla", "paged_mla"),
}
PROMPT_LENS = (6, 1, 11)  # ragged, with a one-token prompt (its "prefill" is a decode step)
MAX_NEW = 5

# Triton runs: fp32 under the CPU interpreter; on the GPU fp16 (the kernels' fp32 dots there may use tf32).
TRITON_DTYPE = KERNEL_DTYPES[0]
# Logits of the cached path against the plain full forward in the same dtype: the two differ only in the order
# of their roundings (kernel vs reference attention, cached vs recomputed K/V). fp32: the conftest budget. fp16:
# ~2^-11 per rounding through 2 layers and logits of size ~5 (the enlarged embedding below) -> 2e-2.
LOGIT_TOLERANCES = {torch.float32: TOLERANCES[torch.float32], torch.float16: dict(atol=2e-2, rtol=2e-2)}


def tiny_model(
    variant: str, backend: str = "torch", dtype=torch.float32, block_size: int = 64, n_embd: int = 64, n_layer: int = 2
) -> GPT:
    torch.manual_seed(0)
    config = GPTConfig(
        vocab_size=65,
        block_size=block_size,
        n_layer=n_layer,
        n_head=4,
        n_embd=n_embd,
        dropout=0.0,
        attn_backend=backend,
        **VARIANTS[variant],
    )
    model = GPT(config)
    with torch.no_grad():  # GPT-2's init gives near-flat logits; a wider (tied) embedding makes greedy margins
        model.transformer.wte.weight.normal_(0.0, 0.5)  # large, so no argmax is decided by rounding noise
    return model.to(DEVICE, dtype).eval()


def prompts(lens=PROMPT_LENS, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 65, (n,), generator=g).tolist() for n in lens]


def _record():
    seen: dict[int, list[torch.Tensor]] = {}
    return seen, lambda i, logits: seen.setdefault(i, []).append(logits.float().cpu())


def _close(got, ref, dtype, name):
    tol = LOGIT_TOLERANCES[dtype]
    err = (got - ref).abs()
    assert (err <= tol["atol"] + tol["rtol"] * ref.abs()).all(), (
        f"{name} ({dtype}): max err {err.max().item():.3e}, mean err {err.mean().item():.3e}, "
        f"max |ref| {ref.abs().max().item():.3e}"
    )


def _variant_cache_backend():
    for variant, kinds in CACHES.items():
        for kind in kinds:
            yield pytest.param(variant, kind, "torch", torch.float32, id=f"{variant}-{kind}-torch")
            yield pytest.param(
                variant, kind, "triton", TRITON_DTYPE, id=f"{variant}-{kind}-triton-{str(TRITON_DTYPE).split('.')[-1]}"
            )


@pytest.mark.parametrize("variant,kind,backend,dtype", list(_variant_cache_backend()))
def test_every_decode_step_matches_full_forward(variant, kind, backend, dtype):
    """A ragged batch through the cache: the logits behind every new token equal the plain PyTorch model's full
    forward over the prompt and the tokens generated so far (same weights, same dtype, torch attention)."""
    model = tiny_model(variant, backend, dtype)
    plain = tiny_model(variant, "torch", dtype)
    ps = prompts()
    seen, hook = _record()
    out, stats = generate(model, ps, kind, max_new_tokens=MAX_NEW, page_size=8, on_logits=hook)
    assert [len(o) for o in out] == [MAX_NEW] * len(ps)
    assert stats.decode_steps == MAX_NEW - 1 and stats.prefill_tokens == sum(PROMPT_LENS)
    for i, (p, o) in enumerate(zip(ps, out)):
        with torch.no_grad():
            full = plain(torch.tensor([p + o[:-1]], device=DEVICE))[0][0].float().cpu()  # (S, V)
        ref = full[len(p) - 1 :]
        assert len(seen[i]) == MAX_NEW
        for step, got in enumerate(seen[i]):
            _close(got, ref[step], dtype, f"{variant} {kind} {backend} sequence {i} step {step}")


def test_paged_cache_at_head_dim_64(monkeypatch):
    """GQA with 64-wide heads through the paged cache: on an H100/H200 (fp16) its decode steps run the Hopper paged
    kernel (attention_kernels/decode_sm90.py) on the cache's own pools and block tables, and every step's logits still
    equal the plain model's full forward. Elsewhere the Triton kernel runs the same check."""
    from attention_kernels import decode_sm90

    launches = []
    launch = decode_sm90.launch
    monkeypatch.setattr(decode_sm90, "launch", lambda *a, **kw: launches.append(1) or launch(*a, **kw))
    model = tiny_model("gqa", "triton", TRITON_DTYPE, n_embd=256)
    plain = tiny_model("gqa", "torch", TRITON_DTYPE, n_embd=256)
    ps = prompts()
    seen, hook = _record()
    out, _ = generate(model, ps, "paged", max_new_tokens=MAX_NEW, page_size=16, on_logits=hook)
    for i, (p, o) in enumerate(zip(ps, out)):
        with torch.no_grad():
            ref = plain(torch.tensor([p + o[:-1]], device=DEVICE))[0][0].float().cpu()[len(p) - 1 :]
        assert len(seen[i]) == MAX_NEW, f"sequence {i}: logits of {len(seen[i])} steps"
        for step, got in enumerate(seen[i]):
            _close(got, ref[step], TRITON_DTYPE, f"paged D64 sequence {i} step {step}")
    hopper = DEVICE == "cuda" and decode_sm90.on_hopper(torch.empty(1, device=DEVICE))
    assert bool(launches) == hopper, f"{len(launches)} Hopper paged launches (expected some: {hopper})"


def _greedy_params():
    for variant in VARIANTS:
        yield pytest.param(variant, "torch", torch.float32, id=f"{variant}-torch")
        yield pytest.param(variant, "triton", TRITON_DTYPE, id=f"{variant}-triton")


@pytest.mark.parametrize("variant,backend,dtype", list(_greedy_params()))
def test_greedy_identical_across_caches(variant, backend, dtype):
    """none (the plain PyTorch model recomputing everything, same weights and dtype), and each cache of the
    variant on the backend under test: the same tokens. An end-of-text token taken from the reference's own output
    makes one sequence stop early, so the others go on after its rows/pages are released."""
    model = tiny_model(variant, backend, dtype)
    plain = tiny_model(variant, "torch", dtype)
    ps = prompts((7, 3, 12, 5), seed=2)
    ref, _ = generate(plain, ps, "none", max_new_tokens=8)
    eot = ref[1][2]  # sequence 1 stops at its third token (others may stop too, wherever it occurs first)
    ref, _ = generate(plain, ps, "none", max_new_tokens=8, eot_token=eot)
    assert min(len(o) for o in ref) < 8 <= max(len(o) for o in ref), "the test wants some sequences to end early"
    for kind in CACHES[variant]:
        out, _ = generate(model, ps, kind, max_new_tokens=8, eot_token=eot, page_size=8)
        assert out == ref, f"{variant} {kind} {backend}: {out} != none's {ref}"


@pytest.mark.parametrize("variant,kind", [("gqa", "grouped"), ("gqa", "paged"), ("mla", "mla"), ("mla", "paged_mla")])
def test_ragged_batch_equals_each_sequence_alone(variant, kind):
    model = tiny_model(variant)
    ps = prompts((9, 2, 4))
    seen_batch, hook = _record()
    out_batch, _ = generate(model, ps, kind, max_new_tokens=MAX_NEW, page_size=8, on_logits=hook)
    for i, p in enumerate(ps):
        seen_alone, hook_alone = _record()
        out_alone, _ = generate(model, [p], kind, max_new_tokens=MAX_NEW, page_size=8, on_logits=hook_alone)
        assert out_alone[0] == out_batch[i]
        assert len(seen_alone[0]) == len(seen_batch[i]) == MAX_NEW, f"sequence {i}: steps with logits"
        for step, (a, b) in enumerate(zip(seen_alone[0], seen_batch[i])):
            _close(b, a, torch.float32, f"sequence {i} step {step}")


def test_ragged_prompts_prefill_together_right_padded(monkeypatch):
    """Admitted prompts of different lengths share a prefill forward, padded on the right to the longest, while
    the padding is at most half of it; the tokens and every step's logits are those of each prompt run alone
    (test_ragged_batch_equals_each_sequence_alone), and only the real tokens count as prefill."""
    model = tiny_model("gqa")
    ps = prompts((12, 2, 9, 2, 2))
    forwards = []
    forward = model.forward
    monkeypatch.setattr(model, "forward", lambda idx, **kw: forwards.append(tuple(idx.shape)) or forward(idx, **kw))
    out, stats = generate(model, ps, "grouped", max_new_tokens=MAX_NEW)
    prefills = [shape for shape in forwards if shape[1] > 1]
    assert prefills == [(4, 12), (1, 2)], prefills  # 12, 9, 2, 2: 25 tokens in 48; a third 2 would make 27 in 60
    assert stats.prefill_tokens == sum(len(p) for p in ps)
    for i, p in enumerate(ps):
        assert out[i] == generate(model, [p], "grouped", max_new_tokens=MAX_NEW)[0][0]


def test_prefill_groups_pad_only_into_free_pages():
    """In a paged cache a padded prefill takes pages for every row at the longest length until trim gives the
    padding's back: prompts join a forward only while the free pages cover that, else they go in one of their own."""
    lens = {0: 30, 1: 20, 2: 17}  # sequence -> prompt length; pages of 8: 4, 3 and 3 unpadded
    prompt_of = [[0] * lens[i] for i in range(3)]
    admitted = [(0, 0), (1, 1), (2, 2)]

    def groups(num_free, paged=True):
        store = SimpleNamespace(paged=paged, page_size=8, allocator=SimpleNamespace(num_free=num_free))
        return engine._prefill_groups(SimpleNamespace(store=store), prompt_of, admitted)

    assert groups(12) == [[(0, 0), (1, 1), (2, 2)]]  # 3 rows x 4 pages
    assert groups(11) == [[(0, 0), (1, 1)], [(2, 2)]]  # 2 x 4 fit; then 3 pages of 11 - 4 - 3 left
    assert groups(7) == [[(0, 0)], [(1, 1)], [(2, 2)]]  # not 2 x 4; then not 2 x 3 of the 7 - 4 left
    assert groups(0, paged=False) == [[(0, 0), (1, 1), (2, 2)]]


def test_paged_scheduler_waits_for_pages_or_raises():
    """A pool that holds two sequences at a time: with waiting, five prompts go through three rows as pages free
    up and give the same tokens as an unconstrained run; a pool that could run out partway (without waiting, or
    smaller than one sequence) is refused at start, before any token is generated and lost."""
    model = tiny_model("mha")
    ps = prompts((5, 9, 3, 12, 7), seed=3)
    ref, _ = generate(model, ps, "grouped", max_new_tokens=6)
    out, stats = generate(
        model, ps, "paged", max_new_tokens=6, page_size=8, num_pages=5, wait_for_pages=True, max_batch=3
    )
    assert out == ref
    scratch = stats.extra["engine"] != "eager"  # the static engines' pool has one more page, where padding writes
    assert stats.cache_bytes_peak <= stats.cache_bytes_allocated == (5 + scratch) * 8 * stats.cache_bytes_per_token
    with pytest.raises(
        ValueError,
        match=r"num_pages: got 5; the pool must hold 10 pages of 8 tokens for 5 "
        r"sequences at once .* or wait_for_pages=True with >= 3",
    ):
        generate(model, ps, "paged", max_new_tokens=6, page_size=8, num_pages=5)
    with pytest.raises(ValueError, match=r"num_pages: got 5; the pool must hold 6 pages .* the longest sequence"):
        generate(model, [[1] * 40], "paged", max_new_tokens=6, page_size=8, num_pages=5, wait_for_pages=True)


def test_sampling_filters():
    logits = torch.tensor([[0.0, 3.0, 1.0, 2.5, -1.0]] * 4000)
    g = torch.Generator().manual_seed(0)
    assert sample_next(logits[:2]).tolist() == [1, 1]
    top2 = sample_next(logits, temperature=1.0, top_k=2, generator=g)
    assert set(top2.tolist()) == {1, 3}
    # softmax of the logits: p(1) ~ 0.53, p(3) ~ 0.32 -> top_p 0.7 keeps exactly {1, 3}
    nucleus = sample_next(logits, temperature=1.0, top_p=0.7, generator=g)
    assert set(nucleus.tolist()) == {1, 3}
    assert set(sample_next(logits, temperature=1.0, top_p=0.1, generator=g).tolist()) == {1}
    everything = sample_next(logits, temperature=1.0, generator=g)
    assert set(everything.tolist()) == {0, 1, 2, 3, 4}
    tiny = sample_next(logits[:50], temperature=1e-45, generator=g)  # logits / 1e-45 alone would overflow to inf
    assert tiny.tolist() == [1] * 50
    a = sample_next(logits[:50], 0.8, generator=torch.Generator().manual_seed(5))
    b = sample_next(logits[:50], 0.8, generator=torch.Generator().manual_seed(5))
    assert torch.equal(a, b)


@pytest.mark.parametrize(
    "option,match",
    [
        (dict(temperature=-0.5), r"temperature: got -0.5; valid: a number >= 0"),
        (dict(temperature=float("nan")), r"temperature: got nan"),
        (dict(temperature=1.0, top_k=-1), r"top_k: got -1; valid: an int >= 0"),
        (dict(temperature=1.0, top_p=0.0), r"top_p: got 0.0; valid: a number in \(0, 1\]"),
        (dict(temperature=1.0, top_p=1.5), r"top_p: got 1.5; valid"),
    ],
    ids=["temperature-neg", "temperature-nan", "top_k-neg", "top_p-0", "top_p-1.5"],
)
def test_bad_sampling_options_raise(option, match):
    model = tiny_model("mqa")
    with pytest.raises(ValueError, match=match):
        generate(model, prompts((3,)), "grouped", max_new_tokens=2, **option)


def test_choices_and_lengths_fail_at_start():
    gqa, mla = tiny_model("gqa").config, tiny_model("mla").config
    assert resolve_cache_kind(gqa, "auto") == "grouped" and resolve_cache_kind(mla, "auto") == "mla"
    assert resolve_cache_kind(mla, "paged") == "paged_mla"
    with pytest.raises(ValueError, match=r"--cache: got 'mla'.*attention='gqa'; valid: auto, grouped, paged, none"):
        resolve_cache_kind(gqa, "mla")
    with pytest.raises(ValueError, match=r"--cache: got 'grouped'.*valid: auto, mla, paged, paged_mla, none"):
        resolve_cache_kind(mla, "grouped")
    learned = tiny_model("mha", block_size=16).config
    check_length(learned, [10], 7, False)  # positions 0..15: fits exactly
    with pytest.raises(ValueError, match="block_size=16 for learned position"):
        check_length(learned, [10], 8, True)
    rope = tiny_model("gqa", block_size=16).config
    with pytest.raises(ValueError, match="allow_past_block_size=True"):
        check_length(rope, [10], 8, False)
    check_length(rope, [10], 8, True)
    with pytest.raises(ValueError, match="prompts: got none"):
        check_length(rope, [], 8, False)


def test_length_errors_name_the_option_as_the_caller_writes_it():
    """The README's library call past a RoPE model's block_size names generate's keyword (and sample.py's flag);
    sample.py's check (prefix "--") names its flags alone."""
    model = tiny_model("gqa", block_size=16)
    keyword = "allow_past_block_size=True (sample.py: --allow_past_block_size=True)"
    with pytest.raises(ValueError) as e:
        generate(model, prompts((3,)), "paged", max_new_tokens=16, page_size=8)
    assert str(e.value) == (
        "prompt of 3 tokens + max_new_tokens=16 - 1 = 18 tokens > block_size=16; this RoPE model may go past what "
        f"it was trained on with {keyword}, or lower max_new_tokens"
    )
    with pytest.raises(ValueError, match=r"on with --allow_past_block_size=True, or lower --max_new_tokens$"):
        check_length(model.config, [3], 16, False, prefix="--")
    with pytest.raises(ValueError, match=r"\(shorten the prompt\), or allow_past_block_size=True \(sample.py: --allow"):
        check_length(model.config, [20], 1, False)
    with pytest.raises(
        ValueError, match=r"\(shorten the prompt\), or --allow_past_block_size=True for this RoPE model$"
    ):
        check_length(model.config, [20], 1, False, prefix="--")
    learned = tiny_model("mha", block_size=16).config
    with pytest.raises(ValueError, match=r"\(shorten the prompt or lower --max_new_tokens\)$"):
        check_length(learned, [10], 8, True, prefix="--")


def test_rope_model_generates_past_block_size_when_asked():
    model = tiny_model("gqa", block_size=8)
    ps = prompts((6,))
    ref, _ = generate(model, ps, "none", max_new_tokens=6, allow_past_block_size=True)
    out, _ = generate(model, ps, "paged", max_new_tokens=6, allow_past_block_size=True, page_size=8)
    assert out == ref and len(out[0]) == 6


CHARS = "".join(chr(c) for c in range(32, 97))  # 65 printable characters = the tiny model's vocabulary


def _checkpoint(directory, variant="mla", backend="torch"):
    """A tiny checkpoint written by checkpoint.save_checkpoint, with a character-level tokenizer; returns the model."""
    from checkpoint import save_checkpoint
    from data import char_meta

    model = tiny_model(variant, backend, dtype=torch.float32).cpu()
    save_checkpoint(
        directory / "last.pt",
        {
            "model": model.state_dict(),
            "model_args": vars(model.config),
            "tokenizer": char_meta(CHARS),
            "iter_num": 7,
            "config": {},
        },
    )
    return model


def test_sample_py_end_to_end(tmp_path):
    """A tiny checkpoint and a FILE: prompt; sample.py's stdout is the text alone (the first sample, a separator,
    the second), equal to greedy generation in-process; statistics go to stderr."""
    from data import char_meta, get_tokenizer

    model = _checkpoint(tmp_path)
    tok = get_tokenizer(char_meta(CHARS))
    start = "HELLO, "
    expected, _ = generate(model, [tok.encode(start)], "none", max_new_tokens=20)
    expected_text = start + tok.decode(expected[0])
    (tmp_path / "prompt.txt").write_text(start)
    env = {**os.environ, "PYTHONPATH": REPO}
    run = subprocess.run(
        [
            sys.executable,
            os.path.join(REPO, "sample.py"),
            f"--init_from={tmp_path}",
            "--device=cpu",
            "--cache=paged",
            "--num_samples=2",
            "--max_new_tokens=20",
            "--temperature=0",
            "--start=FILE:prompt.txt",
            "--page_size=8",
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
        cwd=tmp_path,
    )
    assert run.returncode == 0, run.stderr
    assert run.stdout == f"{expected_text}\n---------------\n{expected_text}\n"
    assert "decode:" in run.stderr and "tokens/s" in run.stderr and "bytes/token (float32)" in run.stderr


def test_sample_py_ctrl_c_prints_the_samples_so_far(tmp_path, monkeypatch, capsys):
    """Ctrl-C mid-generation: stdout gets every sample as far as it got (in the usual layout), stderr says so, and
    the KeyboardInterrupt goes on to __main__ (exit 130)."""
    from data import char_meta, get_tokenizer

    model = _checkpoint(tmp_path, "gqa")
    tok = get_tokenizer(char_meta(CHARS))
    real = sample.generate

    def interrupted(*args, on_token, **kwargs):
        seen = []

        def on_token_then_ctrl_c(i, token):
            on_token(i, token)
            seen.append((i, token))
            if len(seen) == 7:  # sample 0 has 4 tokens, sample 1 has 3
                raise KeyboardInterrupt

        return real(*args, on_token=on_token_then_ctrl_c, **kwargs)

    monkeypatch.setattr(sample, "generate", interrupted)
    full, _ = real(model, [tok.encode("HI")] * 2, "none", max_new_tokens=20)
    with pytest.raises(KeyboardInterrupt):
        sample.main([f"--init_from={tmp_path}", "--device=cpu", "--num_samples=2", "--temperature=0", "--start=HI"])
    out, err = capsys.readouterr()
    assert out == f"HI{tok.decode(full[0][:4])}\n---------------\nHI{tok.decode(full[1][:3])}\n"
    assert "interrupted: the samples stop where generation was (7 new tokens in all)" in err


def test_sample_py_exits_130_on_ctrl_c(tmp_path):
    """The command line under a real SIGINT: exit status 130 and no traceback."""
    _checkpoint(tmp_path, "gqa")
    cmd = [sys.executable, os.path.join(REPO, "sample.py"), f"--init_from={tmp_path}", "--device=cpu"]
    proc = subprocess.Popen(
        [*cmd, "--max_new_tokens=1000000", "--start=HI"],  # far past block_size (RoPE): runs until stopped
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": REPO},
        cwd=tmp_path,
    )
    try:
        head = proc.stdout.read(3)  # blocks until the prompt and the first generated character are out
        assert head.startswith("HI") and len(head) == 3, head
        os.kill(proc.pid, signal.SIGINT)
        rest, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 130, err
    assert "interrupted: the samples stop where generation was" in err and "Traceback" not in err


def _sample_py_streaming(tmp_path, *args):
    """sample.py from a tiny RoPE checkpoint, run until stopped, once its first generated character is out."""
    _checkpoint(tmp_path, "gqa")
    cmd = [sys.executable, os.path.join(REPO, "sample.py"), f"--init_from={tmp_path}", "--device=cpu", "--start=HI"]
    proc = subprocess.Popen(
        [*cmd, "--max_new_tokens=1000000", *args],  # far past block_size (RoPE): runs until stopped
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": REPO},
        cwd=tmp_path,
    )
    head = proc.stdout.read(3)  # blocks until the prompt and the first generated character are out
    assert head.startswith("HI") and len(head) == 3, head
    return proc, head


def test_sample_py_sigterm_prints_the_samples_and_exits_143(tmp_path):
    """SIGTERM (`timeout`, `kill`) as Ctrl-C: every sample as far as it got, in the usual layout, and 143."""
    proc, head = _sample_py_streaming(tmp_path, "--num_samples=2")
    try:
        os.kill(proc.pid, signal.SIGTERM)
        rest, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 143, err
    first, second = (head + rest).split("\n---------------\n")  # both samples, the second too
    assert first.startswith("HI") and second.startswith("HI") and rest.endswith("\n")
    assert "terminated (SIGTERM): the samples stop where generation was" in err and "Traceback" not in err


def test_sample_py_ends_quietly_when_stdout_closes(tmp_path):
    """`sample.py | head -c 3`: the reader closing stdout ends the run with 141 (128 + SIGPIPE, as a Unix tool
    killed by SIGPIPE), no error message and nothing printed at the interpreter's exit."""
    proc, _ = _sample_py_streaming(tmp_path)
    try:
        proc.stdout.close()
        err = proc.stderr.read()
        proc.wait(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 141, err
    assert "error" not in err and "Traceback" not in err and "Exception ignored" not in err, err


def test_sample_py_start_outside_a_char_vocabulary_names_start(tmp_path, monkeypatch, capsys):
    """A --start character that a character-level model never saw: the message names --start and the characters it
    knows (CHARS: the one run ' '..'`'), and it is a usage error (2)."""
    _checkpoint(tmp_path)
    monkeypatch.chdir(tmp_path)
    argv = [f"--init_from={tmp_path}", "--device=cpu", "--max_new_tokens=2"]
    with pytest.raises(
        ValueError,
        match=r"^--start: got 'HI there', whose characters 't', 'h', 'e', 'r' are not in this character-level "
        r"model's vocabulary; valid: text in the 65 characters of its training text: ' '..'`'$",
    ):
        sample.main([*argv, "--start=HI there"])
    assert sample.cli([*argv, "--start=HIé"]) == 2
    assert "--start: got 'HIé', whose character 'é' is not in" in capsys.readouterr().err
    assert sample._char_ranges("abcxz\n") == "'\\n', 'a'..'c', 'x', 'z'"


def test_sample_py_out_dir_and_init_from_must_agree(tmp_path, monkeypatch, capsys):
    """--out_dir and --init_from naming two models is a usage error naming both; naming the same checkpoint (a run
    directory and its file) is fine."""
    monkeypatch.chdir(tmp_path)
    for name, variant in (("out-gqa", "gqa"), ("out-mla", "mla")):
        (tmp_path / name).mkdir()
        _checkpoint(tmp_path / name, variant)
    message = r"^--init_from: got '{}' with --out_dir='out-gqa', which names another model; valid: one of the two"
    for other in ("out-mla", "gpt2"):
        with pytest.raises(ValueError, match=message.format(other)):
            sample.main(["--out_dir=out-gqa", f"--init_from={other}", *SHORT])
    assert sample.cli(["--out_dir=out-gqa", "--init_from=out-mla", *SHORT]) == 2
    assert sample.main(["--out_dir=out-gqa", "--init_from=out-gqa/last.pt", *SHORT])["attention"] == "gqa"
    assert capsys.readouterr().out.count("HELLO, ") == 1  # the run that agreed, nothing from the refused ones


def test_sample_py_wandb_run_lands_beside_the_checkpoint(tmp_path):
    """--wandb_log (a bool key alone) without credentials: an offline run in the checkpoint's directory, where
    train.py's runs are (`wandb sync out-*/wandb/offline-run-*` takes both), with the decode statistics; stdout stays
    the sample text alone."""
    pytest.importorskip("wandb")  # a core dependency, but the GPU machine has none
    ckpt = tmp_path / "out-mla"
    ckpt.mkdir()
    _checkpoint(ckpt)
    env = {k: v for k, v in os.environ.items() if not k.startswith("WANDB_")}
    env.update(PYTHONPATH=REPO, HOME=str(tmp_path))  # no ~/.netrc: no credentials
    run = subprocess.run(
        [
            sys.executable,
            os.path.join(REPO, "sample.py"),
            "--out_dir",
            "out-mla",
            "--device=cpu",
            "--start=HELLO, ",
            "--max_new_tokens=5",
            "--num_samples=1",
            "--wandb_log",
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
        cwd=tmp_path,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stdout.startswith("HELLO, ") and "wandb" not in run.stdout
    runs = list(ckpt.glob("wandb/offline-run-*/run-*.wandb"))
    assert len(runs) == 1 and not (tmp_path / "wandb").exists(), os.listdir(tmp_path)
    assert f"wandb sync {os.path.join('out-mla', 'wandb', runs[0].parent.name)}" in run.stderr
    history = [
        {i.key or "/".join(i.nested_key) for i in r.history.item}
        for r in read_wandb_records(runs[0])
        if r.WhichOneof("record_type") == "history"
    ]
    assert {"sample/decode_tokens", "sample/prefill_tokens"} <= set().union(*history), history


def test_sample_py_stops_at_end_of_text(tmp_path, monkeypatch, capsys):
    """With a tokenizer that has an end-of-text token, the sample stops where the model first emits it: stdout is
    the prompt and the tokens before it, nothing after."""
    import data

    model = _checkpoint(tmp_path, "gqa")
    tok = data.get_tokenizer(data.char_meta(CHARS))
    start = "HELLO, "
    free, _ = generate(model, [tok.encode(start)], "none", max_new_tokens=20)
    eot = free[0][6]
    stop = free[0].index(eot)  # its first occurrence, at most 6 of 20

    def with_eot(meta):
        tokenizer = tok.__class__(CHARS)
        tokenizer.eot_token = eot
        return tokenizer

    monkeypatch.setattr(data, "get_tokenizer", with_eot)
    summary = sample.main(
        [
            f"--init_from={tmp_path}",
            "--device=cpu",
            "--cache=paged",
            "--page_size=8",
            "--max_new_tokens=20",
            "--temperature=0",
            f"--start={start}",
        ]
    )
    assert capsys.readouterr().out == start + tok.decode(free[0][:stop]) + "\n"
    assert summary["prefill_tokens"] == len(start) and summary["decode_tokens"] == stop


BAD_OPTIONS = [
    ("--cache=grouped", r"--cache: got 'grouped' for a model with attention='mla'; valid: auto, mla, paged"),
    ("--cache=flat", r"--cache: got 'flat'; valid: auto, grouped, paged, mla, paged_mla, none"),
    ("--num_samples=0", r"--num_samples: got 0; valid: an int >= 1"),
    # 4e16 bytes of tokens: more than any host has (the OS would kill the run partway, with --cache=none too).
    (
        "--num_samples=100000000000000 --cache=none",
        r"--num_samples=100000000000000 x --max_new_tokens=10: the samples' tokens need .* GiB of host memory",
    ),
    ("--temperature=-1", r"^--temperature: got -1.0; valid: a number >= 0"),
    ("--top_k=-2", r"^--top_k: got -2; valid: an int >= 0"),
    ("--top_p=1.5", r"^--top_p: got 1.5; valid: a number in \(0, 1\]"),
    ("--cuda_graphs=True", r"^--cuda_graphs: got True with --device=cpu; valid: False on a CPU"),
    ("--page_size=12", r"page_size: got 12; valid: a power of two"),
    ("--num_pages=-1", r"--num_pages: got -1; valid"),
    ("--device=tpu0", r"--device: got 'tpu0'; valid: cpu, cuda"),
    ("--device=meta", r"--device: got 'meta'; valid: cpu, cuda"),
    ("--dtype=float64", r"--dtype: got 'float64'; valid"),
    ("--seed=99999999999999999999", r"^--seed: got 99999999999999999999; valid: an int in \[-2\*\*63, 2\*\*64 - 1\]$"),
    ("--start=FILE:missing.txt", r"--start: got 'FILE:missing.txt', which cannot be read"),
    (
        "--max_new_tokens=70 --allow_past_block_size=False",
        r"block_size=64; this RoPE model may go past .* --allow_past_block_size=True",
    ),
    # only the options given are named (their defaults, 0 and False, are not)
    (
        "--cache=mla --num_pages=4",
        r"^--num_pages=4: given with --cache=mla, which has no page pool; valid: --cache=paged, or no --num_pages$",
    ),
    ("--cache=mla --wait_for_pages=True", r"^--wait_for_pages=True: given with --cache=mla, which has no page pool"),
    (
        "--cache=mla --num_pages=4 --wait_for_pages=True",
        r"^--num_pages=4 and --wait_for_pages=True: given .* or no --num_pages and no --wait_for_pages$",
    ),
    (
        "--cache=paged --page_size=8 --num_samples=3 --num_pages=5",  # 2 pages each at full length
        r"--num_pages: got 5; the pool must hold 6 pages .* 3 samples at once.*>= 6, "
        r"or --wait_for_pages=True with >= 2",
    ),
    ("--cache=paged --page_size=8 --num_pages=1 --wait_for_pages=True", r"--num_pages: got 1; .* for one sample"),
]


@pytest.mark.parametrize("args,match", BAD_OPTIONS, ids=[a for a, _ in BAD_OPTIONS])
def test_sample_py_rejects_bad_options_at_start(tmp_path, monkeypatch, capsys, args, match):
    """Each bad option or combination raises ValueError naming it and the valid values before any text is written
    (prompt "HELLO, ": 7 tokens, + 10 new - 1 = 16 tokens = 2 pages of 8)."""
    _checkpoint(tmp_path)
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ValueError, match=match):
        sample.main(
            [f"--init_from={tmp_path}", "--device=cpu", "--start=HELLO, ", "--max_new_tokens=10", *args.split()]
        )
    assert capsys.readouterr().out == ""


def test_generate_refuses_sizes_that_cannot_work_at_start(monkeypatch):
    """A cache larger than the device's available memory (it would fail to allocate, or get the process killed),
    a boolean top_k and a max_batch below 1 are refused before anything runs."""
    model = tiny_model("mha", dtype=torch.float32).cpu()
    monkeypatch.setattr(engine, "available_bytes", lambda device: 1000)
    with pytest.raises(
        ValueError,
        match=r"cache: .* GiB \(2 sequences of up to 12 tokens at \d+ bytes a token\), "
        r"but 0.0 GiB is available on cpu; valid: fewer samples",
    ):
        generate(model, [[1, 2, 3], [4]], "grouped", max_new_tokens=10)
    monkeypatch.undo()
    with pytest.raises(ValueError, match=r"top_k: got True; valid: an int >= 0"):
        generate(model, [[1]], "grouped", max_new_tokens=2, temperature=1.0, top_k=True)
    with pytest.raises(ValueError, match=r"max_batch: got 0; valid: None \(all prompts together\) or an int >= 1"):
        generate(model, [[1]], "grouped", max_new_tokens=2, max_batch=0)


@pytest.mark.parametrize("kind", ["grouped", "paged", "mla", "paged_mla"])
@pytest.mark.parametrize("engine_name", ["eager", "static"])
def test_the_size_check_counts_what_the_cache_allocates(kind, engine_name, monkeypatch):
    """The bytes the start-up check asks for are exactly the cache's allocation (a static engine's paged pool has
    its scratch page too): with one byte less available the run is refused, with exactly that much it runs."""
    model = tiny_model("mla" if "mla" in kind else "gqa", dtype=torch.float32).cpu()
    prompts, args = [[1, 2, 3], [4]], dict(max_new_tokens=10, engine=engine_name, page_size=8)
    monkeypatch.setattr(engine, "available_bytes", lambda device: None)
    allocated = generate(model, prompts, kind, **args)[1].cache_bytes_allocated
    monkeypatch.setattr(engine, "available_bytes", lambda device: allocated - 1)
    with pytest.raises(ValueError, match=r"cache: .* GiB .* is available on cpu"):
        generate(model, prompts, kind, **args)
    monkeypatch.setattr(engine, "available_bytes", lambda device: allocated)
    generate(model, prompts, kind, **args)


BAD_GENERATE_CALLS = [
    (dict(prompts=[[500, 1]]), ValueError, r"^prompts\[0\]\[0\]: got 500; valid: an int token id in \[0, 65\)$"),
    (dict(prompts=[[1], [2, -1]], cache="paged"), ValueError, r"^prompts\[1\]\[1\]: got -1; valid: an int token id in"),
    (dict(prompts=torch.tensor([[1, 2]])), TypeError, r"^prompts: got a Tensor; valid: a list of token-id lists"),
    (dict(prompts="HELLO"), TypeError, r"^prompts: got a str; valid: a list of token-id lists \(one per prompt\)$"),
    (dict(prompts=[1, 2, 3]), TypeError, r"^prompts\[0\]: got an int; valid: a list of token ids \(\[\[1, 2, 3\]\]"),
    (
        dict(prompts=[[1.0, 2]]),
        TypeError,
        r"^prompts\[0\]\[0\]: got 1.0 \(a float\); valid: an int token id in \[0, 65\)$",
    ),
    (dict(prompts=[[1], []]), ValueError, r"^prompts\[1\]: got an empty list; valid: at least one token id$"),
    (dict(temperature="hot"), TypeError, r"^temperature: got 'hot'; valid: a number >= 0"),
    (dict(dtype="fp16"), ValueError, r"^dtype: got 'fp16'; valid: None \(the model's\), a floating-point torch.dtype"),
    (dict(eot_token=65), ValueError, r"^eot_token: got 65; valid: None or an int token id in \[0, 65\)$"),
    (dict(num_pages=4), ValueError, r"^num_pages=4: given with cache 'grouped', which has no page pool; valid: cache"),
    (dict(wait_for_pages=True, cache="none"), ValueError, r"^wait_for_pages=True: given with cache 'none'"),
]


@pytest.mark.parametrize(
    "call,error,match",
    BAD_GENERATE_CALLS,
    ids=[
        "id-500",
        "id-neg-paged",
        "tensor",
        "str",
        "flat",
        "float-id",
        "empty",
        "temperature-str",
        "dtype-name",
        "eot",
        "num_pages-grouped",
        "wait-none",
    ],
)
def test_generate_refuses_bad_prompts_and_options_on_the_host(call, error, match):
    """generate checks its prompts (token ids in the vocabulary, in lists) and options up front on the host, with
    the argument's name and what is valid, where PyTorch would raise from deep inside (or a GPU assert)."""
    model = tiny_model("gqa")
    call = {"prompts": [[1, 2]], "cache": "grouped", **call}
    with pytest.raises(error, match=match):
        generate(model, call.pop("prompts"), call.pop("cache"), max_new_tokens=3, **call)


def test_generate_takes_dtype_names_and_tuples_of_ints():
    """dtype by name (as sample.py's --dtype writes it) is the torch.dtype; prompts as tuples of ints do as lists."""
    model = tiny_model("gqa")
    ref, _ = generate(model, [[1, 2]], "grouped", max_new_tokens=3, dtype=torch.float32)
    assert generate(model, [[1, 2]], "grouped", max_new_tokens=3, dtype="float32")[0] == ref
    assert generate(model, ((1, 2),), "none", max_new_tokens=3)[0] == ref


def test_forward_refuses_bad_idx_and_targets_shapes():
    """GPT.forward checks idx's rank and dtype and targets' shape (metadata only, no device sync)."""
    model = tiny_model("gqa")
    idx = torch.zeros(4, 4, dtype=torch.long, device=DEVICE)
    with pytest.raises(ValueError, match=r"^idx: got shape \(5,\); valid: \(B, T\) token ids$"):
        model(torch.zeros(5, dtype=torch.long, device=DEVICE))
    with pytest.raises(TypeError, match=r"^idx: got dtype torch.float32; valid: \(B, T\) token ids of dtype"):
        model(idx.float())
    with pytest.raises(
        ValueError, match=r"^targets: got shape \(16,\); valid: None or token ids of idx's shape \(4, 4\)$"
    ):
        model(idx, idx.view(-1))
    assert model(idx.int(), idx)[1] is not None  # int32 ids go through the embedding as int64 do


def test_sample_py_bad_checkpoint_and_prompt_sources(tmp_path, monkeypatch):
    """--init_from that is neither a directory, a file nor a GPT-2 name, a checkpoint whose model_args do not fit its
    weights, and a --start file that is not UTF-8 each say what is wrong and what is valid."""
    from checkpoint import CheckpointError, load_checkpoint, save_checkpoint

    _checkpoint(tmp_path)
    monkeypatch.chdir(tmp_path)
    with pytest.raises(
        ValueError,
        match=r"--init_from: got 'gpt3', which is not a directory or a checkpoint file; valid: a run directory "
        r"holding best.pt or last.pt, a checkpoint file, 'resume' \(--out_dir\), or gpt2, ",
    ):
        sample.main(["--init_from=gpt3", "--device=cpu"])
    (tmp_path / "prompt.bin").write_bytes(b"\xff\xfe\x00binary")
    with pytest.raises(ValueError, match=r"--start: got 'FILE:prompt.bin', which cannot be read \(not UTF-8 text\)"):
        sample.main([f"--init_from={tmp_path}", "--device=cpu", "--start=FILE:prompt.bin"])
    ckpt = load_checkpoint(tmp_path / "last.pt")
    ckpt["model_args"]["n_layer"] += 1
    save_checkpoint(tmp_path / "last.pt", ckpt)
    with pytest.raises(CheckpointError, match=r"last.pt': its model_args and weights do not make a model"):
        sample.main([f"--init_from={tmp_path}", "--device=cpu"])


SHORT = ["--device=cpu", "--start=HELLO, ", "--max_new_tokens=4", "--temperature=0"]


def test_sample_py_takes_the_newest_checkpoint_here(tmp_path, monkeypatch, capsys):
    """Without --out_dir: no checkpoint here says how to train one; with several run directories, the one whose
    checkpoint was written last, named on stderr (`python train.py configs/gqa.py` then `python sample.py`)."""
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ValueError, match=r"no checkpoint here .*train one first: python train.py configs/gqa.py"):
        sample.main(["--device=cpu"])
    for name, variant, age in (("out", "mha", 300), ("out-gqa", "gqa", 0), ("out-mla", "mla", 100)):
        (tmp_path / name).mkdir()
        _checkpoint(tmp_path / name, variant)
        stamp = (tmp_path / name / "last.pt").stat().st_mtime - age
        os.utime(tmp_path / name / "last.pt", (stamp, stamp))
    summary = sample.main(["--cache", "paged", "--page_size=8", *SHORT])
    err = capsys.readouterr().err
    assert "no --out_dir given: sampling from out-gqa, the newest checkpoint here; also here: out, out-mla" in err
    assert "loaded out-gqa/last.pt" in err and summary["attention"] == "gqa"
    assert sample.main(["--out_dir=out", *SHORT])["attention"] == "mha"  # given, even as the default's value
    with pytest.raises(
        ValueError,
        match=r"--out_dir: got 'out-mqa', which is not a directory or a checkpoint file; valid: .*; here: "
        r"--out_dir=out, --out_dir=out-gqa, --out_dir=out-mla$",
    ):
        sample.main(["--out_dir=out-mqa", *SHORT])
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match=r"--init_from: no checkpoint in 'empty' .*; valid: --out_dir=out, "):
        sample.main(["--init_from=empty", *SHORT])


def test_sample_py_takes_a_checkpoint_file_and_names_the_other_when_one_is_corrupt(tmp_path, monkeypatch, capsys):
    """--out_dir=out-gqa/last.pt and --init_from=.../last.pt load that file; a corrupt best.pt (taken first from the
    directory) fails with the message that names last.pt beside it, and the other way round; with both damaged,
    the message offers neither."""
    from checkpoint import CheckpointError

    monkeypatch.chdir(tmp_path)
    run = tmp_path / "out-gqa"
    run.mkdir()
    _checkpoint(run, "gqa")
    assert sample.main(["--out_dir=out-gqa/last.pt", *SHORT])["attention"] == "gqa"
    assert sample.main([f"--init_from={run / 'last.pt'}", *SHORT])["attention"] == "gqa"
    good = (run / "last.pt").read_bytes()
    data = bytearray(good)
    data[len(data) // 2 : len(data) // 2 + 64] = bytes(64)  # inside the weights: the archive's CRC check fails
    (run / "best.pt").write_bytes(bytes(data))
    with pytest.raises(
        CheckpointError,
        match=r"best.pt.*is corrupt.*; valid: the other checkpoint beside it, --out_dir=out-gqa/last.pt$",
    ):
        sample.main(["--out_dir=out-gqa", *SHORT])
    (run / "best.pt").write_bytes(good)
    (run / "last.pt").write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=r"valid: the other checkpoint beside it, --init_from=.*out-gqa/best.pt$"):
        sample.main([f"--init_from={run / 'last.pt'}", *SHORT])
    (run / "best.pt").write_bytes(bytes(data))  # both damaged: the message offers neither
    with pytest.raises(CheckpointError, match=r"last.pt.*is corrupt") as failed:
        sample.main([f"--init_from={run / 'last.pt'}", *SHORT])
    assert "beside" not in str(failed.value)
    assert capsys.readouterr().out.count("HELLO, ") == 2  # the two runs that loaded, nothing from the failed ones


def test_sample_py_past_block_size(tmp_path, monkeypatch, capsys):
    """A RoPE model (block_size 64) generates past block_size with a one-line warning on stderr, the prompt too
    long for it included; learned positions keep the error, and a prompt longer than block_size has its own."""
    monkeypatch.chdir(tmp_path)
    for name, variant in (("out-gqa", "gqa"), ("out-mha", "mha")):
        (tmp_path / name).mkdir()
        _checkpoint(tmp_path / name, variant)
    rope = ["--out_dir=out-gqa", "--device=cpu", "--start=HELLO, ", "--temperature=0", "--page_size=8"]
    summary = sample.main([*rope, "--cache=paged", "--num_samples=2", "--max_new_tokens=70"])
    err = capsys.readouterr().err
    warning = "warning: prompt 7 + max_new_tokens 70 - 1 = 76 tokens > block_size=64: this RoPE model goes past"
    assert [line for line in err.splitlines() if line.startswith("warning")] == [
        warning + " the positions it was trained on"
    ]
    assert summary["decode_tokens"] == 2 * 69
    sample.main([*rope[:2], f"--start={'A' * 70}", "--max_new_tokens=2", "--temperature=0"])
    assert "warning: the prompt alone (70 tokens) is longer than block_size=64" in capsys.readouterr().err
    learned = ["--out_dir=out-mha", "--device=cpu", "--temperature=0"]
    with pytest.raises(ValueError, match=r"= 76 tokens; valid: at most block_size=64 for learned position"):
        sample.main([*learned, "--start=HELLO, ", "--max_new_tokens=70"])
    with pytest.raises(ValueError, match=r"^prompt: got 70 tokens, longer than the model's block_size=64; valid: at"):
        sample.main([*learned, f"--start={'A' * 70}", "--max_new_tokens=2"])
    assert capsys.readouterr().out == ""


def test_sample_py_error_is_a_message_not_a_traceback(tmp_path):
    _checkpoint(tmp_path)
    run = subprocess.run(
        [sys.executable, os.path.join(REPO, "sample.py"), f"--init_from={tmp_path}", "--device=cpu", "--cache=grouped"],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONPATH": REPO},
    )
    assert run.returncode == 2 and run.stdout == ""  # a usage error, as train.py's
    assert "Traceback" not in run.stderr
    assert run.stderr.strip().endswith(
        "error: --cache: got 'grouped' for a model with attention='mla'; valid: auto, mla, paged, paged_mla, none"
    )


def test_sample_py_exit_statuses(tmp_path, monkeypatch, capsys):
    """sample.cli, as train.py's: 2 for a usage error (an unknown key, a bad value, an option this model or folder
    cannot take), 1 for a failure with its message (a checkpoint that does not load, a pool run dry, GPT-2 without
    transformers), 0 for help; "error: ..." on stderr, never a traceback."""
    import model as model_module
    from cache import CacheFullError

    monkeypatch.chdir(tmp_path)
    (tmp_path / "out-mla").mkdir()
    _checkpoint(tmp_path / "out-mla")
    (tmp_path / "out-bad").mkdir()
    (tmp_path / "out-bad" / "last.pt").write_bytes(b"not a checkpoint")
    run = ["--out_dir=out-mla", "--device=cpu", "--start=HELLO, ", "--max_new_tokens=2"]
    usage = [
        (["--bogus=1"], "error: override '--bogus=1': unknown config key 'bogus'"),
        ([*run, "--num_samples=0"], "error: --num_samples: got 0; valid: an int >= 1"),
        ([*run, "--seed=99999999999999999999"], "error: --seed: got 99999999999999999999; valid: an int in "),
        ([*run, "--cache=grouped"], "error: --cache: got 'grouped' for a model with attention='mla'"),
        ([*run, "--max_new_tokens=70", "--allow_past_block_size=False"], "error: prompt of 7 tokens"),
        (["--out_dir=out-gqa", "--device=cpu"], "error: --out_dir: got 'out-gqa', which is not a directory"),
    ]
    for argv, message in usage:
        assert sample.cli(argv) == 2, argv
        assert capsys.readouterr().err.splitlines()[-1].startswith(message), argv
    assert sample.cli(["--out_dir=out-bad", "--device=cpu"]) == 1
    assert "error: checkpoint 'out-bad/last.pt'" in capsys.readouterr().err

    def dry(*args, **kwargs):
        raise CacheFullError("the page pool ran dry")

    monkeypatch.setattr(sample, "generate", dry)
    assert sample.cli(run) == 1
    assert capsys.readouterr().err.endswith("error: the page pool ran dry\n")
    assert sample.cli(["--help"]) == 0

    def no_transformers(*args, **kwargs):
        raise ImportError("GPT.from_pretrained needs transformers: pip install transformers")

    monkeypatch.setattr(model_module.GPT, "from_pretrained", no_transformers)
    assert sample.cli(["--init_from=gpt2", "--device=cpu"]) == 1
    assert capsys.readouterr().err.endswith("error: GPT.from_pretrained needs transformers: pip install transformers\n")


def test_sample_py_help_shows_what_the_defaults_do(tmp_path, monkeypatch, capsys):
    """--help shows --out_dir='' (none given: the newest checkpoint here) and --device=auto, and a run with neither
    does what they say."""
    from configurator import help_text

    text = help_text(sample.__doc__, sample.DEFAULTS, sample.__file__)
    assert "\n  --out_dir=''\n" in text and "'': the newest checkpoint's run here" in text
    assert "\n  --device=auto  # auto (cuda where this torch sees a GPU, else cpu)" in text
    monkeypatch.chdir(tmp_path)
    (tmp_path / "out-gqa").mkdir()
    _checkpoint(tmp_path / "out-gqa", "gqa", backend="auto")  # "auto" says in the status line which device ran
    summary = sample.main(["--start=HELLO, ", "--max_new_tokens=2", "--cuda_graphs=False"])
    err = capsys.readouterr().err
    assert "no --out_dir given: sampling from out-gqa" in err and summary["attention"] == "gqa"
    assert f"backend={'triton' if torch.cuda.is_available() else 'torch'}" in err  # auto: the GPU where there is one
