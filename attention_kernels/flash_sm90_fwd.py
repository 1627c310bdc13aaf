"""Flash attention forward for Hopper (sm_90) in Gluon: persistent and warp-specialized (FlashAttention-3's
structure, Shah et al. 2024).

Math, per query head h (reading KV head h // GROUP_SIZE), over key blocks j in the log2 domain (qk_scale = the
softmax scale times log2(e)); FlashAttention-2's online softmax (Dao 2023):

    S_j = qk_scale * Q K_j^T        m_j = max(m_{j-1}, rowmax S_j)        P_j = exp2(S_j - m_j)
    l_j = l_{j-1} exp2(m_{j-1} - m_j) + rowsum P_j        O_j = O_{j-1} exp2(m_{j-1} - m_j) + P_j V_j
    out = O / l        lse = ln 2 * (m + log2 l)                  (natural log)

Structure (the roles of flash_sm90_common.py):
- persistent: one program per SM takes tiles of 128 query rows of one (query head, batch) from a global counter in
  `schedule.ranked` order (heavy causal tiles first), so programs that drew light tiles take more of them; while
  the consumers finish a tile the loader already streams the next tile's Q and K/V.
- the loader streams K and V through a ring each (CONFIGS: K and V stages). The consumers release a K buffer once
  its scores are in and a V buffer once its P V is, so K's ring turns over sooner and needs fewer stages.
- each consumer warpgroup owns 64 query rows. The scores of key block j and P V of block j-1 are issued together,
  P stays in registers as the A operand of the P V wgmma, and each warpgroup's softmax runs while the other's
  products are on the tensor cores.
- causal: blocks wholly above the diagonal are never loaded; only blocks on the diagonal or past the sequence end
  are masked, with one compare per score against a per-row limit. Where blocks are 64 keys wide, a warpgroup skips
  the tile's last blocks its own rows never see and only releases their ring slots (`_skip_kv`).
- a consumer releases its Q buffer with the tile's last scores, so the next tile's Q arrives while it finishes;
  the output leaves through a shared-memory buffer of its own by a TMA store, which clips the rows past S_q.
"""

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)

from attention_kernels import _checks
from attention_kernels._host import cdiv, launcher, num_sms
from attention_kernels.flash_sm90_common import (
    CONSUMER_REGS,
    CONSUMERS,
    LOADER_REGS,
    PROGRAM_ROWS,
    ROWS,
    ROWS_PER_CONSUMER,
    SMEM_PER_PROGRAM,
    issue_scores,
    key_blocks,
    load_kv,
    publish_tile,
    qk_descriptors,
    qk_tiles,
    receive_tile,
    tile_counter,
    tile_descriptor,
    tile_handover,
    visible_mask,
)
from attention_kernels.schedule import bucket_size, ranked
from attention_kernels.sm90 import wgmma_layout


@gluon.jit
def _tile(t, n_tiles, n_m, bucket, H, M, N, CAUSAL: gl.constexpr, BLOCK_N: gl.constexpr):
    """Tile t of the persistent schedule: (batch, head, first query row, key blocks, unmasked key blocks), in
    `schedule.ranked` order with query blocks as ranks. Causal ranks count from the last query block (which sees
    the most keys) down, so the lightest tiles fill the tail; heads of a KV group are neighbouring pairs."""
    BLOCK_M: gl.constexpr = CONSUMERS * ROWS
    pid_m, hb = ranked(t, n_m, n_tiles // n_m, bucket)
    head = hb % H
    batch = hb // H
    if CAUSAL:
        pid_m = n_m - 1 - pid_m
    start_m = pid_m * BLOCK_M
    n_blocks, n_unmasked = key_blocks(start_m, M, N, CAUSAL, BLOCK_M, BLOCK_N)
    return batch, head, start_m, n_blocks, n_unmasked


@gluon.jit
def _loader(
    q_desc,
    qr_desc,
    k_desc,
    kr_desc,
    v_desc,
    q_smem,
    qr_smem,
    k_smem,
    kr_smem,
    v_smem,
    q_ready,
    q_free,
    k_ready,
    v_ready,
    k_free,
    v_free,
    tile_smem,
    tile_ready,
    tile_free,
    counter_ptr,
    n_tiles,
    n_m,
    bucket,
    H,
    M,
    N,
    GROUP_SIZE: gl.constexpr,
    CAUSAL: gl.constexpr,
    BLOCK_N: gl.constexpr,
    K_STAGES: gl.constexpr,
    V_STAGES: gl.constexpr,
    DR: gl.constexpr,
):
    """One warp: for each tile, each consumer's Q rows, then K and V of every key block into their rings. Key block
    number g (counted over all of the program's tiles) goes into stage g % K_STAGES of K's ring and g % V_STAGES of
    V's once every consumer has released those stages' previous blocks (`load_kv`); a consumer's Q buffer is
    refilled once that consumer has the previous tile's last scores."""
    g = 0
    tc = 0
    t = gl.program_id(0)
    while t < n_tiles:
        publish_tile(tile_smem, tile_ready, tile_free, tc, t)
        batch, head, start_m, n_blocks, n_unmasked = _tile(t, n_tiles, n_m, bucket, H, M, N, CAUSAL, BLOCK_N)
        kv_head = head // GROUP_SIZE
        for c in gl.static_range(CONSUMERS):
            mbarrier.wait(q_free.index(c), (tc & 1) ^ 1, pred=tc > 0)
            if DR > 0:
                mbarrier.expect(q_ready.index(c), q_desc.block_type.nbytes + qr_desc.block_type.nbytes)
                tma.async_copy_global_to_shared(
                    qr_desc,
                    [batch, head, start_m + c * ROWS, q_desc.block_type.shape[3]],
                    q_ready.index(c),
                    qr_smem.index(c),
                )
            else:
                mbarrier.expect(q_ready.index(c), q_desc.block_type.nbytes)
            tma.async_copy_global_to_shared(
                q_desc, [batch, head, start_m + c * ROWS, 0], q_ready.index(c), q_smem.index(c)
            )
        for j in range(n_blocks):
            load_kv(
                k_desc,
                kr_desc,
                v_desc,
                k_smem,
                kr_smem,
                v_smem,
                k_ready,
                v_ready,
                k_free,
                v_free,
                g,
                batch,
                kv_head,
                j * BLOCK_N,
                K_STAGES,
                V_STAGES,
                DR,
            )
            g += 1
        tc += 1
        t = gl.num_programs(0) + gl.atomic_add(counter_ptr, 1)  # the next tile nobody has taken
    publish_tile(tile_smem, tile_ready, tile_free, tc, t)


@gluon.jit
def _mask(s, j, n_unmasked, start_m, q_shift, N, CAUSAL: gl.constexpr, BLOCK_N: gl.constexpr, s_layout: gl.constexpr):
    """Scores of key block j with the causal diagonal and the sequence end masked; blocks before n_unmasked are
    wholly visible to every row of the tile and pass through untouched."""
    if j >= n_unmasked:
        s = gl.where(visible_mask(j, start_m, q_shift, N, CAUSAL, BLOCK_N, s_layout), s, -float("inf"))
    return s


@gluon.jit
def _step(
    q,
    qr,
    k_smem,
    kr_smem,
    v_smem,
    k_ready,
    v_ready,
    k_free,
    v_free,
    q_free,
    last,
    p,
    p_op,
    acc,
    m_i,
    l_i,
    gj,
    j,
    n_unmasked,
    start_m,
    q_shift,
    N,
    qk_scale,
    CAUSAL: gl.constexpr,
    BLOCK_N: gl.constexpr,
    D: gl.constexpr,
    DR: gl.constexpr,
    DV: gl.constexpr,
    K_STAGES: gl.constexpr,
    V_STAGES: gl.constexpr,
    s_layout: gl.constexpr,
    o_layout: gl.constexpr,
    p_layout: gl.constexpr,
):
    """Key block j (the program's gj-th): its scores and block j-1's P V on the tensor cores together, then block
    j's softmax (written to overlap that P V; ptxas waits for it first, see the module docstring). K's stage is
    released once the scores are in, V's once P V is, and with `last` (the tile's last block) the Q buffer too."""
    st = gj % K_STAGES
    prev = (gj - 1) % V_STAGES
    mbarrier.wait(k_ready.index(st), (gj // K_STAGES) & 1)
    mbarrier.wait(v_ready.index(prev), ((gj - 1) // V_STAGES) & 1)
    # The scores go into the registers of block j-1's dead fp32 probabilities (use_acc=False).
    s = issue_scores(q, qr, k_smem, kr_smem, st, p, BLOCK_N, D, DR)
    acc = warpgroup_mma(p_op, v_smem.index(prev).reshape([BLOCK_N, DV]), acc, is_async=True)
    s = warpgroup_mma_wait(num_outstanding=1, deps=[s])  # scores in; P V of block j-1 may still run
    mbarrier.arrive(k_free.index(st), count=1)  # K of block j is no longer read
    mbarrier.arrive(q_free, count=1, pred=last)
    s = _mask(s, j, n_unmasked, start_m, q_shift, N, CAUSAL, BLOCK_N, s_layout)
    m_ij = gl.maximum(m_i, gl.max(s, 1) * qk_scale)
    p = gl.exp2(s * qk_scale - m_ij[:, None])
    alpha = gl.exp2(m_i - m_ij)
    l_i = l_i * alpha + gl.sum(p, 1)
    acc = warpgroup_mma_wait(num_outstanding=0, deps=[acc])
    mbarrier.arrive(v_free.index(prev), count=1)  # V of block j-1 is no longer read
    acc = acc * gl.convert_layout(alpha, gl.SliceLayout(1, o_layout))[:, None]
    p_op = gl.convert_layout(p.to(p_op.dtype), p_layout)
    return p, p_op, acc, m_ij, l_i


@gluon.jit
def _skip_kv(k_ready, v_ready, k_free, v_free, g0, j0, n_blocks, K_STAGES: gl.constexpr, V_STAGES: gl.constexpr):
    """The forward's `release_kv`: blocks [j0, n_blocks) of the tile whose first is the program's g0-th lie wholly
    past this warpgroup's rows; release their K and V stages once each has arrived."""
    for j in range(j0, n_blocks):
        g = g0 + j
        mbarrier.wait(k_ready.index(g % K_STAGES), (g // K_STAGES) & 1)
        mbarrier.arrive(k_free.index(g % K_STAGES), count=1)
        mbarrier.wait(v_ready.index(g % V_STAGES), (g // V_STAGES) & 1)
        mbarrier.arrive(v_free.index(g % V_STAGES), count=1)


@gluon.jit
def _consumer(
    q_smem,
    qr_smem,
    k_smem,
    kr_smem,
    v_smem,
    o_smem,
    q_ready,
    q_free,
    k_ready,
    v_ready,
    k_free,
    v_free,
    tile_smem,
    tile_ready,
    tile_free,
    o_desc,
    lse_ptr,
    stride_lb,
    stride_lh,
    stride_lm,
    n_tiles,
    n_m,
    bucket,
    H,
    M,
    N,
    qk_scale,
    WG: gl.constexpr,
    CAUSAL: gl.constexpr,
    BLOCK_N: gl.constexpr,
    D: gl.constexpr,
    DR: gl.constexpr,
    DV: gl.constexpr,
    K_STAGES: gl.constexpr,
    V_STAGES: gl.constexpr,
):
    """One warpgroup: for each tile, the online softmax over its key blocks for query rows
    [start_m + WG*64, +64), then its rows of lse, and of out through shared memory (o_smem) and a TMA store, which
    clips the rows past M. Its Q buffer is released with the tile's last scores, so that the next tile's Q arrives
    while this one ends."""
    s_layout: gl.constexpr = wgmma_layout(BLOCK_N)
    o_layout: gl.constexpr = wgmma_layout(DV)
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    row_o: gl.constexpr = gl.SliceLayout(1, o_layout)
    dtype: gl.constexpr = q_smem.dtype
    q = q_smem.index(WG).reshape([ROWS, D])
    qr = q  # (unused without a RoPE part)
    if DR > 0:
        qr = qr_smem.index(WG).reshape([ROWS, DR])
    q_shift = N - M
    g = 0
    tc = 0
    t = receive_tile(tile_smem, tile_ready, tile_free, 0)
    while t < n_tiles:
        batch, head, start_m, n_blocks, n_unmasked = _tile(t, n_tiles, n_m, bucket, H, M, N, CAUSAL, BLOCK_N)
        start_m = start_m + WG * ROWS
        mbarrier.wait(q_ready.index(WG), tc & 1)
        m_i = gl.full([ROWS], -float("inf"), gl.float32, gl.SliceLayout(1, s_layout))
        acc = gl.zeros([ROWS, DV], gl.float32, o_layout)
        p = gl.zeros([ROWS, BLOCK_N], gl.float32, s_layout)

        # Causal, with key blocks of at most 64: the tile's last blocks can lie wholly past these 64 rows
        # (_skip_kv).
        n_own = n_blocks
        if CAUSAL and BLOCK_N <= ROWS:
            n_own = gl.minimum(n_blocks, gl.cdiv(q_shift + start_m + ROWS, BLOCK_N))

        # Key block 0: its scores alone.
        st = g % K_STAGES
        mbarrier.wait(k_ready.index(st), (g // K_STAGES) & 1)
        s = issue_scores(q, qr, k_smem, kr_smem, st, p, BLOCK_N, D, DR)
        s = warpgroup_mma_wait(num_outstanding=0, deps=[s])
        mbarrier.arrive(k_free.index(st), count=1)
        mbarrier.arrive(q_free.index(WG), count=1, pred=n_own == 1)
        s = _mask(s, 0, n_unmasked, start_m, q_shift, N, CAUSAL, BLOCK_N, s_layout)
        m_i = gl.maximum(m_i, gl.max(s, 1) * qk_scale)
        p = gl.exp2(s * qk_scale - m_i[:, None])
        l_i = gl.sum(p, 1)
        p_op = gl.convert_layout(p.to(dtype), p_layout)

        # Key blocks 1..: each step issues the scores of block j and P V of block j-1 together.
        for j in range(1, n_own):
            p, p_op, acc, m_i, l_i = _step(
                q,
                qr,
                k_smem,
                kr_smem,
                v_smem,
                k_ready,
                v_ready,
                k_free,
                v_free,
                q_free.index(WG),
                j == n_own - 1,
                p,
                p_op,
                acc,
                m_i,
                l_i,
                g + j,
                j,
                n_unmasked,
                start_m,
                q_shift,
                N,
                qk_scale,
                CAUSAL,
                BLOCK_N,
                D,
                DR,
                DV,
                K_STAGES,
                V_STAGES,
                s_layout,
                o_layout,
                p_layout,
            )

        last = (g + n_own - 1) % V_STAGES
        mbarrier.wait(v_ready.index(last), ((g + n_own - 1) // V_STAGES) & 1)
        acc = warpgroup_mma(p_op, v_smem.index(last).reshape([BLOCK_N, DV]), acc, is_async=True)
        acc = warpgroup_mma_wait(num_outstanding=0, deps=[acc])
        mbarrier.arrive(v_free.index(last), count=1)
        if CAUSAL and BLOCK_N <= ROWS:
            _skip_kv(k_ready, v_ready, k_free, v_free, g, n_own, n_blocks, K_STAGES, V_STAGES)
        g += n_blocks
        tc += 1

        # Every row sees at least key 0 (bottom-right alignment, S_q <= S_kv), so l_i > 0; padding rows (past M,
        # zero-filled by TMA) are finite too and never stored. The loader is already streaming the next tile.
        out = acc / gl.convert_layout(l_i, row_o)[:, None]
        lse = (m_i + gl.log2(l_i)) * 0.6931471805599453  # natural log
        tma.store_wait(0)  # the previous tile's output has been read out of o_smem
        o_smem.index(WG).reshape([ROWS, DV]).store(out.to(dtype))
        fence_async_shared()
        tma.async_copy_shared_to_global(o_desc, [batch, head, start_m, 0], o_smem.index(WG))
        offs_l = start_m + gl.arange(0, ROWS, layout=gl.SliceLayout(1, s_layout))
        l_ptrs = lse_ptr + batch.to(gl.int64) * stride_lb + head.to(gl.int64) * stride_lh + offs_l * stride_lm
        gl.store(l_ptrs, lse, mask=offs_l < M)
        t = receive_tile(tile_smem, tile_ready, tile_free, tc)
    tma.store_wait(0)


@gluon.jit
def _flash_fwd_sm90_kernel(
    q_desc,
    qr_desc,
    k_desc,
    kr_desc,
    v_desc,
    o_desc,
    lse_ptr,
    counter_ptr,
    stride_lb,
    stride_lh,
    stride_lm,
    n_tiles,
    n_m,
    bucket,
    H,
    M,
    N,
    qk_scale,
    GROUP_SIZE: gl.constexpr,
    CAUSAL: gl.constexpr,
    BLOCK_N: gl.constexpr,
    D: gl.constexpr,
    DR: gl.constexpr,
    DV: gl.constexpr,
    K_STAGES: gl.constexpr,
    V_STAGES: gl.constexpr,
):
    """Persistent: one program per SM (or per tile, when fewer). Program p starts with tile p; its loader then takes
    the next tile nobody has taken from a global counter (an atomic add), so programs that drew light causal tiles
    take more of them. The loader hands each tile number to the consumers through shared memory (tile_ready /
    tile_free, two slots), and streams the next tile's Q and K/V while they finish the previous one.
    Q and K are TMA tiles of their first D columns, and with DR > 0 a second tile each of their last DR columns
    (MLA's 128 + 64: a TMA tile's width must be a power of two); the scores add both products."""
    q_smem = gl.allocate_shared_memory(q_desc.dtype, [CONSUMERS] + q_desc.block_type.shape, q_desc.layout)
    k_smem = gl.allocate_shared_memory(k_desc.dtype, [K_STAGES] + k_desc.block_type.shape, k_desc.layout)
    if DR > 0:
        qr_smem = gl.allocate_shared_memory(qr_desc.dtype, [CONSUMERS] + qr_desc.block_type.shape, qr_desc.layout)
        kr_smem = gl.allocate_shared_memory(kr_desc.dtype, [K_STAGES] + kr_desc.block_type.shape, kr_desc.layout)
    else:  # (not used)
        qr_smem = q_smem
        kr_smem = k_smem
    v_smem = gl.allocate_shared_memory(v_desc.dtype, [V_STAGES] + v_desc.block_type.shape, v_desc.layout)
    q_ready = gl.allocate_shared_memory(gl.int64, [CONSUMERS, 1], mbarrier.MBarrierLayout())
    q_free = gl.allocate_shared_memory(gl.int64, [CONSUMERS, 1], mbarrier.MBarrierLayout())
    k_ready = gl.allocate_shared_memory(gl.int64, [K_STAGES, 1], mbarrier.MBarrierLayout())
    k_free = gl.allocate_shared_memory(gl.int64, [K_STAGES, 1], mbarrier.MBarrierLayout())
    v_ready = gl.allocate_shared_memory(gl.int64, [V_STAGES, 1], mbarrier.MBarrierLayout())
    v_free = gl.allocate_shared_memory(gl.int64, [V_STAGES, 1], mbarrier.MBarrierLayout())
    o_smem = gl.allocate_shared_memory(o_desc.dtype, [CONSUMERS] + o_desc.block_type.shape, o_desc.layout)
    tile_smem, tile_ready, tile_free = tile_handover()
    for c in gl.static_range(CONSUMERS):
        mbarrier.init(q_ready.index(c), count=1)
        mbarrier.init(q_free.index(c), count=1)
    for i in gl.static_range(K_STAGES):
        mbarrier.init(k_ready.index(i), count=1)
        mbarrier.init(k_free.index(i), count=CONSUMERS)  # one arrival per consumer warpgroup
    for i in gl.static_range(V_STAGES):
        mbarrier.init(v_ready.index(i), count=1)
        mbarrier.init(v_free.index(i), count=CONSUMERS)
    fence_async_shared()

    # The default partition (this program's own four warps) is consumer 0; the others are worker partitions.
    # Worker arguments cannot be constexprs computed here, so every value is passed explicitly.
    gl.warp_specialize(
        [
            (
                _consumer,
                (
                    q_smem,
                    qr_smem,
                    k_smem,
                    kr_smem,
                    v_smem,
                    o_smem,
                    q_ready,
                    q_free,
                    k_ready,
                    v_ready,
                    k_free,
                    v_free,
                    tile_smem,
                    tile_ready,
                    tile_free,
                    o_desc,
                    lse_ptr,
                    stride_lb,
                    stride_lh,
                    stride_lm,
                    n_tiles,
                    n_m,
                    bucket,
                    H,
                    M,
                    N,
                    qk_scale,
                    gl.constexpr(0),
                    CAUSAL,
                    BLOCK_N,
                    D,
                    DR,
                    DV,
                    K_STAGES,
                    V_STAGES,
                ),
            ),
            (
                _consumer,
                (
                    q_smem,
                    qr_smem,
                    k_smem,
                    kr_smem,
                    v_smem,
                    o_smem,
                    q_ready,
                    q_free,
                    k_ready,
                    v_ready,
                    k_free,
                    v_free,
                    tile_smem,
                    tile_ready,
                    tile_free,
                    o_desc,
                    lse_ptr,
                    stride_lb,
                    stride_lh,
                    stride_lm,
                    n_tiles,
                    n_m,
                    bucket,
                    H,
                    M,
                    N,
                    qk_scale,
                    gl.constexpr(1),
                    CAUSAL,
                    BLOCK_N,
                    D,
                    DR,
                    DV,
                    K_STAGES,
                    V_STAGES,
                ),
            ),
            (
                _loader,
                (
                    q_desc,
                    qr_desc,
                    k_desc,
                    kr_desc,
                    v_desc,
                    q_smem,
                    qr_smem,
                    k_smem,
                    kr_smem,
                    v_smem,
                    q_ready,
                    q_free,
                    k_ready,
                    v_ready,
                    k_free,
                    v_free,
                    tile_smem,
                    tile_ready,
                    tile_free,
                    counter_ptr,
                    n_tiles,
                    n_m,
                    bucket,
                    H,
                    M,
                    N,
                    GROUP_SIZE,
                    CAUSAL,
                    BLOCK_N,
                    K_STAGES,
                    V_STAGES,
                    DR,
                ),
            ),
        ],
        [4, 1],
        [CONSUMER_REGS, LOADER_REGS],
    )


# Per (D_qk, D_v): (BLOCK_N, K stages, V stages), each the fastest that fits shared memory on an H200
# (benchmarks/RESULTS.md). At D=128, 2 K and 3 V stages leave room for the output's own buffers; MLA's 192/128
# takes 64-key blocks, with which three stages and the output buffers fit.
CONFIGS = {
    (64, 64): (128, 3, 3),
    (96, 64): (128, 3, 3),
    (128, 128): (128, 2, 3),
    (192, 128): (64, 3, 3),
}


def forward_smem(d: int, d_v: int, block_n: int, k_stages: int, v_stages: int, itemsize: int = 2) -> int:
    """Bytes of shared memory a forward program takes (the barriers aside): both consumers' Q and output buffers,
    and the K and V rings (D=128 with CONFIGS' 2 + 3 stages: 32 + 32 + 64 + 96 KB)."""
    return (PROGRAM_ROWS * (d + d_v) + block_n * (k_stages * d + v_stages * d_v)) * itemsize


def forward(q, k, v, out, lse, qk_scale: float, causal: bool, config=None, key=None):
    """Launch on inputs `supports` accepted; out (B, H_q, S_q, D) and lse (B, H_q, S_q) fp32 any strides (an out
    TMA cannot write is filled from a contiguous one). qk_scale is the softmax scale times log2(e). `config`
    (BLOCK_N, K stages, V stages) overrides CONFIGS (benchmarks). `key`: the caller's for the launch
    (`Launcher.keyed`: flash._signature of these inputs)."""
    if not _checks.tma_readable(out):
        staged = torch.empty(out.shape, device=out.device, dtype=out.dtype)
        forward(q, k, v, staged, lse, qk_scale, causal, config, key)
        out.copy_(staged)
        return
    b, h_q, s_q, d = q.shape
    h_kv, s_kv, d_v = k.shape[1], k.shape[2], v.shape[3]
    block_n, k_stages, v_stages = config or CONFIGS[(d, d_v)]
    smem = forward_smem(d, d_v, block_n, k_stages, v_stages, q.element_size())
    if smem > SMEM_PER_PROGRAM:
        raise ValueError(
            f"forward config (BLOCK_N, K stages, V stages) = {(block_n, k_stages, v_stages)} takes "
            f"{smem // 1024} KB of shared memory at D_qk {d}, D_v {d_v}; a program has at most "
            f"{SMEM_PER_PROGRAM // 1024} KB: take fewer stages or narrower blocks"
        )
    d_main, d_rope = qk_tiles(d)
    n_m = cdiv(s_q, PROGRAM_ROWS)
    n_tiles = n_m * h_q * b
    counter = tile_counter(q.device, True)
    grid = (min(n_tiles, num_sms(q.device)),)
    launcher(_flash_fwd_sm90_kernel).keyed(key, grid)(
        *qk_descriptors(q, ROWS_PER_CONSUMER),
        *qk_descriptors(k, block_n),
        tile_descriptor(v, block_n),
        tile_descriptor(out, ROWS_PER_CONSUMER),
        lse,
        counter,
        *lse.stride(),
        n_tiles,
        n_m,
        bucket_size(n_m, h_q // h_kv, causal),
        h_q,
        s_q,
        s_kv,
        qk_scale,
        GROUP_SIZE=h_q // h_kv,
        CAUSAL=causal,
        BLOCK_N=block_n,
        D=d_main,
        DR=d_rope,
        DV=d_v,
        K_STAGES=k_stages,
        V_STAGES=v_stages,
        num_warps=4,
    )
