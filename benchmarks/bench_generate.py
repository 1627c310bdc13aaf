"""Decode speed of GPT-2-small-sized models four ways in one process: our engine (generate.py, decode steps
replayed from CUDA graphs), the same with the blocks compiled, our eager loop, and a gpt-fast-style peer written
here, on the same weights.

    python -m benchmarks.bench_generate                                  # the full grid (over 10 minutes on an H200)
    python -m benchmarks.bench_generate --quick                          # batches 1, 8, ragged; 32 new tokens
    python -m benchmarks.bench_generate --batches 1,8,64,ragged --ragged_prompts 64 --ragged_rows 16   # ~7 min
    python -m benchmarks.bench_generate --device=cpu --tiny              # a smoke run of the same code on the CPU
    python -m benchmarks.bench_generate --variants gqa,mla --batches 1 --profile   # where a decode step's time goes

Models: GPT-2 small (12 layers, 12 heads of 64, 768 wide, learned positions) with GQA (4 KV heads) and with MLA
(a 256-wide latent and a 32-dim RoPE key), random weights in bf16. Each batch (--batches) is that many prompts of
--prompt_len tokens decoding --new_tokens greedily; "ragged" is --ragged_prompts prompts of prompt_len / 8 ..
prompt_len tokens that each want new_tokens / 4 .. new_tokens tokens, through --ragged_rows rows (continuous
batching: finished sequences' rows go to the next prompts, --admit_batch of them at a time).

- engine: generate(engine="graphs"), the natural cache of the model (grouped / mla; --caches adds paged);
- compiled: the same engine over a copy of the model whose blocks generate.compile_model compiled (sample.py
  --compile=True): Inductor's fused norms, projections and MLP between our cache kernels, replayed in the graphs;
- eager: generate(engine="eager"), a forward and a read-back per step;
- peer: gpt-fast's recipe over the same modules: a static KV cache tensor per layer (MLA: the latent and RoPE key),
  F.scaled_dot_product_attention with a mask of each row's length, the decode step (with the argmax) compiled with
  torch.compile(mode="reduce-overhead", fullgraph=True) with coordinate-descent tuning (gpt-fast sets it; so does
  compile_model); prefill eager. On the ragged prompts it batches statically:
  --ragged_rows prompts at a time, each batch decoding until its longest request is done.

Decode tokens/s counts the tokens decoded (not the prefill's first) over the decode seconds (device-synchronized);
ms/step is the decode seconds over the steps. After each way's warm-up, the engine, compiled and peer ways run in
alternating rounds (--rounds, default 3) and each reports its median run; the progress lines give the spread. The
ragged rows count every new token over the whole run's wall time, prefill included (a server's throughput, as
nano-vllm's bench reports it), capture and compile excluded, and give each way's seconds of prefill (the peer's: its
run outside the decode loops). Before timing, each model is checked: the engine's (plain and compiled) and the
peer's logits equal the eager loop's within the dtype's tolerance and their greedy tokens equal its tokens (up to a
near-tie, where rounding may pick either token). On the CPU the engines run their static step without capture and
the peer's step is not compiled (no CUDA graphs); the compiled way is Inductor's CPU code there.

--profile traces one more run of the compiled way and of the peer at each fixed batch (torch.profiler) and prints
what a decode step of each spends: the GPU kernels that run in every step (a prefill's run once a layer), each one's
microseconds and launches a step, with the step's wall time beside them; on the CPU, the ops' own host time instead.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import os
import sys
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

GPT2_SMALL = dict(n_layer=12, n_head=12, n_embd=768, block_size=1024, vocab_size=50304, bias=True, dropout=0.0)
TINY = dict(n_layer=2, n_head=4, n_embd=64, block_size=256, vocab_size=512, bias=True, dropout=0.0)
VARIANTS = {
    "mha": dict(attention="mha"),
    "gqa": dict(attention="gqa", n_kv_head=4),
    "mqa": dict(attention="mqa"),
    # DeepSeek-V2's proportions at GPT-2-small width: latent 4 x head_dim, rope half a head
    "mla": dict(attention="mla", kv_lora_rank=256, qk_nope_head_dim=64, qk_rope_head_dim=32, v_head_dim=64),
}
TINY_MLA = dict(attention="mla", kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16)
# Logits against the eager loop's: bf16 rounds every activation to 2^-8 through 12 layers (logits of a random
# GPT-2-small are ~0.5 wide), fp32 differs only in summation order.
TOLERANCE = {torch.bfloat16: 0.06, torch.float16: 0.02, torch.float32: 1e-3}
# The ragged rows' seconds of prefill per way; the rest of each run is its decode steps.
PREFILL = "prefill s (engine, compiled, eager, peer)"


# ---------------------------------------------------------------------------------------------- the peer

PEER_INDUCTOR_OPTIONS = {"triton.cudagraphs": True, "coordinate_descent_tuning": True}


class StaticCachePeer(nn.Module):
    """gpt-fast's decoder over the modules of one of our GPTs: a static cache per layer (registered buffers, so the
    compiled step's graphs may write them in place), rows at their own positions (B,), attention through SDPA with
    a mask of the positions each row has filled. GQA family: K and V (B, H_kv, S_max, D); MLA: the latent and the
    RoPE key (B, S_max, D_c + D_r), attended in the absorbed form, through projections with both up-projections
    folded in (`_fold_query`, kept as buffers here: the compiled step is one graph)."""

    def __init__(self, model, batch: int, max_len: int, compile: bool):
        import model as gpt  # here, not at the top: --device=cpu chooses Triton's interpreter before it is imported

        super().__init__()
        self.model, cfg = model, model.config
        self.rope_cos_sin, self.apply_rope, self.linear = gpt.rope_cos_sin, gpt.apply_rope, gpt.linear
        p = next(model.parameters())
        self.mla = cfg.attention == "mla"
        for i in range(cfg.n_layer):
            if self.mla:
                shapes = {"c": (batch, max_len, cfg.kv_lora_rank + cfg.qk_rope_head_dim)}
            else:
                shape = (batch, cfg.n_kv_head, max_len, cfg.n_embd // cfg.n_head)
                shapes = {"k": shape, "v": shape}
            for name, shape in shapes.items():
                self.register_buffer(f"{name}{i}", torch.zeros(shape, device=p.device, dtype=p.dtype))
                if compile:
                    torch._dynamo.mark_static_address(getattr(self, f"{name}{i}"))
            if self.mla:
                w_in, b_in, w_out = _fold_query(model.transformer.h[i].attn)
                for name, t in (("w_in", w_in), ("b_in", b_in), ("w_out", w_out)):
                    self.register_buffer(f"{name}{i}", t, persistent=False)
        self.register_buffer("key_pos", torch.arange(max_len, device=p.device))
        self.step, self.rows, self.compiled = self.decode_step, batch, compile
        if compile:
            torch._dynamo.reset()  # a fresh compile per peer: the guards of earlier shapes never pile up to the limit
            # mode="reduce-overhead" (CUDA graphs) with gpt-fast's coordinate-descent tuning, as our compiled step has
            self.step = torch.compile(self.decode_step, fullgraph=True, options=PEER_INDUCTOR_OPTIONS)

    def decode_step(self, tokens: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        """tokens (B,), pos (B,) -> next greedy tokens (B,)."""
        return self.forward(tokens[:, None], pos[:, None], slice(None))[:, -1].argmax(-1)

    @torch.no_grad()
    def prefill(self, prompts: list[list[int]], rows: list[int]) -> list[int]:
        """Each prompt into its row, one row at a time (ragged lengths); returns the first greedy tokens."""
        device = self.key_pos.device
        first = []
        for prompt, r in zip(prompts, rows):
            idx = torch.tensor([prompt], device=device)
            logits = self.forward(idx, torch.arange(len(prompt), device=device)[None], slice(r, r + 1))
            first.append(int(logits[0, -1].argmax()))
        return first

    def forward(self, idx, pos, rows: slice, last_only: bool = True):
        """idx (B, T) at positions pos (B, T) into cache rows `rows` -> logits (B, 1 or T, V)."""
        m, cfg = self.model, self.model.config
        x = m.transformer.wte(idx)
        if cfg.pos_embedding == "learned":
            x = x + m.transformer.wpe(pos)
        rope = self.rope_cos_sin(pos, cfg.rope_dim, cfg.rope_theta) if cfg.rope_dim else None
        mask = (self.key_pos <= pos[..., None])[:, None]  # (B, 1, T, S_max): keys this query may see
        for i, block in enumerate(m.transformer.h):
            attend = self._mla if self.mla else self._gqa
            x = x + attend(block.attn, block.ln_1(x), pos, rope, mask, rows, i)
            x = x + block.mlp(block.ln_2(x))
        x = m.transformer.ln_f(x[:, -1:] if last_only else x)
        return m.lm_head(x)

    def _gqa(self, attn, x, pos, rope, mask, rows, i):
        B, T, _ = x.shape
        H, H_kv, D = attn.n_head, attn.n_kv_head, attn.head_dim
        q, k, v = attn.c_attn(x).split([H * D, H_kv * D, H_kv * D], dim=2)
        q, k, v = q.view(B, T, H, D), k.view(B, T, H_kv, D), v.view(B, T, H_kv, D)
        if rope is not None:
            q, k = self.apply_rope(q, *rope), self.apply_rope(k, *rope)
        k_cache, v_cache = getattr(self, f"k{i}")[rows], getattr(self, f"v{i}")[rows]
        b = torch.arange(B, device=x.device)[:, None]
        k_cache[b, :, pos] = k  # (B, T, H_kv, D) into (B, H_kv, S, D) at each row's positions
        v_cache[b, :, pos] = v
        y = F.scaled_dot_product_attention(q.transpose(1, 2), k_cache, v_cache, attn_mask=mask, enable_gqa=True)
        return attn.c_proj(y.transpose(1, 2).reshape(B, T, H * D))

    def _mla(self, attn, x, pos, rope, mask, rows, i):
        B, T, _ = x.shape
        H, d_c, d_r = attn.n_head, attn.d_c, attn.d_r
        w_in, b_in, w_out = getattr(self, f"w_in{i}"), getattr(self, f"b_in{i}"), getattr(self, f"w_out{i}")
        if hasattr(attn, "q_a_proj"):
            q = self.linear(attn.q_a_norm(attn.q_a_proj(x)), w_in, b_in)
            c_kv, k_rope = attn.kv_a_proj(x).split([d_c, d_r], dim=-1)
        else:
            q, c_kv, k_rope = self.linear(x, w_in, b_in).split([H * (d_c + d_r), d_c, d_r], dim=-1)
        q_absorbed, q_rope = q.view(B, T, H, d_c + d_r).split([d_c, d_r], dim=-1)
        q_rope, k_rope = self.apply_rope(q_rope, *rope), self.apply_rope(k_rope, *rope)
        cache = getattr(self, f"c{i}")[rows]  # (B, S, D_c + D_r)
        cache[torch.arange(B, device=x.device)[:, None], pos] = torch.cat([attn.kv_a_norm(c_kv), k_rope], -1)
        q = torch.cat([q_absorbed, q_rope], -1).transpose(1, 2)  # (B, H, T, D_c + D_r)
        k, v = cache[:, None], cache[:, None, :, :d_c]  # one latent "head" shared by every query head
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=attn.scale, enable_gqa=True)
        return self.linear(o.transpose(1, 2).reshape(B, T, H * d_c), w_out, attn.c_proj.bias)


@torch.no_grad()
def _fold_query(attn) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """The peer's MLA decode weights (w_in, b_in, w_out): both up-projections folded into the projections around
    attention (DeepSeek-V2, section 2.1.2), which in plain PyTorch beats applying W_UK per head, a batched matmul
    more a layer (benchmarks/RESULTS.md). w_in: per head the rows of W_UK[h]^T W_q_nope[h] then of W_q_rope[h],
    and without query compression the latent projection's rows; w_out: the model's own (W_O W_UV folded)."""
    H, d_n, d_r, d_c = attn.n_head, attn.d_n, attn.d_r, attn.d_c
    q = attn.q_b_proj if hasattr(attn, "q_a_proj") else attn.q_proj
    w_uk = attn._up_weights()[0].float()  # (H, D_n, D_c)
    w_q_nope, w_q_rope = q.weight.float().view(H, d_n + d_r, -1).split([d_n, d_r], dim=1)
    w_in = torch.cat([torch.einsum("hnc,hni->hci", w_uk, w_q_nope), w_q_rope], dim=1).reshape(H * (d_c + d_r), -1)
    b_in = None
    if q.bias is not None:
        b_nope, b_rope = q.bias.float().view(H, d_n + d_r).split([d_n, d_r], dim=1)
        b_in = torch.cat([torch.einsum("hn,hnc->hc", b_nope, w_uk), b_rope], dim=1).reshape(-1)
    if not hasattr(attn, "q_a_proj"):
        w_in = torch.cat([w_in, attn.kv_a_proj.weight.float()])
        b_in = None if b_in is None else torch.cat([b_in, attn.kv_a_proj.bias.float()])
    dtype = q.weight.dtype
    return w_in.to(dtype), None if b_in is None else b_in.to(dtype), attn.absorbed_weights()[2]


@torch.no_grad()
def peer_generate(peer: StaticCachePeer, prompts: list[list[int]], new_tokens: list[int], sync, trace=None):
    """Static batching: as many prompts as the peer has rows at a time, prefilled, then decoded until the batch's
    longest request is done. Returns (tokens per prompt, decode seconds, decode steps, wall seconds). `trace`, a
    profiler, is entered around the decode loop of a single batch."""
    rows, device = peer.rows, peer.key_pos.device
    out, decode_s, steps = [], 0.0, 0
    sync()
    t_run = time.perf_counter()
    for start in range(0, len(prompts), rows):
        batch, want = prompts[start : start + rows], new_tokens[start : start + rows]
        pad = [0] * (rows - len(batch))  # the last batch's empty rows decode at position 0, unread
        tokens = torch.tensor(peer.prefill(batch, list(range(len(batch)))) + pad, device=device)
        pos = torch.tensor([len(p) for p in batch] + pad, device=device)
        history = torch.empty(max(want), rows, dtype=torch.int64, device=device)
        history[0] = tokens
        sync()
        with trace if trace is not None else contextlib.nullcontext():
            t0 = time.perf_counter()
            for k in range(1, max(want)):
                if peer.compiled:
                    torch.compiler.cudagraph_mark_step_begin()
                tokens = peer.step(tokens, pos).clone()
                history[k] = tokens
                pos += 1
            sync()
            decode_s += time.perf_counter() - t0
        steps += max(want) - 1
        got = history.t().tolist()
        out += [got[j][: want[j]] for j in range(len(batch))]
    sync()
    return out, decode_s, steps, time.perf_counter() - t_run


# ------------------------------------------------------------------------------------------------ checks


def check(model, compiled, prompt_len: int, engine: str, device, n: int = 4, new: int = 12) -> str:
    """The engine's (on `model` and on its `compiled` copy) and the peer's logits against the eager loop's on
    n prompts x `new` tokens, and the engines' greedy tokens against its tokens up to the first near-tie (a top-2
    margin within twice the tolerance)."""
    from generate import generate

    g = torch.Generator().manual_seed(99)
    prompts = torch.randint(0, model.config.vocab_size, (n, prompt_len), generator=g).tolist()
    seen = {"eager": {}, "engine": {}, "compiled": {}}

    def hook(name):
        return lambda i, x: seen[name].setdefault(i, []).append(x.float().cpu())

    ref, _ = generate(model, prompts, engine="eager", max_new_tokens=new, on_logits=hook("eager"))
    outs = {
        name: generate(m, prompts, engine=engine, max_new_tokens=new, on_logits=hook(name))[0]
        for name, m in (("engine", model), ("compiled", compiled))
    }
    peer = StaticCachePeer(model, 1, prompt_len + new, compile=False)
    seen["peer"] = {i: _teacher_forced(peer, p, ref[i], device) for i, p in enumerate(prompts)}
    tol = TOLERANCE[model.lm_head.weight.dtype]
    worst, ties = {}, 0
    for name in ("engine", "compiled", "peer"):
        errors = []
        for i in range(len(prompts)):
            tokens = ref[i] if name == "peer" else outs[name][i]
            for k, (got, want) in enumerate(zip(seen[name][i], seen["eager"][i])):
                errors.append((got - want).abs().max().item())
                if errors[-1] > tol:
                    raise SystemExit(f"check: {name} logits of prompt {i} step {k} differ by {errors[-1]:.3g} > {tol}")
                if tokens[k] != ref[i][k]:
                    margin = float(want.topk(2).values.diff().abs())
                    if margin > 2 * tol:
                        raise SystemExit(f"check: {name} token of prompt {i} step {k} differs (margin {margin:.3g})")
                    ties += 1
                    break  # past a near-tie the two sequences go on from different tokens
        worst[name] = max(errors)
    errors = ", ".join(f"{name} {worst[name]:.2e}" for name in worst)
    return f"max logit error vs eager: {errors}; {ties} near-ties"


@torch.no_grad()
def _teacher_forced(peer, prompt: list[int], tokens: list[int], device) -> list[torch.Tensor]:
    """The peer's logits (uncompiled) for the prompt and then each of `tokens` but the last fed in turn."""
    row = slice(0, 1)
    logits = [peer.forward(torch.tensor([prompt], device=device), torch.arange(len(prompt), device=device)[None], row)]
    for k, t in enumerate(tokens[:-1]):
        pos = torch.tensor([[len(prompt) + k]], device=device)
        logits.append(peer.forward(torch.tensor([[t]], device=device), pos, row))
    return [x[0, -1].float().cpu() for x in logits]


# ---------------------------------------------------------------------------------------------- the runs


def build(variant: str, args):
    from model import GPT, GPTConfig

    torch.manual_seed(0)
    shape = TINY if args.tiny else GPT2_SMALL
    fields = TINY_MLA if args.tiny and variant == "mla" else VARIANTS[variant]
    model = GPT(GPTConfig(**shape, **fields, attn_backend="triton"))
    return model.to(args.device, getattr(torch, args.dtype)).eval()


def workload(model, batch: int | str, args) -> tuple[list[list[int]], list[int], int]:
    """(prompts, new tokens per prompt, rows decoded together) of a batch size or "ragged"."""
    g = torch.Generator().manual_seed(0)
    vocab = model.config.vocab_size
    if batch != "ragged":
        return torch.randint(0, vocab, (batch, args.prompt_len), generator=g).tolist(), [args.new_tokens] * batch, batch
    lens = torch.randint(max(1, args.prompt_len // 8), args.prompt_len + 1, (args.ragged_prompts,), generator=g)
    new = torch.randint(max(2, args.new_tokens // 4), args.new_tokens + 1, (args.ragged_prompts,), generator=g)
    prompts = [torch.randint(0, vocab, (int(n),), generator=g).tolist() for n in lens]
    return prompts, new.tolist(), args.ragged_rows


def ours_timer(model, cache: str, batch, engine: str, args, sync, warm: bool = False):
    """Warm our engine up on this workload (compiles and tuning happen here, untimed); returns a function that
    times one run of it: {"tok/s", "ms/step", "prefill s"}."""
    from generate import generate

    prompts, new, rows = workload(model, batch, args)
    common = dict(page_size=args.page_size, max_batch=rows, admit_batch=args.admit_batch, engine=engine)
    if warm or args.device == "cuda":
        # A fixed batch meets every shape it will in two tokens; the ragged run admits and prefills its prompts in
        # groups that depend on when rows finish, so it warms up on itself.
        generate(model, prompts, cache, max_new_tokens=new if batch == "ragged" else 2, **common)

    def timed() -> dict:
        sync()
        t0 = time.perf_counter()
        _, stats = generate(model, prompts, cache, max_new_tokens=new, **common)
        wall = time.perf_counter() - t0 - stats.extra.get("capture_s", 0.0)
        s = stats.summary()
        if batch == "ragged":
            return {"tok/s": sum(new) / wall, "ms/step": None, "prefill s": stats.prefill_s}
        return {"tok/s": s["decode_tokens_per_s"], "ms/step": 1e3 * stats.decode_s / max(stats.decode_steps, 1)}

    return timed


def profile_step(label: str, run, cuda: bool, top: int = 16) -> None:
    """Print the kernels of a decode step (see the module docstring, --profile). run(prof) -> (decode seconds,
    steps) runs the way with the profiler `prof` entered around what it traces."""
    from torch.profiler import ProfilerActivity, profile

    prof = profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else []))
    decode_s, steps = run(prof)
    steps = max(steps, 1)
    events = prof.key_averages()
    if cuda:  # the kernels themselves, not the host ops that launched them
        events = [e for e in events if e.device_type == torch.autograd.DeviceType.CUDA]
    spent = (lambda e: e.self_device_time_total) if cuda else (lambda e: e.self_cpu_time_total)
    per_step = sorted((e for e in events if e.count >= steps), key=lambda e: -spent(e))
    what = "GPU kernels" if cuda else "host ops (self CPU time)"
    print(
        f"\nprofile {label}: {1e3 * decode_s / steps:.3f} ms a step traced, {sum(map(spent, per_step)) / steps:.1f} us "
        f"of {what} in {sum(e.count for e in per_step) / steps:.0f} calls a step; the top {top}:"
    )
    for e in per_step[:top]:
        print(f"  {spent(e) / steps:8.1f} us {e.count / steps:6.1f}x  {e.key[:110]}")


def ours_profile_run(model, cache: str, batch: int, engine: str, args, sync):
    """A run of our engine for profile_step."""
    from generate import generate

    prompts, new, _ = workload(model, batch, args)

    def run(prof):
        with prof:  # the prefill too: its kernels run once a layer, fewer times than the steps, and drop out
            _, stats = generate(model, prompts, cache, max_new_tokens=new, page_size=args.page_size, engine=engine)
            sync()
        return stats.decode_s, stats.decode_steps

    return run


def peer_timer(model, batch, args, sync):
    """Build the peer for this workload and warm it up (its compile, graph capture and every prompt length's
    prefill, untimed); returns a function that times one run of it, as `ours_timer`'s does."""
    prompts, new, rows = workload(model, batch, args)
    max_len = max(len(p) for p in prompts) + max(new)  # static batching: a row decodes as long as its batch
    peer = StaticCachePeer(model, min(rows, len(prompts)), max_len, compile=args.device == "cuda")
    if peer.compiled:
        peer_generate(peer, prompts, [3] * len(prompts), sync)

    def timed() -> dict:
        out, decode_s, steps, wall = peer_generate(peer, prompts, new, sync)
        if batch == "ragged":  # its prefill: the run's time outside the decode loops
            return {"tok/s": sum(new) / wall, "ms/step": None, "prefill s": wall - decode_s}
        return {"tok/s": sum(len(o) - 1 for o in out) / decode_s, "ms/step": 1e3 * decode_s / steps}

    # for profile_step: the decode loop alone, since the peer prefills one prompt at a time (kernels a prompt a layer)
    timed.profile_run = lambda prof: peer_generate(peer, prompts, new, sync, trace=prof)[1:3]
    return timed


def _spread(result: dict) -> str:
    return f" ({result['low']:,.0f}-{result['high']:,.0f})" if result.get("high", 0) > result.get("low", 0) else ""


def median_run(runs: list[dict]) -> dict:
    """The run of median tokens/s (the lower middle one of an even count), with its spread over all runs."""
    ordered = sorted(runs, key=lambda r: r["tok/s"])
    return dict(ordered[(len(ordered) - 1) // 2], low=ordered[0]["tok/s"], high=ordered[-1]["tok/s"])


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    p.add_argument("--dtype", default=None, help="bfloat16 (the default on a GPU) | float16 | float32 (CPU default)")
    p.add_argument("--variants", default="gqa,mla", help=f"comma-separated, from {', '.join(VARIANTS)}")
    p.add_argument("--caches", default="auto", help="comma-separated: auto (grouped / mla), paged")
    p.add_argument("--batches", default=None, help="comma-separated sizes and/or 'ragged' (default 1,8,64,256,ragged)")
    p.add_argument("--prompt_len", type=int, default=512)
    p.add_argument("--new_tokens", type=int, default=128)
    p.add_argument("--ragged_prompts", type=int, default=256)
    p.add_argument("--ragged_rows", type=int, default=64, help="rows decoded together on the ragged prompts")
    p.add_argument(
        "--admit_batch",
        type=int,
        default=None,
        help="rows freed before waiting prompts are admitted (generate's admit_batch; default a quarter of the rows)",
    )
    p.add_argument("--page_size", type=int, default=16)
    p.add_argument(
        "--rounds",
        type=int,
        default=None,
        help="timed runs of the engine, compiled and peer ways, alternating; the median counts (default 3; tiny 1)",
    )
    p.add_argument(
        "--profile",
        action="store_true",
        help="per fixed batch: the kernels of a compiled decode step, ours and the peer's",
    )
    p.add_argument("--quick", action="store_true", help="batches 1, 8 and 32 ragged prompts over 8 rows, 32 tokens")
    p.add_argument("--tiny", action="store_true", help="2-layer models, 8-token prompts, 4 new tokens (CPU smoke run)")
    args = p.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("no CUDA device here; --device=cpu --tiny is the CPU smoke run")
    args.dtype = args.dtype or ("bfloat16" if args.device == "cuda" else "float32")
    if args.quick:
        args.batches = args.batches or "1,8,ragged"
        args.new_tokens, args.ragged_prompts, args.ragged_rows = min(args.new_tokens, 32), 32, 8
    if args.tiny:
        args.batches = args.batches or "2,ragged"
        args.prompt_len, args.new_tokens, args.ragged_prompts, args.ragged_rows = 8, 4, 4, 2
    args.batches = [b if b == "ragged" else int(b) for b in (args.batches or "1,8,64,256,ragged").split(",")]
    args.variants, args.caches = args.variants.split(","), args.caches.split(",")
    if args.rounds is None:
        args.rounds = 1 if args.tiny else 3
    if args.rounds < 1:
        p.error(f"--rounds: got {args.rounds}; valid: an int >= 1")
    return args


def main(argv: list[str] | None = None):
    args = parse_args(sys.argv[1:] if argv is None else argv)
    if args.device == "cpu":
        os.environ.setdefault("TRITON_INTERPRET", "1")  # before anything imports triton: our kernels on CPU tensors
        torch.set_num_threads(min(4, torch.get_num_threads()))
    from benchmarks.common import ceilings, header, print_table
    from generate import compile_model, default_admit_batch

    cuda = args.device == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    engine = "graphs" if cuda else "static"
    print(header())
    if cuda:
        c = ceilings()
        print(f"ceilings: copy {c['copy_TBps']:.2f} TB/s, bf16 matmul {c['matmul_bf16_TFLOPs']:.0f} TFLOP/s")
    admit = args.admit_batch or default_admit_batch(args.ragged_rows)
    print(
        f"prompt {args.prompt_len} tokens, {args.new_tokens} new tokens, {args.dtype}, ragged: "
        f"{args.ragged_prompts} prompts through {args.ragged_rows} rows, admitted {admit} at a time; "
        f"engine = generate(engine={engine!r}), "
        "compiled = the same over generate.compile_model(model), "
        f"peer = static cache + SDPA{' + torch.compile(reduce-overhead)' if cuda else ' (eager on the CPU)'}",
        flush=True,
    )
    t_start = time.perf_counter()
    rows, step_ms = [], {}
    ways = ("engine", "compiled", "eager", "peer")
    for variant in args.variants:
        model = build(variant, args)
        compiled = compile_model(copy.deepcopy(model))
        size = dict(n=2, new=3) if args.tiny else {}
        print(f"{variant} check: {check(model, compiled, args.prompt_len, engine, args.device, **size)}", flush=True)
        for batch in args.batches:
            try:
                peer = peer_timer(model, batch, args, sync)
            except Exception as e:  # a torch.compile that fails here must not hide our numbers: say so, go on
                print(f"  peer failed on {variant} B{batch}: {type(e).__name__}: {str(e)[:300]}", flush=True)
                peer = None
            for cache in args.caches:
                timers = dict(
                    engine=ours_timer(model, cache, batch, engine, args, sync),
                    compiled=ours_timer(compiled, cache, batch, engine, args, sync, warm=True),
                    peer=peer,
                )
                runs = {name: [] for name in timers}
                for _ in range(args.rounds):  # alternating, so that a drift of the clocks reaches every way alike
                    for name, timer in timers.items():
                        if timer is None:
                            continue
                        try:
                            runs[name].append(timer())
                        except Exception as e:  # only the peer may fail here, and its failure must not hide ours
                            if name != "peer":
                                raise
                            print(f"  peer failed on {variant} B{batch}: {type(e).__name__}: {str(e)[:300]}")
                            timers["peer"] = peer = None
                failed = {"tok/s": float("nan"), "ms/step": None, "prefill s": float("nan")}
                results = {name: median_run(r) if r else failed for name, r in runs.items()}
                # the eager loop is the slow baseline, not a rival: one run
                results["eager"] = ours_timer(model, cache, batch, "eager", args, sync)()
                row = {"model": variant, "cache": cache, "batch": batch}
                for name, r in results.items():
                    row[f"{name} tok/s"], row[f"{name} ms/step"] = r["tok/s"], r["ms/step"]
                if batch == "ragged":  # where a continuous-batching run's time goes: prefill, one prompt at a time
                    row[PREFILL] = ", ".join(f"{results[name]['prefill s']:.3f}" for name in ways)
                for name in ways[:-1]:
                    row[f"{name}/peer"] = row[f"{name} tok/s"] / row["peer tok/s"]
                rows.append(row)
                for name in ways[:2]:
                    step_ms[name, variant, cache, batch] = row[f"{name} ms/step"]
                speeds = ", ".join(f"{name} {row[name + ' tok/s']:,.0f}{_spread(results[name])}" for name in ways)
                elapsed = time.perf_counter() - t_start
                split = f"; prefill s {row[PREFILL]}" if PREFILL in row else ""
                print(f"  {variant} {cache} B{batch}: {speeds} tok/s{split}; {elapsed:.0f} s so far", flush=True)
                if args.profile and batch != "ragged":
                    run = ours_profile_run(compiled, cache, batch, engine, args, sync)
                    profile_step(f"{variant} {cache} B{batch} compiled", run, cuda)
                    if peer is not None:  # the same step of the peer, kernel by kernel beside ours
                        profile_step(f"{variant} B{batch} peer", peer.profile_run, cuda)
        del model, compiled
        if cuda:
            torch.cuda.empty_cache()
    columns = ["model", "cache", "batch"] + [f"{w} tok/s" for w in ways] + [f"{w}/peer" for w in ways[:-1]]
    print_table(rows, columns + [f"{w} ms/step" for w in ways] + [PREFILL])
    for name in ways[:2]:
        for cache in args.caches:
            if (name, "gqa", cache, 1) in step_ms and (name, "mla", cache, 1) in step_ms:
                ratio = step_ms[name, "mla", cache, 1] / step_ms[name, "gqa", cache, 1]
                print(f"MLA/GQA {name} step time at batch 1 ({cache} cache): {ratio:.2f}")
    print(f"wall time {(time.perf_counter() - t_start) / 60:.1f} minutes")


if __name__ == "__main__":
    main()
