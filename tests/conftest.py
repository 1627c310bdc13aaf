"""Shared test setup. Without a GPU the Triton kernels run on CPU tensors under the interpreter; that switch must
be set before anything imports triton, which is why it lives here, at the top of the first file pytest loads."""

import os

import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"
    # The tests' tensors are tiny and the interpreter is single-threaded numpy: intra-op threads only add
    # synchronization, and on a busy 2-core machine spinning OpenMP workers made a tiny generate() ~50x slower.
    torch.set_num_threads(1)

import pytest  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"

# bf16 gives garbage under the triton 3.6 interpreter (see GPU.md), so the CPU tests fp32 and fp16 and the GPU
# tests fp16 and bf16: every kernel test runs on both machines, each with the dtypes that machine computes right.
KERNEL_DTYPES = [torch.float16, torch.bfloat16] if DEVICE == "cuda" else [torch.float32, torch.float16]

# Tolerances against the fp32 reference, per input dtype. The kernels round P (the softmax numerator) to the
# input dtype before the P@V product, as every flash kernel does, so the error is that of one rounding of P
# and of V: ~2^-8 relative for bf16, ~2^-11 for fp16; fp32 inputs use tf32-free fp32 dots on the interpreter.
TOLERANCES = {
    torch.float32: dict(atol=2e-4, rtol=2e-4),
    torch.float16: dict(atol=2e-3, rtol=2e-3),
    torch.bfloat16: dict(atol=1.6e-2, rtol=1.6e-2),
}
# Gradients sum many rounded products (dS has the rounding of P and of dP), so they get 4x the forward's budget.
GRAD_TOLERANCES = {dt: dict(atol=4 * t["atol"], rtol=4 * t["rtol"]) for dt, t in TOLERANCES.items()}


def assert_close(got: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype, name: str, grad: bool = False):
    """assert_close on fp32 values with the dtype's tolerance; the message gives max and mean error."""
    tol = (GRAD_TOLERANCES if grad else TOLERANCES)[dtype]
    got32, ref32 = got.float(), ref.float()
    assert not torch.isnan(got32).any(), f"{name}: NaN in the output"
    err = (got32 - ref32).abs()
    bound = tol["atol"] + tol["rtol"] * ref32.abs()
    bad = err > bound
    if bad.any():
        raise AssertionError(
            f"{name} ({dtype}): {int(bad.sum())}/{err.numel()} elements out of tolerance "
            f"(atol={tol['atol']}, rtol={tol['rtol']}); max err {err.max().item():.3e}, "
            f"mean err {err.mean().item():.3e}, max |ref| {ref32.abs().max().item():.3e}"
        )


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


# ---------------------------------------------------------------------------------------- decode-kernel tests


@pytest.fixture
def poison_decode_outputs(monkeypatch):
    """Outputs and split partials of the decode kernels start as NaN: an element a kernel forgets to write fails
    the NaN check of assert_close."""
    from kernels import decode

    def poisoned(shape, device, dtype):
        return torch.full(shape, float("nan"), device=device, dtype=dtype)

    monkeypatch.setattr(decode, "new_empty", poisoned)


def ragged_lens(batch: int, s_max: int) -> torch.Tensor:
    """Sequence lengths in [1, s_max] on DEVICE (int32) that always include s_max and 1 (when batch allows)."""
    lens = torch.randint(1, s_max + 1, (batch,))
    lens[0] = s_max
    if batch > 1:
        lens[1] = 1
    return lens.to(torch.int32).to(DEVICE)
