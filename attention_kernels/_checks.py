"""Input validation shared by every public op: each failure is a ValueError naming the argument, what it got
and what is valid. Shapes, dtypes and devices are checked always (host metadata, free); checks that read tensor
values (sequence lengths, block-table entries) need a device sync and are skipped while a CUDA graph is being
captured or torch.compile is tracing."""

from __future__ import annotations

import math
import os

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


def check_scale(scale, valid: str = "a finite float > 0", name: str = "scale"):
    # Comparisons rather than math.isfinite: under torch.compile a float argument can arrive as a SymFloat, which
    # comparisons guard on and math.isfinite breaks the graph at.
    if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not 0 < scale < math.inf:
        fail(name, repr(scale), valid)


def check_angles(cos, sin, B: int, tail: tuple, layout: str, dims: str, last: str):
    """RoPE's angles: cos and sin alike, fp32, (B or 1, *tail) with a unit stride along the last dim."""
    for name, t in (("cos", cos), ("sin", sin)):
        check_rank(name, t, 1 + len(tail), layout)
        if t.dtype != torch.float32:
            fail(name, f"dtype {t.dtype}", "torch.float32 (bf16 angles are off by whole radians)")
        if t.shape[0] not in (1, B) or tuple(t.shape[1:]) != tail or t.stride(-1) != 1:
            fail(name, f"shape {tuple(t.shape)}", f"({B} or 1, {dims}), unit stride along {last}")
    if cos.shape != sin.shape or cos.stride() != sin.stride():
        fail("sin", f"shape {tuple(sin.shape)}, strides {sin.stride()}", "cos's shape and strides")


def check_write_indices(pages, slots, shape: tuple[int, ...], layout: str):
    """Where new tokens go in a cache: pages and slots, int32 or int64 tensors of `shape`."""
    for name, idx in (("pages", pages), ("slots", slots)):
        if not isinstance(idx, torch.Tensor) or idx.dtype not in (torch.int32, torch.int64) or idx.shape != shape:
            got = f"{idx.dtype} shape {tuple(idx.shape)}" if isinstance(idx, torch.Tensor) else type(idx).__name__
            fail(name, got, f"an int32 or int64 tensor of shape {layout}")


def check_write_index_values(dst: torch.Tensor, pages, slots):
    """pages and slots inside dst's (P, S, ...) rows and positions (reads their values: a device sync)."""
    for name, idx, bound in (("pages", pages, dst.shape[0]), ("slots", slots, dst.shape[1])):
        if idx.numel() and (int(idx.min()) < 0 or int(idx.max()) >= bound):
            fail(name, f"values in [{int(idx.min())}, {int(idx.max())}]", f"values in [0, {bound})")


def check_int32(name: str, x: torch.Tensor, shape: tuple[int, ...], layout: str):
    if not isinstance(x, torch.Tensor) or x.dtype != torch.int32:
        got = f"dtype {x.dtype}" if isinstance(x, torch.Tensor) else type(x).__name__
        fail(name, got, f"an int32 tensor {layout}")
    if tuple(x.shape) != tuple(shape):
        fail(name, f"shape {tuple(x.shape)}", f"{layout} = {tuple(shape)}")


def tma_readable(t: torch.Tensor) -> bool:
    """Can a TMA tensor descriptor read t as it is? A unit stride along the last dim, the other strides and the
    base address 16-byte aligned."""
    size = t.element_size()
    return t.stride(-1) == 1 and t.data_ptr() % 16 == 0 and all(s * size % 16 == 0 for s in t.stride()[:-1])


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def can_read_values(x: torch.Tensor) -> bool:
    """Value checks sync the device: skip them while capturing a CUDA graph or tracing with torch.compile."""
    if torch.compiler.is_compiling():
        return False
    if x.is_cuda and torch.cuda.is_current_stream_capturing():
        return False
    return True


# ---- Decode-kernel checks (grouped, paged and MLA decode; decode.py and mla.py) --------------------------------------


def check_head_dim(name: str, dim: int, low: int, high: int):
    if not low <= dim <= high:
        fail(name, f"head dim {dim}", f"a head dim from {low} to {high}")


def check_num_splits(num_splits, max_splits: int):
    if num_splits is None:
        return
    if isinstance(num_splits, bool) or not isinstance(num_splits, int) or not 1 <= num_splits <= max_splits:
        fail("num_splits", repr(num_splits), f"None (automatic) or an int from 1 to {max_splits}")


def check_page_size(name: str, page_size: int):
    if page_size < 8 or page_size > 256 or page_size & (page_size - 1):
        fail(name, f"page_size (dim 1) {page_size}", "a power of two from 8 to 256")


def check_seq_lens_values(seq_lens: torch.Tensor, capacity: int, what: str):
    """Every sequence sees at least one token and no more than the cache holds (one device sync)."""
    if capacity < 1:  # an empty cache or pool: no length is valid
        fail("seq_lens", f"a cache of {capacity} tokens ({what})", "a cache of at least one token per sequence")
    bad = (seq_lens < 1) | (seq_lens > capacity)
    if bool(bad.any()):
        b = int(bad.nonzero()[0, 0])
        fail("seq_lens", f"seq_lens[{b}] = {int(seq_lens[b])}", f"lengths from 1 to {capacity} ({what})")


def check_block_table_values(block_table: torch.Tensor, seq_lens: torch.Tensor, page_size: int, num_pages: int):
    """The table is long enough for every sequence, and every page a sequence uses lies inside the pool."""
    max_pages = block_table.shape[1]
    needed = (seq_lens.long() + page_size - 1) // page_size  # (B,) pages each sequence reads
    short = needed > max_pages
    if bool(short.any()):
        b = int(short.nonzero()[0, 0])
        fail(
            "block_table",
            f"{max_pages} pages per row, but sequence {b} has seq_len {int(seq_lens[b])}",
            f"at least {int(needed[b])} pages for it at page_size {page_size}",
        )
    if num_pages < 1:
        fail("block_table", "a pool of 0 pages", "a pool of at least one page")
    used = torch.arange(max_pages, device=block_table.device)[None, :] < needed[:, None]
    bad = used & ((block_table < 0) | (block_table >= num_pages))
    if bool(bad.any()):
        b, p = (int(i) for i in bad.nonzero()[0])
        fail(
            "block_table",
            f"block_table[{b}, {p}] = {int(block_table[b, p])}",
            f"page ids from 0 to {num_pages - 1} (the pool's pages) for the pages a sequence uses",
        )
