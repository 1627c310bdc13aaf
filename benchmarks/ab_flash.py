"""Another revision's Hopper flash kernels against the working tree's (or a variant's), in one process: the
measure of a kernel change.

    mkdir -p /tmp/zoo-old && git archive REV attention_kernels | tar -x -C /tmp/zoo-old  # any revision's package
    python -m benchmarks.ab_flash --old /tmp/zoo-old/attention_kernels                  # on the GPU machine
    python -m benchmarks.ab_flash --old /tmp/zoo-old/attention_kernels --shapes 4,32,32,4096,128,128,causal \
        16,12,12,1024,96,64,full --what backward
    cp -r attention_kernels /tmp/zoo-try                                                 # edit its flash_sm90*.py
    python -m benchmarks.ab_flash --old attention_kernels --new /tmp/zoo-try             # the tree against a variant

--old and --new take a copy of the attention_kernels/ directory: its Hopper flash modules (flash_sm90.py, the
flash_sm90_*.py it imports and sm90.py) are loaded apart from the tree's, their kernels compiling and caching
apart; every other module (the Triton kernels, _host, schedule) is the tree's. A single file is taken too: the
flash_sm90.py of a revision that kept every Hopper flash kernel in that one file.

Per shape (B, H_q, H_kv, S, D_qk, D_v, causal or full): the forward and the whole backward (`flash._forward` and
`flash._backward`, every launch the autograd path makes) run through each version (`flash.flash_sm90` swapped for
the loaded module), their outputs and gradients are compared (bitwise, else the relative L2 difference), and both
are timed on the GPU alone (`common.bench_gpu_interleaved_ms`: call after call side by side) in rounds, after two
seconds of matmuls that bring the clocks up. Identical kernels on both sides read up to 2% apart on an H200 at 4096
keys, and single samples up to 13% (benchmarks/RESULTS.md): quote the best and the median pair, beside a shape the
change leaves alone.
"""

import argparse
import importlib
import importlib.util
import os
import sys

import torch

import attention_kernels
from attention_kernels import flash
from benchmarks.bench_flash import flops
from benchmarks.common import bench_gpu_interleaved_ms, header

# Causal D=128 GQA at three lengths, MHA, group 8, MLA's two training shapes, and a full-attention control.
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
# The modules of attention_kernels/ that make up the Hopper flash kernels: those a copy's version replaces.
HOPPER_FLASH = (
    "flash_sm90",
    "sm90",
    "flash_sm90_common",
    "flash_sm90_fwd",
    "flash_sm90_bwd_dq",
    "flash_sm90_bwd_dkdv",
    "flash_sm90_bwd_fused",
)


def parse_shape(text: str) -> tuple:
    """ "B,H_q,H_kv,S,D_qk,D_v,causal" (or "full" last) -> the shape tuple."""
    parts = text.split(",")
    if len(parts) != 7 or parts[6] not in ("causal", "full") or not all(p.isdigit() for p in parts[:6]):
        raise argparse.ArgumentTypeError(
            f"{text!r}: expected B,H_q,H_kv,S,D_qk,D_v,causal|full, e.g. 4,32,8,4096,128,128,causal"
        )
    return (*(int(p) for p in parts[:6]), parts[6] == "causal")


def load_version(path: str, name: str):
    """The flash_sm90 module of a copy of attention_kernels/ (a directory) or a one-file flash_sm90.py."""
    if os.path.isdir(path):
        module = _load_package_copy(path, name)
    elif os.path.isfile(path):
        spec = importlib.util.spec_from_file_location(f"flash_sm90_{name}", path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    else:
        raise SystemExit(
            f"--{name} {path!r}: no such directory or file; valid: a copy of attention_kernels/ (git archive REV "
            "attention_kernels | tar -x -C DIR, then DIR/attention_kernels) or a one-file flash_sm90.py"
        )
    if not hasattr(module, "FUSED_PAIRS"):  # a revision without the one-launch backward
        module.FUSED_PAIRS = frozenset()
    return module


def _load_package_copy(path: str, name: str):
    """Import `path`/flash_sm90.py as attention_kernels.flash_sm90 with the HOPPER_FLASH modules it imports taken
    from `path` too, then put the tree's modules back: the copy's modules keep their own references to each other,
    and every other module they import is the tree's (already imported, so the copy's are never read)."""
    if not os.path.isfile(os.path.join(path, "flash_sm90.py")):
        raise SystemExit(f"--{name} {path!r}: no flash_sm90.py there; valid: a copy of attention_kernels/")
    copied = [m for m in HOPPER_FLASH if os.path.isfile(os.path.join(path, m + ".py"))]
    saved = {m: sys.modules.pop(f"attention_kernels.{m}") for m in copied if f"attention_kernels.{m}" in sys.modules}
    tree_path = list(attention_kernels.__path__)
    attention_kernels.__path__[:] = [os.path.abspath(path)]
    try:
        module = importlib.import_module("attention_kernels.flash_sm90")
    finally:
        attention_kernels.__path__[:] = tree_path
        for m in copied:
            sys.modules.pop(f"attention_kernels.{m}", None)
        sys.modules.update({f"attention_kernels.{m}": mod for m, mod in saved.items()})
        for m in copied:
            if m in saved:
                setattr(attention_kernels, m, saved[m])
            elif hasattr(attention_kernels, m):
                delattr(attention_kernels, m)
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
    parser.add_argument("--old", required=True, help="a copy of another revision's attention_kernels/ directory")
    parser.add_argument("--new", help="a copy of attention_kernels/ to measure in place of the working tree's")
    parser.add_argument(
        "--shapes",
        nargs="+",
        type=parse_shape,
        default=SHAPES,
        help="B,H_q,H_kv,S,D_qk,D_v,causal|full ... (default: the nine of SHAPES)",
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
        "old": load_version(args.old, "old"),
        "new": load_version(args.new, "new") if args.new else flash.flash_sm90,
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
