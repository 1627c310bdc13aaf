"""decode_linear against its math in fp32, on the CPU (interpreter) and the GPU: every combination of bias, layer
norm (with and without its bias), GELU and residual, one to MAX_ROWS rows, widths that are not powers of two, rows
with a stride, under torch.compile, and every bad input; and the one-row tiles compiled for sm_90 on any machine."""

import pytest
import torch
from conftest import DEVICE, DTYPE_IDS, KERNEL_DTYPES, assert_close

from attention_kernels.projections import MAX_ROWS, decode_linear
from attention_kernels.reference import decode_linear_reference as _reference

PARTS = {
    "plain": dict(),
    "bias": dict(bias=True),
    "norm": dict(norm=True),
    "norm+gelu": dict(norm=True, norm_bias=True, bias=True, gelu=True),
    "residual": dict(bias=True, residual=True),
    "everything": dict(norm=True, norm_bias=True, bias=True, gelu=True, residual=True),
}


def _inputs(M, K, N, dtype, parts):
    x = torch.randn(M, K, device=DEVICE, dtype=dtype)
    weight = (torch.randn(N, K, device=DEVICE) / K**0.5).to(dtype)
    given = dict(
        bias=torch.randn(N, device=DEVICE, dtype=dtype) if parts.get("bias") else None,
        norm_weight=(1 + 0.1 * torch.randn(K, device=DEVICE)).to(dtype) if parts.get("norm") else None,
        norm_bias=(0.1 * torch.randn(K, device=DEVICE)).to(dtype) if parts.get("norm_bias") else None,
        gelu=bool(parts.get("gelu")),
        residual=torch.randn(M, N, device=DEVICE, dtype=dtype) if parts.get("residual") else None,
    )
    return x, weight, given


@pytest.mark.parametrize("dtype", KERNEL_DTYPES, ids=DTYPE_IDS.get)
@pytest.mark.parametrize("parts", list(PARTS), ids=str)
@pytest.mark.parametrize("M, K, N", [(1, 96, 130), (3, 40, 24), (MAX_ROWS, 64, 72), (2, 1100, 40)])
def test_matches_the_unfused_math(dtype, parts, M, K, N):
    """K = 1100 takes the one-row-a-program tile (K > 1024) and pads the row to 2048."""
    x, weight, given = _inputs(M, K, N, dtype, PARTS[parts])
    bias = given.pop("bias")
    y = decode_linear(x, weight, bias, **given)
    assert y.shape == (M, N) and y.dtype == dtype
    assert_close(y, _reference(x, weight, bias, **given), dtype, f"decode_linear {parts}")


def test_rows_with_a_stride():
    """x and the residual may be row slices of wider tensors (the kernel reads them by their row stride)."""
    wide_x, wide_r = torch.randn(3, 80, device=DEVICE), torch.randn(3, 50, device=DEVICE)
    x, residual = wide_x[:, 8:72], wide_r[:, :30]
    weight, bias = torch.randn(30, 64, device=DEVICE) / 8, torch.randn(30, device=DEVICE)
    norm_weight = torch.rand(64, device=DEVICE) + 0.5
    y = decode_linear(x, weight, bias, norm_weight=norm_weight, residual=residual)
    assert_close(
        y, _reference(x, weight, bias, norm_weight=norm_weight, residual=residual), torch.float32, "strided rows"
    )


def test_compiled_call_goes_through_the_custom_op():
    """Under torch.compile(fullgraph=True) decode_linear traces as the zoo::decode_linear op (eagerly it launches
    directly) and computes what the eager call does."""
    x, weight, given = _inputs(2, 48, 20, torch.float32, PARTS["everything"])
    bias = given.pop("bias")
    eager = decode_linear(x, weight, bias, **given)
    compiled = torch.compile(
        lambda x, w, b, g, s, r: decode_linear(x, w, b, norm_weight=g, norm_bias=s, gelu=True, residual=r),
        fullgraph=True,
        backend="aot_eager",
    )
    got = compiled(x, weight, bias, given["norm_weight"], given["norm_bias"], given["residual"])
    assert torch.equal(got, eager)


def test_bad_inputs_fail_clearly():
    x, weight = torch.randn(2, 16, device=DEVICE), torch.randn(8, 16, device=DEVICE)
    cases = [
        (dict(x=torch.randn(MAX_ROWS + 1, 16, device=DEVICE)), f"x: got {MAX_ROWS + 1} rows; valid: 1 to {MAX_ROWS}"),
        (dict(x=x[None]), "x: got shape (1, 2, 16); valid: a 2-d tensor (M, K)"),
        (dict(weight=weight[:, :12]), "weight: got shape (8, 12); valid: (N, K=16) as x's K"),
        (dict(weight=weight.t().contiguous().t()), "weight: got strides (1, 8); valid: unit stride along K"),
        (dict(weight=weight.half()), "weight: got dtype torch.float16; valid: x's dtype torch.float32"),
        (dict(bias=torch.randn(7, device=DEVICE)), "bias: got shape (7,), strides (1,); valid: a contiguous tensor"),
        (dict(norm_bias=torch.randn(16, device=DEVICE)), "norm_bias: got a tensor without norm_weight"),
        (dict(residual=torch.randn(2, 7, device=DEVICE)), "residual: got shape (2, 7); valid: (M=2, N=8)"),
        (dict(x=x.int()), "x: got dtype torch.int32; valid: torch.float16, torch.bfloat16 or torch.float32"),
    ]
    for change, message in cases:
        args = {**dict(x=x, weight=weight), **change}
        extra = {k: v for k, v in args.items() if k not in ("x", "weight", "bias")}
        with pytest.raises(ValueError) as err:
            decode_linear(args["x"], args["weight"], args.get("bias"), **extra)
        assert message in str(err.value), (change, str(err.value))


@pytest.mark.slow
@pytest.mark.parametrize("K, block_n, warps", [(768, 2, 4), (3072, 1, 8)])
def test_one_row_tiles_compile_for_sm90_without_spills(K, block_n, warps):
    """The kernel as the model launches it at one row on an H100/H200 (every part on, a programmatic dependent launch),
    compiled for sm_90 on any machine (`conftest.compile_gluon_sm90`): the compiler accepts it (the interpreter
    runs what the compiler refuses, such as a plain Python global inside the kernel) and ptxas spills nothing."""
    from conftest import compile_gluon_sm90, spill_bytes

    from attention_kernels import projections

    assert projections._tile(1, 3072, K, torch.device("cuda")) == (block_n, warps)
    pointers = dict(X="*bf16", W="*bf16", BIAS="*bf16", NORM_W="*bf16", NORM_B="*bf16", RES="*bf16", Y="*bf16")
    parts = dict(HAS_BIAS=True, NORM=True, HAS_NORM_BIAS=True, GELU=True, HAS_RES=True, WAIT=True)
    const = dict(M=1, K=K, BLOCK_N=block_n, BLOCK_K=projections.next_power_of_2(K), **parts)
    result = compile_gluon_sm90(
        "attention_kernels.projections",
        "_decode_linear_kernel",
        dict(pointers, eps="fp32"),
        const,
        options=dict(num_warps=warps),
        gluon=False,
    )
    assert "griddepcontrol.wait" in result["ptx"], "no wait for the previous kernel: WAIT did not reach the PTX"
    assert spill_bytes(result["ptxas"]) == [(0, 0)], result["ptxas"]
