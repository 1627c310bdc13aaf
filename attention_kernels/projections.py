"""The projections of a decode step at a few rows: y = residual + act(norm(x) W^T + b) in one launch.

At batch 1 a GPT-2-small decode step is four projections a layer over one row each, and each is a matrix-vector
product bound by reading its weights (1-5 MB): cuBLAS and Inductor run them at a tenth to a third of the memory's
speed, and the layer norm before and the bias, GELU and residual add after each cost a launch of their own or a
slower fused reduction (docs/kernel-notes.md, "Few-row projections"). Here one program reads BLOCK_N whole rows
of W (all of K at once, so every read is in flight together), then the M input rows, and writes BLOCK_N outputs
of each:

    x_m  = layer_norm(x[m]) * norm_weight + norm_bias   (norm_weight given; rounded to x's dtype, as F.layer_norm
                                                          returns it, before the product)
    y[m] = x_m W^T + bias            (fp32 accumulation)
    y[m] = gelu_tanh(y[m])           (gelu=True; GPT-2's "gelu_new")
    y[m] = y[m] + residual[m]        (residual given)

rounded once to x's dtype. The weights, bias and norm parameters are read before the program waits for the kernel
before it (a programmatic dependent launch on sm_90, `_host.pdl`), so their reads overlap that kernel's end; x and
the residual are read after the wait. So the kernel launched right before must not write the weights (GPT.forward
refolds MLA's decode weights before the embedding's kernels for this reason).

Layouts: x (M, K), weight (N, K) with unit stride along K, bias (N,), norm_weight / norm_bias (K,), residual and
y (M, N); M at most MAX_ROWS (a larger batch is a GEMM's work: cuBLAS's). The model uses it at one row
(model.FUSED_MAX_ROWS): at eight its tile measured slower than cuBLAS (benchmarks/RESULTS.md).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_wait

from attention_kernels import _checks
from attention_kernels._host import (
    MAX_LAUNCH_KEYS,
    cdiv,
    device_guard,
    launcher,
    next_power_of_2,
    num_sms,
    pdl,
    tensor_signature,
)

MAX_ROWS = 8
# The largest K whose whole rows one program holds (BLOCK_K values in registers per row of the tile).
MAX_K = 8192
SQRT_2_OVER_PI = tl.constexpr(0.7978845608028654)


@triton.jit
def _decode_linear_kernel(
    X,
    W,
    BIAS,
    NORM_W,
    NORM_B,
    RES,
    Y,
    N,
    stride_xm,
    stride_wn,
    stride_rm,
    stride_ym,
    eps,
    M: tl.constexpr,
    K: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    NORM: tl.constexpr,
    HAS_NORM_BIAS: tl.constexpr,
    GELU: tl.constexpr,
    HAS_RES: tl.constexpr,
    WAIT: tl.constexpr,
):
    # grid (cdiv(N, BLOCK_N),): one program per BLOCK_N output columns, for every row
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    cols = tl.arange(0, BLOCK_K)
    mask_n = rows < N
    mask_k = cols < K
    w = tl.load(W + rows[:, None] * stride_wn + cols[None, :], mask=mask_n[:, None] & mask_k[None, :], other=0.0)
    w = w.to(tl.float32)
    if HAS_BIAS:
        bias = tl.load(BIAS + rows, mask=mask_n, other=0.0).to(tl.float32)
    if NORM:
        gain = tl.load(NORM_W + cols, mask=mask_k, other=0.0).to(tl.float32)
        if HAS_NORM_BIAS:
            shift = tl.load(NORM_B + cols, mask=mask_k, other=0.0).to(tl.float32)
    if WAIT:  # x and the residual are the previous kernel's outputs
        gdc_wait()
    for m in tl.static_range(M):
        x = tl.load(X + m * stride_xm + cols, mask=mask_k, other=0.0).to(tl.float32)
        if NORM:
            mean = tl.sum(x, axis=0) / K
            centered = tl.where(mask_k, x - mean, 0.0)
            var = tl.sum(centered * centered, axis=0) / K
            x = centered * tl.rsqrt(var + eps) * gain
            if HAS_NORM_BIAS:
                x += shift
            x = x.to(Y.dtype.element_ty).to(tl.float32)
        y = tl.sum(w * x[None, :], axis=1)
        if HAS_BIAS:
            y += bias
        if GELU:  # 0.5 (1 + tanh(z)) = sigmoid(2 z)
            y = y * tl.sigmoid(2.0 * SQRT_2_OVER_PI * (y + 0.044715 * y * y * y))
        if HAS_RES:
            y += tl.load(RES + m * stride_rm + rows, mask=mask_n, other=0.0).to(tl.float32)
        tl.store(Y + m * stride_ym + rows, y.to(Y.dtype.element_ty), mask=mask_n)


def _tile(M: int, N: int, K: int, device: torch.device) -> tuple[int, int]:
    """(BLOCK_N, num_warps). Whole rows of K <= 1024 two to a program, longer ones one (their registers); more
    input rows share a program's weights over more outputs, which keeps their reads of x from the L2 few. The
    interpreter on the CPU runs programs one after another, so there the outputs go to `num_sms` (2) programs."""
    if device.type != "cuda":
        return next_power_of_2(cdiv(N, num_sms(device))), 4
    block_n = 2 if K <= 1024 else 1
    if M > 2:
        block_n *= 4 if M > 4 else 2
    return block_n, 4 if K <= 1024 else 8


def _run(x, weight, bias, norm_weight, norm_bias, residual, eps, gelu, key=None):
    y = x.new_empty(x.shape[0], weight.shape[0])
    key = tensor_signature((x, weight, bias, norm_weight, norm_bias, residual)) if key is None else key
    _launch(x, weight, bias, norm_weight, norm_bias, residual, eps, gelu, y, key)
    return y


def _launch(x, weight, bias, norm_weight, norm_bias, residual, eps, gelu, y, key):
    M, K = x.shape
    N = weight.shape[0]
    block_n, warps = _tile(M, N, K, x.device)
    wait = pdl(x.device)
    with device_guard(x):
        launcher(_decode_linear_kernel).keyed(key + (gelu, wait), (cdiv(N, block_n),))(
            x,
            weight,
            bias if bias is not None else weight,
            norm_weight if norm_weight is not None else weight,
            norm_bias if norm_bias is not None else weight,
            residual if residual is not None else y,
            y,
            N,
            x.stride(0),
            weight.stride(0),
            residual.stride(0) if residual is not None else 0,
            y.stride(0),
            eps,
            M=M,
            K=K,
            BLOCK_N=block_n,
            BLOCK_K=next_power_of_2(K),
            HAS_BIAS=bias is not None,
            NORM=norm_weight is not None,
            HAS_NORM_BIAS=norm_bias is not None,
            GELU=gelu,
            HAS_RES=residual is not None,
            WAIT=wait,
            num_warps=warps,
            launch_pdl=wait,
        )


@torch.library.custom_op("zoo::decode_linear", mutates_args=())
def _decode_linear_op(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    norm_weight: torch.Tensor | None,
    norm_bias: torch.Tensor | None,
    residual: torch.Tensor | None,
    eps: float,
    gelu: bool,
) -> torch.Tensor:
    return _run(x, weight, bias, norm_weight, norm_bias, residual, eps, gelu)


@_decode_linear_op.register_fake
def _(x, weight, bias, norm_weight, norm_bias, residual, eps, gelu):
    return x.new_empty(x.shape[0], weight.shape[0])


# Signatures whose tensors passed `_check`: a decode step repeats a few projection shapes every layer and step.
_CHECKED: set = set()


def _check(x, weight, bias, norm_weight, norm_bias, residual):
    _checks.check_rank("x", x, 2, "(M, K)")
    _checks.check_rank("weight", weight, 2, "(N, K)")
    _checks.check_float("x", x)
    M, K = x.shape
    N = weight.shape[0]
    if not 1 <= M <= MAX_ROWS:
        _checks.fail("x", f"{M} rows", f"1 to {MAX_ROWS} rows (more are a GEMM's work: use F.linear)")
    if weight.shape[1] != K:
        _checks.fail("weight", f"shape {tuple(weight.shape)}", f"(N, K={K}) as x's K")
    if K > MAX_K:
        _checks.fail("x", f"K={K}", f"K <= {MAX_K} (one program holds whole rows of the weight)")
    if weight.stride(1) != 1 or x.stride(1) != 1:
        name = "weight" if weight.stride(1) != 1 else "x"
        _checks.fail(name, f"strides {tuple((weight if name == 'weight' else x).stride())}", "unit stride along K")
    named = dict(x=x, weight=weight, bias=bias, norm_weight=norm_weight, norm_bias=norm_bias, residual=residual)
    for name, t in named.items():
        if t is not None and t.dtype != x.dtype:
            _checks.fail(name, f"dtype {t.dtype}", f"x's dtype {x.dtype}")
    for name, t, shape in (("bias", bias, (N,)), ("norm_weight", norm_weight, (K,)), ("norm_bias", norm_bias, (K,))):
        if t is not None and (tuple(t.shape) != shape or t.stride(0) != 1):
            _checks.fail(name, f"shape {tuple(t.shape)}, strides {t.stride()}", f"a contiguous tensor of shape {shape}")
    if norm_bias is not None and norm_weight is None:
        _checks.fail("norm_bias", "a tensor without norm_weight", "norm_bias only with norm_weight")
    if residual is not None and (tuple(residual.shape) != (M, N) or residual.stride(1) != 1):
        _checks.fail("residual", f"shape {tuple(residual.shape)}", f"(M={M}, N={N}) with unit stride along N")
    _checks.check_same_device({k: v for k, v in named.items() if v is not None})


def decode_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    norm_weight: torch.Tensor | None = None,
    norm_bias: torch.Tensor | None = None,
    eps: float = 1e-5,
    gelu: bool = False,
    residual: torch.Tensor | None = None,
) -> torch.Tensor:
    """residual + gelu(layer_norm(x) @ weight.T + bias) for x (M <= MAX_ROWS, K), each part optional (the module
    docstring gives the math): y (M, N) in x's dtype. No gradient flows through it (decode only)."""
    compiling = torch.compiler.is_compiling()
    key = None if compiling else tensor_signature((x, weight, bias, norm_weight, norm_bias, residual))
    if key is None or key not in _CHECKED:
        _check(x, weight, bias, norm_weight, norm_bias, residual)
        if key is not None:
            if len(_CHECKED) >= MAX_LAUNCH_KEYS:
                _CHECKED.clear()
            _CHECKED.add(key)
    if compiling:
        return torch.ops.zoo.decode_linear(x, weight, bias, norm_weight, norm_bias, residual, float(eps), bool(gelu))
    # Eagerly the launch goes without the custom op's dispatch, whose host time is about the launch's own.
    return _run(x, weight, bias, norm_weight, norm_bias, residual, float(eps), bool(gelu), key)
