"""Another revision's Hopper flash kernels against the working tree's (or a variant's), in one process: the
measure of a lever.

    git show HEAD:attention_kernels/flash_sm90.py > benchmarks/flash_sm90_old.py  # git ignores flash_sm90_*.py here
    python3 benchmarks/ab_flash.py --old benchmarks/flash_sm90_old.py            # on the GPU machine
    python3 benchmarks/ab_flash.py --old benchmarks/flash_sm90_old.py --shapes 4,32,32,4096,128,128,causal \
        16,12,12,1024,96,64,full --what backward
    python3 benchmarks/ab_flash.py --old attention_kernels/flash_sm90.py --new benchmarks/flash_sm90_try.py  # a variant

Per shape (B, H_q, H_kv, S, D_qk, D_v, causal or full): the forward and the whole backward (`flash._forward` and
`flash._backward`, every launch the autograd path makes) run through each version (`flash.flash_sm90` swapped for
the old module), their outputs and gradients are compared (bitwise, else the relative L2 difference), and both are
timed on the GPU alone (`common.bench_gpu_interleaved_ms`: call after call side by side) in rounds, after two
seconds of matmuls that bring the clocks up. Identical kernels on both sides read up to 2% apart on an H200 at 4096
keys, their single samples up to 13% (benchmarks/RESULTS.md, session 32): quote the best and the median pair, beside
a shape the change leaves alone.
"""

import argparse
import importlib.util
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from attention_kernels import flash  # noqa: E402
from benchmarks.bench_flash import flops  # noqa: E402
from benchmarks.common import bench_gpu_interleaved_ms, header  # noqa: E402

# Session 32's: causal D=128 GQA at three lengths, MHA, group 8, MLA's two training shapes, a full-attention control.
SHAPES = [
    (16, 32, 8, 1024, 128, 128, True),
    (4, 32, 8, 4096, 128, 128, True),
    (1, 32, 8, 16384, 128, 128, True),
    (4, 32, 32, 4096, 128, 128, True),
    (4, 32, 4, 4096, 128, 128, True),
    (8, 12, 12, 1024, 128, 128, True),
    (4, 16, 16, 4096, 192, 128, True),
    (16, 12, 12, 1024, 96, 64, True),
    (4, 32, 8, 4096, 128, 128, False),
]


def parse_shape(text: str) -> tuple:
    """ "B,H_q,H_kv,S,D_qk,D_v,causal" (or "full" last) -> the shape tuple."""
    parts = text.split(",")
    if len(parts) != 7 or parts[6] not in ("causal", "full") or not all(p.isdigit() for p in parts[:6]):
        raise argparse.ArgumentTypeError(
            f"{text!r}: expected B,H_q,H_kv,S,D_qk,D_v,causal|full, e.g. 4,32,8,4096,128,128,causal"
        )
    return (*(int(p) for p in parts[:6]), parts[6] == "causal")


def load_module(path: str, name: str):
    """A copy of attention_kernels/flash_sm90.py loaded as its own module (its kernels compile and cache apart)."""
    if not os.path.isfile(path):
        raise SystemExit(
            f"--{name} {path!r}: no such file (a copy of attention_kernels/flash_sm90.py, e.g. git show "
            "REV:attention_kernels/flash_sm90.py > PATH)"
        )
    spec = importlib.util.spec_from_file_location(f"flash_sm90_{name}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    if not hasattr(module, "FUSED_PAIRS"):  # a revision before the one-launch backward (session 40): none
        module.FUSED_PAIRS = frozenset()
    return module


def compare(new, old) -> str:
    """'=' where bitwise equal, else the relative L2 difference, per tensor."""
    return " ".join(
        "=" if torch.equal(a, b) else f"{((a.float() - b.float()).norm() / b.float().norm()).item():.1e}"
        for a, b in zip(new, old)
    )


def ab(fn, versions: dict, rounds: int) -> dict:
    """GPU-alone ms of fn() under each version, `rounds` times: each a median over calls of the versions side by
    side (`common.bench_gpu_interleaved_ms`)."""

    def under(module):
        def call():
            flash.flash_sm90 = module
            return fn()

        return call

    calls = [under(module) for module in versions.values()]
    times = {name: [] for name in versions}
    for _ in range(rounds):
        for name, ms in zip(versions, bench_gpu_interleaved_ms(calls)):
            times[name].append(ms)
    flash.flash_sm90 = versions["new"]
    return times


def row(name: str, what: str, n_flops: float, times: dict, diff: str) -> str:
    old, new = times["old"], times["new"]
    pairs = sorted(o / n for o, n in zip(old, new))
    samples = " ".join(f"{t * 1e3:.0f}" for t in old + new)
    return (
        f"| {name} | {what} | {min(old) * 1e3:.1f} ({n_flops / min(old) / 1e9:.1f}) | {min(new) * 1e3:.1f} "
        f"({n_flops / min(new) / 1e9:.1f}) | {min(old) / min(new):.3f} | {pairs[len(pairs) // 2]:.3f} | {diff} "
        f"| {samples} |"
    )


def run_shape(shape, versions: dict, rounds: int, what: str) -> list[str]:
    """The table's rows for one shape: forward and/or backward, old against new."""
    b, h_q, h_kv, s, d_qk, d_v, causal = shape
    q = torch.randn(b, h_q, s, d_qk, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(b, h_kv, s, d_qk, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(b, h_kv, s, d_v, device="cuda", dtype=torch.bfloat16)
    do = torch.randn(b, h_q, s, d_v, device="cuda", dtype=torch.bfloat16)
    name = f"B{b} H{h_q}/{h_kv} S{s} D{d_qk}/{d_v} {'causal' if causal else 'full'}"
    results = {}
    for version, module in versions.items():
        flash.flash_sm90 = module
        out, lse = flash._forward(q, k, v, None, causal)
        results[version] = (out, lse, *flash._backward(q, k, v, out, lse, do, None, causal))
    flash.flash_sm90 = versions["new"]
    out, lse = results["new"][:2]  # the backward's inputs on both sides
    lines = []
    if what != "backward":
        times = ab(lambda: flash._forward(q, k, v, None, causal), versions, rounds)
        lines.append(row(name, "forward", flops(shape), times, compare(results["new"][:2], results["old"][:2])))
    if what != "forward":
        times = ab(lambda: flash._backward(q, k, v, out, lse, do, None, causal), versions, rounds)
        lines.append(row(name, "backward", 2.5 * flops(shape), times, compare(results["new"][2:], results["old"][2:])))
    flash.flash_sm90 = versions["new"]
    return lines


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--old", required=True, help="a copy of another revision's attention_kernels/flash_sm90.py")
    parser.add_argument(
        "--new", help="a copy to measure in place of the working tree's attention_kernels/flash_sm90.py"
    )
    parser.add_argument(
        "--shapes",
        nargs="+",
        type=parse_shape,
        default=SHAPES,
        help="B,H_q,H_kv,S,D_qk,D_v,causal|full ... (default: session 32's nine)",
    )
    parser.add_argument("--rounds", type=int, default=5, help="alternated rounds per shape (default 5)")
    parser.add_argument("--what", choices=["both", "forward", "backward"], default="both")
    args = parser.parse_args()
    if (
        flash.flash_sm90 is None
        or not torch.cuda.is_available()
        or not flash.flash_sm90.on_hopper(torch.empty(0, device="cuda"))
    ):
        raise SystemExit("needs an sm_90 GPU and Triton 3.6 (the Hopper kernels are what it compares)")
    versions = {
        "old": load_module(args.old, "old"),
        "new": load_module(args.new, "new") if args.new else flash.flash_sm90,
    }
    print(header())
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    for _ in range(200):
        a @ a
    torch.cuda.synchronize()
    lines = []
    for shape in args.shapes:
        lines += run_shape(shape, versions, args.rounds, args.what)
        print("\n".join(lines[-2 if args.what == "both" else -1 :]), flush=True)
        torch.cuda.empty_cache()
    print("\nGPU alone, best of the rounds, us (TFLOP/s); speed = old / new: best, and the median round's pair")
    print("| shape | pass | old | new | speed | median pair | new vs old (out lse / dq dk dv) | samples: old, new |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
