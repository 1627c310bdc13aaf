"""Input validation shared by every public op: each failure is a ValueError naming the argument, what it got
and what is valid. Shapes, dtypes and devices are checked always (host metadata, free); checks that read tensor
values (sequence lengths, block-table entries) need a device sync and are skipped while a CUDA graph is being
captured or torch.compile is tracing."""

from __future__ import annotations

import torch

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def fail(name: str, got, valid: str):
    raise ValueError(f"{name}: got {got}; valid: {valid}")


def check_rank(name: str, x: torch.Tensor, rank: int, layout: str):
    if not isinstance(x, torch.Tensor):
        fail(name, type(x).__name__, f"a torch.Tensor of shape {layout}")
    if x.ndim != rank:
        fail(name, f"shape {tuple(x.shape)}", f"a {rank}-d tensor {layout}")


def check_float(name: str, x: torch.Tensor, like: torch.Tensor | None = None, like_name: str = ""):
    if x.dtype not in FLOAT_DTYPES:
        fail(name, f"dtype {x.dtype}", "torch.float16, torch.bfloat16 or torch.float32")
    if like is not None and x.dtype != like.dtype:
        fail(name, f"dtype {x.dtype}", f"the dtype of {like_name}, {like.dtype}")


def check_same_device(tensors: dict[str, torch.Tensor]):
    devices = {name: t.device for name, t in tensors.items()}
    first_name, first = next(iter(devices.items()))
    for name, dev in devices.items():
        if dev != first:
            fail(name, f"device {dev}", f"the device of {first_name}, {first}")
    if first.type != "cuda" and not interpreting():
        fail(first_name, f"device {first}", "a CUDA tensor (or run with TRITON_INTERPRET=1 to execute on the CPU)")


def check_int32(name: str, x: torch.Tensor, shape: tuple[int, ...], layout: str):
    if not isinstance(x, torch.Tensor) or x.dtype != torch.int32:
        got = f"dtype {x.dtype}" if isinstance(x, torch.Tensor) else type(x).__name__
        fail(name, got, f"an int32 tensor {layout}")
    if tuple(x.shape) != tuple(shape):
        fail(name, f"shape {tuple(x.shape)}", f"{layout} = {tuple(shape)}")


def interpreting() -> bool:
    import os

    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def can_read_values(x: torch.Tensor) -> bool:
    """Value checks sync the device: skip them while capturing a CUDA graph or tracing with torch.compile."""
    if torch.compiler.is_compiling():
        return False
    if x.is_cuda and torch.cuda.is_current_stream_capturing():
        return False
    return True
