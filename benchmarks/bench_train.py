"""One training step (forward + backward) of every attention variant on a GPT-2-small-sized model, on our Triton
kernels and on PyTorch SDPA, in the same run.

    python3 benchmarks/bench_train.py                       # the H200 table (about a minute)
    python3 benchmarks/bench_train.py --device=cpu --tiny   # a smoke run of the same code on the CPU

Per variant (mha, gqa with 4 KV heads, mqa, mla; the shapes of bench_generate.py) and backend ("triton":
kernels.flash_gqa_attention; "torch": F.scaled_dot_product_attention with K/V repeated to the query heads, the
model's plain PyTorch path): fp32 weights under bf16 autocast, eager, batch 8 of 1024-token sequences, a step of
forward, cross-entropy loss and backward. Step time is the median of --steps synchronized steps after warm-up;
MFU counts model.flops_per_token against the GPU's dense bf16 peak.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

if "--device=cpu" in sys.argv:  # the Triton kernels run on CPU tensors under the interpreter (set before import)
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.bench_generate import GPT2_SMALL, TINY, TINY_MLA, VARIANTS  # noqa: E402
from benchmarks.common import header, print_table  # noqa: E402
from model import GPT, GPTConfig  # noqa: E402


def step_seconds(model: GPT, batch: int, seq_len: int, steps: int, device: str) -> float:
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, model.config.vocab_size, (batch, seq_len), generator=g).to(device)
    y = torch.randint(0, model.config.vocab_size, (batch, seq_len), generator=g).to(device)
    autocast = torch.autocast(device_type="cuda", dtype=torch.bfloat16) if device == "cuda" \
        else torch.autocast(device_type="cpu", enabled=False)
    times = []
    for i in range(steps + 2):  # two warm-up steps: kernel compiles and config timing happen there
        if device == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        with autocast:
            _, loss = model(x, y)
        loss.backward()
        model.zero_grad(set_to_none=True)
        if device == "cuda":
            torch.cuda.synchronize()
        if i >= 2:
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--tiny", action="store_true", help="a 2-layer, 64-wide model (the CPU smoke run)")
    args = p.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        sys.exit("bench_train: no CUDA device; run with --device=cpu --tiny for the CPU smoke run")
    shape = TINY if args.tiny else GPT2_SMALL
    seq_len = 64 if args.tiny else shape["block_size"]
    print(header())
    rows = []
    for variant in VARIANTS:
        fields = TINY_MLA if args.tiny and variant == "mla" else VARIANTS[variant]
        row = {"variant": variant}
        for backend in ("triton", "torch"):
            torch.manual_seed(0)
            model = GPT(GPTConfig(**{**shape, "block_size": seq_len}, **fields, attn_backend=backend)).to(args.device)
            dt = step_seconds(model, args.batch, seq_len, 2 if args.tiny else args.steps, args.device)
            row[f"{backend} ms"] = 1e3 * dt
            mfu = model.estimate_mfu(args.batch, dt)
            row[f"{backend} MFU"] = f"{100 * mfu:.1f}%" if mfu is not None else None
            row["KV bytes/token"] = model.kv_cache_bytes_per_token()
            del model
        row["triton/torch"] = row["torch ms"] / row["triton ms"]
        rows.append(row)
        print(f"{variant}: triton {row['triton ms']:.1f} ms, torch {row['torch ms']:.1f} ms", flush=True)
    print(f"\nbatch {args.batch} x {seq_len} tokens, bf16 autocast, eager; triton/torch > 1: the Triton step is faster")
    print_table(rows, ["variant", "triton ms", "torch ms", "triton/torch", "triton MFU", "torch MFU", "KV bytes/token"])


if __name__ == "__main__":
    main()
