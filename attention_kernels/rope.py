"""RoPE on the fused projection's heads: qkv -> rotated q, rotated k and v in one launch, and its gradient in one.

A GQA-family layer projects x once into rows [q | k | v] (`model.CausalSelfAttention.c_attn`) and rotates q and k
by the token's angles (rotate-half, GPT-NeoX's pairing: dims i and i + D/2). Written in PyTorch, the backward of that
split, rotation and re-concatenation is one Inductor kernel over the whole gradient whose every element picks among
three sources and two halves by index arithmetic: at 32 sequences of 1,024 tokens it took 0.40 ms a layer on an
H100, ten times its bytes' time (benchmarks/RESULTS.md, "Training iteration"). Here a program moves one head of
BLOCK_T tokens as two half tiles, and the backward writes the packed gradient of qkv directly:

    forward   q[b, t, h] = rot(qkv[b, t, h], +angle)      k likewise from the next H_kv heads, v copied
    backward  dqkv[b, t, h] = rot(dq[b, t, h], -angle)    dk likewise, dv copied
    rot(x, a) = [x1 cos a - x2 sin a, x2 cos a + x1 sin a]  with x = [x1 | x2], in fp32, rounded once

Layouts: qkv (B, T, (H + 2 H_kv) D) with unit stride along its last dim; cos, sin (B or 1, T, D/2) fp32 (model's
`rope_cos_sin`); q (B, T, H, D), k and v (B, T, H_kv, D), new contiguous tensors (v too: an op may not return a view
of its input, and the copy is what lets the backward write one packed gradient).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from attention_kernels import _checks
from attention_kernels._host import cdiv, device_guard, launcher, next_power_of_2

BLOCK_T = 64  # tokens a program moves: 64 x D/2 half tiles, a few KB each


@triton.jit
def _rope_qkv_kernel(
    PACKED,
    Q,
    K,
    V,
    COS,
    SIN,
    T,
    stride_pb,
    stride_pt,
    stride_qb,
    stride_qt,
    stride_qh,
    stride_kb,
    stride_kt,
    stride_kh,
    stride_vb,
    stride_vt,
    stride_vh,
    stride_cb,
    stride_ct,
    H: tl.constexpr,
    H_KV: tl.constexpr,
    HALF: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BACKWARD: tl.constexpr,
):
    # grid (cdiv(T, BLOCK_T), B, H + 2 H_KV): one head slot of the packed rows (q heads, then k, then v), one sequence
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    b = tl.program_id(1).to(tl.int64)  # a training batch's qkv can pass 2^31 elements
    slot = tl.program_id(2)
    i = tl.arange(0, BLOCK_HALF)
    mask = (t[:, None] < T) & (i[None, :] < HALF)
    packed = PACKED + b * stride_pb + t[:, None] * stride_pt + slot * 2 * HALF + i[None, :]
    if slot < H:
        split = Q + b * stride_qb + t[:, None] * stride_qt + slot * stride_qh + i[None, :]
    elif slot < H + H_KV:
        split = K + b * stride_kb + t[:, None] * stride_kt + (slot - H) * stride_kh + i[None, :]
    else:
        split = V + b * stride_vb + t[:, None] * stride_vt + (slot - H - H_KV) * stride_vh + i[None, :]
    if BACKWARD:
        src = split
        dst = packed
    else:
        src = packed
        dst = split
    x1 = tl.load(src, mask=mask, other=0.0)
    x2 = tl.load(src + HALF, mask=mask, other=0.0)
    if slot < H + H_KV:  # q and k heads rotate; v heads are copied
        angle = b * stride_cb + t[:, None] * stride_ct + i[None, :]
        cos = tl.load(COS + angle, mask=mask, other=0.0)
        sin = tl.load(SIN + angle, mask=mask, other=0.0)
        if BACKWARD:  # the inverse rotation: the transpose of a rotation is the rotation by minus its angle
            sin = -sin
        x1f, x2f = x1.to(tl.float32), x2.to(tl.float32)
        y1 = (x1f * cos - x2f * sin).to(dst.dtype.element_ty)
        y2 = (x2f * cos + x1f * sin).to(dst.dtype.element_ty)
    else:
        y1, y2 = x1, x2
    tl.store(dst, y1, mask=mask)
    tl.store(dst + HALF, y2, mask=mask)


def _launch(packed, q, k, v, cos, sin, backward: bool):
    B, T = packed.shape[:2]
    H, H_kv, D = q.shape[2], k.shape[2], q.shape[3]
    # On the CPU the interpreter runs programs one after another: a whole sequence a program keeps them few.
    block_t = min(BLOCK_T, next_power_of_2(T)) if packed.is_cuda else next_power_of_2(T)
    with device_guard(packed):
        launcher(_rope_qkv_kernel)[(cdiv(T, block_t), B, H + 2 * H_kv)](
            packed,
            q,
            k,
            v,
            cos,
            sin,
            T,
            packed.stride(0),
            packed.stride(1),
            *q.stride()[:3],
            *k.stride()[:3],
            *v.stride()[:3],
            cos.stride(0) if cos.shape[0] > 1 else 0,
            cos.stride(1),
            H=H,
            H_KV=H_kv,
            HALF=D // 2,
            BLOCK_HALF=next_power_of_2(D // 2),
            BLOCK_T=block_t,
            BACKWARD=backward,
            num_warps=4,
        )


def _split_like(qkv, n_head: int, n_kv_head: int):
    B, T, width = qkv.shape
    D = width // (n_head + 2 * n_kv_head)
    return [qkv.new_empty(B, T, h, D) for h in (n_head, n_kv_head, n_kv_head)]


@torch.library.custom_op("zoo::rope_qkv", mutates_args=())
def _rope_qkv_op(
    qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, n_head: int, n_kv_head: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    q, k, v = _split_like(qkv, n_head, n_kv_head)
    _launch(qkv, q, k, v, cos, sin, backward=False)
    return q, k, v


@_rope_qkv_op.register_fake
def _(qkv, cos, sin, n_head, n_kv_head):
    return tuple(_split_like(qkv, n_head, n_kv_head))


@torch.library.custom_op("zoo::rope_qkv_backward", mutates_args=())
def _rope_qkv_backward_op(
    dq: torch.Tensor, dk: torch.Tensor, dv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> torch.Tensor:
    B, T, H, D = dq.shape
    dqkv = dq.new_empty(B, T, (H + 2 * dk.shape[2]) * D)
    _launch(dqkv, dq, dk, dv, cos, sin, backward=True)
    return dqkv


@_rope_qkv_backward_op.register_fake
def _(dq, dk, dv, cos, sin):
    B, T, H, D = dq.shape
    return dq.new_empty(B, T, (H + 2 * dk.shape[2]) * D)


def _setup_context(ctx, inputs, output):
    _, cos, sin, _, _ = inputs
    ctx.save_for_backward(cos, sin)


def _backward(ctx, dq, dk, dv):
    cos, sin = ctx.saved_tensors
    # Gradients may arrive in any layout (SDPA's, a transpose's); the kernel wants a unit stride along D.
    dq, dk, dv = (g if g.stride(-1) == 1 else g.contiguous() for g in (dq, dk, dv))
    return _rope_qkv_backward_op(dq, dk, dv, cos, sin), None, None, None, None


_rope_qkv_op.register_autograd(_backward, setup_context=_setup_context)


def _check(qkv, cos, sin, n_head, n_kv_head):
    _checks.check_rank("qkv", qkv, 3, "(B, T, (n_head + 2 n_kv_head) D)")
    _checks.check_float("qkv", qkv)
    for name, n in (("n_head", n_head), ("n_kv_head", n_kv_head)):
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            _checks.fail(name, repr(n), "an int >= 1")
    B, T, width = qkv.shape
    slots = n_head + 2 * n_kv_head
    if B < 1 or T < 1:
        _checks.fail("qkv", f"shape {tuple(qkv.shape)}", "at least one sequence of at least one token")
    if width % slots or (width // slots) % 2:
        _checks.fail("qkv", f"last dim {width}", f"(n_head + 2 n_kv_head) = {slots} heads of an even head dim")
    if qkv.stride(-1) != 1:
        _checks.fail("qkv", f"strides {tuple(qkv.stride())}", "unit stride along the last dim")
    half = width // slots // 2
    _checks.check_angles(cos, sin, B, (T, half), "(B or 1, T, D/2)", f"T={T}, D/2={half}", "D/2")
    _checks.check_same_device({"qkv": qkv, "cos": cos, "sin": sin})


def rope_qkv(
    qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, n_head: int, n_kv_head: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The fused projection's rows [q | k | v] (B, T, (n_head + 2 n_kv_head) D) -> q (B, T, n_head, D) and
    k (B, T, n_kv_head, D) rotated by RoPE at angles cos, sin (B or 1, T, D/2), and v (B, T, n_kv_head, D), in
    qkv's dtype; differentiable in qkv (the module docstring gives the math)."""
    _check(qkv, cos, sin, n_head, n_kv_head)
    return torch.ops.zoo.rope_qkv(qkv, cos, sin, n_head, n_kv_head)
