"""The flash-attention forward for Hopper (sm_90), warp-specialized, in Gluon: FlashAttention-3's structure.

Same math, inputs and outputs as `flash._flash_fwd_kernel` (see kernels/flash.py); `flash._forward` launches this
kernel instead on an sm_90 GPU for fp16/bf16 with D_qk == D_v in CONFIGS (128) and TMA-compatible strides, and
the portable Triton kernel everywhere else (other GPUs and head dims, fp32, the CPU interpreter).

Why a second kernel: the Triton-language forward stops at 440-490 TFLOP/s at D=128 on an H200, while SDPA runs at
530-690. Its warps issue their own loads and all run the same phase of the loop at the same time, so the tensor
cores idle during every softmax. Triton 3.6's automatic warp specialization does not apply to that kernel (see
flash.py). Gluon, Triton's lower-level language, states the layouts, shared memory, barriers and warp roles
explicitly, so the kernel can have FlashAttention-3's structure (Shah et al. 2024):

- one program per (128 query rows, query head, batch), in three warp roles (`gl.warp_specialize`):
  - a loader warp streams Q once and K/V blocks through TMA into a ring of STAGES shared-memory buffers, waiting
    on an mbarrier until the consumers have released a buffer before it refills it;
  - two consumer warpgroups of four warps, each owning 64 query rows: Q K^T and P V on the tensor cores (wgmma),
    the online softmax in registers. The loader warp gives its registers to them (setmaxnreg: 24 for the loader,
    240 per consumer thread).
- inside a consumer, the scores of key block j+1 are issued before P V of block j, and the softmax of block j+1
  runs while that P V is on the tensor cores (FlashAttention-3's intra-warpgroup overlap); P stays in registers
  as the A operand of the P V wgmma.
- causal masking: blocks wholly above the diagonal are never loaded; only blocks on the diagonal or past the
  sequence end are masked (a runtime branch per block), with one compare per score against a per-row limit.

Measured on an H200 beside SDPA (bf16, H_q 32 / H_kv 8, D 128, TFLOP/s; benchmarks/RESULTS.md has the grid): B4
S4096 causal 559 (Triton kernel 453, SDPA 611), full 605 (479, 624); B1 S16384 causal 614 (484, 584). Tried and
dropped, each beside this kernel in one run: FlashAttention-3's ping-pong between the two consumers (an mbarrier
token passed so that one warpgroup's products run during the other's softmax): within +-3%, no consistent gain; a
persistent schedule (one program per SM walking the tiles, the loader streaming the next tile during the
epilogue): +10-13% at S 1024 (B16 causal 404-409 vs 359-364) but -15% for MHA (B4 H32/32 causal 456-460 vs 527-547),
as tiles that share K/V no longer run side by side, and its causal consumer spills registers; with the tiles
ordered to share K/V it kept only the full-attention gains (B16 S1024 full 544 vs 491). The two-compare mask
(causal and sequence end separately) measured 3% slower at B4 S4096 causal (539 vs 559).

The backward's dK/dV (`backward_dkdv`, opt-in with ZOO_FLASH_SM90_BWD=1) has the same roles: a loader warp
streams the Q and dO blocks of every query head of the KV group through a two-stage ring, and two consumer
warpgroups each own 64 key rows and compute transposed products (key rows as the wgmma's M): S^T = K Q^T, then
dP^T = V dO^T issued together with dV += P^T dO, then dK += dS^T Q. dQ and delta stay in the Triton dQ kernel.
Measured beside the Triton dK/dV in one run on an H200 (whole backward, TFLOP/s, H_q 32, D 128): B4 H_kv 8 S4096
causal 373 vs 353 (SDPA 457), full 411 vs 414, B16 S1024 causal 276 vs 241, B1 S16384 causal 417 vs 414, MHA
B4 S4096 causal 372 vs 361. At 64-query blocks the consumers spill a little (ptxas: 140-300 bytes); 32-query
blocks do not spill but ran at 322-366, below the Triton kernel. It is off by default until the GPU test suite
has run it on its small and ragged shapes (tests/test_flash.py::test_sm90_backward_dkdv forces it).

Gluon has no CPU interpreter, so this kernel's numerics are tested on the GPU (every forward test in
tests/test_flash.py runs through it on an H100/H200); on the CPU, tests/test_flash.py compiles it for sm_90 and
checks its structure (warp roles, registers, shared memory).
"""

import functools
import os

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from kernels import _checks

ROWS_PER_CONSUMER = 64  # query rows per consumer warpgroup: the M of one wgmma
ROWS = gl.constexpr(ROWS_PER_CONSUMER)
CONSUMERS = gl.constexpr(2)  # consumer warpgroups per program
PROGRAM_ROWS = 2 * ROWS_PER_CONSUMER  # rows a program owns: query rows in the forward, key rows in dK/dV
LOADER_REGS = gl.constexpr(24)
# The SM's 64K registers over three warpgroups once the loader's keeps 24 per thread: (512 - 24) / 2 = 244,
# rounded down to setmaxnreg's multiple of 8.
CONSUMER_REGS = gl.constexpr(240)

# Per head dim: (BLOCK_N, STAGES), measured on an H200 (see benchmarks/RESULTS.md).
# D=64 stays on the Triton kernel: at B4 S4096 this kernel measured 390 TFLOP/s causal against 396, and at B16
# S1024 240 against 313.
CONFIGS = {
    128: (128, 3),
}


@gluon.jit
def _loader(q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_ready, k_ready, v_ready, kv_free,
            batch, head, kv_head, start_m, n_blocks, BLOCK_N: gl.constexpr, STAGES: gl.constexpr):
    """One warp: each consumer's Q rows once, then K and V of every key block into the ring. Block j goes into
    stage j % STAGES once every consumer has released that stage's previous block (j - STAGES) on kv_free."""
    for c in gl.static_range(CONSUMERS):
        mbarrier.expect(q_ready.index(c), q_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(q_desc, [batch, head, start_m + c * ROWS, 0], q_ready.index(c),
                                        q_smem.index(c))
    for j in range(n_blocks):
        s = j % STAGES
        # The (j // STAGES)-th reuse of stage s waits for the release of the previous one (phase parity).
        mbarrier.wait(kv_free.index(s), ((j // STAGES) & 1) ^ 1, pred=j >= STAGES)
        mbarrier.expect(k_ready.index(s), k_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(k_desc, [batch, kv_head, j * BLOCK_N, 0], k_ready.index(s), k_smem.index(s))
        mbarrier.expect(v_ready.index(s), v_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(v_desc, [batch, kv_head, j * BLOCK_N, 0], v_ready.index(s), v_smem.index(s))


@gluon.jit
def _mask(s, j, n_unmasked, start_m, q_shift, N, CAUSAL: gl.constexpr, BLOCK_N: gl.constexpr,
          s_layout: gl.constexpr):
    """Scores of key block j with the causal diagonal and the sequence end masked; blocks before n_unmasked are
    wholly visible to every row of the program and pass through untouched."""
    if j >= n_unmasked:
        offs_n = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
        limit = N - j * BLOCK_N
        if CAUSAL:
            rows = q_shift + start_m + 1 - j * BLOCK_N + gl.arange(0, ROWS, layout=gl.SliceLayout(1, s_layout))
            s = gl.where(offs_n[None, :] < gl.minimum(rows, limit)[:, None], s, -float("inf"))
        else:
            s = gl.where(offs_n[None, :] < limit, s, -float("inf"))
    return s


@gluon.jit
def _consumer(q_smem, k_smem, v_smem, q_ready, k_ready, v_ready, kv_free, out_ptr, lse_ptr,
              stride_ob, stride_oh, stride_om, stride_od, stride_lb, stride_lh, stride_lm,
              batch, head, start_m, M, N, n_blocks, n_unmasked, q_shift, qk_scale,
              WG: gl.constexpr, CAUSAL: gl.constexpr, BLOCK_N: gl.constexpr, D: gl.constexpr,
              STAGES: gl.constexpr):
    """One warpgroup: online softmax over the key blocks for query rows [start_m + WG*64, +64)."""
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, BLOCK_N, 16])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, D, 16])
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    row_o: gl.constexpr = gl.SliceLayout(1, o_layout)
    dtype: gl.constexpr = q_smem.dtype
    start_m = start_m + WG * ROWS
    q = q_smem.index(WG).reshape([ROWS, D])

    mbarrier.wait(q_ready.index(WG), 0)
    m_i = gl.full([ROWS], -float("inf"), gl.float32, gl.SliceLayout(1, s_layout))
    acc = gl.zeros([ROWS, D], gl.float32, o_layout)
    s = gl.zeros([ROWS, BLOCK_N], gl.float32, s_layout)

    # Key block 0: its scores alone.
    mbarrier.wait(k_ready.index(0), 0)
    s = warpgroup_mma(q, k_smem.index(0).reshape([BLOCK_N, D]).permute((1, 0)), s, use_acc=False, is_async=True)
    s = warpgroup_mma_wait(num_outstanding=0, deps=[s])
    s = _mask(s, 0, n_unmasked, start_m, q_shift, N, CAUSAL, BLOCK_N, s_layout)
    m_i = gl.maximum(m_i, gl.max(s, 1) * qk_scale)
    p = gl.exp2(s * qk_scale - m_i[:, None])
    l_i = gl.sum(p, 1)
    p_op = gl.convert_layout(p.to(dtype), p_layout)

    for j in range(1, n_blocks):
        st = j % STAGES
        prev = (j - 1) % STAGES
        mbarrier.wait(k_ready.index(st), (j // STAGES) & 1)
        mbarrier.wait(v_ready.index(prev), ((j - 1) // STAGES) & 1)
        # Scores of block j go into the registers of block j-1's dead fp32 probabilities (use_acc=False).
        s = warpgroup_mma(q, k_smem.index(st).reshape([BLOCK_N, D]).permute((1, 0)), p, use_acc=False,
                          is_async=True)
        acc = warpgroup_mma(p_op, v_smem.index(prev).reshape([BLOCK_N, D]), acc, is_async=True)
        s = warpgroup_mma_wait(num_outstanding=1, deps=[s])  # the scores are in; P V of block j-1 may still run
        s = _mask(s, j, n_unmasked, start_m, q_shift, N, CAUSAL, BLOCK_N, s_layout)
        m_ij = gl.maximum(m_i, gl.max(s, 1) * qk_scale)
        p = gl.exp2(s * qk_scale - m_ij[:, None])
        alpha = gl.exp2(m_i - m_ij)
        l_i = l_i * alpha + gl.sum(p, 1)
        acc = warpgroup_mma_wait(num_outstanding=0, deps=[acc])
        mbarrier.arrive(kv_free.index(prev), count=1)  # K and V of block j-1 are no longer read
        acc = acc * gl.convert_layout(alpha, row_o)[:, None]
        m_i = m_ij
        p_op = gl.convert_layout(p.to(dtype), p_layout)

    last = (n_blocks - 1) % STAGES
    mbarrier.wait(v_ready.index(last), ((n_blocks - 1) // STAGES) & 1)
    acc = warpgroup_mma(p_op, v_smem.index(last).reshape([BLOCK_N, D]), acc, is_async=True)
    acc = warpgroup_mma_wait(num_outstanding=0, deps=[acc])
    mbarrier.arrive(kv_free.index(last), count=1)

    # Every row sees at least key 0 (bottom-right alignment, S_q <= S_kv), so l_i > 0; padding rows (past M,
    # zero-filled by TMA) are finite too and never stored.
    out = acc / gl.convert_layout(l_i, row_o)[:, None]
    lse = (m_i + gl.log2(l_i)) * 0.6931471805599453  # natural log
    offs_m = start_m + gl.arange(0, ROWS, layout=row_o)
    offs_d = gl.arange(0, D, layout=gl.SliceLayout(0, o_layout))
    o_ptrs = out_ptr + batch.to(gl.int64) * stride_ob + head.to(gl.int64) * stride_oh \
        + offs_m[:, None] * stride_om + offs_d[None, :] * stride_od
    gl.store(o_ptrs, out.to(dtype), mask=(offs_m < M)[:, None])
    offs_l = start_m + gl.arange(0, ROWS, layout=gl.SliceLayout(1, s_layout))
    l_ptrs = lse_ptr + batch.to(gl.int64) * stride_lb + head.to(gl.int64) * stride_lh + offs_l * stride_lm
    gl.store(l_ptrs, lse, mask=offs_l < M)


@gluon.jit
def _flash_fwd_sm90_kernel(
    q_desc, k_desc, v_desc, out_ptr, lse_ptr,
    stride_ob, stride_oh, stride_om, stride_od, stride_lb, stride_lh, stride_lm,
    M, N, qk_scale,
    GROUP_SIZE: gl.constexpr, CAUSAL: gl.constexpr, BLOCK_N: gl.constexpr, D: gl.constexpr,
    STAGES: gl.constexpr,
):
    BLOCK_M: gl.constexpr = CONSUMERS * ROWS
    # Causal programs run heaviest first (the last query blocks see the most keys).
    pid_m = gl.num_programs(0) - 1 - gl.program_id(0) if CAUSAL else gl.program_id(0)
    head = gl.program_id(1)
    batch = gl.program_id(2)
    kv_head = head // GROUP_SIZE
    start_m = pid_m * BLOCK_M
    q_shift = N - M  # query row i sits at key position q_shift + i
    if CAUSAL:
        n_end = gl.minimum(N, q_shift + start_m + BLOCK_M)
        n_unmasked = gl.minimum((q_shift + start_m + 1) // BLOCK_N, N // BLOCK_N)
    else:
        n_end = N
        n_unmasked = N // BLOCK_N
    n_blocks = gl.cdiv(n_end, BLOCK_N)

    q_smem = gl.allocate_shared_memory(q_desc.dtype, [CONSUMERS] + q_desc.block_type.shape, q_desc.layout)
    k_smem = gl.allocate_shared_memory(k_desc.dtype, [STAGES] + k_desc.block_type.shape, k_desc.layout)
    v_smem = gl.allocate_shared_memory(v_desc.dtype, [STAGES] + v_desc.block_type.shape, v_desc.layout)
    q_ready = gl.allocate_shared_memory(gl.int64, [CONSUMERS, 1], mbarrier.MBarrierLayout())
    k_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    v_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    kv_free = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for c in gl.static_range(CONSUMERS):
        mbarrier.init(q_ready.index(c), count=1)
    for i in gl.static_range(STAGES):
        mbarrier.init(k_ready.index(i), count=1)
        mbarrier.init(v_ready.index(i), count=1)
        mbarrier.init(kv_free.index(i), count=CONSUMERS)  # one arrival per consumer warpgroup
    fence_async_shared()

    # The default partition (this program's own four warps) is consumer 0; the others are worker partitions.
    # Worker arguments cannot be constexprs computed here, so every value is passed explicitly.
    gl.warp_specialize([
        (_consumer, (q_smem, k_smem, v_smem, q_ready, k_ready, v_ready, kv_free, out_ptr, lse_ptr,
                     stride_ob, stride_oh, stride_om, stride_od, stride_lb, stride_lh, stride_lm,
                     batch, head, start_m, M, N, n_blocks, n_unmasked, q_shift, qk_scale,
                     gl.constexpr(0), CAUSAL, BLOCK_N, D, STAGES)),
        (_consumer, (q_smem, k_smem, v_smem, q_ready, k_ready, v_ready, kv_free, out_ptr, lse_ptr,
                     stride_ob, stride_oh, stride_om, stride_od, stride_lb, stride_lh, stride_lm,
                     batch, head, start_m, M, N, n_blocks, n_unmasked, q_shift, qk_scale,
                     gl.constexpr(1), CAUSAL, BLOCK_N, D, STAGES)),
        (_loader, (q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_ready, k_ready, v_ready, kv_free,
                   batch, head, kv_head, start_m, n_blocks, BLOCK_N, STAGES)),
    ], [4, 1], [CONSUMER_REGS, LOADER_REGS])


# --------------------------------------------------------------------------------------------------------------
# Launcher
# --------------------------------------------------------------------------------------------------------------


def enabled() -> bool:
    """ZOO_FLASH_SM90=0 turns this kernel off (flash._forward then uses the Triton kernel on Hopper too). Gluon is
    experimental and its API moves between Triton releases, so the kernel runs only on the release it was written
    and verified against (3.6); with another one the Triton kernel runs."""
    return os.environ.get("ZOO_FLASH_SM90", "1") != "0" and triton.__version__.startswith("3.6")


@functools.cache
def _is_sm90(device_index: int) -> bool:
    return torch.cuda.get_device_capability(device_index) == (9, 0)


def supports(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
    """Does flash._forward launch this kernel for these inputs? On an sm_90 GPU, when `eligible`."""
    return q.is_cuda and enabled() and _is_sm90(q.device.index) and eligible(q, k, v)


def backward_mode() -> str:
    """ZOO_FLASH_SM90_BWD: "0" (default) keeps dK/dV on the Triton kernel; "1" runs `backward_dkdv` where its
    launch fills the GPU; "force" wherever it can run (tests). Off by default: it was measured and checked against
    the Triton kernel on the benchmark's shapes only (see benchmarks/RESULTS.md), not yet through the GPU test
    suite's small and ragged shapes."""
    mode = os.environ.get("ZOO_FLASH_SM90_BWD", "0")
    if mode not in ("0", "1", "force"):
        raise ValueError(f"ZOO_FLASH_SM90_BWD={mode!r}: expected 0 (off), 1 (on where it fills the GPU) or force")
    return mode


def supports_backward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, do: torch.Tensor) -> bool:
    """Can `backward_dkdv` run these inputs? As `supports`, with dO TMA-readable too (its shape and dtype are q's,
    checked by the caller)."""
    return supports(q, k, v) and _checks.tma_readable(do)


def eligible(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
    """fp16/bf16, D_qk == D_v in CONFIGS, and strides TMA can read (`_checks.tma_readable`)."""
    if q.dtype not in (torch.float16, torch.bfloat16) or q.shape[-1] not in CONFIGS:
        return False
    if k.shape[-1] != q.shape[-1] or v.shape[-1] != q.shape[-1]:
        return False
    return all(_checks.tma_readable(t) for t in (q, k, v))


def _descriptor(t: torch.Tensor, rows: int) -> TensorDescriptor:
    """A 4-d descriptor over (B, H, S, D) with its own strides: one (rows, D) tile of one (batch, head) per copy,
    zero-filled past the sequence end (so a tile never reads the next head's rows)."""
    dtype = gl.bfloat16 if t.dtype == torch.bfloat16 else gl.float16
    block = [1, 1, rows, t.shape[-1]]
    return TensorDescriptor.from_tensor(t, block, gl.NVMMASharedLayout.get_default_for(block, dtype))


def forward(q, k, v, out, lse, qk_scale: float, causal: bool, config=None):
    """Launch on inputs `supports` accepted; out (B, H_q, S_q, D) and lse (B, H_q, S_q) fp32 any strides.
    qk_scale is the softmax scale times log2(e). `config` overrides CONFIGS (benchmarks)."""
    b, h_q, s_q, d = q.shape
    h_kv, s_kv = k.shape[1], k.shape[2]
    block_n, stages = config or CONFIGS[d]
    grid = (triton.cdiv(s_q, PROGRAM_ROWS), h_q, b)
    _flash_fwd_sm90_kernel[grid](
        _descriptor(q, ROWS_PER_CONSUMER), _descriptor(k, block_n), _descriptor(v, block_n), out, lse,
        *out.stride(), *lse.stride(), s_q, s_kv, qk_scale,
        GROUP_SIZE=h_q // h_kv, CAUSAL=causal, BLOCK_N=block_n, D=d, STAGES=stages, num_warps=4,
    )


# --------------------------------------------------------------------------------------------------------------
# Backward: dK and dV
# --------------------------------------------------------------------------------------------------------------


@gluon.jit
def _bwd_loader(q_desc, do_desc, k_desc, v_desc, q_smem, do_smem, k_smem, v_smem, kv_ready, q_ready, do_ready,
                qdo_free, batch, kv_head, start_n, m_start, n_m,
                GROUP_SIZE: gl.constexpr, BLOCK_M: gl.constexpr, STAGES: gl.constexpr):
    """One warp: the program's K and V block once, then Q and dO of every (query head of the group, query block)
    into a ring of STAGES buffers, in the consumers' order."""
    mbarrier.expect(kv_ready, k_desc.block_type.nbytes + v_desc.block_type.nbytes)
    tma.async_copy_global_to_shared(k_desc, [batch, kv_head, start_n, 0], kv_ready, k_smem)
    tma.async_copy_global_to_shared(v_desc, [batch, kv_head, start_n, 0], kv_ready, v_smem)
    it = 0
    for hh in range(GROUP_SIZE):
        head = kv_head * GROUP_SIZE + hh
        for m in range(m_start, n_m):
            s = it % STAGES
            mbarrier.wait(qdo_free.index(s), ((it // STAGES) & 1) ^ 1, pred=it >= STAGES)
            mbarrier.expect(q_ready.index(s), q_desc.block_type.nbytes)
            tma.async_copy_global_to_shared(q_desc, [batch, head, m * BLOCK_M, 0], q_ready.index(s), q_smem.index(s))
            mbarrier.expect(do_ready.index(s), do_desc.block_type.nbytes)
            tma.async_copy_global_to_shared(do_desc, [batch, head, m * BLOCK_M, 0], do_ready.index(s),
                                            do_smem.index(s))
            it += 1


@gluon.jit
def _bwd_consumer(q_smem, do_smem, k_smem, v_smem, kv_ready, q_ready, do_ready, qdo_free,
                  lse_ptr, delta_ptr, dk_ptr, dv_ptr,
                  stride_lb, stride_lh, stride_lm, stride_db, stride_dh, stride_dm,
                  stride_kb, stride_kh, stride_kn, stride_kd, stride_vb, stride_vh, stride_vn, stride_vd,
                  batch, kv_head, start_n, m_start, n_m, M, N, sm_scale, qk_scale,
                  WG: gl.constexpr, GROUP_SIZE: gl.constexpr, CAUSAL: gl.constexpr, BLOCK_M: gl.constexpr,
                  D: gl.constexpr, STAGES: gl.constexpr):
    """One warpgroup: dK and dV of key rows [start_n + WG*64, +64), summed over every query head of the KV group
    and every query block. Transposed products, so the key rows are the M of every wgmma:
    S^T = K Q^T, P^T = exp2(S^T - lse), dP^T = V dO^T, dS^T = P^T (dP^T - delta), dV += P^T dO, dK += dS^T Q."""
    st_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                        instr_shape=[16, BLOCK_M, 16])
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                         instr_shape=[16, D, 16])
    op_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=acc_layout, k_width=2)
    cols: gl.constexpr = gl.SliceLayout(0, st_layout)  # one value per query row of the block
    vec: gl.constexpr = gl.BlockedLayout([1], [32], [4], [0])
    dtype: gl.constexpr = q_smem.dtype
    k_wg = k_smem.reshape([CONSUMERS * ROWS, D]).slice(WG * ROWS, ROWS)
    v_wg = v_smem.reshape([CONSUMERS * ROWS, D]).slice(WG * ROWS, ROWS)
    kv0 = start_n + WG * ROWS
    kv_pos = kv0 + gl.arange(0, ROWS, layout=gl.SliceLayout(1, st_layout))
    q_shift = N - M  # query row i sits at key position q_shift + i
    dk = gl.zeros([ROWS, D], gl.float32, acc_layout)
    dv = gl.zeros([ROWS, D], gl.float32, acc_layout)
    scratch = gl.zeros([ROWS, BLOCK_M], gl.float32, st_layout)
    mbarrier.wait(kv_ready, 0)
    it = 0
    for hh in range(GROUP_SIZE):
        head = kv_head * GROUP_SIZE + hh
        lse_base = lse_ptr + batch.to(gl.int64) * stride_lb + head.to(gl.int64) * stride_lh
        delta_base = delta_ptr + batch.to(gl.int64) * stride_db + head.to(gl.int64) * stride_dh
        for m in range(m_start, n_m):
            s = it % STAGES
            phase = (it // STAGES) & 1
            # lse and delta of the block's query rows, loaded one per thread and then spread to the columns of the
            # score tile (a load in the tile's own layout needs a 64-bit address per element: 32 registers more).
            # Rows past the sequence get lse = +inf, so their P is 0 (their Q and dO tiles are zero-filled).
            offs_q = m * BLOCK_M + gl.arange(0, BLOCK_M, layout=vec)
            lse = gl.load(lse_base + offs_q * stride_lm, mask=offs_q < M, other=float("inf")) * 1.4426950408889634
            delta = gl.load(delta_base + offs_q * stride_dm, mask=offs_q < M, other=0.0)
            lse = gl.convert_layout(lse, cols)
            delta = gl.convert_layout(delta, cols)
            mbarrier.wait(q_ready.index(s), phase)
            q_t = q_smem.index(s).reshape([BLOCK_M, D])
            # S^T goes into the registers of the previous step's dead dP^T (use_acc=False), and dP^T below into
            # those of S^T, dead once P is out: one 64 x BLOCK_M fp32 tile serves both.
            st = warpgroup_mma(k_wg, q_t.permute((1, 0)), scratch, use_acc=False, is_async=True)
            st = warpgroup_mma_wait(num_outstanding=0, deps=[st])
            pt = gl.exp2(st * qk_scale - lse[None, :])
            if CAUSAL:
                if q_shift + m * BLOCK_M < start_n + CONSUMERS * ROWS - 1:  # the block crosses the diagonal
                    # key row r is visible to query column c of the block when c >= first[r]
                    first = kv_pos - q_shift - m * BLOCK_M
                    pt = gl.where(gl.arange(0, BLOCK_M, layout=cols)[None, :] >= first[:, None], pt, 0.0)
            pt = pt.to(dtype)
            mbarrier.wait(do_ready.index(s), phase)
            do_t = do_smem.index(s).reshape([BLOCK_M, D])
            # dP^T first: wgmma groups complete in order, so waiting for all but the newest (dV) waits for dP^T.
            dpt = warpgroup_mma(v_wg, do_t.permute((1, 0)), st, use_acc=False, is_async=True)
            dv = warpgroup_mma(gl.convert_layout(pt, op_layout), do_t, dv, is_async=True)
            dpt = warpgroup_mma_wait(num_outstanding=1, deps=[dpt])  # dP^T in; dV may still run
            dst = pt.to(gl.float32) * (dpt - delta[None, :])
            dk = warpgroup_mma(gl.convert_layout(dst.to(dtype), op_layout), q_t, dk, is_async=True)
            dv, dk = warpgroup_mma_wait(num_outstanding=0, deps=[dv, dk])
            mbarrier.arrive(qdo_free.index(s), count=1)  # Q and dO of this step are no longer read
            scratch = dpt
            it += 1

    offs_n = kv0 + gl.arange(0, ROWS, layout=gl.SliceLayout(1, acc_layout))
    offs_d = gl.arange(0, D, layout=gl.SliceLayout(0, acc_layout))
    rows_ok = (offs_n < N)[:, None]
    dk_ptrs = dk_ptr + batch.to(gl.int64) * stride_kb + kv_head.to(gl.int64) * stride_kh \
        + offs_n[:, None] * stride_kn + offs_d[None, :] * stride_kd
    gl.store(dk_ptrs, (dk * sm_scale).to(dk_ptr.dtype.element_ty), mask=rows_ok)
    dv_ptrs = dv_ptr + batch.to(gl.int64) * stride_vb + kv_head.to(gl.int64) * stride_vh \
        + offs_n[:, None] * stride_vn + offs_d[None, :] * stride_vd
    gl.store(dv_ptrs, dv.to(dv_ptr.dtype.element_ty), mask=rows_ok)


@gluon.jit
def _flash_bwd_dkdv_sm90_kernel(
    q_desc, do_desc, k_desc, v_desc, lse_ptr, delta_ptr, dk_ptr, dv_ptr,
    stride_lb, stride_lh, stride_lm, stride_db, stride_dh, stride_dm,
    stride_kb, stride_kh, stride_kn, stride_kd, stride_vb, stride_vh, stride_vn, stride_vd,
    M, N, sm_scale, qk_scale,
    GROUP_SIZE: gl.constexpr, CAUSAL: gl.constexpr, BLOCK_M: gl.constexpr, D: gl.constexpr,
    STAGES: gl.constexpr,
):
    """One program per (128 key rows, KV head, batch)."""
    start_n = gl.program_id(0) * (CONSUMERS * ROWS)
    kv_head = gl.program_id(1)
    batch = gl.program_id(2)
    n_m = gl.cdiv(M, BLOCK_M)
    if CAUSAL:  # query blocks wholly before the program's first key see none of its keys
        m_start = gl.maximum(start_n - (N - M), 0) // BLOCK_M
    else:
        m_start = 0

    q_smem = gl.allocate_shared_memory(q_desc.dtype, [STAGES] + q_desc.block_type.shape, q_desc.layout)
    do_smem = gl.allocate_shared_memory(do_desc.dtype, [STAGES] + do_desc.block_type.shape, do_desc.layout)
    k_smem = gl.allocate_shared_memory(k_desc.dtype, k_desc.block_type.shape, k_desc.layout)
    v_smem = gl.allocate_shared_memory(v_desc.dtype, v_desc.block_type.shape, v_desc.layout)
    kv_ready = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    q_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    do_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    qdo_free = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    mbarrier.init(kv_ready, count=1)
    for i in gl.static_range(STAGES):
        mbarrier.init(q_ready.index(i), count=1)
        mbarrier.init(do_ready.index(i), count=1)
        mbarrier.init(qdo_free.index(i), count=CONSUMERS)
    fence_async_shared()

    gl.warp_specialize([
        (_bwd_consumer, (q_smem, do_smem, k_smem, v_smem, kv_ready, q_ready, do_ready, qdo_free,
                         lse_ptr, delta_ptr, dk_ptr, dv_ptr,
                         stride_lb, stride_lh, stride_lm, stride_db, stride_dh, stride_dm,
                         stride_kb, stride_kh, stride_kn, stride_kd, stride_vb, stride_vh, stride_vn, stride_vd,
                         batch, kv_head, start_n, m_start, n_m, M, N, sm_scale, qk_scale,
                         gl.constexpr(0), GROUP_SIZE, CAUSAL, BLOCK_M, D, STAGES)),
        (_bwd_consumer, (q_smem, do_smem, k_smem, v_smem, kv_ready, q_ready, do_ready, qdo_free,
                         lse_ptr, delta_ptr, dk_ptr, dv_ptr,
                         stride_lb, stride_lh, stride_lm, stride_db, stride_dh, stride_dm,
                         stride_kb, stride_kh, stride_kn, stride_kd, stride_vb, stride_vh, stride_vn, stride_vd,
                         batch, kv_head, start_n, m_start, n_m, M, N, sm_scale, qk_scale,
                         gl.constexpr(1), GROUP_SIZE, CAUSAL, BLOCK_M, D, STAGES)),
        (_bwd_loader, (q_desc, do_desc, k_desc, v_desc, q_smem, do_smem, k_smem, v_smem, kv_ready, q_ready,
                       do_ready, qdo_free, batch, kv_head, start_n, m_start, n_m, GROUP_SIZE, BLOCK_M, STAGES)),
    ], [4, 1], [CONSUMER_REGS, LOADER_REGS])


BWD_BLOCK_M, BWD_STAGES = 64, 2  # query rows per streamed block, ring stages


def backward_dkdv(q, k, v, do, lse, delta, dk, dv, sm_scale: float, causal: bool, config=None):
    """dK and dV into dk (B, H_kv, S_kv, D) and dv; q, k, v, do as `supports` accepted them (and do too), lse and
    delta (B, H_q, S_q) fp32, delta = rowsum(dO * Out) - dlse as the dQ kernel wrote it."""
    b, h_q, s_q, d = q.shape
    h_kv, s_kv = k.shape[1], k.shape[2]
    block_m, stages = config or (BWD_BLOCK_M, BWD_STAGES)
    grid = (triton.cdiv(s_kv, PROGRAM_ROWS), h_kv, b)
    _flash_bwd_dkdv_sm90_kernel[grid](
        _descriptor(q, block_m), _descriptor(do, block_m), _descriptor(k, PROGRAM_ROWS), _descriptor(v, PROGRAM_ROWS),
        lse, delta, dk, dv,
        *lse.stride(), *delta.stride(), *dk.stride(), *dv.stride(),
        s_q, s_kv, sm_scale, sm_scale * 1.4426950408889634,
        GROUP_SIZE=h_q // h_kv, CAUSAL=causal, BLOCK_M=block_m, D=d, STAGES=stages, num_warps=4,
    )
