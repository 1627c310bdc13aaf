"""Flash attention backward in one launch for Hopper (sm_90) in Gluon, at D = 128 and 64: the dK/dV program also
takes dQ (FlashAttention-3's backward, Shah et al. 2024).

Math as the two launches' (flash_sm90_bwd_dq.py, flash_sm90_bwd_dkdv.py), with dQ summed in fp32 over the key
blocks by the programs that own them:

    per step (query head, query block of BLOCK_M rows):   dK, dV as in the dK/dV kernel,   dQ += scale * dS K

Each step, each consumer stores its dS^T (64 keys x the step's queries) into a shared buffer of the tile's 128
keys, and once both halves are in computes its 64 x 64 share of dQ = dS K (`_fused_dq`): with 64-query steps
(D = 128) every query row and half the columns, with 128-query steps (D = 64) half the rows and every column. It
stages the scaled share in shared memory, and a writer warp adds it into an fp32 dQ by TMA reduce-add
(`_async_reduce_add`), releasing each buffer once the reduce has read it: five products per step instead of the two
launches' seven, and no recomputed P. A Triton pre-pass (`_fused_prep_kernel`) writes delta and lse2 and zeroes the
fp32 dQ, which a final cast copies into dq. Causal programs walk their query blocks from the last down, the group's
heads inside each (`_fused_step`), so that every program of a (batch, KV head) adds into the same dQ tiles at the
same time, in L2.

dQ's fp32 sum is taken in the order the programs finish, so its last bits may differ from call to call; flash.py
keeps the two launches under torch.use_deterministic_algorithms.
"""

import torch
import triton
import triton.language as tl
from triton._C.libtriton import ir
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language._core import builtin
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)

from attention_kernels._host import LOG2E, cdiv, launcher
from attention_kernels.flash_sm90_common import (
    CONSUMER_REGS,
    CONSUMERS,
    LOADER_REGS,
    PROGRAM_ROWS,
    ROWS,
    ROWS_PER_CONSUMER,
    causal_mask_t,
    dkdv_tile,
    issue_scores_t,
    load_qdo,
    padded_rows,
    staged_grads,
    tile_descriptor,
)
from attention_kernels.schedule import bucket_size
from attention_kernels.sm90 import descriptor, wgmma_layout


@builtin
def _async_reduce_add(tensor_desc, coord, src, _semantic=None):
    """TMA bulk reduce-add of a shared-memory tile into global memory (`cp.reduce.async.bulk.tensor...add`),
    completed like a TMA store (`tma.store_wait`). Gluon 3.6's `tma` modules (Hopper's and Blackwell's) do not wrap
    the op; its op builder has it, which this reaches (FlashAttention-3 adds dQ the same way)."""
    coord = _semantic._convert_to_ir_values(coord, require_i64=False)
    _semantic.builder.create_async_tma_reduce(ir.DESCRIPTOR_REDUCE_KIND.ADD, tensor_desc.handle, coord, src.handle)


@gluon.jit
def _fused_step(t, kv_head, m_start, n_m, GROUP_SIZE: gl.constexpr, CAUSAL: gl.constexpr):
    """(query head, query block) of a one-launch program's step t. Full attention: head by head, query blocks in
    order. Causal: query blocks from the last down, the group's heads inside each, so that every program of a
    (batch, KV head) walks the same dQ tiles at the same time (each stops at its own first block) and their
    reduce-adds meet in L2. Groups of more than 4 (even) take two such passes, each over half the heads: a
    program's window of Q, dO and dQ tiles per query block is then a group of 4's."""
    if CAUSAL:
        if GROUP_SIZE > 4 and GROUP_SIZE % 2 == 0:
            HALF: gl.constexpr = GROUP_SIZE // 2
            per_pass = HALF * (n_m - m_start)
            second = (t >= per_pass).to(gl.int32)
            u = t - second * per_pass
            return kv_head * GROUP_SIZE + second * HALF + u % HALF, n_m - 1 - u // HALF
        else:
            return kv_head * GROUP_SIZE + t % GROUP_SIZE, n_m - 1 - t // GROUP_SIZE
    else:
        nb = n_m - m_start
        return kv_head * GROUP_SIZE + t // nb, m_start + t % nb


@gluon.jit
def _fused_loader(
    q_desc,
    do_desc,
    k_desc,
    v_desc,
    lse_desc,
    delta_desc,
    q_smem,
    do_smem,
    k_smem,
    v_smem,
    lse_smem,
    delta_smem,
    kv_ready,
    q_ready,
    do_ready,
    qdo_free,
    batch,
    kv_head,
    start_n,
    m_start,
    n_m,
    H,
    M_PAD,
    GROUP_SIZE: gl.constexpr,
    CAUSAL: gl.constexpr,
    BLOCK_M: gl.constexpr,
    STAGES: gl.constexpr,
):
    """One warp: the tile's K and V, then each step's Q (with its rows' lse2 and delta, on Q's barrier) and dO into
    the ring, in `_fused_step`'s order."""
    mbarrier.expect(kv_ready.index(0), k_desc.block_type.nbytes + v_desc.block_type.nbytes)
    tma.async_copy_global_to_shared(k_desc, [batch, kv_head, start_n, 0], kv_ready.index(0), k_smem.index(0))
    tma.async_copy_global_to_shared(v_desc, [batch, kv_head, start_n, 0], kv_ready.index(0), v_smem.index(0))
    for it in range(GROUP_SIZE * (n_m - m_start)):
        head, m = _fused_step(it, kv_head, m_start, n_m, GROUP_SIZE, CAUSAL)
        load_qdo(
            q_desc,
            q_desc,
            do_desc,
            lse_desc,
            delta_desc,
            q_smem,
            q_smem,
            do_smem,
            lse_smem,
            delta_smem,
            q_ready,
            do_ready,
            qdo_free,
            it,
            batch,
            head,
            m,
            H,
            M_PAD,
            BLOCK_M,
            STAGES,
            0,
        )


@gluon.jit
def _fused_dq(
    u,
    ds_smem,
    k_tile,
    dq_smem,
    ds_ready,
    dq_ready,
    dq_free,
    sm_scale,
    WG: gl.constexpr,
    BLOCK_M: gl.constexpr,
    D: gl.constexpr,
):
    """Consumer WG, step u: its share of the step's dQ = dS K over the tile's 128 keys (dS^T of both warpgroups
    from shared memory, the wgmma's A read transposed), scaled, into this warpgroup's staging buffer (two,
    alternating) for the writer warp. The share is a 64 x 64 product (`fused_dq_block`): with 64-query steps (D = 128)
    every query row and this warpgroup's D/2 columns, with 128-query steps (D = 64) this warpgroup's 64 query rows
    and every column."""
    SPLIT_ROWS: gl.constexpr = BLOCK_M > ROWS
    DQ_M: gl.constexpr = BLOCK_M // CONSUMERS if SPLIT_ROWS else BLOCK_M
    DQ_N: gl.constexpr = D if SPLIT_ROWS else D // 2
    dq_layout: gl.constexpr = wgmma_layout(DQ_N)
    b = u % 2
    mbarrier.wait(ds_ready.index(b), (u // 2) & 1)  # the other warpgroup's half of dS^T is in too
    qb = WG * 2 + b
    mbarrier.wait(dq_free.index(qb), ((u // 2) & 1) ^ 1, pred=u >= 2)  # the writer's reduce has read it
    if SPLIT_ROWS:
        ds_t = ds_smem.index(b).slice(WG * DQ_M, DQ_M, dim=1).permute((1, 0))
        k_op = k_tile
    else:
        ds_t = ds_smem.index(b).permute((1, 0))
        k_op = k_tile.slice(WG * DQ_N, DQ_N, dim=1)
    dq = warpgroup_mma(ds_t, k_op, gl.zeros([DQ_M, DQ_N], gl.float32, dq_layout), use_acc=False, is_async=True)
    dq = warpgroup_mma_wait(num_outstanding=0, deps=[dq])  # (the next step's S^T, issued before, completes too)
    dq_smem.index(qb).reshape([DQ_M, DQ_N]).store(dq * sm_scale)
    fence_async_shared()
    mbarrier.arrive(dq_ready.index(qb), count=1)


@gluon.jit
def _fused_kv(k_smem, v_smem, m, M, WG: gl.constexpr, BLOCK_M: gl.constexpr, D: gl.constexpr):
    """The one-launch consumer's K tile (128 keys), and its warpgroup's 64 rows of K and V, as the step with query
    block m reads them. Their buffer index is always 0 (block m starts before row M), but the compiler cannot know
    it, so the wgmma descriptors are rebuilt each step from the buffer's address by a few integer instructions.
    Built once before the loop, as loop invariants, they would stay live across it, and ptxas, short of registers,
    would spill other loop invariants (60-92 bytes at D = 128) and reload 5-11 values a step: rebuilt, they leave
    D = 128 without spills and the backward faster (benchmarks/RESULTS.md)."""
    kv = (m * BLOCK_M >= M).to(gl.int32)
    k_tile = k_smem.index(kv).reshape([CONSUMERS * ROWS, D])
    v_tile = v_smem.index(kv).reshape([CONSUMERS * ROWS, D])
    return k_tile, k_tile.slice(WG * ROWS, ROWS), v_tile.slice(WG * ROWS, ROWS)


@gluon.jit
def _fused_consumer(
    q_smem,
    do_smem,
    k_smem,
    v_smem,
    lse_smem,
    delta_smem,
    ds_smem,
    dq_smem,
    kv_ready,
    q_ready,
    do_ready,
    qdo_free,
    ds_ready,
    dq_ready,
    dq_free,
    k_read,
    dk_desc,
    dv_desc,
    batch,
    kv_head,
    start_n,
    m_start,
    n_m,
    M,
    N,
    sm_scale,
    qk_scale,
    WG: gl.constexpr,
    GROUP_SIZE: gl.constexpr,
    CAUSAL: gl.constexpr,
    BLOCK_M: gl.constexpr,
    D: gl.constexpr,
    STAGES: gl.constexpr,
):
    """One warpgroup: `_bwd_tile`'s dK and dV of key rows [start_n + WG*64, +64) (one tile per program, D = DV, no
    RoPE part, no skipped steps), and per step also `_fused_dq`: each warpgroup stores its dS^T (64 keys x BLOCK_M
    queries, bf16) into a shared buffer of the step's 128 keys (two, alternating) before it issues the next step's
    S^T, then takes its share of dQ."""
    st_layout: gl.constexpr = wgmma_layout(BLOCK_M)
    acc_layout: gl.constexpr = wgmma_layout(D)
    op_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=acc_layout, k_width=2)
    cols: gl.constexpr = gl.SliceLayout(0, st_layout)
    dtype: gl.constexpr = q_smem.dtype
    q_shift = N - M
    k_tile = k_smem.index(0).reshape([CONSUMERS * ROWS, D])
    k_wg = k_tile.slice(WG * ROWS, ROWS)
    v_wg = v_smem.index(0).reshape([CONSUMERS * ROWS, D]).slice(WG * ROWS, ROWS)
    kv0 = start_n + WG * ROWS
    kv_pos = kv0 + gl.arange(0, ROWS, layout=gl.SliceLayout(1, st_layout))
    dk = gl.zeros([ROWS, D], gl.float32, acc_layout)
    dv = gl.zeros([ROWS, D], gl.float32, acc_layout)
    total = GROUP_SIZE * (n_m - m_start)
    mbarrier.wait(kv_ready.index(0), 0)
    mbarrier.wait(q_ready.index(0), 0)
    st = issue_scores_t(k_wg, k_wg, q_smem, q_smem, 0, gl.zeros([ROWS, BLOCK_M], gl.float32, st_layout), BLOCK_M, D, 0)
    for t in range(0, total):
        s = t % STAGES
        _, m = _fused_step(t, kv_head, m_start, n_m, GROUP_SIZE, CAUSAL)
        k_tile_t, k_wg_t, v_wg_t = _fused_kv(k_smem, v_smem, m, M, WG, BLOCK_M, D)
        st = warpgroup_mma_wait(num_outstanding=0, deps=[st])
        q_t = q_smem.index(s).reshape([BLOCK_M, D])
        pt = gl.exp2(st * qk_scale - lse_smem.index(s).load(cols)[None, :])
        if CAUSAL:
            # Against immediates at 64-query steps too: written plainly, the column indices stay live across the
            # loop and ptxas spills.
            pt = causal_mask_t(pt, m, kv_pos, q_shift, start_n, BLOCK_M, True, cols)
        mbarrier.wait(do_ready.index(s), (t // STAGES) & 1)
        do_t = do_smem.index(s).reshape([BLOCK_M, D])
        dpt = warpgroup_mma(v_wg_t, do_t.permute((1, 0)), st, use_acc=False, is_async=True)
        dv = warpgroup_mma(gl.convert_layout(pt.to(dtype), op_layout), do_t, dv, is_async=True)
        dpt = warpgroup_mma_wait(num_outstanding=1, deps=[dpt])
        dst = (pt * (dpt - delta_smem.index(s).load(cols)[None, :])).to(dtype)
        dk = warpgroup_mma(gl.convert_layout(dst, op_layout), q_t, dk, is_async=True)
        ds_smem.index(t % 2).slice(WG * ROWS, ROWS).store(dst)
        fence_async_shared()
        mbarrier.arrive(ds_ready.index(t % 2), count=1)
        s1 = (t + 1) % STAGES
        mbarrier.wait(q_ready.index(s1), ((t + 1) // STAGES) & 1, pred=t + 1 < total)
        st = issue_scores_t(k_wg_t, k_wg_t, q_smem, q_smem, s1, dpt, BLOCK_M, D, 0)  # (past the last step: drained)
        dv, dk = warpgroup_mma_wait(num_outstanding=1, deps=[dv, dk])
        mbarrier.arrive(qdo_free.index(s), count=1)
        # dS^T buffer t % 2 is written again at step t + 2, after this warpgroup's dQ of step t + 1, which waits
        # for the other's half of dS^T t + 1; the other stores that after its own dQ of step t, the buffer's last
        # read. So two buffers suffice.
        _fused_dq(t, ds_smem, k_tile_t, dq_smem, ds_ready, dq_ready, dq_free, sm_scale, WG, BLOCK_M, D)
    st = warpgroup_mma_wait(num_outstanding=0, deps=[st])
    # dK and dV out through this warpgroup's K and V rows, by TMA, as `_bwd_tile` does. The other warpgroup's dQ
    # products read these K rows too (every key, its columns), up to its last step: each warpgroup has waited for
    # its own last dQ product, and both say so (k_read) before either overwrites its rows.
    mbarrier.arrive(k_read.index(0), count=1)
    mbarrier.wait(k_read.index(0), 0)
    k_wg.store((dk * sm_scale).to(dtype))
    v_wg.store(dv.to(dtype))
    fence_async_shared()
    tma.async_copy_shared_to_global(dk_desc, [batch, kv_head, kv0, 0], k_smem.index(0).slice(WG * ROWS, ROWS, dim=2))
    tma.async_copy_shared_to_global(dv_desc, [batch, kv_head, kv0, 0], v_smem.index(0).slice(WG * ROWS, ROWS, dim=2))
    tma.store_wait(0)


@gluon.jit
def _fused_writer(
    dq_desc,
    dq_smem,
    dq_ready,
    dq_free,
    batch,
    kv_head,
    m_start,
    n_m,
    GROUP_SIZE: gl.constexpr,
    CAUSAL: gl.constexpr,
    BLOCK_M: gl.constexpr,
    D: gl.constexpr,
):
    """One warp: each step's two dQ tiles (64 x 64 fp32, one per consumer: `_fused_dq`) added into the fp32 dQ by
    TMA reduce, which clips the rows past S_q. A buffer is released once its reduce has read it, checked one step
    later so that the reduces overlap. Each tile's reduce is one bulk group (two messages of 32 fp32 columns, the
    128-byte swizzle, committed together), so a step is two groups: once step u's are issued, at most two pending
    means step u - 1's have read their buffers, which the consumers fill again at step u + 1."""
    for u in range(GROUP_SIZE * (n_m - m_start)):
        head, m = _fused_step(u, kv_head, m_start, n_m, GROUP_SIZE, CAUSAL)
        for wg in gl.static_range(2):
            qb = wg * 2 + u % 2
            mbarrier.wait(dq_ready.index(qb), (u // 2) & 1)
            if BLOCK_M > ROWS:  # `_fused_dq`'s shares: query rows
                _async_reduce_add(dq_desc, [batch, head, m * BLOCK_M + wg * (BLOCK_M // 2), 0], dq_smem.index(qb))
            else:  # columns
                _async_reduce_add(dq_desc, [batch, head, m * BLOCK_M, wg * (D // 2)], dq_smem.index(qb))
        tma.store_wait(CONSUMERS)  # step u - 1's reduces have read their buffers
        for wg in gl.static_range(2):
            mbarrier.arrive(dq_free.index(wg * 2 + (u + 1) % 2), count=1, pred=u >= 1)
    tma.store_wait(0)


@gluon.jit
def _flash_bwd_fused_sm90_kernel(
    q_desc,
    do_desc,
    k_desc,
    v_desc,
    lse_desc,
    delta_desc,
    dk_desc,
    dv_desc,
    dq_desc,
    M,
    M_PAD,
    N,
    H_KV,
    bucket,
    sm_scale,
    qk_scale,
    GROUP_SIZE: gl.constexpr,
    CAUSAL: gl.constexpr,
    BLOCK_M: gl.constexpr,
    D: gl.constexpr,
    STAGES: gl.constexpr,
):
    """One program per tile of (128 key rows, KV head, batch), in `dkdv_tile`'s order, BLOCK_M query rows per step:
    dK and dV as the one-tile dK/dV kernel, dQ added into an fp32 (B, H_q, S_q, D) buffer. Roles: two consumer
    warpgroups, the loader warp and the dQ writer warp (setmaxnreg 240 / 24 / 24)."""
    n_kb = gl.cdiv(N, CONSUMERS * ROWS)
    n_m = gl.cdiv(M, BLOCK_M)
    batch, kv_head, start_n, m_start = dkdv_tile(
        gl.program_id(0), n_kb, gl.num_programs(0), bucket, H_KV, M, N, CAUSAL, BLOCK_M
    )
    q_smem = gl.allocate_shared_memory(q_desc.dtype, [STAGES] + q_desc.block_type.shape, q_desc.layout)
    do_smem = gl.allocate_shared_memory(do_desc.dtype, [STAGES] + do_desc.block_type.shape, do_desc.layout)
    k_smem = gl.allocate_shared_memory(k_desc.dtype, [1] + k_desc.block_type.shape, k_desc.layout)
    v_smem = gl.allocate_shared_memory(v_desc.dtype, [1] + v_desc.block_type.shape, v_desc.layout)
    lse_smem = gl.allocate_shared_memory(lse_desc.dtype, [STAGES] + lse_desc.block_type.shape, lse_desc.layout)
    delta_smem = gl.allocate_shared_memory(delta_desc.dtype, [STAGES] + delta_desc.block_type.shape, delta_desc.layout)
    ds_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([CONSUMERS * ROWS, BLOCK_M], q_desc.dtype)
    ds_smem = gl.allocate_shared_memory(q_desc.dtype, [2, CONSUMERS * ROWS, BLOCK_M], ds_layout)
    dq_smem = gl.allocate_shared_memory(dq_desc.dtype, [2 * CONSUMERS] + dq_desc.block_type.shape, dq_desc.layout)
    kv_ready = gl.allocate_shared_memory(gl.int64, [1, 1], mbarrier.MBarrierLayout())
    q_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    do_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    qdo_free = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    ds_ready = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    dq_ready = gl.allocate_shared_memory(gl.int64, [2 * CONSUMERS, 1], mbarrier.MBarrierLayout())
    dq_free = gl.allocate_shared_memory(gl.int64, [2 * CONSUMERS, 1], mbarrier.MBarrierLayout())
    k_read = gl.allocate_shared_memory(gl.int64, [1, 1], mbarrier.MBarrierLayout())
    mbarrier.init(kv_ready.index(0), count=1)
    mbarrier.init(k_read.index(0), count=CONSUMERS)
    for i in gl.static_range(STAGES):
        mbarrier.init(q_ready.index(i), count=1)
        mbarrier.init(do_ready.index(i), count=1)
        mbarrier.init(qdo_free.index(i), count=CONSUMERS)
    for i in gl.static_range(2):
        mbarrier.init(ds_ready.index(i), count=CONSUMERS)
    for i in gl.static_range(2 * CONSUMERS):
        mbarrier.init(dq_ready.index(i), count=1)
        mbarrier.init(dq_free.index(i), count=1)
    fence_async_shared()
    gl.warp_specialize(
        [
            (
                _fused_consumer,
                (
                    q_smem,
                    do_smem,
                    k_smem,
                    v_smem,
                    lse_smem,
                    delta_smem,
                    ds_smem,
                    dq_smem,
                    kv_ready,
                    q_ready,
                    do_ready,
                    qdo_free,
                    ds_ready,
                    dq_ready,
                    dq_free,
                    k_read,
                    dk_desc,
                    dv_desc,
                    batch,
                    kv_head,
                    start_n,
                    m_start,
                    n_m,
                    M,
                    N,
                    sm_scale,
                    qk_scale,
                    gl.constexpr(0),
                    GROUP_SIZE,
                    CAUSAL,
                    BLOCK_M,
                    D,
                    STAGES,
                ),
            ),
            (
                _fused_consumer,
                (
                    q_smem,
                    do_smem,
                    k_smem,
                    v_smem,
                    lse_smem,
                    delta_smem,
                    ds_smem,
                    dq_smem,
                    kv_ready,
                    q_ready,
                    do_ready,
                    qdo_free,
                    ds_ready,
                    dq_ready,
                    dq_free,
                    k_read,
                    dk_desc,
                    dv_desc,
                    batch,
                    kv_head,
                    start_n,
                    m_start,
                    n_m,
                    M,
                    N,
                    sm_scale,
                    qk_scale,
                    gl.constexpr(1),
                    GROUP_SIZE,
                    CAUSAL,
                    BLOCK_M,
                    D,
                    STAGES,
                ),
            ),
            (
                _fused_loader,
                (
                    q_desc,
                    do_desc,
                    k_desc,
                    v_desc,
                    lse_desc,
                    delta_desc,
                    q_smem,
                    do_smem,
                    k_smem,
                    v_smem,
                    lse_smem,
                    delta_smem,
                    kv_ready,
                    q_ready,
                    do_ready,
                    qdo_free,
                    batch,
                    kv_head,
                    start_n,
                    m_start,
                    n_m,
                    H_KV * GROUP_SIZE,
                    M_PAD,
                    GROUP_SIZE,
                    CAUSAL,
                    BLOCK_M,
                    STAGES,
                ),
            ),
            (
                _fused_writer,
                (dq_desc, dq_smem, dq_ready, dq_free, batch, kv_head, m_start, n_m, GROUP_SIZE, CAUSAL, BLOCK_M, D),
            ),
        ],
        [4, 1, 1],
        [CONSUMER_REGS, LOADER_REGS, LOADER_REGS],
    )


@triton.jit
def _fused_prep_kernel(
    out_ptr,
    do_ptr,
    lse_ptr,
    dlse_ptr,
    delta_ptr,
    lse2_ptr,
    dq_acc_ptr,
    stride_ob,
    stride_oh,
    stride_om,
    stride_od,
    stride_gb,
    stride_gh,
    stride_gm,
    stride_gd,
    stride_lb,
    stride_lh,
    stride_lm,
    stride_tb,
    stride_th,
    stride_tm,
    H,
    M,
    M_PAD,
    HAS_DLSE: tl.constexpr,
    D: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """Before the one-launch backward, per BLOCK rows of one (batch, head): delta = rowsum(dO * Out) - dlse and lse2
    (the lse in log2 units) into contiguous (B, H, M_PAD) buffers (0 past M), and zeros into the rows' fp32 dQ."""
    bh = tl.program_id(1)
    b = (bh // H).to(tl.int64)
    h = (bh % H).to(tl.int64)
    rows = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = rows < M
    cols = tl.arange(0, D)
    o = tl.load(
        out_ptr + b * stride_ob + h * stride_oh + rows[:, None] * stride_om + cols[None, :] * stride_od,
        mask=ok[:, None],
        other=0.0,
    )
    do = tl.load(
        do_ptr + b * stride_gb + h * stride_gh + rows[:, None] * stride_gm + cols[None, :] * stride_gd,
        mask=ok[:, None],
        other=0.0,
    )
    delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), axis=1)
    if HAS_DLSE:
        delta -= tl.load(dlse_ptr + b * stride_tb + h * stride_th + rows * stride_tm, mask=ok, other=0.0)
    lse2 = tl.load(lse_ptr + b * stride_lb + h * stride_lh + rows * stride_lm, mask=ok, other=0.0) * 1.4426950408889634
    padded = bh.to(tl.int64) * M_PAD + rows
    tl.store(delta_ptr + padded, tl.where(ok, delta, 0.0), mask=rows < M_PAD)
    tl.store(lse2_ptr + padded, tl.where(ok, lse2, 0.0), mask=rows < M_PAD)
    tl.store(
        dq_acc_ptr + (bh.to(tl.int64) * M + rows[:, None]) * D + cols[None, :],
        tl.zeros([BLOCK, D], tl.float32),
        mask=ok[:, None],
    )


# (D_qk, D_v) pairs the one-launch backward runs: query rows per step (BLOCK_M).
FUSED_PAIRS = {(64, 64): 128, (128, 128): 64}


def fused_dq_block(d: int, block_m: int) -> list[int]:
    """The TMA block of one consumer's dQ share in the one-launch backward (`_fused_dq`, `_fused_writer`): with
    64-query steps every row and half the columns, with 128-query steps half the rows and every column (two
    consumers)."""
    return [1, 1, block_m // 2, d] if block_m > ROWS_PER_CONSUMER else [1, 1, block_m, d // 2]


def backward_fused(q, k, v, out, lse, do, dlse, dq, dk, dv, sm_scale: float, causal: bool, key=None):
    """The whole backward in one Gluon launch (plus a Triton pre-pass and dQ's cast): dq, dk, dv any strides and
    dtypes (dK and dV go through contiguous buffers in q's dtype where TMA cannot write them). q, k, v, do as
    `supports_backward` accepted them with (D_qk, D_v) in FUSED_PAIRS (its query rows per step); lse and dlse (or
    None) (B, H_q, S_q) fp32.
    dQ's fp32 sum over the key blocks is taken in the order their programs finish, so its last bits may differ
    from call to call (dK and dV do not); it takes an fp32 buffer of dQ's shape for the call. `key`: the caller's
    for the launches (`Launcher.keyed`)."""
    if staged_grads(
        lambda dk_, dv_: backward_fused(q, k, v, out, lse, do, dlse, dq, dk_, dv_, sm_scale, causal, key),
        q.dtype,
        dk,
        dv,
    ):
        return
    b, h_q, s_q, d = q.shape
    h_kv, s_kv = k.shape[1], k.shape[2]
    block_m, stages = FUSED_PAIRS[(d, v.shape[3])], 2
    rows = padded_rows(s_q)
    delta = torch.empty((b, h_q, rows), device=q.device, dtype=torch.float32)
    lse2 = torch.empty_like(delta)
    dq_acc = torch.empty((b, h_q, s_q, d), device=q.device, dtype=torch.float32)
    dlse_arg = dlse if dlse is not None else lse
    launcher(_fused_prep_kernel).keyed(key, (cdiv(rows, block_m), b * h_q))(
        out,
        do,
        lse,
        dlse_arg,
        delta,
        lse2,
        dq_acc,
        *out.stride(),
        *do.stride(),
        *lse.stride(),
        *dlse_arg.stride(),
        h_q,
        s_q,
        rows,
        HAS_DLSE=dlse is not None,
        D=d,
        BLOCK=block_m,
        num_warps=4,
    )
    n_kb = cdiv(s_kv, PROGRAM_ROWS)
    launcher(_flash_bwd_fused_sm90_kernel).keyed(key, (n_kb * h_kv * b,))(
        tile_descriptor(q, block_m),
        tile_descriptor(do, block_m),
        tile_descriptor(k, PROGRAM_ROWS),
        tile_descriptor(v, PROGRAM_ROWS),
        descriptor(lse2.view(-1), [block_m]),
        descriptor(delta.view(-1), [block_m]),
        tile_descriptor(dk, ROWS_PER_CONSUMER),
        tile_descriptor(dv, ROWS_PER_CONSUMER),
        descriptor(dq_acc, fused_dq_block(d, block_m)),
        s_q,
        rows,
        s_kv,
        h_kv,
        bucket_size(n_kb, h_q // h_kv, causal),
        sm_scale,
        sm_scale * LOG2E,
        GROUP_SIZE=h_q // h_kv,
        CAUSAL=causal,
        BLOCK_M=block_m,
        D=d,
        STAGES=stages,
        num_warps=4,
    )
    dq.copy_(dq_acc)
