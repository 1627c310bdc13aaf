"""Writing new tokens into a KV cache: both halves of each token (K and V, or MLA's latent and RoPE key) stored at
its (row or page, slot) in one launch, where two index_puts take two (vLLM's reshape_and_cache does the same job).
A decode step at small batch is bound by its launches, one of these per layer (docs/kernel-notes.md).

Layouts, with the letters of reference.py:
    a (n, T, H, D_a), b (n, T, H, D_b)                 the new tokens of n sequences, T each (any strides)
    a_dst (P, S, H, D_a), b_dst (P, S, H, D_b)         token-major views of the cache: P rows of S positions
                                                       (contiguous), or P pages of S slots (paged)
    pages (n, T), slots (n, T) int32/int64             token t of sequence i goes to [pages[i, t], slots[i, t]]
                                                       (a contiguous cache passes each sequence's row as its
                                                       page, broadcast over T, and the positions as slots)
A latent cache has no head axis: its tensors pass with H = 1 (`unsqueeze(2)`). The kernel stores in the cache's
dtype, converting as a copy would.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from attention_kernels import _checks
from attention_kernels._host import MAX_LAUNCH_KEYS, device_guard, launcher, next_power_of_2, tensor_signature


@triton.jit
def _write_kernel(
    A,
    B,
    A_DST,
    B_DST,
    PAGES,
    SLOTS,
    T,
    stride_an,
    stride_at,
    stride_ah,
    stride_ad,
    stride_bn,
    stride_bt,
    stride_bh,
    stride_bd,
    stride_dap,
    stride_das,
    stride_dah,
    stride_dad,
    stride_dbp,
    stride_dbs,
    stride_dbh,
    stride_dbd,
    stride_pn,
    stride_pt,
    stride_sn,
    stride_st,
    D_A: tl.constexpr,
    D_B: tl.constexpr,
    BLOCK_A: tl.constexpr,
    BLOCK_B: tl.constexpr,
):
    # grid (n * T, H): one program per token and head
    token = tl.program_id(0)
    head = tl.program_id(1)
    i = token // T
    t = token % T
    page = tl.load(PAGES + i * stride_pn + t * stride_pt).to(tl.int64)
    slot = tl.load(SLOTS + i * stride_sn + t * stride_st).to(tl.int64)
    src = i * stride_an + t * stride_at + head * stride_ah
    dst = page * stride_dap + slot * stride_das + head * stride_dah
    _copy_row(A + src, A_DST + dst, stride_ad, stride_dad, D_A, BLOCK_A)
    src = i * stride_bn + t * stride_bt + head * stride_bh
    dst = page * stride_dbp + slot * stride_dbs + head * stride_dbh
    _copy_row(B + src, B_DST + dst, stride_bd, stride_dbd, D_B, BLOCK_B)


@triton.jit
def _copy_row(src, dst, stride_src, stride_dst, D: tl.constexpr, BLOCK: tl.constexpr):
    """D elements from src to dst, in dst's dtype."""
    offs = tl.arange(0, BLOCK)
    x = tl.load(src + offs * stride_src, mask=offs < D)
    tl.store(dst + offs * stride_dst, x.to(dst.dtype.element_ty), mask=offs < D)


@torch.library.custom_op("zoo::write_tokens", mutates_args=("a_dst", "b_dst"))
def _write_tokens_op(
    a_dst: torch.Tensor,
    b_dst: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    pages: torch.Tensor,
    slots: torch.Tensor,
) -> None:
    _launch(a_dst, b_dst, a, b, pages, slots, _signature(a_dst, b_dst, a, b, pages, slots))


# The signatures whose tensors passed `_check`: a cache writes every layer with the same shapes, strides and dtypes,
# so the checks run once per signature, and the signature keys the launch (`Launcher.keyed`).
_CHECKED: set = set()


def _signature(*tensors) -> tuple | None:
    """`tensor_signature`, which also fixes the launch's integers (its shapes and strides); None if an argument is
    not a tensor (the checks then say so)."""
    if not all(isinstance(t, torch.Tensor) for t in tensors):
        return None
    return tensor_signature(tensors)


def _launch(a_dst, b_dst, a, b, pages, slots, key):
    n, T, H, d_a = a.shape
    if n * T == 0:
        return
    d_b = b.shape[-1]
    with device_guard(a):
        launcher(_write_kernel).keyed(key, (n * T, H))(
            a,
            b,
            a_dst,
            b_dst,
            pages,
            slots,
            T,
            *a.stride(),
            *b.stride(),
            *a_dst.stride(),
            *b_dst.stride(),
            *pages.stride(),
            *slots.stride(),
            D_A=d_a,
            D_B=d_b,
            BLOCK_A=next_power_of_2(d_a),
            BLOCK_B=next_power_of_2(d_b),
            num_warps=1,
        )


def _check(a_dst, b_dst, a, b, pages, slots):
    for name, x, layout in (
        ("a_dst", a_dst, "(P, S, H, D_a)"),
        ("b_dst", b_dst, "(P, S, H, D_b)"),
        ("a", a, "(n, T, H, D_a)"),
        ("b", b, "(n, T, H, D_b)"),
    ):
        _checks.check_rank(name, x, 4, layout)
        _checks.check_float(name, x)
    n, T, H, _ = a.shape
    if tuple(b.shape[:3]) != (n, T, H):
        _checks.fail("b", f"shape {tuple(b.shape)}", f"(n={n}, T={T}, H={H}, D_b) as a's first three")
    for name, dst, src in (("a_dst", a_dst, a), ("b_dst", b_dst, b)):
        if dst.shape[2:] != src.shape[2:]:
            _checks.fail(name, f"shape {tuple(dst.shape)}", f"(P, S, H={H}, D={src.shape[3]}) as its new tokens'")
    if a_dst.shape[:2] != b_dst.shape[:2]:
        _checks.fail("b_dst", f"shape {tuple(b_dst.shape)}", f"(P={a_dst.shape[0]}, S={a_dst.shape[1]}, ...) as a_dst")
    _checks.check_write_indices(pages, slots, (n, T), f"(n={n}, T={T})")
    _checks.check_same_device(dict(a_dst=a_dst, b_dst=b_dst, a=a, b=b, pages=pages, slots=slots))


def write_tokens(
    a_dst: torch.Tensor,
    b_dst: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    pages: torch.Tensor,
    slots: torch.Tensor,
    *,
    validate: bool = True,
) -> None:
    """In place: a_dst[pages[i, t], slots[i, t]] = a[i, t] and b_dst[...] = b[i, t] for every new token, in one
    launch (the module docstring gives the layouts). pages and slots may be broadcast views (stride 0).
    validate=False skips the checks that read pages and slots (a device sync); they are skipped anyway under CUDA
    graph capture and torch.compile."""
    compiling = torch.compiler.is_compiling()
    key = None if compiling else _signature(a_dst, b_dst, a, b, pages, slots)  # traced tensors have no address
    if key is None or key not in _CHECKED:
        _check(a_dst, b_dst, a, b, pages, slots)
        if key is not None:
            if len(_CHECKED) >= MAX_LAUNCH_KEYS:  # a prefill per prompt length adds a signature each
                _CHECKED.clear()
            _CHECKED.add(key)
    if validate and _checks.can_read_values(pages):
        _checks.check_write_index_values(a_dst, pages, slots)
    if compiling:
        torch.ops.zoo.write_tokens(a_dst, b_dst, a, b, pages, slots)
    else:
        # Eagerly (the caches call this outside any compiled region, once a layer) the launch goes without the
        # custom op's dispatch, which for a mutating op adds about as much host time as the launch takes.
        _launch(a_dst, b_dst, a, b, pages, slots, key)
