"""The output head and its cross-entropy, with the loss's gradient computed in the forward: linear_cross_entropy.

A GPT-2-small micro-step of 32 x 1,024 tokens has 3.3 GB of bf16 logits (50,304 a token). Written as F.linear then
F.cross_entropy, the forward reads them once for the loss and the backward reads them again to form the gradient
and writes it, each a pass over gigabytes. Here one kernel does both in the forward, as Liger-Kernel's
cross-entropy does: a program takes one row, finds its max and sum of exponentials in a first pass over the
vocabulary, and in a second pass (whose reads mostly hit the L2, the row just read) writes the gradient

    dlogits[i, j] = softmax(logits[i])[j] - [j == target_i]     (0 for a row whose target is ignored)
    loss = sum_i (logsumexp(logits[i]) - logits[i, target_i]) / n_valid

in fp32, rounded once. The backward then multiplies that gradient into the two products the head needs,
dx = dlogits W and dW = dlogits^T x, and scales their (much smaller) results by the mean's 1 / n_valid times the
loss's incoming gradient (GradScaler's scale, a gradient-accumulation step's division) in fp32, so the logits'
gradient is never read or written again. The stored gradient is unscaled so that fp16 keeps it: divided by 32,768
rows, most of a row's softmax would flush to zero there. A target outside [0, V) other than ignore_index makes the
loss NaN (found on the device, without a host sync).

Layouts: x (N, C) and weight (V, C) in one float dtype (under autocast, the autocast dtype: what F.linear would
multiply in); targets (N,) int64, ignore_index where a token has no target. Returns logits (N, V) in x's dtype,
detached (they are not differentiable here: their gradient is this loss's), and the mean loss in fp32.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from attention_kernels import _checks
from attention_kernels._host import device_guard, launcher, next_power_of_2

# Vocabulary entries a program holds at once, and its warps: 7 blocks of 8,192 for GPT-2's 50,304, 16 values a
# thread. Liger-Kernel's 32,768 spills at 32 warps, whose threads get at most 64 registers each; of five settings
# timed on an H100, this one ran the kernel fastest (benchmarks/RESULTS.md, "Training iteration").
MAX_BLOCK_V = 8192
NUM_WARPS = 16
NEG_INF = tl.constexpr(float("-inf"))


@triton.jit
def _cross_entropy_kernel(
    LOGITS,
    TARGETS,
    LOSS,
    DLOGITS,
    stride_l,
    stride_d,
    ignore_index,
    V: tl.constexpr,  # a model's one vocabulary size (a compile-time loop bound: the interpreter's range needs one)
    BLOCK_V: tl.constexpr,
):
    # grid (N,): one row of logits a program
    row = tl.program_id(0).to(tl.int64)
    logits = LOGITS + row * stride_l
    dlogits = DLOGITS + row * stride_d
    target = tl.load(TARGETS + row)
    cols = tl.arange(0, BLOCK_V)
    # pass 1: the row's max and its sum of exponentials, block by block (online softmax)
    x = tl.load(logits + cols, mask=cols < V, other=NEG_INF).to(tl.float32)
    m = tl.max(x, axis=0)
    s = tl.sum(tl.exp(x - m), axis=0)
    for start in range(BLOCK_V, V, BLOCK_V):
        x = tl.load(logits + start + cols, mask=start + cols < V, other=NEG_INF).to(tl.float32)
        m_new = tl.maximum(m, tl.max(x, axis=0))
        s = s * tl.exp(m - m_new) + tl.sum(tl.exp(x - m_new), axis=0)
        m = m_new
    lse = m + tl.log(s)
    valid = target != ignore_index
    in_range = (target >= 0) & (target < V)
    x_target = tl.load(logits + target, mask=valid & in_range, other=0.0).to(tl.float32)
    # A target outside the vocabulary makes the loss NaN: loud, and found without a host sync.
    tl.store(LOSS + row, tl.where(valid, tl.where(in_range, lse - x_target, float("nan")), 0.0))
    # pass 2: the row's loss's gradient, softmax - one-hot (zero for an ignored row), unscaled: divided by the valid
    # rows' count here, fp16 would flush most of it to zero before GradScaler's scale reaches it in the backward
    keep = tl.where(valid, 1.0, 0.0)
    for start in range(0, V, BLOCK_V):
        j = start + cols
        x = tl.load(logits + j, mask=j < V, other=0.0).to(tl.float32)
        grad = (tl.exp(x - lse) - (j == target).to(tl.float32)) * keep
        tl.store(dlogits + j, grad.to(DLOGITS.dtype.element_ty), mask=j < V)


def _launch(logits, targets, ignore_index: int):
    N, V = logits.shape
    targets = targets.contiguous()  # the kernel reads a row's target at its row index
    loss_rows = torch.empty(N, device=logits.device, dtype=torch.float32)
    dlogits = torch.empty_like(logits)
    block_v = min(MAX_BLOCK_V, next_power_of_2(V))
    with device_guard(logits):
        launcher(_cross_entropy_kernel)[(N,)](
            logits,
            targets,
            loss_rows,
            dlogits,
            logits.stride(0),
            dlogits.stride(0),
            ignore_index,
            V=V,
            BLOCK_V=block_v,
            num_warps=NUM_WARPS if logits.is_cuda else 4,
        )
    return loss_rows.sum() / _valid_rows(targets, ignore_index), dlogits


def _valid_rows(targets, ignore_index: int) -> torch.Tensor:
    return (targets != ignore_index).sum()


@torch.library.custom_op("zoo::linear_cross_entropy", mutates_args=())
def _linear_cross_entropy_op(
    x: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, ignore_index: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    logits = x @ weight.t()
    loss, dlogits = _launch(logits, targets, ignore_index)
    return logits, loss, dlogits


@_linear_cross_entropy_op.register_fake
def _(x, weight, targets, ignore_index):
    logits = x.new_empty(x.shape[0], weight.shape[0])
    return logits, x.new_empty((), dtype=torch.float32), torch.empty_like(logits)


def _setup_context(ctx, inputs, output):
    x, weight, targets, ignore_index = inputs
    _, _, dlogits = output
    ctx.save_for_backward(x, weight, targets, dlogits)
    ctx.ignore_index = ignore_index
    ctx.mark_non_differentiable(output[0], output[2])
    ctx.set_materialize_grads(False)


def _backward(ctx, d_logits, d_loss, d_dlogits):
    x, weight, targets, dlogits = ctx.saved_tensors
    if d_loss is None:
        return None, None, None, None
    # The mean's 1 / n_valid and the loss's incoming gradient (GradScaler's scale, a gradient-accumulation step's
    # 1 / steps) as one fp32 factor; a bf16 / fp16 product times an fp32 0-d tensor is computed in fp32 and rounded
    # once to the product's dtype.
    scale = d_loss.float() / _valid_rows(targets, ctx.ignore_index).clamp(min=1)  # none valid: zero, as PyTorch's
    dx = (dlogits @ weight) * scale if ctx.needs_input_grad[0] else None
    dweight = (dlogits.t() @ x) * scale if ctx.needs_input_grad[1] else None
    return dx, dweight, None, None


_linear_cross_entropy_op.register_autograd(_backward, setup_context=_setup_context)


def _check(x, weight, targets, ignore_index):
    _checks.check_rank("x", x, 2, "(N, C)")
    _checks.check_rank("weight", weight, 2, "(V, C)")
    _checks.check_float("x", x)
    _checks.check_float("weight", weight, x, "x")
    if weight.shape[1] != x.shape[1] or weight.shape[0] == 0:
        _checks.fail("weight", f"shape {tuple(weight.shape)}", f"(V >= 1, C={x.shape[1]}) as x's C")
    if not isinstance(targets, torch.Tensor) or targets.dtype != torch.int64 or tuple(targets.shape) != x.shape[:1]:
        got = f"{targets.dtype} of shape {tuple(targets.shape)}" if isinstance(targets, torch.Tensor) else targets
        _checks.fail("targets", got, f"an int64 tensor of shape ({x.shape[0]},)")
    if isinstance(ignore_index, bool) or not isinstance(ignore_index, int):
        _checks.fail("ignore_index", repr(ignore_index), "an int")
    _checks.check_same_device({"x": x, "weight": weight, "targets": targets})


def linear_cross_entropy(
    x: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, ignore_index: int = -1
) -> tuple[torch.Tensor, torch.Tensor]:
    """(logits = x @ weight.T, the mean cross-entropy of targets) for x (N, C), weight (V, C), targets (N,) int64;
    rows whose target is ignore_index count for nothing. Under autocast x and weight are multiplied in the autocast
    dtype, as F.linear would. The logits are detached; the loss is differentiable in x and weight (the module
    docstring gives the math)."""
    device_type = x.device.type
    if torch.is_autocast_enabled(device_type):
        dtype = torch.get_autocast_dtype(device_type)
        x, weight = x.to(dtype), weight.to(dtype)
    _check(x, weight, targets, ignore_index)
    logits, loss, _ = torch.ops.zoo.linear_cross_entropy(x, weight, targets, ignore_index)
    return logits, loss
