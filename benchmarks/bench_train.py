"""The training iteration as train.py runs it, for every attention variant at GPT-2-small width, on our Triton kernels
and on the same model with PyTorch SDPA, in one run: tokens/s, MFU, peak memory, GPU time and busy share, ours/SDPA.

    python -m benchmarks.bench_train                                  # the H200 table (about 5 minutes)
    python -m benchmarks.bench_train --variants=gqa --contexts=1024 --modes=compile,compile+graph
    python -m benchmarks.bench_train --contexts=1024 --variants=mha --profile    # where the host's time goes
    python -m benchmarks.bench_train --device=cpu --tiny              # a smoke run of the same code on the CPU

What is timed is train_step.TrainStep, the iteration train.py runs: --accum micro-steps of forward, loss and backward
(gradient accumulation), the gradient clip and the AdamW step (fused on CUDA), under bf16 autocast with fp32 weights.
The model is configs/gpt2_small_gqa.py's (12 layers, 12 heads of 64, 768 wide, no biases, RoPE, 50304-token
vocabulary) with each variant's natural dims from model.GPTConfig: MHA 12 K/V heads, GQA 3 (groups of 4), MQA 1,
MLA a 256-wide latent and a 32-dim RoPE key. "ours" runs attention through attention_kernels.flash_gqa_attention
(attn_backend="triton"), "SDPA" through F.scaled_dot_product_attention with K/V repeated to the query heads
(attn_backend="torch"); everything else is the same model, weights and batch.

Each context (--contexts, default 1k, 2k and 8k) keeps the tokens of a micro-step at --tokens (batch = tokens /
context), so attention's share of the step grows with the context while the rest stays alike. The default, 32,768
tokens, is configs/gpt2_small_gqa.py's micro-step (32 sequences of 1,024): what train.py runs on one GPU. At half of
it, the host's launches and Python start to show on the fastest GPUs (benchmarks/RESULTS.md). Per context and
variant both models are built and compiled once, warmed up (--warmup iterations: compiles and the kernels' config
timing happen there), then timed in alternating rounds (ours, SDPA, ours, SDPA, ... --rounds rounds of --iters
iterations each, device-synchronized around each round); a number is the median over the rounds.

MFU = tokens/s x model.flops_per_token(context) / the GPU's dense bf16 peak (model.PEAK_BF16_FLOPS), with
    flops_per_token(T) = 6 x (weights of every Linear, lm_head included)
                         + 3 x n_layer x n_head x (D_qk + D_v) x T
(the matmuls' forward and backward, and attention's scores and P V for a causal token that sees T/2 keys on average,
forward and backward). Peak memory is torch.cuda.max_memory_allocated over a model's timed rounds, less the other
model's weights and optimizer state, which stay resident beside it. "first iter s" is the first iteration's seconds:
with compile on, mostly the compile. "GPU ms" is the time the GPU spends running one iteration's kernels and
copies, summed from a torch.profiler trace of one more iteration (on a GPU), and "GPU busy" is that time over the
iteration's wall time from the timed rounds. Near 100% the GPU bounds the iteration; well below it the GPU waits on
the host (the launches and the Python around them), and the wall-time ratio then says less about the kernels than
"GPU ours/SDPA", the ratio of the two models' GPU ms (> 1: ours takes less GPU time).

--profile prints, per cell and model, what that traced iteration spent: the ops with the most host time and the
kernels with the most GPU time.

--modes picks how the model runs, each for both backends:
- compile: train_step.compile_model (each block and the loss head compiled, as train.py with compile=True);
- eager: the model as train.py runs it with compile=False;
- graph: each micro-step captured in a CUDA graph and replayed, as train.py with cuda_graphs=True;
- compile+graph: both, as train.py with compile=True and cuda_graphs=True.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

from benchmarks.bench_generate import GPT2_SMALL, TINY, VARIANTS
from benchmarks.common import ceilings, header, print_table
from model import GPT, GPTConfig, peak_bf16_flops
from train_step import TrainStep, compile_model

MODES = ("compile", "eager", "graph", "compile+graph")
BACKENDS = {"ours": "triton", "SDPA": "torch"}
# configs/gpt2_small_gqa.py's model: bench_generate's GPT-2-small shapes without biases, with RoPE
TRAIN_SHAPE = dict(GPT2_SMALL, bias=False, pos_embedding="rope")
# A run's planned cost on an H200, for the budget printed before it starts: a compile of one block and the loss
# head, with its Triton kernels, and the seconds of one timed iteration per 1k tokens of a micro-step (a GPT-2-small
# micro-step of 32k tokens at ~500k tokens/s).
COMPILE_S, ITER_S_PER_KTOKEN = 10.0, 0.002


def main(argv: list[str] | None = None):
    args = parse_args(sys.argv[1:] if argv is None else argv)
    if args.device == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        # The kernels are jit-decorated when attention_kernels is imported, which has happened: run again with
        # Triton's CPU interpreter chosen from the start.
        env = dict(os.environ, TRITON_INTERPRET="1")
        os.execve(sys.executable, [sys.executable, "-m", "benchmarks.bench_train", *args.argv], env)
    print(header())
    if args.device == "cuda":
        c = ceilings()
        print(f"ceilings: copy {c['copy_TBps']:.2f} TB/s, bf16 matmul {c['matmul_bf16_TFLOPs']:.0f} TFLOP/s")
    print_budget(args)
    t0 = time.perf_counter()
    rows = []
    for mode in args.modes:
        for context in args.contexts:
            for variant in args.variants:
                rows.append(measure(variant, context, mode, args))
                print_progress(rows[-1], time.perf_counter() - t0)
    print_results(rows, args, time.perf_counter() - t0)


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    p.add_argument("--tiny", action="store_true", help="a 2-layer, 64-wide model, context 64 (the CPU smoke run)")
    p.add_argument("--variants", default=",".join(VARIANTS), help=f"comma-separated, from {', '.join(VARIANTS)}")
    p.add_argument("--contexts", default=None, help="comma-separated lengths (default 1024,2048,8192; tiny 64)")
    p.add_argument(
        "--modes", default=None, help=f"comma-separated, from {', '.join(MODES)} (default compile; CPU eager)"
    )
    p.add_argument("--tokens", type=int, default=0, help="tokens per micro-step (default 32768; tiny 128)")
    p.add_argument("--batch", type=int, default=0, help="sequences per micro-step (default: tokens / context)")
    p.add_argument("--accum", type=int, default=2, help="micro-steps per iteration (gradient accumulation)")
    p.add_argument("--rounds", type=int, default=0, help="alternating timed rounds per backend (default 3; tiny 1)")
    p.add_argument("--iters", "--steps", type=int, default=0, help="iterations per round (default 3; tiny 1)")
    p.add_argument("--warmup", type=int, default=0, help="untimed iterations first (default 2; tiny 1)")
    p.add_argument(
        "--profile", action="store_true", help="per cell and model: the top host ops and GPU kernels of an iteration"
    )
    args = p.parse_args(argv)
    args.argv = argv
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("no CUDA device here; --device=cpu --tiny is the CPU smoke run")
    args.variants = _listed(p, "--variants", args.variants, str, VARIANTS)
    default_contexts = "64" if args.tiny else "1024,2048,8192"
    args.contexts = _listed(p, "--contexts", args.contexts or default_contexts, int)
    args.modes = _listed(p, "--modes", args.modes or ("eager" if args.device == "cpu" else "compile"), str, MODES)
    if args.device == "cpu" and any(m.endswith("graph") for m in args.modes):
        p.error("--modes: graph and compile+graph need a CUDA device (CUDA graphs); on the CPU use eager or compile")
    args.tokens = args.tokens or (128 if args.tiny else 32768)
    args.rounds, args.iters = args.rounds or (1 if args.tiny else 3), args.iters or (1 if args.tiny else 3)
    args.warmup = args.warmup or (1 if args.tiny else 2)
    for name in ("tokens", "batch", "accum", "rounds", "iters", "warmup"):
        if getattr(args, name) < (0 if name == "batch" else 1):
            p.error(f"--{name}: got {getattr(args, name)}; valid: a positive int")
    shape = TINY if args.tiny else TRAIN_SHAPE
    for context in args.contexts:
        if context < 1 or (not args.batch and args.tokens % context):
            p.error(f"--contexts: got {context}; valid: positive lengths that divide --tokens={args.tokens}")
    args.shape = shape
    return args


def _listed(p, flag: str, text: str, kind, valid=None) -> list:
    try:
        items = [kind(x) for x in text.split(",") if x]
    except ValueError:
        items = []
    if not items or (valid is not None and any(x not in valid for x in items)):
        choices = f"a comma-separated list from {', '.join(valid)}" if valid else "a comma-separated list of ints"
        p.error(f"{flag}: got {text!r}; valid: {choices}")
    return items


def print_budget(args) -> None:
    """What the run will do and about how long it takes on an H200, before it starts."""
    cells = len(args.modes) * len(args.contexts) * len(args.variants)
    compiles = cells * len(BACKENDS) * sum(m.startswith("compile") for m in args.modes) // len(args.modes)
    iters = cells * len(BACKENDS) * (args.warmup + args.rounds * args.iters)
    estimate = compiles * COMPILE_S + iters * args.accum * args.tokens / 1000 * ITER_S_PER_KTOKEN
    print(
        f"plan: {cells} cells ({len(args.modes)} modes x {len(args.contexts)} contexts x {len(args.variants)} "
        f"variants) x {len(BACKENDS)} backends: {compiles} compiles, {iters} iterations of {args.accum} x "
        f"{args.tokens:,} tokens" + (f"; on an H200 about {estimate / 60:.1f} minutes" if args.device == "cuda" else "")
    )


def build(variant: str, backend: str, context: int, args) -> GPT:
    """The model of a cell: the same weights for both backends (seeded), initialized on the device (a GPT-2-small
    initialized on the host takes seconds, times two models per cell)."""
    torch.manual_seed(0)
    config = GPTConfig(**{**args.shape, "block_size": context}, attention=variant, attn_backend=backend)
    with torch.device(args.device):
        return GPT(config)


def measure(variant: str, context: int, mode: str, args) -> dict:
    """Both backends of one (variant, context, mode): built, compiled and warmed up, then timed in alternating
    rounds. Returns the table row."""
    batch = args.batch or args.tokens // context
    g = torch.Generator().manual_seed(context)
    vocab = args.shape["vocab_size"]
    batches = [
        tuple(torch.randint(0, vocab, (batch, context), generator=g).to(args.device) for _ in "xy")
        for _ in range(args.accum)
    ]
    runs = {name: Run(build(variant, backend, context, args), mode, args) for name, backend in BACKENDS.items()}
    first = {name: run.warm_up(batches, args.warmup) for name, run in runs.items()}
    check_same_loss(first, variant, context)
    seconds = {name: [] for name in runs}
    for _ in range(args.rounds):
        for name, run in runs.items():
            seconds[name].append(run.time(batches, args.iters))
    tokens = args.iters * args.accum * batch * context
    row = {"mode": mode, "variant": variant, "context": context, "batch": batch}
    model = runs["ours"].model
    peak = peak_bf16_flops(args.device)
    for name, run in runs.items():
        tok_s = tokens / statistics.median(seconds[name])
        row[f"{name} tok/s"] = tok_s
        row[f"{name} MFU"] = f"{100 * tok_s * model.flops_per_token(context) / peak:.1f}%" if peak else None
        row[f"{name} peak GiB"] = run.peak_bytes / 2**30 if run.peak_bytes is not None else None
        row[f"{name} first iter s"] = run.first_s
        events = run.traced_iteration(batches) if args.device == "cuda" or args.profile else None
        gpu_ms = kernel_ms(events)
        wall_ms = 1e3 * statistics.median(seconds[name]) / args.iters
        row[f"{name} GPU ms"] = gpu_ms
        row[f"{name} GPU busy"] = f"{100 * gpu_ms / wall_ms:.0f}%" if gpu_ms is not None else None
        if args.profile:
            print_profile(f"{mode} {variant} T={context} {name}", events)
    row["ours/SDPA"] = row["ours tok/s"] / row["SDPA tok/s"]
    gpu = row["ours GPU ms"], row["SDPA GPU ms"]
    row["GPU ours/SDPA"] = gpu[1] / gpu[0] if None not in gpu else None
    row["KV B/token (bf16)"] = model.kv_cache_bytes_per_token(torch.bfloat16)
    del runs
    torch._dynamo.reset()  # the next cell's models compile afresh; the compiled graphs of this one are freed
    if args.device == "cuda":
        torch.cuda.empty_cache()
    return row


class Run:
    """One model training as train.py trains it: compiled per the mode, its AdamW (fused on CUDA), TrainStep."""

    def __init__(self, model: GPT, mode: str, args):
        self.model, self.device = model, args.device
        if mode.startswith("compile"):
            compile_model(model)
        optimizer = model.configure_optimizers(0.1, 6e-4, (0.9, 0.95), args.device)
        scaler = torch.amp.GradScaler(args.device, enabled=False)  # bf16: no loss scaling
        dtype = "bfloat16" if args.device == "cuda" else "float32"  # bf16 is wrong under the Triton interpreter
        self.step = TrainStep(
            model, optimizer, scaler, dtype=dtype, accum_steps=args.accum, grad_clip=1.0, cuda_graphs="graph" in mode
        )
        self.first_s, self.peak_bytes = None, None

    def warm_up(self, batches, iterations: int) -> float:
        """Untimed iterations (compiles, the kernels' config timing, the CUDA graph's capture); the first one's
        seconds are reported (with compile on, mostly the compile). Returns the first iteration's loss."""
        t0 = time.perf_counter()
        loss = self.step(batches).item()  # the mean over the micro-steps (each loss is divided by their number)
        self.first_s = time.perf_counter() - t0
        for _ in range(iterations - 1):
            self.step(batches)
        self._sync()
        return loss

    def time(self, batches, iterations: int) -> float:
        """Seconds of `iterations` iterations, device-synchronized before and after; records the peak memory."""
        if self.device == "cuda":
            resident = torch.cuda.memory_allocated() - self._own_bytes()  # the other model, kept alive beside
            torch.cuda.reset_peak_memory_stats()
        self._sync()
        t0 = time.perf_counter()
        for _ in range(iterations):
            self.step(batches)
        self._sync()
        seconds = time.perf_counter() - t0
        if self.device == "cuda":
            peak = torch.cuda.max_memory_allocated() - resident
            self.peak_bytes = max(peak, self.peak_bytes or 0)
        return seconds

    def traced_iteration(self, batches):
        """One iteration under torch.profiler (CPU ops, and on a GPU its kernels): the trace's key_averages()."""
        from torch.profiler import ProfilerActivity, profile

        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.device == "cuda" else [])
        self.step(batches)  # out of the trace: the profiler's own first-use costs
        self._sync()
        with profile(activities=activities) as prof:
            self.step(batches)
            self._sync()
        return prof.key_averages()

    def _own_bytes(self) -> int:
        """Bytes of this model's weights, gradients and optimizer state, resident between iterations."""
        tensors = [*self.model.parameters(), *(p.grad for p in self.model.parameters() if p.grad is not None)]
        tensors += [t for state in self.step.optimizer.state.values() for t in state.values() if torch.is_tensor(t)]
        return sum(t.numel() * t.element_size() for t in tensors)

    def _sync(self):
        if self.device == "cuda":
            torch.cuda.synchronize()


def kernel_ms(events) -> float | None:
    """Milliseconds of GPU work in a trace: its kernels, copies and fills summed (one stream: they never overlap).
    None for a trace without GPU activity (the CPU)."""
    gpu = [e for e in events or () if e.device_type == torch.autograd.DeviceType.CUDA]
    return sum(e.self_device_time_total for e in gpu) / 1e3 if gpu else None


def print_profile(title: str, events, top: int = 12) -> None:
    """What one traced iteration spent: the ops that take the most host time (self CPU time: the Python and
    dispatch around each launch) and, on a GPU, the kernels that take the most GPU time."""
    print(f"\nprofile {title}: host ms (self CPU) of the top {top} ops, one iteration")
    for e in sorted(events, key=lambda e: -e.self_cpu_time_total)[:top]:
        print(f"  {e.self_cpu_time_total / 1e3:8.2f} ms {e.count:6d} calls  {e.key[:100]}")
    kernels = [e for e in events if e.device_type == torch.autograd.DeviceType.CUDA]  # not the ops launching them
    if kernels:
        print(f"profile {title}: GPU ms of the top {top} kernels, one iteration")
        for e in sorted(kernels, key=lambda e: -e.self_device_time_total)[:top]:
            print(f"  {e.self_device_time_total / 1e3:8.2f} ms {e.count:6d} calls  {e.key[:100]}")


def check_same_loss(first: dict, variant: str, context: int) -> None:
    """Both backends start from the same weights and batch: their first losses agree (bf16 rounding apart), or the
    benchmark is timing two different computations."""
    ours, sdpa = first["ours"], first["SDPA"]
    if abs(ours - sdpa) > 1e-2 * max(1.0, abs(sdpa)):
        raise SystemExit(f"bench_train: {variant} at context {context}: first loss {ours} on ours, {sdpa} on SDPA")


def print_progress(row: dict, elapsed: float) -> None:
    print(
        f"{row['mode']} {row['variant']} T={row['context']}: ours {row['ours tok/s']:,.0f} tok/s, SDPA "
        f"{row['SDPA tok/s']:,.0f} tok/s ({row['ours/SDPA']:.2f}x); GPU ms (busy): ours "
        f"{_ms(row['ours GPU ms'])} ({row['ours GPU busy'] or '-'}), SDPA {_ms(row['SDPA GPU ms'])} "
        f"({row['SDPA GPU busy'] or '-'}); {elapsed:.0f} s so far",
        flush=True,
    )


def _ms(x) -> str:
    return "-" if x is None else f"{x:.1f}"


def print_results(rows: list[dict], args, elapsed: float) -> None:
    print(
        f"\n{args.accum} micro-steps of {args.tokens:,} tokens per iteration; median of {args.rounds} rounds of "
        f"{args.iters} iterations; ours/SDPA > 1: ours is faster; MFU counts attention as flops_per_token(T) = "
        "6 x Linear weights + 3 x n_layer x n_head x (D_qk + D_v) x T"
    )
    columns = ["mode", "variant", "context", "batch", "ours tok/s", "SDPA tok/s", "ours/SDPA", "ours MFU", "SDPA MFU"]
    columns += ["ours GPU ms", "ours GPU busy", "SDPA GPU ms", "SDPA GPU busy", "GPU ours/SDPA"]
    columns += ["ours peak GiB", "SDPA peak GiB", "ours first iter s", "SDPA first iter s", "KV B/token (bf16)"]
    print_table(rows, columns)
    print(f"\nwall time {elapsed / 60:.1f} minutes")


if __name__ == "__main__":
    main()
