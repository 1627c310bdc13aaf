"""One training step (forward + backward) of every attention variant on a GPT-2-small-sized model, on our Triton
kernels and on PyTorch SDPA, in the same run.

    python3 benchmarks/bench_train.py                       # the H200 table, every mode (about 8 minutes)
    python3 benchmarks/bench_train.py --modes=graph         # one mode
    python3 benchmarks/bench_train.py --device=cpu --tiny --modes=eager   # a smoke run of the same code on the CPU

Per variant (mha, gqa with 4 KV heads, mqa, mla; the shapes of bench_generate.py) and backend ("triton":
attention_kernels.flash_gqa_attention; "torch": F.scaled_dot_product_attention with K/V repeated to the query heads, the
model's plain PyTorch path): fp32 weights under bf16 autocast, batch 8 of 1024-token sequences, a step of
forward, cross-entropy loss and backward. Step time is the median of --steps synchronized steps after warm-up;
MFU counts model.flops_per_token against the GPU's dense bf16 peak.

--modes picks how the step runs, each for both backends in the same run:
- eager: the model as train.py runs it with compile=False;
- compile: torch.compile(model), as train.py with compile=True;
- graph: the eager step captured in a CUDA graph and replayed, as train.py with cuda_graphs=True (the host's launch
  work removed: at this size an eager step is bound by the host, so this is the mode that times the kernels);
- compile+graph: both, as train.py with compile=True and cuda_graphs=True.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

# --device=cpu (or --device cpu): the Triton kernels run on CPU tensors under the interpreter, set before import.
_device = argparse.ArgumentParser(add_help=False)
_device.add_argument("--device")
if _device.parse_known_args()[0].device == "cpu":
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.bench_generate import GPT2_SMALL, TINY, TINY_MLA, VARIANTS  # noqa: E402
from benchmarks.common import header, print_table  # noqa: E402
from model import GPT, GPTConfig  # noqa: E402
from train import GraphedMicroStep  # noqa: E402

MODES = ("eager", "compile", "graph", "compile+graph")


def step_seconds(model: GPT, batch: int, seq_len: int, steps: int, device: str, mode: str = "eager") -> float:
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, model.config.vocab_size, (batch, seq_len), generator=g).to(device)
    y = torch.randint(0, model.config.vocab_size, (batch, seq_len), generator=g).to(device)
    autocast = (
        torch.autocast(device_type="cuda", dtype=torch.bfloat16)
        if device == "cuda"
        else torch.autocast(device_type="cpu", enabled=False)
    )
    run = torch.compile(model) if mode.startswith("compile") else model

    def step():
        with autocast:
            _, loss = run(x, y)
        loss.backward()
        return loss

    graphed = mode.endswith("graph")
    if graphed:
        step = _graphed(model, run, x, y)
    times = []
    for i in range(steps + 2):  # two warm-up steps: kernel compiles and config timing happen there
        if device == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        step()
        if not graphed:
            model.zero_grad(set_to_none=True)
        if device == "cuda":
            torch.cuda.synchronize()
        if i >= 2:
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _graphed(model: GPT, run: torch.nn.Module, x: torch.Tensor, y: torch.Tensor):
    """The step of `run` (the model, or it compiled) as train.py runs it with cuda_graphs=True
    (`train.GraphedMicroStep`): each call zeroes the gradients in place and replays. Its first replay's loss is
    checked against the eager model's: a capture that recorded the wrong work must not be timed."""
    with torch.autocast(device_type="cuda", dtype=torch.bfloat16):
        eager_loss = model(x, y)[1].item()
    graphed = GraphedMicroStep(run, "bfloat16", torch.amp.GradScaler("cuda", enabled=False), 1, x, y)

    def step():
        model.zero_grad(set_to_none=False)
        return graphed(x, y)

    graph_loss = step().item()
    if abs(graph_loss - eager_loss) > 1e-3 * max(1.0, abs(eager_loss)):
        raise AssertionError(f"the graphed step's loss {graph_loss} differs from the eager step's {eager_loss}")
    return step


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--tiny", action="store_true", help="a 2-layer, 64-wide model (the CPU smoke run)")
    p.add_argument("--modes", default=",".join(MODES), help=f"comma-separated, from {', '.join(MODES)}")
    args = p.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        sys.exit("bench_train: no CUDA device; run with --device=cpu --tiny for the CPU smoke run")
    modes = [m for m in args.modes.split(",") if m]
    if not modes or any(m not in MODES for m in modes):
        sys.exit(f"bench_train: --modes={args.modes!r}; valid: a comma-separated list from {', '.join(MODES)}")
    if args.device != "cuda" and any(m.endswith("graph") for m in modes):
        sys.exit("bench_train: --modes=graph needs a CUDA device (CUDA graphs); on the CPU use eager,compile")
    shape = TINY if args.tiny else GPT2_SMALL
    seq_len = 64 if args.tiny else shape["block_size"]
    print(header())
    rows = []
    for mode in modes:
        for variant in VARIANTS:
            fields = TINY_MLA if args.tiny and variant == "mla" else VARIANTS[variant]
            row = {"mode": mode, "variant": variant}
            for backend in ("triton", "torch"):
                torch.manual_seed(0)
                config = GPTConfig(**{**shape, "block_size": seq_len}, **fields, attn_backend=backend)
                model = GPT(config).to(args.device)
                dt = step_seconds(model, args.batch, seq_len, 2 if args.tiny else args.steps, args.device, mode)
                row[f"{backend} ms"] = 1e3 * dt
                mfu = model.estimate_mfu(args.batch, dt)
                row[f"{backend} MFU"] = f"{100 * mfu:.1f}%" if mfu is not None else None
                row["KV bytes/token"] = model.kv_cache_bytes_per_token()
                del model
                torch._dynamo.reset()  # each compiled model starts from a fresh cache
            row["triton/torch"] = row["torch ms"] / row["triton ms"]
            rows.append(row)
            print(f"{mode} {variant}: triton {row['triton ms']:.1f} ms, torch {row['torch ms']:.1f} ms", flush=True)
    print(f"\nbatch {args.batch} x {seq_len} tokens, bf16 autocast; triton/torch > 1: the Triton step is faster")
    print_table(
        rows, ["mode", "variant", "triton ms", "torch ms", "triton/torch", "triton MFU", "torch MFU", "KV bytes/token"]
    )


if __name__ == "__main__":
    main()
