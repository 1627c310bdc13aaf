"""What every benchmark shares: the machine's ceilings measured in the same run, median timing with a cold L2,
and a header that records date, GPU, torch and triton versions beside the numbers."""

from __future__ import annotations

import contextlib
import datetime
import os
import time

import torch
import triton

from attention_kernels._host import behind_sleep, synced_seconds


def header() -> str:
    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    return (
        f"date {datetime.date.today().isoformat()} | gpu {gpu} | torch {torch.__version__} | "
        f"triton {triton.__version__}"
    )


def require_cuda(script: str):
    """Exit with what to run instead where there is no CUDA GPU: these benchmarks time kernels against SDPA and the
    machine's ceilings, which only a GPU has."""
    if not torch.cuda.is_available():
        raise SystemExit(
            f"{script} times the kernels on a CUDA GPU, and torch sees none here; on the CPU, "
            "`pytest -n auto` runs the kernels under the Triton interpreter, and `python -m "
            "benchmarks.bench_generate --device=cpu --tiny` and `python -m benchmarks.bench_train --device=cpu "
            "--tiny` are smoke runs of the benchmark code"
        )


@contextlib.contextmanager
def env(name: str, value: str):
    """Environment variable `name` set to `value` inside the block (the kernels' switches, e.g. ZOO_MLA_SM90=0 to
    time the portable kernel beside the Hopper one), restored to what it was after."""
    saved = os.environ.get(name)
    os.environ[name] = value
    try:
        yield
    finally:
        if saved is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = saved


def bench_ms(fn, warmup_ms: int = 25, rep_ms: int = 100) -> float:
    """Median milliseconds of fn() (device events). do_bench clears the L2 between calls."""
    return triton.testing.do_bench(fn, warmup=warmup_ms, rep=rep_ms, return_mode="median")


MIN_CALLS_PER_REPLAY = 16


def rotated_ms(call, copies: int, warmup_ms: float = 25.0, budget_ms: float = 100.0) -> float:
    """Median milliseconds per call of call(i), i = 0 .. copies - 1, each reading its own copy of the inputs:
    the calls are captured in turn in one CUDA graph, and each replay of the graph is timed between two events.
    With copies whose bytes together are four times the L2 (`rotation`), every call finds the L2 holding the
    previous copies' lines, not its own, so it reads its inputs from memory. This is a cold L2 without a flush:
    do_bench zeroes a 256 MB buffer before every call, and the L2's dirty lines from that are written back while
    the timed call reads, which costs decode calls 3-30% (benchmarks/RESULTS.md). The graph also
    holds the calls back to back, as decode runs in a server, with no host in between.

    The graph holds the copies' calls in as many rounds as make MIN_CALLS_PER_REPLAY calls (rounds of 0, 1, ...,
    copies - 1; a copy's lines are still gone when its turn comes again), because each replay's own start is
    charged to its calls: on an H200 a replay of one tiny kernel takes 11.4 us, 0.9 us per call with 32 in the
    graph (benchmarks/RESULTS.md)."""
    rounds = -(-MIN_CALLS_PER_REPLAY // copies)
    for i in range(copies):
        call(i)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(rounds):
            for i in range(copies):
                call(i)
    # Warm-up replays for at least warmup_ms, as do_bench's: with only two, some shapes read up to 10% apart from a
    # sweep of the same launches.
    t0 = time.perf_counter()
    replays = 0
    while replays < 2 or time.perf_counter() - t0 < warmup_ms / 1e3:
        graph.replay()
        torch.cuda.synchronize()
        replays += 1
    reps = max(5, min(200, int(budget_ms / 1e3 / ((time.perf_counter() - t0) / replays))))
    # The timed replays are enqueued back to back (the GPU never waits for the host between them).
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(reps)]
    for start, end in events:
        start.record()
        graph.replay()
        end.record()
    torch.cuda.synchronize()
    return sorted(start.elapsed_time(end) / (rounds * copies) for start, end in events)[reps // 2]


def rotation(n_bytes: int) -> int:
    """How many copies of inputs of n_bytes `rotated_ms` cycles through: at least two, and together at least four
    times the L2, so a copy's lines are evicted before it is read again."""
    l2 = torch.cuda.get_device_properties(torch.cuda.current_device()).L2_cache_size
    return max(2, -(-4 * l2 // n_bytes))


def bench_gpu_ms(fn, n: int = 30) -> float:
    """Median milliseconds of fn() on the GPU alone (`bench_gpu_interleaved_ms` of fn by itself)."""
    return bench_gpu_interleaved_ms([fn], n)[0]


def bench_gpu_interleaved_ms(fns: list, n: int = 30) -> list[float]:
    """Median milliseconds of each of fns on the GPU alone, their calls interleaved: fns[0], fns[1], ..., n times.
    bench_ms times from an event recorded before the call to one after it, so where the host takes longer to launch
    fn's kernels than the GPU takes to run them, the GPU waits inside the timed window and the host's time is
    measured. Here every call, after an L2 flush and between its own events, is enqueued while the GPU sleeps, so
    they run back to back from a cold L2 with no wait for the host. The sleep is sized from one call of each and
    must outlast the enqueueing (`attention_kernels._host.behind_sleep` checks; else a longer one).
    Why interleaved: the H200 lowers its clocks in bursts at its power cap (nvidia-smi samples "SW power cap" at
    1515-1950 MHz under these benchmarks), so a block of 30 calls of one kernel and then 30 of another can sit in
    different clock states, and the same backward read up to 9% apart in three such blocks. Side by side, call
    after call, the kernels share the same states."""
    cache = torch.empty(int(256e6 // 4), dtype=torch.int, device="cuda")  # do_bench's flush
    for fn in fns:
        fn()
    per_round = synced_seconds(lambda: [fn() for fn in fns])
    events = [
        [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in fns] for _ in range(n)
    ]

    def enqueue():
        for round_events in events:
            for fn, (start, end) in zip(fns, round_events):
                cache.zero_()
                start.record()
                fn()
                end.record()

    for attempt in range(4):
        if behind_sleep(enqueue, (2 * n * per_round + 0.005) * 4**attempt):
            return [
                sorted(round_events[i][0].elapsed_time(round_events[i][1]) for round_events in events)[n // 2]
                for i in range(len(fns))
            ]
    raise RuntimeError("bench_gpu_interleaved_ms: the GPU woke before the calls were enqueued, four times")


def ceilings() -> dict[str, float]:
    """Device-to-device copy bandwidth (bytes read + written per second) and the bf16 matmul rate."""
    return {"copy_TBps": _copy_tbps(), "matmul_bf16_TFLOPs": _matmul_tflops()}


def _copy_tbps(n_bytes: int = 2 * 1024**3) -> float:
    x = torch.empty(n_bytes // 2, device="cuda", dtype=torch.bfloat16).normal_()  # random data, never zeros
    y = torch.empty_like(x)
    return 2 * n_bytes / bench_ms(lambda: y.copy_(x)) / 1e9


def _matmul_tflops(n: int = 8192) -> float:
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    return 2 * n**3 / bench_ms(lambda: a @ b) / 1e9


def print_table(rows: list[dict], columns: list[str]):
    if not rows:  # a section that was not run
        return
    widths = {c: max(len(c), *(len(_fmt(r.get(c))) for r in rows)) for c in columns}
    print(" | ".join(c.ljust(widths[c]) for c in columns))
    print("-|-".join("-" * widths[c] for c in columns))
    for r in rows:
        print(" | ".join(_fmt(r.get(c)).ljust(widths[c]) for c in columns))


def _fmt(v) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.3g}" if abs(v) < 10 else f"{v:.1f}"
    return str(v)
