"""Flash attention training kernels (attention_kernels/flash.py) against PyTorch SDPA and FlexAttention on one GPU.

    python -m benchmarks.bench_flash              # the full grid (about nine minutes)
    python -m benchmarks.bench_flash --quick      # four shapes (under two minutes)
    python -m benchmarks.bench_flash --part 2/3   # the second third of the full grid (one device call each)

Per shape: our forward output and gradients are checked against SDPA (relative L2 error, bf16 budget) before
anything is timed; then the forward and the backward alone (autograd.grad over a retained graph) are timed for ours,
SDPA (`enable_gqa=True`, is_causal; MLA's D_v is padded to D_qk for it) and FlexAttention (compiled, causal block
mask). Ours and SDPA alternate for `--rounds` rounds (default 5), and each ratio to SDPA is the median of the rounds'
paired ratios, with their range beside it: single samples of one kernel spread by up to 13% on the H200, so one
sample of each cannot tell 1.00x from 1.03x (benchmarks/RESULTS.md). Where the forward or the
backward runs on the Hopper kernels (attention_kernels/flash_sm90*.py), the portable Triton one is timed too
(`fwd_triton` with ZOO_FLASH_SM90=0, `bwd_triton` with ZOO_FLASH_SM90_BWD=0), so the run shows that lever beside the
peers. `fwd_gpu` / `bwd_gpu` and their ratios time ours and SDPA on the GPU alone too
(common.bench_gpu_interleaved_ms: the calls enqueued while the GPU sleeps, ours and SDPA's side by side), so a shape
whose launch takes the host longer than the kernels take the GPU shows both numbers: the kernels' speed, and what a
caller waits. FLOPs: 2*B*H_q*S_q*S_kv*(D_qk + D_v) for the forward
(= 4*B*H*M*N*D for equal dims), half of it when causal; the backward counts 2.5x the forward. Ceilings (copy
bandwidth, bf16 matmul) come from the same run.
"""

import argparse
import statistics

import torch
import torch.nn.functional as F

from attention_kernels import flash, flash_gqa_attention
from benchmarks.common import (
    bench_gpu_interleaved_ms,
    bench_ms,
    ceilings,
    env,
    header,
    print_table,
    require_cuda,
)

# (B, H_q, H_kv, S, D_qk, D_v, causal); B * S = 16k tokens per shape.
QUICK = [
    (4, 32, 8, 4096, 128, 128, True),
    (4, 32, 8, 4096, 128, 128, False),
    (4, 32, 8, 4096, 64, 64, True),
    (4, 16, 16, 4096, 192, 128, True),  # MLA training shape: D_qk = 128 nope + 64 rope, D_v = 128
]


def full_grid():
    shapes = []
    for d in (64, 128):
        for causal in (True, False):
            for s in (1024, 4096, 16384):
                shapes.append((16384 // s, 32, 8, s, d, d, causal))  # group 4
            shapes.append((4, 32, 32, 4096, d, d, causal))  # MHA
            shapes.append((4, 32, 4, 4096, d, d, causal))  # group 8
    shapes += [(4, 16, 16, 4096, 192, 128, True), (4, 16, 16, 4096, 192, 128, False)]
    shapes.append((16, 12, 12, 1024, 96, 64, True))  # the GPT-2-small MLA (configs/mla.py): 64 nope + 32 rope, D_v 64
    return shapes


def grid_part(shapes: list, part: str) -> list:
    """The i-th of n near-equal slices of `shapes` for part = "i/n" (1 <= i <= n), so a grid longer than one
    device call runs in n calls."""
    try:
        i, n = (int(x) for x in part.split("/"))
    except ValueError:
        raise SystemExit(f"--part {part!r}: expected i/n with integers, e.g. 2/3") from None
    if not 1 <= i <= n:
        raise SystemExit(f"--part {part!r}: expected 1 <= i <= n")
    return shapes[(i - 1) * len(shapes) // n : i * len(shapes) // n]


def flops(shape) -> float:
    b, h_q, _, s, d_qk, d_v, causal = shape
    return 2.0 * b * h_q * s * s * (d_qk + d_v) * (0.5 if causal else 1.0)


def sdpa(q, k, v, causal):
    d_v = v.shape[-1]
    if d_v != q.shape[-1]:  # SDPA's fused backends need equal head dims: pad V, slice the output
        v = F.pad(v, (0, q.shape[-1] - d_v))
    out = F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=q.shape[1] != k.shape[1])
    return out[..., :d_v]


_flex = None


def flex(q, k, v, causal, block_mask):
    global _flex
    if _flex is None:
        from torch.nn.attention.flex_attention import flex_attention

        # One compile per shape of the grid: past dynamo's default limit (8) torch.compile silently falls back to
        # the unfused eager path, which is what the first full-grid run measured (4-30 TFLOP/s) after 8 shapes.
        for name in ("recompile_limit", "cache_size_limit"):
            if hasattr(torch._dynamo.config, name):
                setattr(torch._dynamo.config, name, 256)
        _flex = torch.compile(flex_attention, dynamic=False)
    return _flex(q, k, v, block_mask=block_mask, enable_gqa=q.shape[1] != k.shape[1])


def causal_block_mask(s, causal):
    if not causal:
        return None
    from torch.nn.attention.flex_attention import create_block_mask

    return create_block_mask(lambda b, h, q_idx, kv_idx: q_idx >= kv_idx, None, None, s, s, device="cuda")


def rel_err(got, want) -> float:
    return ((got.float() - want.float()).norm() / want.float().norm()).item()


def prepare(fn, q, k, v, do):
    """(forward closure, backward-alone closure, out, grads) of fn(q, k, v): the forward runs under no_grad, the
    backward is autograd.grad over a retained graph."""

    def fwd():
        with torch.no_grad():
            return fn(q, k, v)

    leaves = [x.detach().requires_grad_() for x in (q, k, v)]
    out = fn(*leaves)
    grads = torch.autograd.grad(out, leaves, do, retain_graph=True)
    bwd = lambda: torch.autograd.grad(out, leaves, do, retain_graph=True)  # noqa: E731
    return fwd, bwd, out.detach(), grads


def paired(ref_fn, our_fn, rounds: int) -> dict:
    """SDPA's and our call timed in alternated rounds, in events (bench_ms) and on the GPU alone
    (bench_gpu_interleaved_ms: the two calls side by side, call after call), ours with ZOO_FLASH_TMA=auto
    (descriptors for the backward on Hopper). Per timing, the median ms of each over the rounds and the ref / ours
    ratio of every round's pair. Identical kernels read up to 2% apart at 4096 keys and single samples up to 13%
    (benchmarks/RESULTS.md): a ratio from one sample of each cannot tell 1.00x from 1.03x; the median of
    paired rounds can, and the pairs' range shows how well."""

    def ours():
        with env("ZOO_FLASH_TMA", "auto"):
            return our_fn()

    times = {key: [] for key in ("ref", "ours", "ref_gpu", "ours_gpu")}
    for _ in range(rounds):
        times["ref"].append(bench_ms(ref_fn))
        times["ours"].append(bench_ms(ours))
        ref_gpu, ours_gpu = bench_gpu_interleaved_ms([ref_fn, ours])
        times["ref_gpu"].append(ref_gpu)
        times["ours_gpu"].append(ours_gpu)
    result = {key: statistics.median(ts) for key, ts in times.items()}
    for suffix in ("", "_gpu"):
        result["pairs" + suffix] = sorted(r / o for r, o in zip(times["ref" + suffix], times["ours" + suffix]))
    return result


def triton_ms(q, k, v, do, causal):
    """(forward ms, backward-alone ms) of the portable Triton kernels, each where the Hopper kernel would run
    instead, else None."""
    hopper = flash.flash_sm90
    fwd_ms = bwd_ms = None
    if hopper is not None and hopper.supports(q, k, v, causal):
        with env("ZOO_FLASH_SM90", "0"), torch.no_grad():
            fwd_ms = bench_ms(lambda: flash_gqa_attention(q, k, v, causal=causal))
    if hopper is not None and hopper.supports_backward(q, k, v, do):
        with env("ZOO_FLASH_SM90_BWD", "0"):
            leaves = [x.detach().requires_grad_() for x in (q, k, v)]
            out = flash_gqa_attention(*leaves, causal=causal)
            bwd_ms = bench_ms(lambda: torch.autograd.grad(out, leaves, do, retain_graph=True))
    return fwd_ms, bwd_ms


def check(name, ours, ref):
    """Ours against SDPA, forward and every gradient (bf16 rounding of P and dS: ~1e-2 relative); returns the
    largest relative error."""
    errs = [rel_err(ours[2], ref[2])] + [rel_err(g, r) for g, r in zip(ours[3], ref[3])]
    if max(errs) > 2e-2:
        raise AssertionError(f"{name}: ours vs SDPA relative errors (out, dq, dk, dv) = {errs}")
    return max(errs)


def span(pairs: list) -> str:
    """The range of a shape's paired ratios, lowest-highest."""
    return f"{pairs[0]:.3f}-{pairs[-1]:.3f}"


def run_shape(shape, dtype, rounds: int, with_flex=True, with_pointers=False):
    b, h_q, h_kv, s, d_qk, d_v, causal = shape
    q = torch.randn(b, h_q, s, d_qk, device="cuda", dtype=dtype)
    k = torch.randn(b, h_kv, s, d_qk, device="cuda", dtype=dtype)
    v = torch.randn(b, h_kv, s, d_v, device="cuda", dtype=dtype)
    do = torch.randn(b, h_q, s, d_v, device="cuda", dtype=dtype)
    name = f"B{b}-Hq{h_q}-Hkv{h_kv}-S{s}-D{d_qk}" + (f"x{d_v}" if d_v != d_qk else "") + ("-causal" if causal else "")
    ours_fn = lambda q, k, v: flash_gqa_attention(q, k, v, causal=causal)  # noqa: E731
    ref = prepare(lambda q, k, v: sdpa(q, k, v, causal), q, k, v, do)
    with env("ZOO_FLASH_TMA", "auto"):
        ours = prepare(ours_fn, q, k, v, do)
    err = check(name, ours, ref)
    fwd = paired(ref[0], ours[0], rounds)
    bwd = paired(ref[1], ours[1], rounds)
    fwd_triton, bwd_triton = triton_ms(q, k, v, do, causal)
    ptr_ms = None
    if with_pointers:
        with env("ZOO_FLASH_TMA", "0"):
            ptr = prepare(ours_fn, q, k, v, do)
            err = max(err, check(name + " (pointers)", ptr, ref))
            ptr_ms = bench_ms(ptr[0]), bench_ms(ptr[1])
    flex_fwd = flex_bwd = None
    if with_flex:
        try:
            mask = causal_block_mask(s, causal)
            flex_fns = prepare(lambda q, k, v: flex(q, k, v, causal, mask), q, k, v, do)
            flex_fwd, flex_bwd = bench_ms(flex_fns[0]), bench_ms(flex_fns[1])
        except Exception as e:  # noqa: BLE001 - a peer that cannot run this shape is reported, not fatal
            print(f"{name}: FlexAttention failed: {type(e).__name__}: {str(e)[:200]}")
    f = flops(shape)
    tf = lambda ms, mult=1.0: None if ms is None else mult * f / ms / 1e9  # noqa: E731
    row = dict(
        shape=name,
        err=err,
        fwd=tf(fwd["ours"]),
        fwd_triton=tf(fwd_triton),
        fwd_sdpa=tf(fwd["ref"]),
        fwd_flex=tf(flex_fwd),
        bwd=tf(bwd["ours"], 2.5),
        bwd_triton=tf(bwd_triton, 2.5),
        bwd_sdpa=tf(bwd["ref"], 2.5),
        bwd_flex=tf(flex_bwd, 2.5),
    )
    for what, t, mult in (("fwd", fwd, 1.0), ("bwd", bwd, 2.5)):
        row[f"{what}/sdpa"] = statistics.median(t["pairs"])
        row[f"{what}/sdpa range"] = span(t["pairs"])
        row[f"{what}_gpu"], row[f"{what}_gpu_sdpa"] = tf(t["ours_gpu"], mult), tf(t["ref_gpu"], mult)
        row[f"{what}_gpu/sdpa"] = statistics.median(t["pairs_gpu"])
        row[f"{what}_gpu/sdpa range"] = span(t["pairs_gpu"])
    row["fwd/flex"] = None if flex_fwd is None else flex_fwd / fwd["ours"]
    row["bwd/flex"] = None if flex_bwd is None else flex_bwd / bwd["ours"]
    if ptr_ms is not None:
        row["fwd_ptr"], row["bwd_ptr"] = tf(ptr_ms[0]), tf(ptr_ms[1], 2.5)
    print(row, flush=True)
    del q, k, v, do, ours, ref
    torch.cuda.empty_cache()
    return row


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="four shapes instead of the full grid")
    parser.add_argument("--part", default="1/1", help="i/n: run the i-th of n slices of the grid (default all)")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16"])
    parser.add_argument(
        "--rounds",
        type=int,
        default=5,
        help="alternated rounds of SDPA and ours per shape (default 5): medians and paired ratios",
    )
    parser.add_argument("--no-flex", action="store_true", help="skip FlexAttention (saves its compile time)")
    parser.add_argument(
        "--pointers",
        action="store_true",
        help="also time our kernels with plain pointer loads everywhere (ZOO_FLASH_TMA=0): the backward's TMA lever",
    )
    args = parser.parse_args()
    if args.rounds < 1:
        raise SystemExit(f"--rounds {args.rounds}: expected at least 1")
    require_cuda("bench_flash.py")
    dtype = getattr(torch, args.dtype)
    shapes = grid_part(QUICK if args.quick else full_grid(), args.part)
    print(header())
    c = ceilings()
    print(f"ceilings: copy {c['copy_TBps']:.2f} TB/s, bf16 matmul {c['matmul_bf16_TFLOPs']:.0f} TFLOP/s")
    rows = [run_shape(shape, dtype, args.rounds, not args.no_flex, args.pointers) for shape in shapes]
    print("configs picked (BLOCK_M, BLOCK_N, warps, stages):")
    for key, cfg in flash._TUNED.items():
        print(f"  {key[0]:5s} D{key[1]}/{key[2]} causal={key[3]} {key[5]} tma={key[6]}: {cfg}")
    print(
        f"\n{args.dtype}, TFLOP/s (forward; backward alone = 2.5x forward FLOPs); ratio > 1: ours faster. Ours "
        f"and SDPA: medians of {args.rounds} alternated rounds, each ratio the median of the rounds' pairs (range: "
        "their lowest-highest); Triton and Flex: one sample each"
    )
    columns = [
        "shape",
        "fwd",
        "fwd_triton",
        "fwd_sdpa",
        "fwd_flex",
        "fwd/sdpa",
        "fwd/sdpa range",
        "fwd/flex",
        "bwd",
        "bwd_triton",
        "bwd_sdpa",
        "bwd_flex",
        "bwd/sdpa",
        "bwd/sdpa range",
        "bwd/flex",
        "fwd_gpu",
        "fwd_gpu_sdpa",
        "fwd_gpu/sdpa",
        "fwd_gpu/sdpa range",
        "bwd_gpu",
        "bwd_gpu_sdpa",
        "bwd_gpu/sdpa",
        "bwd_gpu/sdpa range",
        "err",
    ]
    if args.pointers:
        columns[1:1] = ["fwd_ptr", "bwd_ptr"]
    print_table(rows, columns)


if __name__ == "__main__":
    main()
