"""What every Gluon kernel for Hopper (sm_90) in this package shares: where they run, their TMA descriptors and the
register layout of a wgmma result.

The flash kernels (flash_sm90*.py), the paged grouped decode (decode_sm90.py) and the MLA decode (mla_sm90.py) are
written in Gluon, Triton's lower-level language, which states layouts, shared memory, barriers and warp roles
explicitly. Gluon is experimental and its API moves between Triton releases, so these kernels run only with the
release they were written and verified against (`on_hopper`); everywhere else the portable Triton kernels run.
"""

import functools

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor


@gluon.constexpr_function
def wgmma_layout(n):
    """The registers of a wgmma result of n columns over one warpgroup (four warps of 16 rows): every accumulator,
    score tile and probability tile of these kernels and mla_sm90.py's and decode_sm90.py's."""
    return gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, n, 16])


def on_hopper(t: torch.Tensor) -> bool:
    """Can Gluon's Hopper kernels (this module's and mla_sm90.py's) run on t's device? An sm_90 GPU, and
    the Triton release they were written and verified against (3.6): Gluon is experimental and its API moves
    between releases, so with another one the Triton kernels run."""
    return t.is_cuda and triton.__version__.startswith("3.6") and _is_sm90(t.device.index)


@functools.cache
def _is_sm90(device_index: int) -> bool:
    return torch.cuda.get_device_capability(device_index) == (9, 0)


def descriptor(t: torch.Tensor, block: list[int]) -> TensorDescriptor:
    """A TMA descriptor over t with its own strides, one `block` tile per copy, zero-filled outside the tensor
    (so a tile never reads the next head's or sequence's rows), in the NVMMA layout wgmma reads. Every caller has
    checked t with `_checks.tma_readable`, so this builds what `TensorDescriptor.from_tensor` builds without its
    checks (alignment, block shape), which cost about as much host time as the launch's own work per descriptor."""
    desc = TensorDescriptor.__new__(TensorDescriptor)
    desc.__dict__.update(
        base=t,
        shape=t.shape,
        strides=t.stride(),
        block_shape=block,
        layout=_nvmma_layout(tuple(block), t.dtype),
        padding="zero",
    )
    return desc


@functools.cache
def _nvmma_layout(block: tuple[int, ...], dtype: torch.dtype) -> gl.NVMMASharedLayout:
    """The shared-memory layout of a TMA tile, once per (block, dtype): building it costs more host time than
    the launch it is for (a backward takes ten to seventeen descriptors)."""
    gl_dtype = {torch.bfloat16: gl.bfloat16, torch.float16: gl.float16, torch.float32: gl.float32}[dtype]
    return gl.NVMMASharedLayout.get_default_for(list(block), gl_dtype)
