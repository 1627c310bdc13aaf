"""The pieces the Hopper flash kernels share (flash_sm90_fwd.py, flash_sm90_bwd_dq.py, flash_sm90_bwd_dkdv.py,
flash_sm90_bwd_fused.py): the sizes of the warp roles, the hand-over of persistent tiles, the ring loaders, the
score products and masks, and on the host the TMA descriptors, tile counters and padded row buffers.

Every program has the same roles (`gl.warp_specialize`): a loader warp streams tiles through TMA into rings of
shared-memory buffers, waiting on an mbarrier until the consumers have released a buffer before it refills it, and
two consumer warpgroups of four warps each own 64 rows (ROWS, the M of one wgmma) and run the products on the tensor
cores. The loader gives its registers to the consumers (setmaxnreg: LOADER_REGS and CONSUMER_REGS). Persistent
programs (one per SM) take tiles from a global counter (`tile_counter`), and the loader hands each tile number to
the consumers through shared memory (`publish_tile`, `receive_tile`).

Q and K of a head dim that is not a power of two (MLA's 192 = 128 + 64 and 96 = 64 + 32) arrive as two TMA tiles
each (`qk_tiles`: a TMA tile's width must be a power of two), and the scores add two products.
"""

import functools

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma, warpgroup_mma
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from attention_kernels import _checks
from attention_kernels._host import cdiv
from attention_kernels.schedule import ranked
from attention_kernels.sm90 import descriptor

SMEM_PER_PROGRAM = 227 * 1024  # Hopper: the most shared memory one program may take


ROWS_PER_CONSUMER = 64  # query rows per consumer warpgroup: the M of one wgmma


ROWS = gl.constexpr(ROWS_PER_CONSUMER)


CONSUMERS = gl.constexpr(2)  # consumer warpgroups per program


PROGRAM_ROWS = 2 * ROWS_PER_CONSUMER  # rows a program owns: query rows in the forward, key rows in dK/dV


LOADER_REGS = gl.constexpr(24)


# The SM's 64K registers over three warpgroups once the loader's keeps 24 per thread: (512 - 24) / 2 = 244,
# rounded down to setmaxnreg's multiple of 8.
CONSUMER_REGS = gl.constexpr(240)


@gluon.jit
def key_blocks(start_m, M, N, CAUSAL: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr):
    """Key blocks that query rows [start_m, +BLOCK_M) read, and how many of the first ones every row of them sees
    whole (no mask). Query row i sits at key position N - M + i."""
    q_shift = N - M
    if CAUSAL:
        n_end = gl.minimum(N, q_shift + start_m + BLOCK_M)
        n_unmasked = gl.minimum((q_shift + start_m + 1) // BLOCK_N, N // BLOCK_N)
    else:
        n_end = N
        n_unmasked = N // BLOCK_N
    return gl.cdiv(n_end, BLOCK_N), n_unmasked


@gluon.jit
def publish_tile(tile_smem, tile_ready, tile_free, tc, t):
    """Loader: hand tile t (the tc-th of this program; t >= n_tiles means stop) to the consumers."""
    slot = tc % 2
    mbarrier.wait(tile_free.index(slot), ((tc // 2) & 1) ^ 1, pred=tc >= 2)
    tile_smem.index(slot).store(gl.full([1], t, gl.int32, gl.BlockedLayout([1], [32], [1], [0])))
    mbarrier.arrive(tile_ready.index(slot), count=1)


@gluon.jit
def receive_tile(tile_smem, tile_ready, tile_free, tc):
    """Consumer: the tc-th tile the loader published."""
    slot = tc % 2
    mbarrier.wait(tile_ready.index(slot), (tc // 2) & 1)
    t = gl.max(tile_smem.index(slot).load(gl.BlockedLayout([1], [32], [4], [0])), 0)
    mbarrier.arrive(tile_free.index(slot), count=1)
    return t


@gluon.jit
def tile_handover():
    """The shared memory through which a persistent program's loader hands its tiles to the consumers
    (`publish_tile`, `receive_tile`): two slots, each with a ready barrier (the loader's arrival) and a free one (one
    arrival per consumer warpgroup)."""
    tile_smem = gl.allocate_shared_memory(gl.int32, [2, 1], gl.SwizzledSharedLayout(1, 1, 1, [0]))
    tile_ready = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    tile_free = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(2):
        mbarrier.init(tile_ready.index(i), count=1)
        mbarrier.init(tile_free.index(i), count=CONSUMERS)
    return tile_smem, tile_ready, tile_free


@gluon.jit
def load_kv(
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
    row,
    K_STAGES: gl.constexpr,
    V_STAGES: gl.constexpr,
    DR: gl.constexpr,
):
    """Loader: the program's g-th K/V block (rows row.. of one KV head): K into stage g % K_STAGES of its ring once
    every consumer has released that stage's previous block on k_free, V into stage g % V_STAGES of its own once
    they have released that one on v_free (phase parity). The forward's consumers release K after its scores and V
    after its P V; dQ's release both at once, and passes its one barrier as both with equal stage counts (the second
    wait then finds the phase already complete). DR > 0: K's last DR columns (MLA's RoPE part) come as a second
    copy, on the same barrier."""
    s = g % K_STAGES
    mbarrier.wait(k_free.index(s), ((g // K_STAGES) & 1) ^ 1, pred=g >= K_STAGES)
    if DR > 0:
        mbarrier.expect(k_ready.index(s), k_desc.block_type.nbytes + kr_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(
            kr_desc, [batch, kv_head, row, k_desc.block_type.shape[3]], k_ready.index(s), kr_smem.index(s)
        )
    else:
        mbarrier.expect(k_ready.index(s), k_desc.block_type.nbytes)
    tma.async_copy_global_to_shared(k_desc, [batch, kv_head, row, 0], k_ready.index(s), k_smem.index(s))
    s = g % V_STAGES
    mbarrier.wait(v_free.index(s), ((g // V_STAGES) & 1) ^ 1, pred=g >= V_STAGES)
    mbarrier.expect(v_ready.index(s), v_desc.block_type.nbytes)
    tma.async_copy_global_to_shared(v_desc, [batch, kv_head, row, 0], v_ready.index(s), v_smem.index(s))


@gluon.jit
def visible_mask(j, start_m, q_shift, N, CAUSAL: gl.constexpr, BLOCK_N: gl.constexpr, s_layout: gl.constexpr):
    """Which (row, column) of key block j a consumer's 64 query rows from start_m see: the causal diagonal and the
    sequence end. Column c is visible to a row when c < that row's limit: one compare per score."""
    offs_n = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
    limit = N - j * BLOCK_N
    if CAUSAL:
        rows = q_shift + start_m + 1 - j * BLOCK_N + gl.arange(0, ROWS, layout=gl.SliceLayout(1, s_layout))
        return offs_n[None, :] < gl.minimum(rows, limit)[:, None]
    else:
        return offs_n[None, :] < limit


@gluon.jit
def issue_scores(q, qr, k_smem, kr_smem, st, s, BLOCK_N: gl.constexpr, D: gl.constexpr, DR: gl.constexpr):
    """Issue Q K^T of the block in stage st into s's registers (its old values unused): with DR > 0, as the first D
    columns' product plus the last DR columns' (MLA's RoPE part, its own TMA tile)."""
    s = warpgroup_mma(q, k_smem.index(st).reshape([BLOCK_N, D]).permute((1, 0)), s, use_acc=False, is_async=True)
    if DR > 0:
        s = warpgroup_mma(qr, kr_smem.index(st).reshape([BLOCK_N, DR]).permute((1, 0)), s, is_async=True)
    return s


@gluon.jit
def load_qdo(
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
    BLOCK_M: gl.constexpr,
    STAGES: gl.constexpr,
    DR: gl.constexpr,
):
    """Loader, the dK/dV program's step `it` (query head `head`, query block m): once the consumers have released
    its ring slot (step it - STAGES), Q with its rows' lse and delta (one barrier) and dO. DR > 0: Q's last DR
    columns (MLA's RoPE part) as a second copy on Q's barrier."""
    s = it % STAGES
    mbarrier.wait(qdo_free.index(s), ((it // STAGES) & 1) ^ 1, pred=it >= STAGES)
    if DR > 0:
        mbarrier.expect(
            q_ready.index(s),
            q_desc.block_type.nbytes
            + qr_desc.block_type.nbytes
            + lse_desc.block_type.nbytes
            + delta_desc.block_type.nbytes,
        )
        tma.async_copy_global_to_shared(
            qr_desc, [batch, head, m * BLOCK_M, q_desc.block_type.shape[3]], q_ready.index(s), qr_smem.index(s)
        )
    else:
        mbarrier.expect(
            q_ready.index(s), q_desc.block_type.nbytes + lse_desc.block_type.nbytes + delta_desc.block_type.nbytes
        )
    tma.async_copy_global_to_shared(q_desc, [batch, head, m * BLOCK_M, 0], q_ready.index(s), q_smem.index(s))
    row = (batch * H + head) * M_PAD + m * BLOCK_M
    tma.async_copy_global_to_shared(lse_desc, [row], q_ready.index(s), lse_smem.index(s))
    tma.async_copy_global_to_shared(delta_desc, [row], q_ready.index(s), delta_smem.index(s))
    mbarrier.expect(do_ready.index(s), do_desc.block_type.nbytes)
    tma.async_copy_global_to_shared(do_desc, [batch, head, m * BLOCK_M, 0], do_ready.index(s), do_smem.index(s))


@gluon.jit
def dkdv_tile(t, n_kb, n_tiles, bucket, H_KV, M, N, CAUSAL: gl.constexpr, BLOCK_M: gl.constexpr):
    """Tile t of the dK/dV schedule: (batch, KV head, first key row, first query block), in `schedule.ranked` order
    with key blocks as ranks (causal: the first key blocks, which every later query reads, are the heaviest)."""
    r, hb = ranked(t, n_kb, n_tiles // n_kb, bucket)
    start_n = r * (CONSUMERS * ROWS)
    if CAUSAL:  # query blocks wholly before the tile's first key see none of its keys
        m_start = gl.maximum(start_n - (N - M), 0) // BLOCK_M
    else:
        m_start = 0
    return hb // H_KV, hb % H_KV, start_n, m_start


@gluon.jit
def issue_scores_t(k_wg, kr_wg, q_smem, qr_smem, stage, st, BLOCK_M: gl.constexpr, D: gl.constexpr, DR: gl.constexpr):
    """Issue S^T = K Q^T of the Q block in `stage` into st's registers (its old values unused): with DR > 0, the
    first D columns' product plus the last DR columns' (two wgmma groups)."""
    st = warpgroup_mma(
        k_wg, q_smem.index(stage).reshape([BLOCK_M, D]).permute((1, 0)), st, use_acc=False, is_async=True
    )
    if DR > 0:
        st = warpgroup_mma(kr_wg, qr_smem.index(stage).reshape([BLOCK_M, DR]).permute((1, 0)), st, is_async=True)
    return st


@gluon.jit
def causal_mask_t(pt, m, kv_pos, q_shift, start_n, BLOCK_M: gl.constexpr, IMMEDIATES: gl.constexpr, cols: gl.constexpr):
    """P^T of query block m (rows: the consumer's keys at kv_pos; columns: the block's BLOCK_M queries) with the
    keys past each query zeroed, where the block crosses the causal diagonal of the program's keys from start_n.
    IMMEDIATES: qc >= first written as (qc & ~6) >= first - (qc & 6). A column's index is its thread's
    2 * (lane % 4) (bits 1-2) plus a constant, so each compare takes an immediate against the row's
    first - 2 * (lane % 4). Written plainly, the 32 column indices of a thread's 128-query step are hoisted out of
    the dK/dV loop and stay live across it, and ptxas spills inside the loop (196 bytes at D=64 causal)."""
    if q_shift + m * BLOCK_M < start_n + CONSUMERS * ROWS - 1:  # the block crosses the diagonal
        first = kv_pos - q_shift - m * BLOCK_M
        qc = gl.arange(0, BLOCK_M, layout=cols)
        if IMMEDIATES:
            pt = gl.where((qc & ~6)[None, :] >= first[:, None] - (qc & 6)[None, :], pt, 0.0)
        else:
            pt = gl.where(qc[None, :] >= first[:, None], pt, 0.0)
    return pt


@gluon.jit
def release_kv(k_ready, v_ready, kv_free, it0, j0, n_blocks, STAGES: gl.constexpr, PERSISTENT: gl.constexpr):
    """Causal: ring slots [j0, n_blocks) of the tile (counted from it0 when PERSISTENT) hold blocks wholly masked for
    this warpgroup's 64 rows (the tile's other 64 rows need them), so it skips their products and only releases the
    slots, each once both of its ready barriers have fired. The waits keep this warpgroup's view of every barrier's
    phase exact: an arrival before the block's own would count towards the slot's previous block. Forward and dQ:
    K and V past the first consumer's rows (with key blocks of 64, the tile's last block: at 1024 keys 1 of the 9
    blocks it would read on average); MHA's dK/dV: Q and dO (q_ready, do_ready, qdo_free) of the query blocks
    before the second consumer's keys."""
    for j in range(j0, n_blocks):
        if PERSISTENT:
            g = it0 + j
        else:
            g = j
        mbarrier.wait(k_ready.index(g % STAGES), (g // STAGES) & 1)
        mbarrier.wait(v_ready.index(g % STAGES), (g // STAGES) & 1)
        mbarrier.arrive(kv_free.index(g % STAGES), count=1)


@gluon.jit
def store_rows(base, x, row0, n_rows, stride_r, stride_c, col0, COLS: gl.constexpr, layout: gl.constexpr):
    """Store x (64 rows from row0, COLS columns from col0, in `layout`) at base, the rows past n_rows left out."""
    offs_r = row0 + gl.arange(0, ROWS, layout=gl.SliceLayout(1, layout))
    offs_c = col0 + gl.arange(0, COLS, layout=gl.SliceLayout(0, layout))
    gl.store(
        base + offs_r[:, None] * stride_r + offs_c[None, :] * stride_c,
        x.to(base.dtype.element_ty),
        mask=(offs_r < n_rows)[:, None],
    )


def qk_tiles(d: int) -> tuple[int, int]:
    """The widths of Q's and K's two TMA tiles for head dim d (a tile's width must be a power of two): the largest
    power of two in d and the rest (0 when d is itself a power of two; MLA's 192: 128 + 64, 96: 64 + 32)."""
    main = 1 << (d.bit_length() - 1)
    return main, d - main


def tile_descriptor(t: torch.Tensor, rows: int) -> TensorDescriptor:
    """Over (B, H, S, D): one (rows, D) tile of one (batch, head) per copy."""
    return descriptor(t, [1, 1, rows, t.shape[-1]])


def qk_descriptors(t: torch.Tensor, rows: int) -> tuple[TensorDescriptor, TensorDescriptor | None]:
    """Q's or K's two TMA descriptors over (B, H, S, D): (rows, first `qk_tiles` columns) tiles and (rows, rest)
    ones; None for the second when D is a power of two (a constexpr, which the kernels never touch without a RoPE
    part, so Triton's launcher encodes no descriptor for it on every call)."""
    d_main, d_rest = qk_tiles(t.shape[-1])
    return descriptor(t, [1, 1, rows, d_main]), (descriptor(t, [1, 1, rows, d_rest]) if d_rest else None)


def padded_rows(s_q: int) -> int:
    """Rows per (batch, head) of the lse2/delta buffers the dK/dV kernel reads: S_q rounded up to whole dQ programs,
    every row written by `backward_dq` (rows past S_q hold 0), so a query block's rows are one in-bounds TMA copy."""
    return cdiv(s_q, PROGRAM_ROWS) * PROGRAM_ROWS


def tile_counter(device: torch.device, persistent: bool) -> torch.Tensor:
    """A zero int32 for a launch's tile counter (tiles taken past the first wave; a launch of one program per tile
    never reads it). Each persistent launch takes the next zero of a ring kept per (device, stream), and when the
    ring is used up one memset on that stream zeroes it again: stream order puts it after every launch that read
    it. That replaces a zero-fill launch per kernel (about 8 us of host time each, and a kernel on the GPU). While a
    CUDA graph is captured the counter is a fresh zero-fill, which the graph replays."""
    if not persistent:
        return _unread_counter(device)
    if torch.cuda.is_current_stream_capturing():
        return torch.zeros(1, dtype=torch.int32, device=device)
    stream = torch.cuda.current_stream(device).cuda_stream
    ring = _RINGS.get((device, stream))
    if ring is None:
        ring = _RINGS[(device, stream)] = [torch.zeros(_RING_SIZE * _SLOT, dtype=torch.int32, device=device), 0]
    elif ring[1] == _RING_SIZE:
        ring[0].zero_()
        ring[1] = 0
    start = ring[1] * _SLOT
    ring[1] += 1
    return ring[0][start : start + 1]


_RING_SIZE = 1024  # counters per ring: one memset per 1024 persistent launches
# int32s per counter: 16 bytes apart. Triton specializes a pointer on 16-byte alignment, so counters 4 bytes apart
# would compile every persistent kernel twice, and the launch cache's key would change with a counter's place.
_SLOT = 4
_RINGS: dict[tuple[torch.device, int], list] = {}


@functools.cache
def _unread_counter(device: torch.device) -> torch.Tensor:
    return torch.zeros(1, dtype=torch.int32, device=device)


def staged_grads(launch, dtype: torch.dtype, dk: torch.Tensor, dv: torch.Tensor) -> bool:
    """For the kernels that write dK and dV by TMA in `dtype`: where TMA cannot write dk or dv (its strides, or
    another dtype), run launch(dk', dv') into contiguous buffers in `dtype` for those, copy them back, and return
    True; False (nothing run) where both can be written directly."""
    direct = [x.dtype == dtype and _checks.tma_readable(x) for x in (dk, dv)]
    if all(direct):
        return False
    staged = [x if ok else torch.empty(x.shape, device=x.device, dtype=dtype) for x, ok in zip((dk, dv), direct)]
    launch(*staged)
    for x, y, ok in zip((dk, dv), staged, direct):
        if not ok:
            x.copy_(y)
    return True
