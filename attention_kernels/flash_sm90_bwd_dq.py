"""Flash attention backward for Hopper (sm_90) in Gluon, first of two launches: dQ, and for the dK/dV kernel the
rows' delta and lse in log2 units.

Math, per block of 128 query rows (two consumer warpgroups of 64) of one query head, with P recomputed from the
forward's lse (FlashAttention-2's backward, Dao 2023):

    delta = rowsum(dO * Out) - dlse                 (d lse / d S = P, so the lse gradient folds into delta)
    per key block j:   S = Q K_j^T    dP = dO V_j^T    P = exp2(qk_scale * S - lse2)    dS = P (dP - delta)
                       dQ += dS K_j                    (scaled by the softmax scale once, at the end)

Structure (the roles of flash_sm90_common.py): the loader brings each consumer's Q and dO rows, then K and V of
every key block through one ring, released together after dQ's product. Each step issues S and dP on the tensor
cores together. Causal blocks above the diagonal are never loaded; with 64-key blocks a warpgroup only releases the
last blocks its rows never see (`release_kv`). With DQ_CONFIGS' PERSISTENT (D = 64 and MLA's 96/64) one program
per SM takes tiles from a global counter, the next tile's Q and dO arriving in a second buffer; elsewhere one
program per tile. delta and lse2 go to buffers padded to whole programs of rows (`padded_rows`), so that the dK/dV
kernel reads a query block's rows as one in-bounds TMA copy.
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
    issue_scores,
    key_blocks,
    load_kv,
    padded_rows,
    publish_tile,
    qk_descriptors,
    qk_tiles,
    receive_tile,
    release_kv,
    store_rows,
    tile_counter,
    tile_descriptor,
    tile_handover,
    visible_mask,
)
from attention_kernels.schedule import bucket_size, ranked
from attention_kernels.sm90 import wgmma_layout


@gluon.jit
def _dq_tile(t, n_m, n_tiles, bucket, H, M, N, GROUP_SIZE: gl.constexpr, CAUSAL: gl.constexpr, BLOCK_N: gl.constexpr):
    """Tile t of the dQ schedule: (batch, head, KV head, first query row, key blocks, unmasked key blocks), in
    `schedule.ranked` order (causal: the last query blocks, which read the most keys, are the heaviest)."""
    BLOCK_M: gl.constexpr = CONSUMERS * ROWS
    pid_m, hb = ranked(t, n_m, n_tiles // n_m, bucket)
    if CAUSAL:
        pid_m = n_m - 1 - pid_m
    head = hb % H
    start_m = pid_m * BLOCK_M
    n_blocks, n_unmasked = key_blocks(start_m, M, N, CAUSAL, BLOCK_M, BLOCK_N)
    return hb // H, head, head // GROUP_SIZE, start_m, n_blocks, n_unmasked


@gluon.jit
def _dq_load_tile(
    q_desc,
    qr_desc,
    do_desc,
    k_desc,
    kr_desc,
    v_desc,
    q_smem,
    qr_smem,
    do_smem,
    k_smem,
    kr_smem,
    v_smem,
    q_ready,
    q_free,
    k_ready,
    v_ready,
    kv_free,
    batch,
    head,
    kv_head,
    start_m,
    n_blocks,
    g0,
    tc,
    BLOCK_N: gl.constexpr,
    STAGES: gl.constexpr,
    PERSISTENT: gl.constexpr,
    DR: gl.constexpr,
):
    """Loader, the program's tc-th tile: each consumer's Q and dO rows (one barrier for both; buffer tc % 2 when
    persistent, once the consumer is done with the tile before last there), then K and V of every key block into
    the ring, as the forward's loader; g0 counts the program's key blocks over its earlier tiles. DR > 0: Q's and
    K's last DR columns as second copies on the same barriers."""
    qb = (tc % 2) * CONSUMERS
    for c in gl.static_range(CONSUMERS):
        if PERSISTENT:
            mbarrier.wait(q_free.index(qb + c), ((tc // 2) & 1) ^ 1, pred=tc >= 2)
        if DR > 0:
            mbarrier.expect(
                q_ready.index(qb + c), q_desc.block_type.nbytes + qr_desc.block_type.nbytes + do_desc.block_type.nbytes
            )
            tma.async_copy_global_to_shared(
                qr_desc,
                [batch, head, start_m + c * ROWS, q_desc.block_type.shape[3]],
                q_ready.index(qb + c),
                qr_smem.index(qb + c),
            )
        else:
            mbarrier.expect(q_ready.index(qb + c), q_desc.block_type.nbytes + do_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(
            q_desc, [batch, head, start_m + c * ROWS, 0], q_ready.index(qb + c), q_smem.index(qb + c)
        )
        tma.async_copy_global_to_shared(
            do_desc, [batch, head, start_m + c * ROWS, 0], q_ready.index(qb + c), do_smem.index(qb + c)
        )
    for j in range(n_blocks):
        if PERSISTENT:
            g = g0 + j
        else:
            g = j
        load_kv(
            k_desc,
            kr_desc,
            v_desc,
            k_smem,
            kr_smem,
            v_smem,
            k_ready,
            v_ready,
            kv_free,
            kv_free,
            g,
            batch,
            kv_head,
            j * BLOCK_N,
            STAGES,
            STAGES,
            DR,
        )
    return g0 + n_blocks


@gluon.jit
def _dq_loader(
    q_desc,
    qr_desc,
    do_desc,
    k_desc,
    kr_desc,
    v_desc,
    q_smem,
    qr_smem,
    do_smem,
    k_smem,
    kr_smem,
    v_smem,
    q_ready,
    q_free,
    k_ready,
    v_ready,
    kv_free,
    tile_smem,
    tile_ready,
    tile_free,
    counter_ptr,
    batch,
    head,
    kv_head,
    start_m,
    n_blocks,
    n_m,
    n_tiles,
    bucket,
    H,
    M,
    N,
    GROUP_SIZE: gl.constexpr,
    CAUSAL: gl.constexpr,
    BLOCK_N: gl.constexpr,
    STAGES: gl.constexpr,
    PERSISTENT: gl.constexpr,
    DR: gl.constexpr,
):
    """One warp. PERSISTENT: tiles from the global counter, each handed to the consumers and loaded, the next
    tile's Q/dO and first key blocks arriving while the consumers finish this one. Else the program's own tile."""
    if PERSISTENT:
        g = 0
        tc = 0
        t = gl.program_id(0)
        while t < n_tiles:
            publish_tile(tile_smem, tile_ready, tile_free, tc, t)
            batch, head, kv_head, start_m, n_blocks, _ = _dq_tile(
                t, n_m, n_tiles, bucket, H, M, N, GROUP_SIZE, CAUSAL, BLOCK_N
            )
            g = _dq_load_tile(
                q_desc,
                qr_desc,
                do_desc,
                k_desc,
                kr_desc,
                v_desc,
                q_smem,
                qr_smem,
                do_smem,
                k_smem,
                kr_smem,
                v_smem,
                q_ready,
                q_free,
                k_ready,
                v_ready,
                kv_free,
                batch,
                head,
                kv_head,
                start_m,
                n_blocks,
                g,
                tc,
                BLOCK_N,
                STAGES,
                PERSISTENT,
                DR,
            )
            tc += 1
            t = gl.num_programs(0) + gl.atomic_add(counter_ptr, 1)  # the next tile nobody has taken
        publish_tile(tile_smem, tile_ready, tile_free, tc, t)
    else:
        _dq_load_tile(
            q_desc,
            qr_desc,
            do_desc,
            k_desc,
            kr_desc,
            v_desc,
            q_smem,
            qr_smem,
            do_smem,
            k_smem,
            kr_smem,
            v_smem,
            q_ready,
            q_free,
            k_ready,
            v_ready,
            kv_free,
            batch,
            head,
            kv_head,
            start_m,
            n_blocks,
            0,
            0,
            BLOCK_N,
            STAGES,
            PERSISTENT,
            DR,
        )


@gluon.jit
def _dq_tile_body(
    q_smem,
    qr_smem,
    do_smem,
    k_smem,
    kr_smem,
    v_smem,
    q_ready,
    q_free,
    k_ready,
    v_ready,
    kv_free,
    out_ptr,
    lse_ptr,
    dlse_ptr,
    delta_ptr,
    lse2_ptr,
    dq_ptr,
    stride_ob,
    stride_oh,
    stride_om,
    stride_od,
    stride_lb,
    stride_lh,
    stride_lm,
    stride_gb,
    stride_gh,
    stride_gm,
    stride_qb,
    stride_qh,
    stride_qm,
    stride_qd,
    batch,
    head,
    H,
    start_m,
    M,
    M_ROWS,
    N,
    n_blocks,
    n_unmasked,
    sm_scale,
    qk_scale,
    it0,
    tc,
    WG: gl.constexpr,
    CAUSAL: gl.constexpr,
    HAS_DLSE: gl.constexpr,
    WRITE_LSE2: gl.constexpr,
    BLOCK_N: gl.constexpr,
    D: gl.constexpr,
    DR: gl.constexpr,
    DV: gl.constexpr,
    STAGES: gl.constexpr,
    PERSISTENT: gl.constexpr,
):
    """One warpgroup, the program's tc-th tile, query rows [start_m + WG*64, +64): first delta = rowsum(dO * Out)
    - dlse (stored for the dK/dV kernel), then per key block S = Q K^T and dP = dO V^T issued together,
    P = exp2(S - lse), dS = P (dP - delta), dQ += dS K; it0 counts the program's key blocks over its earlier tiles
    (returned updated). With DR > 0, Q and K have DR more columns in tiles of their own: S adds both products and
    dQ's last DR columns are a second accumulator; Out, dO and V are DV wide."""
    s_layout: gl.constexpr = wgmma_layout(BLOCK_N)
    acc_layout: gl.constexpr = wgmma_layout(D)
    op_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=acc_layout, k_width=2)
    r_layout: gl.constexpr = wgmma_layout(DR if DR > 0 else D)
    r_op_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=r_layout, k_width=2)
    rows_s: gl.constexpr = gl.SliceLayout(1, s_layout)
    blk: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])
    dtype: gl.constexpr = q_smem.dtype
    start_m = start_m + WG * ROWS
    q_shift = N - M
    qb = (tc % 2) * CONSUMERS + WG
    q = q_smem.index(qb).reshape([ROWS, D])
    qr = q  # (unused without a RoPE part)
    if DR > 0:
        qr = qr_smem.index(qb).reshape([ROWS, DR])
    do = do_smem.index(qb).reshape([ROWS, DV])
    b64 = batch.to(gl.int64)
    h64 = head.to(gl.int64)

    # delta = rowsum(dO * Out) - dlse for the 64 rows, written for the dK/dV kernel into a contiguous (B, H, M_ROWS)
    # buffer (rows past M hold 0: dO's rows there are TMA's zero fill), and with WRITE_LSE2 the rows' lse in log2
    # units beside it (0 past M).
    offs_mb = start_m + gl.arange(0, ROWS, layout=gl.SliceLayout(1, blk))
    offs_db = gl.arange(0, DV, layout=gl.SliceLayout(0, blk))
    rows_ok = offs_mb < M
    o_ptrs = out_ptr + b64 * stride_ob + h64 * stride_oh + offs_mb[:, None] * stride_om + offs_db[None, :] * stride_od
    o = gl.load(o_ptrs, mask=rows_ok[:, None], other=0.0)
    mbarrier.wait(q_ready.index(qb), (tc // 2) & 1)
    delta = gl.sum(o.to(gl.float32) * do.load(blk).to(gl.float32), axis=1)
    if HAS_DLSE:
        delta -= gl.load(dlse_ptr + b64 * stride_gb + h64 * stride_gh + offs_mb * stride_gm, mask=rows_ok, other=0.0)
    gl.store(delta_ptr + (b64 * H + h64) * M_ROWS + offs_mb, delta, mask=offs_mb < M_ROWS)
    delta = gl.convert_layout(delta, rows_s)
    offs_ms = start_m + gl.arange(0, ROWS, layout=rows_s)
    lse = (
        gl.load(lse_ptr + b64 * stride_lb + h64 * stride_lh + offs_ms * stride_lm, mask=offs_ms < M, other=0.0)
        * 1.4426950408889634
    )
    if WRITE_LSE2:
        gl.store(lse2_ptr + (b64 * H + h64) * M_ROWS + offs_ms, lse, mask=offs_ms < M_ROWS)

    dq = gl.zeros([ROWS, D], gl.float32, acc_layout)
    dqr = dq  # (unused without a RoPE part)
    if DR > 0:
        dqr = gl.zeros([ROWS, DR], gl.float32, r_layout)
    s = gl.zeros([ROWS, BLOCK_N], gl.float32, s_layout)
    dp = gl.zeros([ROWS, BLOCK_N], gl.float32, s_layout)
    n_own = n_blocks
    if CAUSAL and BLOCK_N <= ROWS:  # the tile's last key blocks can lie wholly past these rows' diagonal
        n_own = gl.minimum(n_blocks, gl.cdiv(gl.maximum(q_shift + start_m + ROWS, 0), BLOCK_N))
    for j in range(n_own):
        if PERSISTENT:
            g = it0 + j  # the program's key block count over all of its tiles
        else:
            g = j
        st = g % STAGES
        phase = (g // STAGES) & 1
        mbarrier.wait(k_ready.index(st), phase)
        s = issue_scores(q, qr, k_smem, kr_smem, st, s, BLOCK_N, D, DR)
        mbarrier.wait(v_ready.index(st), phase)
        dp = warpgroup_mma(
            do, v_smem.index(st).reshape([BLOCK_N, DV]).permute((1, 0)), dp, use_acc=False, is_async=True
        )
        s = warpgroup_mma_wait(num_outstanding=1, deps=[s])
        p = gl.exp2(s * qk_scale - lse[:, None])
        if j >= n_unmasked:
            p = gl.where(visible_mask(j, start_m, q_shift, N, CAUSAL, BLOCK_N, s_layout), p, 0.0)
        dp = warpgroup_mma_wait(num_outstanding=0, deps=[dp])
        ds = (p * (dp - delta[:, None])).to(dtype)
        dq = warpgroup_mma(gl.convert_layout(ds, op_layout), k_smem.index(st).reshape([BLOCK_N, D]), dq, is_async=True)
        if DR > 0:
            dqr = warpgroup_mma(
                gl.convert_layout(ds, r_op_layout), kr_smem.index(st).reshape([BLOCK_N, DR]), dqr, is_async=True
            )
            dq, dqr = warpgroup_mma_wait(num_outstanding=0, deps=[dq, dqr])
        else:
            dq = warpgroup_mma_wait(num_outstanding=0, deps=[dq])
        mbarrier.arrive(kv_free.index(st), count=1)
    if CAUSAL and BLOCK_N <= ROWS:
        release_kv(k_ready, v_ready, kv_free, it0, n_own, n_blocks, STAGES, PERSISTENT)
    if PERSISTENT:
        mbarrier.arrive(q_free.index(qb), count=1)  # the loader may bring the tile after next's Q and dO here

    offs_m = start_m + gl.arange(0, ROWS, layout=gl.SliceLayout(1, acc_layout))
    offs_d = gl.arange(0, D, layout=gl.SliceLayout(0, acc_layout))
    gl.store(
        dq_ptr + b64 * stride_qb + h64 * stride_qh + offs_m[:, None] * stride_qm + offs_d[None, :] * stride_qd,
        (dq * sm_scale).to(dq_ptr.dtype.element_ty),
        mask=(offs_m < M)[:, None],
    )
    if DR > 0:
        store_rows(
            dq_ptr + b64 * stride_qb + h64 * stride_qh,
            dqr * sm_scale,
            start_m,
            M,
            stride_qm,
            stride_qd,
            D,
            DR,
            r_layout,
        )
    return it0 + n_blocks


@gluon.jit
def _dq_consumer(
    q_smem,
    qr_smem,
    do_smem,
    k_smem,
    kr_smem,
    v_smem,
    q_ready,
    q_free,
    k_ready,
    v_ready,
    kv_free,
    tile_smem,
    tile_ready,
    tile_free,
    out_ptr,
    lse_ptr,
    dlse_ptr,
    delta_ptr,
    lse2_ptr,
    dq_ptr,
    stride_ob,
    stride_oh,
    stride_om,
    stride_od,
    stride_lb,
    stride_lh,
    stride_lm,
    stride_gb,
    stride_gh,
    stride_gm,
    stride_qb,
    stride_qh,
    stride_qm,
    stride_qd,
    batch,
    head,
    H,
    start_m,
    M,
    M_ROWS,
    N,
    n_blocks,
    n_unmasked,
    n_m,
    n_tiles,
    bucket,
    sm_scale,
    qk_scale,
    WG: gl.constexpr,
    GROUP_SIZE: gl.constexpr,
    CAUSAL: gl.constexpr,
    HAS_DLSE: gl.constexpr,
    WRITE_LSE2: gl.constexpr,
    BLOCK_N: gl.constexpr,
    D: gl.constexpr,
    DR: gl.constexpr,
    DV: gl.constexpr,
    STAGES: gl.constexpr,
    PERSISTENT: gl.constexpr,
):
    """One warpgroup: `_dq_tile_body` for each tile the loader hands over (PERSISTENT), else for the program's
    own."""
    if PERSISTENT:
        it = 0
        tc = 0
        tile = receive_tile(tile_smem, tile_ready, tile_free, 0)
        while tile < n_tiles:
            batch, head, _, start_m, n_blocks, n_unmasked = _dq_tile(
                tile, n_m, n_tiles, bucket, H, M, N, GROUP_SIZE, CAUSAL, BLOCK_N
            )
            it = _dq_tile_body(
                q_smem,
                qr_smem,
                do_smem,
                k_smem,
                kr_smem,
                v_smem,
                q_ready,
                q_free,
                k_ready,
                v_ready,
                kv_free,
                out_ptr,
                lse_ptr,
                dlse_ptr,
                delta_ptr,
                lse2_ptr,
                dq_ptr,
                stride_ob,
                stride_oh,
                stride_om,
                stride_od,
                stride_lb,
                stride_lh,
                stride_lm,
                stride_gb,
                stride_gh,
                stride_gm,
                stride_qb,
                stride_qh,
                stride_qm,
                stride_qd,
                batch,
                head,
                H,
                start_m,
                M,
                M_ROWS,
                N,
                n_blocks,
                n_unmasked,
                sm_scale,
                qk_scale,
                it,
                tc,
                WG,
                CAUSAL,
                HAS_DLSE,
                WRITE_LSE2,
                BLOCK_N,
                D,
                DR,
                DV,
                STAGES,
                PERSISTENT,
            )
            tc += 1
            tile = receive_tile(tile_smem, tile_ready, tile_free, tc)
    else:
        _dq_tile_body(
            q_smem,
            qr_smem,
            do_smem,
            k_smem,
            kr_smem,
            v_smem,
            q_ready,
            q_free,
            k_ready,
            v_ready,
            kv_free,
            out_ptr,
            lse_ptr,
            dlse_ptr,
            delta_ptr,
            lse2_ptr,
            dq_ptr,
            stride_ob,
            stride_oh,
            stride_om,
            stride_od,
            stride_lb,
            stride_lh,
            stride_lm,
            stride_gb,
            stride_gh,
            stride_gm,
            stride_qb,
            stride_qh,
            stride_qm,
            stride_qd,
            batch,
            head,
            H,
            start_m,
            M,
            M_ROWS,
            N,
            n_blocks,
            n_unmasked,
            sm_scale,
            qk_scale,
            0,
            0,
            WG,
            CAUSAL,
            HAS_DLSE,
            WRITE_LSE2,
            BLOCK_N,
            D,
            DR,
            DV,
            STAGES,
            PERSISTENT,
        )


@gluon.jit
def _flash_bwd_dq_sm90_kernel(
    q_desc,
    qr_desc,
    do_desc,
    k_desc,
    kr_desc,
    v_desc,
    out_ptr,
    lse_ptr,
    dlse_ptr,
    delta_ptr,
    lse2_ptr,
    dq_ptr,
    counter_ptr,
    stride_ob,
    stride_oh,
    stride_om,
    stride_od,
    stride_lb,
    stride_lh,
    stride_lm,
    stride_gb,
    stride_gh,
    stride_gm,
    stride_qb,
    stride_qh,
    stride_qm,
    stride_qd,
    M,
    M_ROWS,
    N,
    H,
    n_tiles,
    bucket,
    sm_scale,
    qk_scale,
    GROUP_SIZE: gl.constexpr,
    CAUSAL: gl.constexpr,
    HAS_DLSE: gl.constexpr,
    WRITE_LSE2: gl.constexpr,
    BLOCK_N: gl.constexpr,
    D: gl.constexpr,
    DR: gl.constexpr,
    DV: gl.constexpr,
    STAGES: gl.constexpr,
    PERSISTENT: gl.constexpr,
):
    """Tiles of (128 query rows, query head, batch). PERSISTENT, as the forward: one program per SM takes tiles from
    a global counter, with two Q/dO buffers per consumer. Else one program per tile. Q and K as TMA tiles of their
    first D columns and, with DR > 0, of their last DR (as the forward)."""
    n_m = gl.cdiv(M, CONSUMERS * ROWS)
    # The program's own tile, for one program per tile (the persistent roles ignore it).
    batch, head, kv_head, start_m, n_blocks, n_unmasked = _dq_tile(
        gl.program_id(0), n_m, gl.num_programs(0), bucket, H, M, N, GROUP_SIZE, CAUSAL, BLOCK_N
    )

    Q_BUFFERS: gl.constexpr = 2 * CONSUMERS if PERSISTENT else CONSUMERS
    q_smem = gl.allocate_shared_memory(q_desc.dtype, [Q_BUFFERS] + q_desc.block_type.shape, q_desc.layout)
    do_smem = gl.allocate_shared_memory(do_desc.dtype, [Q_BUFFERS] + do_desc.block_type.shape, do_desc.layout)
    k_smem = gl.allocate_shared_memory(k_desc.dtype, [STAGES] + k_desc.block_type.shape, k_desc.layout)
    if DR > 0:
        qr_smem = gl.allocate_shared_memory(qr_desc.dtype, [Q_BUFFERS] + qr_desc.block_type.shape, qr_desc.layout)
        kr_smem = gl.allocate_shared_memory(kr_desc.dtype, [STAGES] + kr_desc.block_type.shape, kr_desc.layout)
    else:  # (not used)
        qr_smem = q_smem
        kr_smem = k_smem
    v_smem = gl.allocate_shared_memory(v_desc.dtype, [STAGES] + v_desc.block_type.shape, v_desc.layout)
    q_ready = gl.allocate_shared_memory(gl.int64, [Q_BUFFERS, 1], mbarrier.MBarrierLayout())
    k_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    v_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    kv_free = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for c in gl.static_range(Q_BUFFERS):
        mbarrier.init(q_ready.index(c), count=1)
    for i in gl.static_range(STAGES):
        mbarrier.init(k_ready.index(i), count=1)
        mbarrier.init(v_ready.index(i), count=1)
        mbarrier.init(kv_free.index(i), count=CONSUMERS)
    if PERSISTENT:  # the tile hand-over and the Q/dO buffers' release
        q_free = gl.allocate_shared_memory(gl.int64, [Q_BUFFERS, 1], mbarrier.MBarrierLayout())
        for c in gl.static_range(Q_BUFFERS):
            mbarrier.init(q_free.index(c), count=1)
        tile_smem, tile_ready, tile_free = tile_handover()
    else:  # (not used: one tile per program needs no hand-over)
        q_free = q_ready
        tile_smem = q_ready
        tile_ready = q_ready
        tile_free = q_ready
    fence_async_shared()
    gl.warp_specialize(
        [
            (
                _dq_consumer,
                (
                    q_smem,
                    qr_smem,
                    do_smem,
                    k_smem,
                    kr_smem,
                    v_smem,
                    q_ready,
                    q_free,
                    k_ready,
                    v_ready,
                    kv_free,
                    tile_smem,
                    tile_ready,
                    tile_free,
                    out_ptr,
                    lse_ptr,
                    dlse_ptr,
                    delta_ptr,
                    lse2_ptr,
                    dq_ptr,
                    stride_ob,
                    stride_oh,
                    stride_om,
                    stride_od,
                    stride_lb,
                    stride_lh,
                    stride_lm,
                    stride_gb,
                    stride_gh,
                    stride_gm,
                    stride_qb,
                    stride_qh,
                    stride_qm,
                    stride_qd,
                    batch,
                    head,
                    H,
                    start_m,
                    M,
                    M_ROWS,
                    N,
                    n_blocks,
                    n_unmasked,
                    n_m,
                    n_tiles,
                    bucket,
                    sm_scale,
                    qk_scale,
                    gl.constexpr(0),
                    GROUP_SIZE,
                    CAUSAL,
                    HAS_DLSE,
                    WRITE_LSE2,
                    BLOCK_N,
                    D,
                    DR,
                    DV,
                    STAGES,
                    PERSISTENT,
                ),
            ),
            (
                _dq_consumer,
                (
                    q_smem,
                    qr_smem,
                    do_smem,
                    k_smem,
                    kr_smem,
                    v_smem,
                    q_ready,
                    q_free,
                    k_ready,
                    v_ready,
                    kv_free,
                    tile_smem,
                    tile_ready,
                    tile_free,
                    out_ptr,
                    lse_ptr,
                    dlse_ptr,
                    delta_ptr,
                    lse2_ptr,
                    dq_ptr,
                    stride_ob,
                    stride_oh,
                    stride_om,
                    stride_od,
                    stride_lb,
                    stride_lh,
                    stride_lm,
                    stride_gb,
                    stride_gh,
                    stride_gm,
                    stride_qb,
                    stride_qh,
                    stride_qm,
                    stride_qd,
                    batch,
                    head,
                    H,
                    start_m,
                    M,
                    M_ROWS,
                    N,
                    n_blocks,
                    n_unmasked,
                    n_m,
                    n_tiles,
                    bucket,
                    sm_scale,
                    qk_scale,
                    gl.constexpr(1),
                    GROUP_SIZE,
                    CAUSAL,
                    HAS_DLSE,
                    WRITE_LSE2,
                    BLOCK_N,
                    D,
                    DR,
                    DV,
                    STAGES,
                    PERSISTENT,
                ),
            ),
            (
                _dq_loader,
                (
                    q_desc,
                    qr_desc,
                    do_desc,
                    k_desc,
                    kr_desc,
                    v_desc,
                    q_smem,
                    qr_smem,
                    do_smem,
                    k_smem,
                    kr_smem,
                    v_smem,
                    q_ready,
                    q_free,
                    k_ready,
                    v_ready,
                    kv_free,
                    tile_smem,
                    tile_ready,
                    tile_free,
                    counter_ptr,
                    batch,
                    head,
                    kv_head,
                    start_m,
                    n_blocks,
                    n_m,
                    n_tiles,
                    bucket,
                    H,
                    M,
                    N,
                    GROUP_SIZE,
                    CAUSAL,
                    BLOCK_N,
                    STAGES,
                    PERSISTENT,
                    DR,
                ),
            ),
        ],
        [4, 1],
        [CONSUMER_REGS, LOADER_REGS],
    )


# Per (D_qk, D_v): (BLOCK_N, STAGES, PERSISTENT) of the dQ kernel: keys per streamed block, ring stages and the
# schedule, the fastest of each pair's configs without register spills on an H200 (benchmarks/RESULTS.md).
# 128-key blocks spill at D=128, and so does a persistent program's tile loop there, so D=128 keeps 64-key blocks
# and one program per tile.
DQ_CONFIGS = {
    (64, 64): (128, 2, True),
    (96, 64): (128, 2, True),
    (128, 128): (64, 2, False),
    (192, 128): (64, 2, False),
}


def backward_dq(
    q, k, v, out, do, lse, dlse, delta, dq, sm_scale: float, causal: bool, lse2=None, config=None, key=None
):
    """dQ into dq (B, H_q, S_q, D, any strides) and delta = rowsum(dO * Out) - dlse into delta, a contiguous fp32
    (B, H_q, R) with R = S_q, or R = padded_rows(S_q) for `backward_dkdv`, which also takes lse2 (the lse in log2
    units, written here, same shape). q, k, v, do as `supports_backward` accepted them, dlse None or
    (B, H_q, S_q) fp32. `key`: the caller's for the launch (`Launcher.keyed`)."""
    b, h_q, s_q, d = q.shape
    h_kv, s_kv, d_v = k.shape[1], k.shape[2], v.shape[3]
    rows = delta.shape[-1]
    assert delta.is_contiguous() and delta.shape == (b, h_q, rows) and rows in (s_q, padded_rows(s_q))
    assert lse2 is None or (lse2.is_contiguous() and lse2.shape == delta.shape)
    dlse_arg = dlse if dlse is not None else lse
    block_n, stages, persistent = config or DQ_CONFIGS[(d, d_v)]
    n_m = cdiv(s_q, PROGRAM_ROWS)
    n_tiles = n_m * h_q * b
    counter = tile_counter(q.device, persistent)
    q_desc, qr_desc = qk_descriptors(q, ROWS_PER_CONSUMER)
    k_desc, kr_desc = qk_descriptors(k, block_n)
    d_main, d_rope = qk_tiles(d)
    launcher(_flash_bwd_dq_sm90_kernel).keyed(key, (min(n_tiles, num_sms(q.device)) if persistent else n_tiles,))(
        q_desc,
        qr_desc,
        tile_descriptor(do, ROWS_PER_CONSUMER),
        k_desc,
        kr_desc,
        tile_descriptor(v, block_n),
        out,
        lse,
        dlse_arg,
        delta,
        lse2 if lse2 is not None else delta,
        dq,
        counter,
        *out.stride(),
        *lse.stride(),
        *dlse_arg.stride(),
        *dq.stride(),
        s_q,
        rows,
        s_kv,
        h_q,
        n_tiles,
        bucket_size(n_m, h_q // h_kv, causal),
        sm_scale,
        sm_scale * LOG2E,
        GROUP_SIZE=h_q // h_kv,
        CAUSAL=causal,
        HAS_DLSE=dlse is not None,
        WRITE_LSE2=lse2 is not None,
        BLOCK_N=block_n,
        D=d_main,
        DR=d_rope,
        DV=d_v,
        STAGES=stages,
        PERSISTENT=persistent,
        num_warps=4,
    )
