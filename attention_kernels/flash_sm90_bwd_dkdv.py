"""Flash attention backward for Hopper (sm_90) in Gluon, second of two launches: dK and dV.

Math, per block of 128 keys of one KV head (two consumer warpgroups of 64 keys), summed over every query head of
the KV group and every query block that sees those keys, in transposed form so that the key rows are the M of
every wgmma (FlashAttention-2's backward, Dao 2023):

    S^T = K Q^T    P^T = exp2(qk_scale * S^T - lse2)    dP^T = V dO^T    dS^T = P^T (dP^T - delta)
    dV += P^T dO    dK += dS^T Q                        (dK scaled by the softmax scale once, at the end)

with lse2 and delta written by the dQ kernel (flash_sm90_bwd_dq.py). A program owns its keys and loops over the
group's query heads, so GQA needs no per-query-head partial buffers.

Structure (the roles of flash_sm90_common.py): the loader brings the tile's K and V once, then for every step
(query head, query block) Q with its rows' lse2 and delta (on Q's barrier; the consumers read them straight from
shared memory in the layout of the score columns) and dO into a ring (BWD_CONFIGS: query rows per step, stages).
The steps are software-pipelined: S^T of the next step is issued right after dK of this one. dS^T is taken from
the fp32 P^T (its fp16/bf16 copy feeds dV only). The causal mask compares against immediates (`causal_mask_t`), so
no column index stays live across the step loop, and MHA's second warpgroup skips the query blocks that end
before its keys (`_dkdv_lead`). One program per tile (D = 128 and MLA's 192/128) writes dK and dV through its own
K and V buffers by TMA store; the persistent programs (D = 64 and MLA's 96/64: one per SM, two K/V buffers so that
the next tile arrives while this one's dK and dV are stored) store them from registers.
"""

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)

from attention_kernels._host import LOG2E, cdiv, launcher, num_sms
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
    publish_tile,
    qk_descriptors,
    qk_tiles,
    receive_tile,
    release_kv,
    staged_grads,
    store_rows,
    tile_counter,
    tile_descriptor,
    tile_handover,
)
from attention_kernels.schedule import bucket_size
from attention_kernels.sm90 import descriptor, wgmma_layout


@gluon.jit
def _dkdv_lead(start_n, m_start, M, N, CAUSAL: gl.constexpr, BLOCK_M: gl.constexpr):
    """Causal dK/dV with query blocks of at most 64 rows: how many query blocks from m_start on end before the
    second consumer's keys [start_n + 64, +64), so that they are wholly masked for that warpgroup. With 64-query
    blocks, 1 wherever the tile's first key sits at or past the first query's position (else 0); with 32, up to 2.

    Only MHA skips them (GROUP_SIZE 1, where they are the tile's first steps): with a KV group they are each query
    head's first steps, and skipped slots between a warpgroup's own steps would stall it (each step issues the next
    step's S^T before it releases its own slot, so with two ring stages it would wait for a slot the loader can
    only fill after that release)."""
    if CAUSAL and BLOCK_M <= ROWS:
        first = gl.maximum(start_n + ROWS - (N - M), 0) // BLOCK_M
        return gl.maximum(gl.minimum(first, gl.cdiv(M, BLOCK_M)) - m_start, 0)
    else:
        return 0


@gluon.jit
def _bwd_load_tile(
    q_desc,
    qr_desc,
    do_desc,
    k_desc,
    kr_desc,
    v_desc,
    lse_desc,
    delta_desc,
    q_smem,
    qr_smem,
    do_smem,
    k_smem,
    kr_smem,
    v_smem,
    lse_smem,
    delta_smem,
    kv_ready,
    kv_free,
    q_ready,
    do_ready,
    qdo_free,
    batch,
    kv_head,
    start_n,
    m_start,
    n_m,
    step0,
    tc,
    H,
    M_PAD,
    GROUP_SIZE: gl.constexpr,
    BLOCK_M: gl.constexpr,
    STAGES: gl.constexpr,
    PERSISTENT: gl.constexpr,
    DR: gl.constexpr,
):
    """Loader, the program's tc-th tile: its K and V block into buffer tc % 2 (once the consumers are done with the
    tile before last there), then for every (query head of the group, query block), in the consumers' order, Q with
    its rows' lse and delta (one barrier) and dO into the ring; step0 counts the program's steps over its earlier
    tiles. Returns the count after this tile. DR > 0: Q's and K's last DR columns (MLA's RoPE part) come as second
    copies on the same barriers, as in the forward's loader."""
    # When not persistent, step0 is a constexpr 0. Small changes to this loader (the step count made a tensor up
    # front, the query-block count computed here) move ptxas's register choices in a consumer warpgroup's loop and
    # measured 3-7% slower at D=128 (benchmarks/RESULTS.md).
    it = step0
    kb = tc % 2
    if PERSISTENT:
        mbarrier.wait(kv_free.index(kb), ((tc // 2) & 1) ^ 1, pred=tc >= 2)
    if DR > 0:
        mbarrier.expect(
            kv_ready.index(kb), k_desc.block_type.nbytes + kr_desc.block_type.nbytes + v_desc.block_type.nbytes
        )
        tma.async_copy_global_to_shared(
            kr_desc, [batch, kv_head, start_n, k_desc.block_type.shape[3]], kv_ready.index(kb), kr_smem.index(kb)
        )
    else:
        mbarrier.expect(kv_ready.index(kb), k_desc.block_type.nbytes + v_desc.block_type.nbytes)
    tma.async_copy_global_to_shared(k_desc, [batch, kv_head, start_n, 0], kv_ready.index(kb), k_smem.index(kb))
    tma.async_copy_global_to_shared(v_desc, [batch, kv_head, start_n, 0], kv_ready.index(kb), v_smem.index(kb))
    for hh in range(GROUP_SIZE):
        head = kv_head * GROUP_SIZE + hh
        for m in range(m_start, n_m):
            load_qdo(
                q_desc,
                qr_desc,
                do_desc,
                lse_desc,
                delta_desc,
                q_smem,
                qr_smem,
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
                DR,
            )
            it += 1
    return it


@gluon.jit
def _bwd_loader(
    q_desc,
    qr_desc,
    do_desc,
    k_desc,
    kr_desc,
    v_desc,
    lse_desc,
    delta_desc,
    q_smem,
    qr_smem,
    do_smem,
    k_smem,
    kr_smem,
    v_smem,
    lse_smem,
    delta_smem,
    kv_ready,
    kv_free,
    q_ready,
    do_ready,
    qdo_free,
    tile_smem,
    tile_ready,
    tile_free,
    counter_ptr,
    batch,
    kv_head,
    start_n,
    m_start,
    n_m,
    n_tiles,
    n_kb,
    bucket,
    H_KV,
    M,
    N,
    M_PAD,
    GROUP_SIZE: gl.constexpr,
    CAUSAL: gl.constexpr,
    BLOCK_M: gl.constexpr,
    STAGES: gl.constexpr,
    PERSISTENT: gl.constexpr,
    DR: gl.constexpr,
):
    """One warp. PERSISTENT: tiles from the global counter, each handed to the consumers (tile_smem) and loaded;
    the next tile's K/V and first steps arrive while the consumers finish this one. Else the program's own tile
    (batch, kv_head, start_n, m_start)."""
    if PERSISTENT:
        it = 0
        tc = 0
        t = gl.program_id(0)
        while t < n_tiles:
            publish_tile(tile_smem, tile_ready, tile_free, tc, t)
            batch, kv_head, start_n, m_start = dkdv_tile(t, n_kb, n_tiles, bucket, H_KV, M, N, CAUSAL, BLOCK_M)
            it = _bwd_load_tile(
                q_desc,
                qr_desc,
                do_desc,
                k_desc,
                kr_desc,
                v_desc,
                lse_desc,
                delta_desc,
                q_smem,
                qr_smem,
                do_smem,
                k_smem,
                kr_smem,
                v_smem,
                lse_smem,
                delta_smem,
                kv_ready,
                kv_free,
                q_ready,
                do_ready,
                qdo_free,
                batch,
                kv_head,
                start_n,
                m_start,
                n_m,
                it,
                tc,
                H_KV * GROUP_SIZE,
                M_PAD,
                GROUP_SIZE,
                BLOCK_M,
                STAGES,
                PERSISTENT,
                DR,
            )
            tc += 1
            t = gl.num_programs(0) + gl.atomic_add(counter_ptr, 1)  # the next tile nobody has taken
        publish_tile(tile_smem, tile_ready, tile_free, tc, t)
    else:
        _bwd_load_tile(
            q_desc,
            qr_desc,
            do_desc,
            k_desc,
            kr_desc,
            v_desc,
            lse_desc,
            delta_desc,
            q_smem,
            qr_smem,
            do_smem,
            k_smem,
            kr_smem,
            v_smem,
            lse_smem,
            delta_smem,
            kv_ready,
            kv_free,
            q_ready,
            do_ready,
            qdo_free,
            batch,
            kv_head,
            start_n,
            m_start,
            n_m,
            0,
            0,
            H_KV * GROUP_SIZE,
            M_PAD,
            GROUP_SIZE,
            BLOCK_M,
            STAGES,
            PERSISTENT,
            DR,
        )


@gluon.jit
def _bwd_tile(
    q_smem,
    qr_smem,
    do_smem,
    k_smem,
    kr_smem,
    v_smem,
    lse_smem,
    delta_smem,
    kv_ready,
    kv_free,
    q_ready,
    do_ready,
    qdo_free,
    dk_desc,
    dkr_desc,
    dv_desc,
    dk_ptr,
    dv_ptr,
    stride_kb,
    stride_kh,
    stride_kn,
    stride_kd,
    stride_vb,
    stride_vh,
    stride_vn,
    stride_vd,
    batch,
    kv_head,
    start_n,
    m_start,
    n_m,
    it,
    tc,
    M,
    N,
    sm_scale,
    qk_scale,
    WG: gl.constexpr,
    GROUP_SIZE: gl.constexpr,
    CAUSAL: gl.constexpr,
    BLOCK_M: gl.constexpr,
    D: gl.constexpr,
    DR: gl.constexpr,
    DV: gl.constexpr,
    STAGES: gl.constexpr,
    PERSISTENT: gl.constexpr,
):
    """One warpgroup, the program's tc-th tile: dK and dV of key rows [start_n + WG*64, +64), summed over every
    query head of the KV group and every query block; `it` counts the program's steps (returned updated).
    Transposed products, so the key rows are the M of every wgmma:
    S^T = K Q^T, P^T = exp2(S^T - lse), dP^T = V dO^T, dS^T = P^T (dP^T - delta), dV += P^T dO, dK += dS^T Q.
    Q and K are D columns wide, and with DR > 0 have DR more in tiles of their own (MLA's RoPE part): S^T adds
    both products and dK's last DR columns are a second accumulator; V and dO are DV wide."""
    st_layout: gl.constexpr = wgmma_layout(BLOCK_M)
    acc_layout: gl.constexpr = wgmma_layout(D)
    op_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=acc_layout, k_width=2)
    # dV's and dK's RoPE columns: their own widths (the layouts are acc_layout's when DV == D).
    v_layout: gl.constexpr = wgmma_layout(DV)
    v_op_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=v_layout, k_width=2)
    r_layout: gl.constexpr = wgmma_layout(DR if DR > 0 else D)
    r_op_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=r_layout, k_width=2)
    cols: gl.constexpr = gl.SliceLayout(0, st_layout)  # one value per query row of the block
    dtype: gl.constexpr = q_smem.dtype
    q_shift = N - M  # query row i sits at key position q_shift + i
    kb = tc % 2
    k_wg = k_smem.index(kb).reshape([CONSUMERS * ROWS, D]).slice(WG * ROWS, ROWS)
    v_wg = v_smem.index(kb).reshape([CONSUMERS * ROWS, DV]).slice(WG * ROWS, ROWS)
    kr_wg = k_wg  # (unused without a RoPE part)
    if DR > 0:
        kr_wg = kr_smem.index(kb).reshape([CONSUMERS * ROWS, DR]).slice(WG * ROWS, ROWS)
    kv0 = start_n + WG * ROWS
    kv_pos = kv0 + gl.arange(0, ROWS, layout=gl.SliceLayout(1, st_layout))
    dk = gl.zeros([ROWS, D], gl.float32, acc_layout)
    dv = gl.zeros([ROWS, DV], gl.float32, v_layout)
    dkr = dk  # (unused without a RoPE part)
    if DR > 0:
        dkr = gl.zeros([ROWS, DR], gl.float32, r_layout)
    nb = n_m - m_start
    total = GROUP_SIZE * nb
    mbarrier.wait(kv_ready.index(kb), (tc // 2) & 1)
    # Software pipeline over the steps (query head, query block): S^T of step t+1 is issued right after dK of
    # step t, so it runs while step t's products finish.
    SKIPS: gl.constexpr = CAUSAL and BLOCK_M <= ROWS and GROUP_SIZE == 1  # (see _dkdv_lead)
    if SKIPS:
        t0 = 0
        if WG > 0:
            # The tile's first _dkdv_lead(...) query blocks lie wholly before this warpgroup's keys: it skips them
            # and releases their slots, each once its Q and dO have arrived.
            t0 = _dkdv_lead(start_n, m_start, M, N, CAUSAL, BLOCK_M)
            release_kv(q_ready, do_ready, qdo_free, it, 0, t0, STAGES, True)
        mbarrier.wait(q_ready.index((it + t0) % STAGES), ((it + t0) // STAGES) & 1, pred=t0 < total)
        st = issue_scores_t(
            k_wg,
            kr_wg,
            q_smem,
            qr_smem,
            (it + t0) % STAGES,
            gl.zeros([ROWS, BLOCK_M], gl.float32, st_layout),
            BLOCK_M,
            D,
            DR,
        )
    else:  # no skipped steps: a prologue without t0, so that no skip arithmetic enters these kernels' code
        t0 = 0
        mbarrier.wait(q_ready.index(it % STAGES), (it // STAGES) & 1)
        st = issue_scores_t(
            k_wg, kr_wg, q_smem, qr_smem, it % STAGES, gl.zeros([ROWS, BLOCK_M], gl.float32, st_layout), BLOCK_M, D, DR
        )
    # 128-query steps (D=64) carry their query block instead of taking t % nb each step (16 fewer instructions).
    CARRY_M: gl.constexpr = CAUSAL and BLOCK_M > ROWS
    mc = m_start
    for t in range(t0, total):
        g = it + t  # the program's step number, over all of its tiles
        s = g % STAGES
        phase = (g // STAGES) & 1
        if SKIPS:
            m = m_start + t  # (one query head: t < nb)
        elif CARRY_M:
            m = mc
            mc += 1
            if mc == n_m:
                mc = m_start
        else:
            m = m_start + t % nb
        st = warpgroup_mma_wait(num_outstanding=0, deps=[st])
        q_t = q_smem.index(s).reshape([BLOCK_M, D])
        # The step's lse (log2 units) and delta came with Q (q_ready), read straight in the columns' layout.
        pt = gl.exp2(st * qk_scale - lse_smem.index(s).load(cols)[None, :])
        if CAUSAL:
            pt = causal_mask_t(pt, m, kv_pos, q_shift, start_n, BLOCK_M, BLOCK_M > ROWS, cols)
        mbarrier.wait(do_ready.index(s), phase)
        do_t = do_smem.index(s).reshape([BLOCK_M, DV])
        dpt = warpgroup_mma(v_wg, do_t.permute((1, 0)), st, use_acc=False, is_async=True)
        dv = warpgroup_mma(gl.convert_layout(pt.to(dtype), v_op_layout), do_t, dv, is_async=True)
        dpt = warpgroup_mma_wait(num_outstanding=1, deps=[dpt])
        # dS^T from the fp32 P^T: its bf16 copy feeds dV only. From that copy (a round trip through bf16) ptxas
        # converts one score at a time and unpacks again, 64-110 more instructions per 64-query step, and the
        # backward measured 4-9% slower (benchmarks/RESULTS.md).
        dst = (pt * (dpt - delta_smem.index(s).load(cols)[None, :])).to(dtype)
        dk = warpgroup_mma(gl.convert_layout(dst, op_layout), q_t, dk, is_async=True)
        if DR > 0:
            dkr = warpgroup_mma(
                gl.convert_layout(dst, r_op_layout), qr_smem.index(s).reshape([BLOCK_M, DR]), dkr, is_async=True
            )
        # S^T of the next step (past the tile's last step it reads a stale stage; its result is drained, never
        # used).
        s1 = (g + 1) % STAGES
        mbarrier.wait(q_ready.index(s1), ((g + 1) // STAGES) & 1, pred=t + 1 < total)
        st = issue_scores_t(k_wg, kr_wg, q_smem, qr_smem, s1, dpt, BLOCK_M, D, DR)
        if DR > 0:
            dv, dk, dkr = warpgroup_mma_wait(num_outstanding=2, deps=[dv, dk, dkr])  # all but the next S^T
        else:
            dv, dk = warpgroup_mma_wait(num_outstanding=1, deps=[dv, dk])  # all but the next S^T
        mbarrier.arrive(qdo_free.index(s), count=1)  # Q and dO of step t are no longer read
    st = warpgroup_mma_wait(num_outstanding=0, deps=[st])
    if not PERSISTENT:
        # One tile per program: this warpgroup's K and V rows are no longer read (every wgmma has completed), so
        # dK and dV go out through them, by TMA (which clips the rows past N), and the registers' stores are gone.
        k_wg.store((dk * sm_scale).to(dtype))
        v_wg.store(dv.to(dtype))
        if DR > 0:
            kr_wg.store((dkr * sm_scale).to(dtype))
        fence_async_shared()
        # (The same rows as TMA tiles: a 4-D view of each buffer's slice.)
        tma.async_copy_shared_to_global(
            dk_desc, [batch, kv_head, kv0, 0], k_smem.index(kb).slice(WG * ROWS, ROWS, dim=2)
        )
        tma.async_copy_shared_to_global(
            dv_desc, [batch, kv_head, kv0, 0], v_smem.index(kb).slice(WG * ROWS, ROWS, dim=2)
        )
        if DR > 0:
            tma.async_copy_shared_to_global(
                dkr_desc, [batch, kv_head, kv0, D], kr_smem.index(kb).slice(WG * ROWS, ROWS, dim=2)
            )
        tma.store_wait(0)  # the program's shared memory is read out before it exits
    else:
        mbarrier.arrive(kv_free.index(kb), count=1)  # the loader may bring the tile after next's K and V here

        # Persistent (D=64, 96/64): the stores from registers. dK's first D columns (and dV when DV == D) are stored
        # here rather than through `store_rows`, which orders the D = 64 kernels' PTX differently; such
        # reorderings measured 3-7% slower (benchmarks/RESULTS.md).
        offs_n = kv0 + gl.arange(0, ROWS, layout=gl.SliceLayout(1, acc_layout))
        offs_d = gl.arange(0, D, layout=gl.SliceLayout(0, acc_layout))
        rows_ok = (offs_n < N)[:, None]
        dk_ptrs = (
            dk_ptr
            + batch.to(gl.int64) * stride_kb
            + kv_head.to(gl.int64) * stride_kh
            + offs_n[:, None] * stride_kn
            + offs_d[None, :] * stride_kd
        )
        gl.store(dk_ptrs, (dk * sm_scale).to(dk_ptr.dtype.element_ty), mask=rows_ok)
        if DR > 0:
            store_rows(
                dk_ptr + batch.to(gl.int64) * stride_kb + kv_head.to(gl.int64) * stride_kh,
                dkr * sm_scale,
                kv0,
                N,
                stride_kn,
                stride_kd,
                D,
                DR,
                r_layout,
            )
        if DV == D:
            dv_ptrs = (
                dv_ptr
                + batch.to(gl.int64) * stride_vb
                + kv_head.to(gl.int64) * stride_vh
                + offs_n[:, None] * stride_vn
                + offs_d[None, :] * stride_vd
            )
            gl.store(dv_ptrs, dv.to(dv_ptr.dtype.element_ty), mask=rows_ok)
        else:
            store_rows(
                dv_ptr + batch.to(gl.int64) * stride_vb + kv_head.to(gl.int64) * stride_vh,
                dv,
                kv0,
                N,
                stride_vn,
                stride_vd,
                0,
                DV,
                v_layout,
            )
    return it + total


@gluon.jit
def _bwd_consumer(
    q_smem,
    qr_smem,
    do_smem,
    k_smem,
    kr_smem,
    v_smem,
    lse_smem,
    delta_smem,
    kv_ready,
    kv_free,
    q_ready,
    do_ready,
    qdo_free,
    tile_smem,
    tile_ready,
    tile_free,
    dk_desc,
    dkr_desc,
    dv_desc,
    dk_ptr,
    dv_ptr,
    stride_kb,
    stride_kh,
    stride_kn,
    stride_kd,
    stride_vb,
    stride_vh,
    stride_vn,
    stride_vd,
    batch,
    kv_head,
    start_n,
    m_start,
    n_m,
    n_tiles,
    n_kb,
    bucket,
    H_KV,
    M,
    N,
    sm_scale,
    qk_scale,
    WG: gl.constexpr,
    GROUP_SIZE: gl.constexpr,
    CAUSAL: gl.constexpr,
    BLOCK_M: gl.constexpr,
    D: gl.constexpr,
    DR: gl.constexpr,
    DV: gl.constexpr,
    STAGES: gl.constexpr,
    PERSISTENT: gl.constexpr,
):
    """One warpgroup: `_bwd_tile` for each tile the loader hands over (PERSISTENT), else for the program's own."""
    if PERSISTENT:
        it = 0
        tc = 0
        tile = receive_tile(tile_smem, tile_ready, tile_free, 0)
        while tile < n_tiles:
            batch, kv_head, start_n, m_start = dkdv_tile(tile, n_kb, n_tiles, bucket, H_KV, M, N, CAUSAL, BLOCK_M)
            it = _bwd_tile(
                q_smem,
                qr_smem,
                do_smem,
                k_smem,
                kr_smem,
                v_smem,
                lse_smem,
                delta_smem,
                kv_ready,
                kv_free,
                q_ready,
                do_ready,
                qdo_free,
                dk_desc,
                dkr_desc,
                dv_desc,
                dk_ptr,
                dv_ptr,
                stride_kb,
                stride_kh,
                stride_kn,
                stride_kd,
                stride_vb,
                stride_vh,
                stride_vn,
                stride_vd,
                batch,
                kv_head,
                start_n,
                m_start,
                n_m,
                it,
                tc,
                M,
                N,
                sm_scale,
                qk_scale,
                WG,
                GROUP_SIZE,
                CAUSAL,
                BLOCK_M,
                D,
                DR,
                DV,
                STAGES,
                PERSISTENT,
            )
            tc += 1
            tile = receive_tile(tile_smem, tile_ready, tile_free, tc)
    else:
        _bwd_tile(
            q_smem,
            qr_smem,
            do_smem,
            k_smem,
            kr_smem,
            v_smem,
            lse_smem,
            delta_smem,
            kv_ready,
            kv_free,
            q_ready,
            do_ready,
            qdo_free,
            dk_desc,
            dkr_desc,
            dv_desc,
            dk_ptr,
            dv_ptr,
            stride_kb,
            stride_kh,
            stride_kn,
            stride_kd,
            stride_vb,
            stride_vh,
            stride_vn,
            stride_vd,
            batch,
            kv_head,
            start_n,
            m_start,
            n_m,
            0,
            0,
            M,
            N,
            sm_scale,
            qk_scale,
            WG,
            GROUP_SIZE,
            CAUSAL,
            BLOCK_M,
            D,
            DR,
            DV,
            STAGES,
            PERSISTENT,
        )


@gluon.jit
def _flash_bwd_dkdv_sm90_kernel(
    q_desc,
    qr_desc,
    do_desc,
    k_desc,
    kr_desc,
    v_desc,
    lse_desc,
    delta_desc,
    dk_desc,
    dkr_desc,
    dv_desc,
    dk_ptr,
    dv_ptr,
    counter_ptr,
    stride_kb,
    stride_kh,
    stride_kn,
    stride_kd,
    stride_vb,
    stride_vh,
    stride_vn,
    stride_vd,
    M,
    M_PAD,
    N,
    H_KV,
    n_tiles,
    bucket,
    sm_scale,
    qk_scale,
    GROUP_SIZE: gl.constexpr,
    CAUSAL: gl.constexpr,
    BLOCK_M: gl.constexpr,
    D: gl.constexpr,
    DR: gl.constexpr,
    DV: gl.constexpr,
    STAGES: gl.constexpr,
    PERSISTENT: gl.constexpr,
):
    """Tiles of (128 key rows, KV head, batch). PERSISTENT, as the forward: one program per SM takes tiles from a
    global counter, its loader streaming the next tile's K/V (two buffers) and first Q/dO steps while the
    consumers finish the current one and store its dK and dV. Else one program per tile. Q and K as TMA tiles of
    their first D columns and, with DR > 0, of their last DR (as the forward)."""
    n_kb = gl.cdiv(N, CONSUMERS * ROWS)
    n_m = gl.cdiv(M, BLOCK_M)
    # The program's own tile, for one program per tile (the persistent roles ignore it).
    batch, kv_head, start_n, m_start = dkdv_tile(
        gl.program_id(0), n_kb, gl.num_programs(0), bucket, H_KV, M, N, CAUSAL, BLOCK_M
    )
    q_smem = gl.allocate_shared_memory(q_desc.dtype, [STAGES] + q_desc.block_type.shape, q_desc.layout)
    do_smem = gl.allocate_shared_memory(do_desc.dtype, [STAGES] + do_desc.block_type.shape, do_desc.layout)
    KV_BUFFERS: gl.constexpr = 2 if PERSISTENT else 1
    k_smem = gl.allocate_shared_memory(k_desc.dtype, [KV_BUFFERS] + k_desc.block_type.shape, k_desc.layout)
    if DR > 0:
        qr_smem = gl.allocate_shared_memory(qr_desc.dtype, [STAGES] + qr_desc.block_type.shape, qr_desc.layout)
        kr_smem = gl.allocate_shared_memory(kr_desc.dtype, [KV_BUFFERS] + kr_desc.block_type.shape, kr_desc.layout)
    else:  # (not used)
        qr_smem = q_smem
        kr_smem = k_smem
    v_smem = gl.allocate_shared_memory(v_desc.dtype, [KV_BUFFERS] + v_desc.block_type.shape, v_desc.layout)
    lse_smem = gl.allocate_shared_memory(lse_desc.dtype, [STAGES] + lse_desc.block_type.shape, lse_desc.layout)
    delta_smem = gl.allocate_shared_memory(delta_desc.dtype, [STAGES] + delta_desc.block_type.shape, delta_desc.layout)
    kv_ready = gl.allocate_shared_memory(gl.int64, [KV_BUFFERS, 1], mbarrier.MBarrierLayout())
    q_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    do_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    qdo_free = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(KV_BUFFERS):
        mbarrier.init(kv_ready.index(i), count=1)
    if PERSISTENT:  # the tile hand-over and the K/V buffers' release
        kv_free = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(2):
            mbarrier.init(kv_free.index(i), count=CONSUMERS)
        tile_smem, tile_ready, tile_free = tile_handover()
    else:  # (not used: one tile per program needs no hand-over)
        kv_free = kv_ready
        tile_smem = kv_ready
        tile_ready = kv_ready
        tile_free = kv_ready
    for i in gl.static_range(STAGES):
        mbarrier.init(q_ready.index(i), count=1)
        mbarrier.init(do_ready.index(i), count=1)
        mbarrier.init(qdo_free.index(i), count=CONSUMERS)
    fence_async_shared()

    gl.warp_specialize(
        [
            (
                _bwd_consumer,
                (
                    q_smem,
                    qr_smem,
                    do_smem,
                    k_smem,
                    kr_smem,
                    v_smem,
                    lse_smem,
                    delta_smem,
                    kv_ready,
                    kv_free,
                    q_ready,
                    do_ready,
                    qdo_free,
                    tile_smem,
                    tile_ready,
                    tile_free,
                    dk_desc,
                    dkr_desc,
                    dv_desc,
                    dk_ptr,
                    dv_ptr,
                    stride_kb,
                    stride_kh,
                    stride_kn,
                    stride_kd,
                    stride_vb,
                    stride_vh,
                    stride_vn,
                    stride_vd,
                    batch,
                    kv_head,
                    start_n,
                    m_start,
                    n_m,
                    n_tiles,
                    n_kb,
                    bucket,
                    H_KV,
                    M,
                    N,
                    sm_scale,
                    qk_scale,
                    gl.constexpr(0),
                    GROUP_SIZE,
                    CAUSAL,
                    BLOCK_M,
                    D,
                    DR,
                    DV,
                    STAGES,
                    PERSISTENT,
                ),
            ),
            (
                _bwd_consumer,
                (
                    q_smem,
                    qr_smem,
                    do_smem,
                    k_smem,
                    kr_smem,
                    v_smem,
                    lse_smem,
                    delta_smem,
                    kv_ready,
                    kv_free,
                    q_ready,
                    do_ready,
                    qdo_free,
                    tile_smem,
                    tile_ready,
                    tile_free,
                    dk_desc,
                    dkr_desc,
                    dv_desc,
                    dk_ptr,
                    dv_ptr,
                    stride_kb,
                    stride_kh,
                    stride_kn,
                    stride_kd,
                    stride_vb,
                    stride_vh,
                    stride_vn,
                    stride_vd,
                    batch,
                    kv_head,
                    start_n,
                    m_start,
                    n_m,
                    n_tiles,
                    n_kb,
                    bucket,
                    H_KV,
                    M,
                    N,
                    sm_scale,
                    qk_scale,
                    gl.constexpr(1),
                    GROUP_SIZE,
                    CAUSAL,
                    BLOCK_M,
                    D,
                    DR,
                    DV,
                    STAGES,
                    PERSISTENT,
                ),
            ),
            (
                _bwd_loader,
                (
                    q_desc,
                    qr_desc,
                    do_desc,
                    k_desc,
                    kr_desc,
                    v_desc,
                    lse_desc,
                    delta_desc,
                    q_smem,
                    qr_smem,
                    do_smem,
                    k_smem,
                    kr_smem,
                    v_smem,
                    lse_smem,
                    delta_smem,
                    kv_ready,
                    kv_free,
                    q_ready,
                    do_ready,
                    qdo_free,
                    tile_smem,
                    tile_ready,
                    tile_free,
                    counter_ptr,
                    batch,
                    kv_head,
                    start_n,
                    m_start,
                    n_m,
                    n_tiles,
                    n_kb,
                    bucket,
                    H_KV,
                    M,
                    N,
                    M_PAD,
                    GROUP_SIZE,
                    CAUSAL,
                    BLOCK_M,
                    STAGES,
                    PERSISTENT,
                    DR,
                ),
            ),
        ],
        [4, 1],
        [CONSUMER_REGS, LOADER_REGS],
    )


# dK/dV per (D_qk, D_v): (BLOCK_M, STAGES, PERSISTENT): query rows per streamed step, ring stages, and the schedule,
# the fastest of each pair's configs on an H200 (benchmarks/RESULTS.md). At D=128, 128-query steps do not fit the
# registers (S^T, dP^T, dK and dV accumulators: 256 per thread), and a persistent program's tile loop makes ptxas
# spill, so D=128 keeps one program per tile. MLA's 192/128 takes 32-query steps: with 64, its 64 x 192 and 64 x 128
# accumulators beside S^T and dP^T spill 108-604 bytes and serialize the wgmma.
BWD_CONFIGS = {
    (64, 64): (128, 2, True),
    (96, 64): (64, 2, True),
    (128, 128): (64, 2, False),
    (192, 128): (32, 4, False),
}


# Ring stages of the causal dK/dV with a KV group, where they differ from BWD_CONFIGS': three at D=64, which
# measured about 2% faster than two on an H200 (benchmarks/RESULTS.md); MHA, full attention and D=128 (where a
# third stage spills in the step loop) keep two.
BWD_CAUSAL_GQA_STAGES = {
    (64, 64): 3,
}


def dkdv_config(d: int, d_v: int, causal: bool, group: int) -> tuple[int, int, bool]:
    """`backward_dkdv`'s (BLOCK_M, STAGES, PERSISTENT) for head dims (d, d_v) and `group` query heads per KV head."""
    block_m, stages, persistent = BWD_CONFIGS[(d, d_v)]
    if causal and group > 1:
        stages = BWD_CAUSAL_GQA_STAGES.get((d, d_v), stages)
    return block_m, stages, persistent


def backward_dkdv(q, k, v, do, lse2, delta, dk, dv, sm_scale: float, causal: bool, config=None, key=None):
    """dK and dV into dk (B, H_kv, S_kv, D) and dv; q, k, v, do as `supports` accepted them (and do too); lse2 (lse
    in log2 units) and delta = rowsum(dO * Out) - dlse as `backward_dq` wrote them, contiguous (B, H_q,
    padded_rows(S_q)) fp32. The one-tile kernels (not `persistent`) write dK and dV by TMA in q's dtype: a dk or dv
    that TMA cannot write (its strides) or of another dtype is filled from a contiguous buffer in q's dtype.
    `key`: the caller's for the launch (`Launcher.keyed`)."""
    b, h_q, s_q, d = q.shape
    h_kv, s_kv, d_v = k.shape[1], k.shape[2], v.shape[3]
    block_m, stages, persistent = config or dkdv_config(d, d_v, causal, h_q // h_kv)
    # dK and dV by TMA, in q's dtype: each through a contiguous buffer where it cannot go so.
    if not persistent and staged_grads(
        lambda dk_, dv_: backward_dkdv(q, k, v, do, lse2, delta, dk_, dv_, sm_scale, causal, config, key),
        q.dtype,
        dk,
        dv,
    ):
        return
    rows = padded_rows(s_q)
    assert lse2.shape == delta.shape == (b, h_q, rows) and lse2.is_contiguous() and delta.is_contiguous()
    n_kb = cdiv(s_kv, PROGRAM_ROWS)
    n_tiles = n_kb * h_kv * b
    counter = tile_counter(q.device, persistent)
    q_desc, qr_desc = qk_descriptors(q, block_m)
    k_desc, kr_desc = qk_descriptors(k, PROGRAM_ROWS)
    d_main, d_rope = qk_tiles(d)
    # The persistent kernels store dK and dV from registers (their K/V buffers take the next tiles).
    dk_desc, dkr_desc = (None, None) if persistent else qk_descriptors(dk, ROWS_PER_CONSUMER)
    dv_desc = None if persistent else tile_descriptor(dv, ROWS_PER_CONSUMER)
    launcher(_flash_bwd_dkdv_sm90_kernel).keyed(key, (min(n_tiles, num_sms(q.device)) if persistent else n_tiles,))(
        q_desc,
        qr_desc,
        tile_descriptor(do, block_m),
        k_desc,
        kr_desc,
        tile_descriptor(v, PROGRAM_ROWS),
        descriptor(lse2.view(-1), [block_m]),
        descriptor(delta.view(-1), [block_m]),
        dk_desc,
        dkr_desc,
        dv_desc,
        dk,
        dv,
        counter,
        *dk.stride(),
        *dv.stride(),
        s_q,
        rows,
        s_kv,
        h_kv,
        n_tiles,
        bucket_size(n_kb, h_q // h_kv, causal),
        sm_scale,
        sm_scale * LOG2E,
        GROUP_SIZE=h_q // h_kv,
        CAUSAL=causal,
        BLOCK_M=block_m,
        D=d_main,
        DR=d_rope,
        DV=d_v,
        STAGES=stages,
        PERSISTENT=persistent,
        num_warps=4,
    )
