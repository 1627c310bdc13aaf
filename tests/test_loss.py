"""linear_cross_entropy against F.linear + F.cross_entropy in fp32, loss and gradients, on the CPU (interpreter) and
the GPU: vocabularies of one block and of several (with a ragged last one), ignored targets, a scaled loss (gradient
accumulation), under autocast and torch.compile, the op's registrations (opcheck), and every bad input."""

import math

import pytest
import torch
import torch.nn.functional as F
from conftest import DEVICE, DTYPE_IDS, KERNEL_DTYPES, assert_close

from attention_kernels import linear_cross_entropy
from attention_kernels.loss import MAX_BLOCK_V, NUM_WARPS, _linear_cross_entropy_op
from attention_kernels.reference import linear_cross_entropy_reference


def _inputs(N, C, V, dtype, ignored=(3,)):
    x = torch.randn(N, C, device=DEVICE, dtype=dtype, requires_grad=True)
    weight = (torch.randn(V, C, device=DEVICE) / C**0.5).to(dtype).requires_grad_()
    targets = torch.randint(0, V, (N,), device=DEVICE)
    targets[list(ignored)] = -1
    return x, weight, targets


def _reference(x, weight, targets, scale: float):
    """The unfused head in fp32: (logits, loss, dx, dweight) of scale * loss."""
    x32, w32 = x.detach().float().requires_grad_(), weight.detach().float().requires_grad_()
    logits, loss = linear_cross_entropy_reference(x32, w32, targets)
    (scale * loss).backward()
    return logits, loss, x32.grad, w32.grad


@pytest.mark.parametrize("dtype", KERNEL_DTYPES, ids=DTYPE_IDS.get)
@pytest.mark.parametrize("V", [96, 1000, MAX_BLOCK_V * 2 + 100], ids=lambda v: f"V{v}")
def test_matches_linear_then_cross_entropy(V, dtype):
    """The last vocabulary is three blocks, the last of 100 entries; a loss scaled by 1/3 (three accumulated
    micro-steps) scales both gradients."""
    N, C = 9 if V > MAX_BLOCK_V else 37, 16
    x, weight, targets = _inputs(N, C, V, dtype)
    logits, loss = linear_cross_entropy(x, weight, targets)
    (loss / 3).backward()
    ref_logits, ref_loss, ref_dx, ref_dw = _reference(x, weight, targets, 1 / 3)
    assert logits.shape == (N, V) and logits.dtype == dtype and not logits.requires_grad
    assert loss.shape == () and loss.dtype == torch.float32
    assert_close(logits, ref_logits, dtype, "logits")
    assert_close(loss, ref_loss, dtype, "loss")
    assert_close(x.grad, ref_dx, dtype, "dx", grad=True)
    assert_close(weight.grad, ref_dw, dtype, "dweight", grad=True)


@pytest.mark.filterwarnings("ignore:divide by zero")  # the interpreter's numpy, on the all-ignored 0/0
def test_ignored_rows_count_for_nothing():
    """A row whose target is ignore_index adds no loss and no gradient; with every row ignored the mean is 0/0 = NaN,
    as F.cross_entropy's, and the gradients are zero."""
    x, weight, targets = _inputs(6, 8, 50, torch.float32, ignored=(0, 4))
    _, loss = linear_cross_entropy(x, weight, targets)
    loss.backward()
    assert x.grad[[0, 4]].abs().max() == 0
    kept = [1, 2, 3, 5]
    ref = F.cross_entropy((x[kept] @ weight.t()).float(), targets[kept])
    assert_close(loss, ref, torch.float32, "loss of the kept rows")
    x.grad = None
    _, loss = linear_cross_entropy(x, weight, torch.full_like(targets, -1))
    loss.backward()
    assert math.isnan(loss.item()) and x.grad.abs().max() == 0


def test_fp16_under_a_grad_scaler_keeps_its_gradients():
    """fp16 training multiplies the loss by GradScaler's scale (65,536 at first): the gradients come back that many
    times larger and finite, as accurate as the unfused head's in fp16. The kernel stores softmax - one-hot
    unscaled; divided by the 512 rows first, a row's small probabilities would flush to zero in fp16."""
    x, weight, targets = _inputs(512, 32, 4096, torch.float16, ignored=())
    _, loss = linear_cross_entropy(x, weight, targets)
    (loss * 65536.0).backward()
    _, _, ref_dx, ref_dw = _reference(x, weight, targets, 65536.0)
    for name, got, ref in (("dx", x.grad, ref_dx), ("dweight", weight.grad, ref_dw)):
        assert torch.isfinite(got).all(), name
        rel = (got.float() - ref).norm() / ref.norm()
        assert rel < 2e-3, f"{name}: relative error {rel:.2e}"  # fp16's 2^-11 rounding of the inputs and products


def test_strided_targets():
    """targets may be a strided view (the kernel reads a contiguous copy)."""
    x, weight, _ = _inputs(6, 8, 50, torch.float32, ignored=())
    every_other = torch.randint(0, 50, (12,), device=DEVICE)[::2]
    _, loss = linear_cross_entropy(x, weight, every_other)
    assert_close(loss, F.cross_entropy((x @ weight.t()).float(), every_other), torch.float32, "loss")


def test_a_target_outside_the_vocabulary_makes_the_loss_nan():
    x, weight, targets = _inputs(4, 8, 50, torch.float32, ignored=())
    targets[2] = 50
    _, loss = linear_cross_entropy(x, weight, targets)
    assert math.isnan(loss.item())


def test_autocast_multiplies_in_the_autocast_dtype():
    """Under autocast the fp32 weights and inputs are multiplied in the autocast dtype, as F.linear would, and their
    gradients come back in fp32 (bf16 on the GPU; fp16 on the CPU, whose interpreter computes bf16 wrong)."""
    dtype = torch.bfloat16 if DEVICE == "cuda" else torch.float16
    x, weight, targets = _inputs(33, 64, 3000, torch.float32)
    with torch.autocast(DEVICE, dtype=dtype):
        logits, loss = linear_cross_entropy(x, weight, targets)
        ref = F.cross_entropy(F.linear(x, weight).float(), targets, ignore_index=-1)
    assert logits.dtype == dtype and x.grad is None
    loss.backward()
    assert x.grad.dtype == weight.grad.dtype == torch.float32
    assert_close(loss, ref, dtype, "loss")


def test_compiled_forward_and_backward_equal_eager():
    """Under torch.compile(fullgraph=True) the head traces as the zoo custom op, with the eager call's numbers."""
    x, weight, targets = _inputs(12, 16, 200, torch.float32)

    def f(x, weight, targets):
        return linear_cross_entropy(x, weight, targets)[1] * 0.5

    compiled = torch.compile(f, fullgraph=True, backend="aot_eager")
    eager = torch.autograd.grad(f(x, weight, targets), (x, weight))
    got = torch.autograd.grad(compiled(x, weight, targets), (x, weight))
    for g, e in zip(got, eager):
        assert torch.equal(g, e)


def test_op_registrations():
    """The fake (meta) outputs match the real ones and the autograd registration is sound (torch.library.opcheck)."""
    x, weight, targets = _inputs(5, 8, 40, torch.float32)
    torch.library.opcheck(_linear_cross_entropy_op, (x, weight, targets, -1))


def test_bad_inputs_fail_clearly():
    x, weight, targets = _inputs(4, 8, 30, torch.float32)
    x, weight = x.detach(), weight.detach()
    cases = [
        (dict(x=x[None]), "x: got shape (1, 4, 8); valid: a 2-d tensor (N, C)"),
        (dict(weight=weight[:, :6]), "weight: got shape (30, 6); valid: (V >= 1, C=8) as x's C"),
        (dict(weight=weight[:0]), "weight: got shape (0, 8); valid: (V >= 1, C=8) as x's C"),
        (dict(weight=weight.half()), "weight: got dtype torch.float16; valid: the dtype of x, torch.float32"),
        (dict(targets=targets.int()), "targets: got torch.int32 of shape (4,); valid: an int64 tensor of shape (4,)"),
        (dict(targets=targets[:3]), "targets: got torch.int64 of shape (3,); valid: an int64 tensor of shape (4,)"),
        (dict(ignore_index=-1.0), "ignore_index: got -1.0; valid: an int"),
    ]
    for change, message in cases:
        args = dict(x=x, weight=weight, targets=targets, ignore_index=-1) | change
        with pytest.raises(ValueError) as err:
            linear_cross_entropy(**args)
        assert message in str(err.value), (change, str(err.value))


@pytest.mark.slow
def test_kernel_compiles_for_sm90_without_spills():
    """The kernel as GPT-2's head launches it on an H100/H200 (bf16 logits, 50,304 entries a row),
    compiled for sm_90 on any machine (`conftest.compile_gluon_sm90`): the compiler accepts what the interpreter ran,
    and ptxas spills nothing."""
    from conftest import compile_gluon_sm90, spill_bytes

    pointers = dict(LOGITS="*bf16", TARGETS="*i64", LOSS="*fp32", DLOGITS="*bf16")
    const = dict(V=50304, BLOCK_V=MAX_BLOCK_V)
    result = compile_gluon_sm90(
        "attention_kernels.loss",
        "_cross_entropy_kernel",
        dict(pointers, stride_l="i64", stride_d="i64"),
        const,
        options=dict(num_warps=NUM_WARPS),
        gluon=False,
    )
    assert spill_bytes(result["ptxas"]) == [(0, 0)], result["ptxas"]
