"""Triton attention kernels: differentiable flash attention for training, and grouped, paged and MLA decode, with
the kernels around them that a step needs: the cache write, the few-row projections of a decode step, RoPE on the
fused projection's heads, and the output head's cross-entropy.

Every op is a `torch.library` custom op (traceable by torch.compile with fullgraph=True; eager flash calls use an
equivalent autograd.Function, which costs less host time), validates its inputs before launching (ValueError naming
the argument, what it got and what is valid), and has a plain PyTorch reference in `attention_kernels.reference`.
On a machine without a GPU the same kernels run on CPU tensors under `TRITON_INTERPRET=1`. On Hopper (sm_90,
Triton 3.6) the flash forward and backward, the 512 + 64 MLA decode and paged grouped decode run warp-specialized
Gluon kernels instead, behind the same ops.

Modules (each imports only those above it):
    _checks, _host, schedule   input validation; host helpers (device queries, launches); the launch order
    reference                  the plain PyTorch math every test compares against
    flash                      flash_gqa_attention / _forward / _backward: the op, its launchers and autograd
    flash_triton               the portable Triton flash kernels (forward, dQ, dK/dV)
    flash_sm90                 which inputs the Hopper flash kernels take, and their launchers:
      flash_sm90_fwd, flash_sm90_bwd_dq, flash_sm90_bwd_dkdv, flash_sm90_bwd_fused, flash_sm90_common
    sm90                       what every Hopper (Gluon) kernel shares: on_hopper, TMA descriptors, wgmma layout
    split_kv                   split-KV decode (Flash-Decoding) pieces shared by decode and mla
    decode, decode_sm90        grouped_decode / paged_grouped_decode; the Hopper paged kernel
    mla, mla_sm90              mla_decode / paged_mla_decode; the Hopper MLA kernels; mla_decode_inputs: a decode
                               step's absorbed query, RoPE parts, latent norm and cache write, one launch
    cache_write                write_tokens: a new token's two halves into a KV cache, one launch
    projections                decode_linear: a decode step's projection of a few rows with its norm, GELU and
                               residual add, one launch
    rope                       rope_qkv: the fused projection's heads split and q, k rotated, one launch (and one
                               for the gradient)
    loss                       linear_cross_entropy: the output head's loss with its gradient formed in the forward
"""

from attention_kernels import reference
from attention_kernels.cache_write import write_tokens
from attention_kernels.decode import grouped_decode, paged_grouped_decode
from attention_kernels.flash import flash_gqa_attention, flash_gqa_backward, flash_gqa_forward
from attention_kernels.loss import linear_cross_entropy
from attention_kernels.mla import mla_decode, mla_decode_inputs, paged_mla_decode
from attention_kernels.projections import decode_linear
from attention_kernels.rope import rope_qkv

__all__ = [
    "flash_gqa_attention",
    "flash_gqa_forward",
    "flash_gqa_backward",
    "grouped_decode",
    "paged_grouped_decode",
    "mla_decode",
    "paged_mla_decode",
    "mla_decode_inputs",
    "write_tokens",
    "decode_linear",
    "rope_qkv",
    "linear_cross_entropy",
    "reference",
]
