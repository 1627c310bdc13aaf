"""Triton attention kernels: differentiable flash attention for training, and grouped, paged and MLA decode.

Every op is a `torch.library` custom op (traceable by torch.compile with fullgraph=True; eager flash calls use
an equivalent autograd.Function, which costs less host time), validates its inputs
before launching (ValueError naming the argument, what it got and what is valid), and has a plain PyTorch
reference in `attention_kernels.reference`. On a machine without a GPU the same kernels run on CPU tensors under
`TRITON_INTERPRET=1`. On Hopper (sm_90, Triton 3.6) the flash forward and backward, the 512 + 64 MLA decode
(64-head tiles, contiguous or paged) and paged grouped decode run warp-specialized Gluon kernels instead
(`attention_kernels.flash_sm90`, `attention_kernels.mla_sm90`, `attention_kernels.decode_sm90`), behind the same ops.
"""

from attention_kernels import reference
from attention_kernels.decode import grouped_decode, paged_grouped_decode
from attention_kernels.flash import flash_gqa_attention, flash_gqa_backward, flash_gqa_forward
from attention_kernels.mla import mla_decode, paged_mla_decode

__all__ = [
    "flash_gqa_attention",
    "flash_gqa_forward",
    "flash_gqa_backward",
    "grouped_decode",
    "paged_grouped_decode",
    "mla_decode",
    "paged_mla_decode",
    "reference",
]
