"""Flash attention for Hopper (sm_90) in Gluon: which inputs the warp-specialized kernels take, and their launchers.

Same math, inputs and outputs as the Triton kernels of flash.py, which launches these instead on an sm_90 GPU
(Triton 3.6) for fp16/bf16 inputs with TMA-readable strides:
- the forward (`forward`, flash_sm90_fwd.py) for D_qk == D_v = 128 and 64 (causal D = 64 from MIN_KEYS keys) and
  for MLA's D_qk / D_v = 192 / 128 and 96 / 64;
- the backward for the same pairs in two launches, dQ (`backward_dq`, flash_sm90_bwd_dq.py) then dK/dV
  (`backward_dkdv`, flash_sm90_bwd_dkdv.py), or at D = 128 and 64 in one launch (`backward_fused`,
  flash_sm90_bwd_fused.py) where `fused_backward_wins`.
The portable Triton kernels run everywhere else (other GPUs and head dims, fp32, the CPU interpreter, other Triton
releases). ZOO_FLASH_SM90=0 turns these kernels off; ZOO_FLASH_SM90_BWD picks the backward (`backward_mode`).

Why a second set of kernels: in the Triton-language kernels the warps that compute also issue their own loads, all
in the same phase of the loop, so the tensor cores idle during every softmax, and Triton 3.6's automatic warp
specialization does not apply to them. Gluon, Triton's lower-level language, states layouts, shared memory,
barriers and warp roles explicitly, so these kernels have FlashAttention-3's structure (Shah et al. 2024): a TMA
loader warp and two consumer warpgroups per program (flash_sm90_common.py). On an H200 they take the D = 128
forward from 315-501 to 417-607 TFLOP/s and the backward from 242-408 to 319-487 (benchmarks/RESULTS.md).

Gluon has no CPU interpreter, so these kernels' numerics are tested on the GPU (every forward and backward test in
tests/test_flash.py runs through them on an H100/H200); on the CPU, tests/test_flash.py compiles them for sm_90 and
checks their structure (warp roles, registers, shared memory, spills).
"""

import os

import torch

from attention_kernels import _checks
from attention_kernels.flash_sm90_bwd_dkdv import BWD_CONFIGS, backward_dkdv, dkdv_config
from attention_kernels.flash_sm90_bwd_dq import DQ_CONFIGS, backward_dq
from attention_kernels.flash_sm90_bwd_fused import FUSED_PAIRS, backward_fused, fused_dq_block
from attention_kernels.flash_sm90_common import (
    PROGRAM_ROWS,
    ROWS_PER_CONSUMER,
    SMEM_PER_PROGRAM,
    padded_rows,
    qk_tiles,
    staged_grads,
)
from attention_kernels.flash_sm90_fwd import CONFIGS, forward, forward_smem
from attention_kernels.sm90 import descriptor, on_hopper, wgmma_layout

__all__ = [
    "BWD_CONFIGS",
    "CONFIGS",
    "DQ_CONFIGS",
    "FUSED_PAIRS",
    "MIN_KEYS",
    "PROGRAM_ROWS",
    "ROWS_PER_CONSUMER",
    "SMEM_PER_PROGRAM",
    "backward_dkdv",
    "backward_dq",
    "backward_fused",
    "backward_mode",
    "descriptor",
    "dkdv_config",
    "eligible",
    "enabled",
    "forward",
    "forward_smem",
    "fused_backward_wins",
    "fused_dq_block",
    "on_hopper",
    "padded_rows",
    "qk_tiles",
    "staged_grads",
    "supports",
    "supports_backward",
    "wgmma_layout",
]


# Fewest keys for which flash._forward prefers the Hopper forward, per (head dim, causal); 0 where absent. At D=64
# a short causal tile has too few key blocks to hide its start and end: on an H200 the Hopper forward is ahead of
# the Triton kernel from 1024 keys causal and at every length otherwise (benchmarks/RESULTS.md).
MIN_KEYS = {
    (64, True): 1024,
}


def enabled() -> bool:
    """ZOO_FLASH_SM90=0 turns these kernels off (flash.py then uses the Triton kernels on Hopper too)."""
    return os.environ.get("ZOO_FLASH_SM90", "1") != "0"


def supports(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool) -> bool:
    """Does flash._forward launch this kernel for these inputs? On an sm_90 GPU, when `eligible` and there are at
    least MIN_KEYS keys."""
    return enabled() and on_hopper(q) and eligible(q, k, v) and k.shape[2] >= MIN_KEYS.get((q.shape[-1], causal), 0)


def backward_mode() -> str:
    """ZOO_FLASH_SM90_BWD: "1" (default) runs the one-launch backward where `fused_backward_wins`, else dQ in
    `backward_dq` and dK/dV in `backward_dkdv` where the latter's programs fill about a wave of the SMs
    (`flash._hopper_dkdv`; else the Triton dK/dV kernel, which can split a KV group's heads over programs); "force"
    runs the two Gluon launches wherever they can (tests); "fused" the one-launch backward wherever it can
    (FUSED_PAIRS; elsewhere as "force"); "0" keeps the whole backward on the Triton kernels."""
    mode = os.environ.get("ZOO_FLASH_SM90_BWD", "1")
    if mode not in ("0", "1", "force", "fused"):
        raise ValueError(
            f"ZOO_FLASH_SM90_BWD={mode!r}: expected 0 (off), 1 (on; dK/dV where it fills a wave, one "
            "launch where it is faster), force (two launches everywhere) or fused (one launch wherever "
            "it can)"
        )
    return mode


def supports_backward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, do: torch.Tensor) -> bool:
    """Can `backward_dq` run these inputs (and `backward_dkdv`, where (D_qk, D_v) is in BWD_CONFIGS too)? On an
    sm_90 GPU, `eligible` with (D_qk, D_v) in DQ_CONFIGS and dO TMA-readable too (its shape and dtype are out's,
    checked by the caller)."""
    return (
        enabled()
        and on_hopper(q)
        and (q.shape[-1], v.shape[-1]) in DQ_CONFIGS
        and eligible(q, k, v)
        and _checks.tma_readable(do)
    )


def eligible(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
    """fp16/bf16, (D_qk, D_v) in CONFIGS, and strides TMA can read (`_checks.tma_readable`)."""
    if q.dtype not in (torch.float16, torch.bfloat16) or (q.shape[-1], v.shape[-1]) not in CONFIGS:
        return False
    if k.shape[-1] != q.shape[-1]:
        return False
    return all(_checks.tma_readable(t) for t in (q, k, v))


def fused_backward_wins(d: int, d_v: int, causal: bool, s_kv: int, group: int, programs: int, sms: int) -> bool:
    """Does `flash._backward` take the one-launch backward (`backward_fused`) instead of the two launches? Where its
    programs (128 keys of a KV head each) fill a wave of the SMs: full attention at every length; causal from 4096
    keys with at most 4 query heads per KV head at D = 128 and from 16384 keys with 5-8; at D = 64 from 8192 keys, or
    where the group's query heads times the keys reach 16384 (groups of 4 from 4096 keys, of 8 from 2048).

    These are the shapes where the one launch measured faster on an H200, the whole backward on the GPU alone
    (benchmarks/RESULTS.md). Below them its fixed costs, a pre-pass and the final cast of dQ (about 0.24 ms per
    2^19 query rows of 128 columns), weigh more than its five products per step save against the two launches'
    seven; groups of 8 need longer sequences because their programs' reads and dQ adds spill out of L2."""
    if (d, d_v) not in FUSED_PAIRS or programs < sms:
        return False
    if not causal:
        return True
    if d == 64:
        return s_kv >= 8192 or group * s_kv >= 16384
    return s_kv >= 4096 and group <= 4 or s_kv >= 16384 and group <= 8
