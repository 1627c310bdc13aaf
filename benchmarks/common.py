"""What every benchmark shares: the machine's ceilings measured in the same run, median timing with a cold L2,
and a header that records date, GPU, torch and triton versions beside the numbers."""

from __future__ import annotations

import datetime

import torch
import triton


def header() -> str:
    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    return (f"date {datetime.date.today().isoformat()} | gpu {gpu} | torch {torch.__version__} | "
            f"triton {triton.__version__}")


def bench_ms(fn, warmup_ms: int = 25, rep_ms: int = 100) -> float:
    """Median milliseconds of fn() (device events). do_bench clears the L2 between calls."""
    return triton.testing.do_bench(fn, warmup=warmup_ms, rep=rep_ms, return_mode="median")


def ceilings() -> dict[str, float]:
    """Device-to-device copy bandwidth (bytes read + written per second) and the bf16 matmul rate."""
    x = torch.empty(2 * 1024**3 // 2, device="cuda", dtype=torch.bfloat16).normal_()
    y = torch.empty_like(x)
    ms = bench_ms(lambda: y.copy_(x))
    copy_tbps = 2 * x.numel() * x.element_size() / ms / 1e9
    del x, y
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    ms = bench_ms(lambda: a @ b)
    mm_tflops = 2 * 8192**3 / ms / 1e9
    return {"copy_TBps": copy_tbps, "matmul_bf16_TFLOPs": mm_tflops}


def print_table(rows: list[dict], columns: list[str]):
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
