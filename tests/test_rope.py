"""rope_qkv against its math in fp32 and against the model's eager RoPE, forward and backward, on the CPU
(interpreter) and the GPU: MHA, GQA and MQA head counts, a head dim whose half is not a power of two, sequences
longer than a program's tile, per-row angles (a decode step), strided inputs and gradients, under torch.compile, the
op's registrations (opcheck), and every bad input."""

import pytest
import torch
from conftest import DEVICE, DTYPE_IDS, KERNEL_DTYPES, assert_close

import model as gpt
from attention_kernels import rope_qkv
from attention_kernels.reference import rope_qkv_reference
from attention_kernels.rope import _rope_qkv_op

SHAPES = {  # B, T, H, H_kv, D
    "mha": (2, 19, 4, 4, 16),
    "gqa": (2, 70, 4, 2, 32),  # two 64-token tiles on a GPU
    "mqa": (3, 5, 3, 1, 24),  # D/2 = 12: a masked half tile
    "decode": (4, 1, 2, 1, 8),
}


def _inputs(B, T, H, H_kv, D, dtype, per_row: bool):
    qkv = torch.randn(B, T, (H + 2 * H_kv) * D, device=DEVICE, dtype=dtype, requires_grad=True)
    # per_row: each row at its own positions, as a decode step's (B, T) positions give
    positions = torch.arange(T, device=DEVICE)[None] + (7 * torch.arange(B, device=DEVICE)[:, None] if per_row else 0)
    cos, sin = gpt.rope_cos_sin(positions, D, 10000.0)
    return qkv, cos, sin


@pytest.mark.parametrize("dtype", KERNEL_DTYPES, ids=DTYPE_IDS.get)
@pytest.mark.parametrize("per_row", [False, True], ids=["shared angles", "per-row angles"])
@pytest.mark.parametrize("shape", list(SHAPES), ids=str)
def test_matches_the_math(shape, per_row, dtype):
    B, T, H, H_kv, D = SHAPES[shape]
    qkv, cos, sin = _inputs(B, T, H, H_kv, D, dtype, per_row)
    got = rope_qkv(qkv, cos, sin, H, H_kv)
    ref = rope_qkv_reference(qkv.detach(), cos, sin, H, H_kv)
    for name, g, r, heads in zip("qkv", got, ref, (H, H_kv, H_kv)):
        assert g.shape == (B, T, heads, D) and g.dtype == dtype and g.is_contiguous()
        assert_close(g, r, dtype, name)
    # The backward is the inverse rotation; the gradients arrive in (B, H, T, D) memory, as attention's do.
    grads = [torch.randn(B, x.shape[2], T, D, device=DEVICE, dtype=dtype).transpose(1, 2) for x in got]
    (dqkv,) = torch.autograd.grad(got, qkv, grads)
    ref_qkv = qkv.detach().float().requires_grad_()
    (ref_dqkv,) = torch.autograd.grad(rope_qkv_reference(ref_qkv, cos, sin, H, H_kv), ref_qkv, grads)
    assert dqkv.shape == qkv.shape and dqkv.dtype == dtype
    assert_close(dqkv, ref_dqkv, dtype, "dqkv")


def test_equals_the_models_eager_rope():
    """The model's PyTorch path (split, view, apply_rope) computes the same q, k and v and the same gradient."""
    B, T, H, H_kv, D = SHAPES["gqa"]
    qkv, cos, sin = _inputs(B, T, H, H_kv, D, torch.float32, per_row=False)
    q, k, v = qkv.split([H * D, H_kv * D, H_kv * D], dim=2)
    eager = gpt.apply_rope(q.view(B, T, H, D), cos, sin), gpt.apply_rope(k.view(B, T, H_kv, D), cos, sin)
    eager += (v.view(B, T, H_kv, D),)
    got = rope_qkv(qkv, cos, sin, H, H_kv)
    grads = [torch.randn_like(x) for x in got]
    for g, e in zip(got, eager):
        assert_close(g, e, torch.float32, "forward")
    (dqkv,) = torch.autograd.grad(got, qkv, grads)
    (ref,) = torch.autograd.grad(eager, qkv, grads)
    assert_close(dqkv, ref, torch.float32, "dqkv")


def test_qkv_rows_with_a_stride():
    """qkv may be a slice of wider rows (the kernel reads it by its batch and token strides)."""
    B, T, H, H_kv, D = 2, 9, 2, 1, 16
    wide = torch.randn(B, T, (H + 2 * H_kv) * D + 24, device=DEVICE)
    qkv = wide[:, :, 8 : 8 + (H + 2 * H_kv) * D]
    _, cos, sin = _inputs(B, T, H, H_kv, D, torch.float32, per_row=False)
    for g, r in zip(rope_qkv(qkv, cos, sin, H, H_kv), rope_qkv_reference(qkv, cos, sin, H, H_kv)):
        assert_close(g, r, torch.float32, "strided qkv")


def test_compiled_forward_and_backward_equal_eager():
    """Under torch.compile(fullgraph=True) the op and its backward trace as the zoo custom ops, with the same
    numbers as the eager call."""
    B, T, H, H_kv, D = SHAPES["mha"]
    qkv, cos, sin = _inputs(B, T, H, H_kv, D, torch.float32, per_row=False)

    def f(qkv, cos, sin):
        q, k, v = rope_qkv(qkv, cos, sin, H, H_kv)
        return (q * 1.5).sum() + (k * k).sum() + v.sum()

    compiled = torch.compile(f, fullgraph=True, backend="aot_eager")
    (eager,) = torch.autograd.grad(f(qkv, cos, sin), qkv)
    (got,) = torch.autograd.grad(compiled(qkv, cos, sin), qkv)
    assert torch.equal(got, eager)


def test_op_registrations():
    """The fake (meta) outputs match the real ones and the autograd registration is sound (torch.library.opcheck)."""
    B, T, H, H_kv, D = SHAPES["mqa"]
    qkv, cos, sin = _inputs(B, T, H, H_kv, D, torch.float32, per_row=True)
    torch.library.opcheck(_rope_qkv_op, (qkv, cos, sin, H, H_kv))


def test_bad_inputs_fail_clearly():
    B, T, H, H_kv, D = 2, 5, 2, 1, 8
    qkv, cos, sin = _inputs(B, T, H, H_kv, D, torch.float32, per_row=False)
    qkv = qkv.detach()
    cases = [
        (dict(qkv=qkv[0]), "qkv: got shape (5, 32); valid: a 3-d tensor"),
        (dict(qkv=qkv[:, :0]), "qkv: got shape (2, 0, 32); valid: at least one sequence of at least one token"),
        (dict(qkv=qkv[..., :30]), "qkv: got last dim 30; valid: (n_head + 2 n_kv_head) = 4 heads of an even head dim"),
        (dict(qkv=qkv[..., :28]), "qkv: got last dim 28; valid: (n_head + 2 n_kv_head) = 4 heads of an even"),
        (dict(qkv=qkv.long()), "qkv: got dtype torch.int64"),
        (dict(qkv=qkv.transpose(1, 2).contiguous().transpose(1, 2)[:, :, :32]), "qkv: got strides"),
        (dict(n_head=0), "n_head: got 0; valid: an int >= 1"),
        (dict(n_kv_head=1.0), "n_kv_head: got 1.0; valid: an int >= 1"),
        (dict(cos=cos.half()), "cos: got dtype torch.float16; valid: torch.float32"),
        (dict(cos=cos[:, :4]), "cos: got shape (1, 4, 4); valid: (2 or 1, T=5, D/2=4)"),
        (dict(cos=cos.expand(3, T, D // 2)), "cos: got shape (3, 5, 4)"),
        (dict(sin=sin[0]), "sin: got shape (5, 4); valid: a 3-d tensor (B or 1, T, D/2)"),
        (dict(sin=sin.expand(2, T, D // 2)), "sin: got shape (2, 5, 4), strides (0, 4, 1); valid: cos's shape"),
    ]
    for change, message in cases:
        args = dict(qkv=qkv, cos=cos, sin=sin, n_head=H, n_kv_head=H_kv) | change
        with pytest.raises(ValueError) as err:
            rope_qkv(args["qkv"], args["cos"], args["sin"], args["n_head"], args["n_kv_head"])
        assert message in str(err.value), (change, str(err.value))


@pytest.mark.slow
@pytest.mark.parametrize("backward", [False, True], ids=["forward", "backward"])
def test_kernel_compiles_for_sm90_without_spills(backward):
    """The kernel as a GPT-2-small layer launches it on an H100/H200 (bf16, D = 64, 64-token tiles), compiled for
    sm_90 on any machine (`conftest.compile_gluon_sm90`): the compiler accepts what the interpreter ran, and ptxas
    spills nothing."""
    from conftest import compile_gluon_sm90, spill_bytes

    from attention_kernels import rope

    pointers = dict(PACKED="*bf16", Q="*bf16", K="*bf16", V="*bf16", COS="*fp32", SIN="*fp32")
    const = dict(H=12, H_KV=3, HALF=32, BLOCK_HALF=32, BLOCK_T=rope.BLOCK_T, BACKWARD=backward)
    result = compile_gluon_sm90("attention_kernels.rope", "_rope_qkv_kernel", pointers, const, gluon=False)
    assert spill_bytes(result["ptxas"]) == [(0, 0)], result["ptxas"]
