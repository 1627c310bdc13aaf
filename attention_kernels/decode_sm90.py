"""Paged grouped decode for Hopper (sm_90) in Gluon: K/V pages streamed by TMA from a loader warp.

Same math, inputs and outputs as `decode._grouped_decode_kernel` over a paged cache (see decode.py, whose paged launcher
runs this kernel instead on an sm_90 GPU for fp16/bf16, D_qk == D_v in {64, 128}, no RoPE term and pools whose heads sit
side by side in each slot; everything else, and every contiguous cache, keeps the Triton kernel). Splits, their partial
outputs and the combine are split_kv.py's.

Why: in the Triton kernel each paged tile's K/V addresses come from a block-table load inside the loop, so the
compiler's pipeline waits for every tile before it starts the next; a paged program alone runs several times
slower per tile than a contiguous one, which the ragged tails of a paged batch expose (0.90-0.95x of the
contiguous kernel on part of the grid, benchmarks/RESULTS.md). Here the addresses never stall the stream: a loader
warp (`gl.warp_specialize`) reads the block table one tile ahead and copies each K/V tile through TMA into a ring
of STAGES shared-memory buffers, as whole pages (a tile of small pages is BLOCK_N // page_size copies, each into
its own rows of the buffer); the consumer warpgroup never touches the table.

Per program: up to 64 query heads of one KV group, padded to the wgmma's M of 64 rows; the
consumer (four warps) computes S = Q K^T with Q in registers, the online softmax, and O += P V with P in registers,
then releases the stage. Decode is memory-bound, so one warpgroup's serial loop keeps up with the stream; two
programs share an SM to hide each one's start and end. A launch of more programs than SMs streams through a ring
of two stages instead of three (`launch_config`), and on sm_90 the launch is a programmatic dependent of the kernel
before it (`_host.pdl`): its programs start as that kernel ends and wait for its outputs first.

No row past a sequence's end meets a zero probability (a cache's unused rows may hold anything, NaN included): a
copy wholly past the end re-reads the last valid page (every tile moves the same bytes, as the mbarrier's expected
count is fixed), and the last tile's rows past the end are masked in the scores and zeroed in the V buffer before
P V (`zero_rows`).

With splits, the launch merges them itself where split_kv.py's rule says it pays (`_combine_if_last`, as the
Triton kernel's `split_kv.combine_if_last`): the consumer warpgroup of the last split to finish reads the partials
back.

Contiguous caches stay on the Triton kernel, which streams them as fast as a contiguous loader here would
(benchmarks/RESULTS.md).

Gluon has no CPU interpreter: the GPU test suite runs the eligible cases of tests/test_decode.py through this kernel;
on the CPU, tests/test_decode.py compiles it for sm_90 and checks its structure.
"""

import os

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
from attention_kernels._host import cdiv, launcher, next_power_of_2, num_sms, pdl
from attention_kernels.sm90 import descriptor, on_hopper, wgmma_layout

HEAD_DIMS = (64, 128)
MMA_ROWS = 64  # the M of every wgmma: a program's query heads, padded
ROWS = gl.constexpr(MMA_ROWS)
LOADER_REGS = gl.constexpr(40)
# Registers per thread at launch. A warp-specialized program is two warpgroups (the loader's warp pads its own), so
# 128 lets two programs share an SM's 64K registers; setmaxnreg then moves the loader warpgroup's spare registers to
# the consumer (232 per thread in the sm_90 PTX).
MAX_REGS = 128

# Per head dim: (BLOCK_N, STAGES): 64 tokens through three stages at D=128, the fastest on the paged shapes of an
# H200 sweep (benchmarks/RESULTS.md), and 128-token tiles at D=64 (the same bytes per tile). Tiles as wide as the
# head dim (BLOCK_N == D) return wrong outputs on an H200 while every config with BLOCK_N != D matches the
# reference; the cause is unknown, so launch() refuses them.
CONFIGS = {
    64: (128, 3),
    128: (64, 3),
}
# Stages per head dim for a launch of more programs than the GPU has SMs, so that two share an SM (`launch_config`):
# there two stages measured up to 3% faster than three on an H200, and where the programs fit one per SM, slower
# (benchmarks/RESULTS.md).
CROWDED_STAGES = {128: 2}


@gluon.jit
def split_range(seq_lens_ptr, b, split, num_splits, BLOCK_N: gl.constexpr):
    """(start, end, tiles) of sequence b's split: split_kv.split_range's rule (chunks rounded up to whole tiles)."""
    seq_len = gl.load(seq_lens_ptr + b)
    chunk = gl.cdiv(gl.cdiv(seq_len, num_splits), BLOCK_N) * BLOCK_N
    start = split * chunk
    end = gl.minimum(start + chunk, seq_len)
    return start, end, gl.maximum(gl.cdiv(end - start, BLOCK_N), 0)


@gluon.jit
def tile_pages(
    table_row,
    stride_tp,
    start,
    end,
    j,
    copy_idx,
    BLOCK_N: gl.constexpr,
    PAGE_SIZE: gl.constexpr,
    PAGE_ROWS: gl.constexpr,
):
    """Pool page and first slot of each of tile j's BLOCK_N // PAGE_ROWS copies (one vector load of the block table;
    scalars for a single copy). A copy wholly past `end` reads the last valid page instead, so every tile moves the same
    bytes; the consumer masks and zeroes those rows (`zero_rows`). Shared with mla_sm90.py's paged loader."""
    first = start + j * BLOCK_N
    if BLOCK_N // PAGE_ROWS > 1:
        first = first + copy_idx * PAGE_ROWS
    rows = gl.maximum(gl.minimum(first, end - 1), 0)
    pages = gl.load(table_row + (rows // PAGE_SIZE) * stride_tp)
    return pages, (rows % PAGE_SIZE) // PAGE_ROWS * PAGE_ROWS


@gluon.jit
def _loader(
    k_desc,
    v_desc,
    k_smem,
    v_smem,
    k_ready,
    v_ready,
    kv_free,
    table_ptr,
    stride_tb,
    stride_tp,
    b,
    kv_head,
    start,
    end,
    n_tiles,
    BLOCK_N: gl.constexpr,
    D: gl.constexpr,
    STAGES: gl.constexpr,
    PAGE_SIZE: gl.constexpr,
    PAGE_ROWS: gl.constexpr,
):
    """One warp: tile j's K and V into stage j % STAGES once the consumer has released tile j - STAGES, each as
    BLOCK_N // PAGE_ROWS copies of whole pages (or of a tile's slice of a larger page) into its own rows."""
    copies: gl.constexpr = BLOCK_N // PAGE_ROWS
    # The table entries of tile j + 1 load while tile j's copies fly and the loader waits for a free stage: loaded
    # just before use, each entry's latency (an L2 round trip) would stall the copies behind it.
    copy_idx = gl.arange(0, copies, layout=gl.BlockedLayout([1], [32], [1], [0]))
    table_row = table_ptr + b.to(gl.int64) * stride_tb
    pages, slots = tile_pages(table_row, stride_tp, start, end, 0, copy_idx, BLOCK_N, PAGE_SIZE, PAGE_ROWS)
    for j in range(n_tiles):
        s = j % STAGES
        mbarrier.wait(kv_free.index(s), ((j // STAGES) & 1) ^ 1, pred=j >= STAGES)
        mbarrier.expect(k_ready.index(s), copies * k_desc.block_type.nbytes)
        mbarrier.expect(v_ready.index(s), copies * v_desc.block_type.nbytes)
        for c in gl.static_range(copies):
            page, slot = pages, slots  # scalars for one copy per tile, else this copy's entries
            if copies > 1:
                page = gl.sum(gl.where(copy_idx == c, pages, 0), axis=0)
                slot = gl.sum(gl.where(copy_idx == c, slots, 0), axis=0)
            tma.async_copy_global_to_shared(
                k_desc,
                [page, slot, kv_head * D],
                k_ready.index(s),
                k_smem.index(s).slice(c * PAGE_ROWS, PAGE_ROWS, dim=1),
            )
            tma.async_copy_global_to_shared(
                v_desc,
                [page, slot, kv_head * D],
                v_ready.index(s),
                v_smem.index(s).slice(c * PAGE_ROWS, PAGE_ROWS, dim=1),
            )
        pages, slots = tile_pages(table_row, stride_tp, start, end, j + 1, copy_idx, BLOCK_N, PAGE_SIZE, PAGE_ROWS)


@gluon.jit
def gdc_wait():
    """Gluon's `triton.language.extra.cuda.gdc_wait`: in a programmatic dependent launch (`_host.pdl`), wait until
    the kernel before it has finished and its writes are visible."""
    gl.inline_asm_elementwise("griddepcontrol.wait; // dummy $0", "=r", [], dtype=gl.int32, is_pure=False, pack=1)


@gluon.jit
def zero_rows(tile, n_valid, BLOCK_N: gl.constexpr, COLS: gl.constexpr):
    """Rows n_valid.. of a (BLOCK_N, COLS) shared-memory tile set to zero, eight rows at a time (a slice of a
    swizzled tile must start at a multiple of its 8-row swizzle period), then fenced for the tensor cores. Shared
    with mla_sm90.py."""
    per_row: gl.constexpr = min(16, COLS // 8)  # threads along a row, 8 columns each (wider tiles wrap)
    blk: gl.constexpr = gl.BlockedLayout([1, 8], [32 // per_row, per_row], [4, 1], [1, 0])
    for c in gl.static_range(BLOCK_N // 8):
        if (c + 1) * 8 > n_valid:
            part = tile.slice(c * 8, 8)
            x = part.load(blk)
            rows = c * 8 + gl.arange(0, 8, layout=gl.SliceLayout(1, blk))
            part.store(gl.where(rows[:, None] < n_valid, x, gl.zeros_like(x)))
    fence_async_shared()


@gluon.jit
def _consumer(
    q_ptr,
    k_smem,
    v_smem,
    k_ready,
    v_ready,
    kv_free,
    out_ptr,
    lse_ptr,
    stride_qb,
    stride_qh,
    stride_qd,
    stride_ob,
    stride_oh,
    stride_os,
    stride_od,
    stride_lb,
    stride_lh,
    stride_ls,
    b,
    head0,
    n_heads,
    split,
    num_splits,
    start,
    end,
    n_tiles,
    scale_log2,
    final_out_ptr,
    final_lse_ptr,
    counters_ptr,
    counter,
    stride_fb,
    stride_fh,
    stride_fd,
    stride_flb,
    stride_flh,
    BLOCK_N: gl.constexpr,
    D: gl.constexpr,
    STAGES: gl.constexpr,
    MERGE_H: gl.constexpr,
    CHUNK: gl.constexpr,
):
    """One warpgroup: the online softmax of n_heads query heads from head0 over the split's tiles, then their
    output (the final one for one split, else a partial) and log-sum-exp; with CHUNK > 0, the last split of the
    tile to finish merges all of them (`_combine_if_last`)."""
    s_layout: gl.constexpr = wgmma_layout(BLOCK_N)
    o_layout: gl.constexpr = wgmma_layout(D)
    q_op: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=s_layout, k_width=2)
    p_op: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    blk: gl.constexpr = gl.BlockedLayout([1, 8], [32 // (D // 8), D // 8], [4, 1], [1, 0])
    dtype: gl.constexpr = k_smem.dtype

    rows_q = gl.arange(0, ROWS, layout=gl.SliceLayout(1, blk))
    cols_q = gl.arange(0, D, layout=gl.SliceLayout(0, blk))
    q = gl.load(
        q_ptr + b.to(gl.int64) * stride_qb + (head0 + rows_q)[:, None] * stride_qh + cols_q[None, :] * stride_qd,
        mask=(rows_q < n_heads)[:, None],
        other=0.0,
    )
    q = gl.convert_layout(q, q_op)

    m_i = gl.full([ROWS], -float("inf"), gl.float32, gl.SliceLayout(1, s_layout))
    l_i = gl.zeros([ROWS], gl.float32, gl.SliceLayout(1, s_layout))
    acc = gl.zeros([ROWS, D], gl.float32, o_layout)
    s = gl.zeros([ROWS, BLOCK_N], gl.float32, s_layout)
    for j in range(n_tiles):
        st = j % STAGES
        phase = (j // STAGES) & 1
        mbarrier.wait(k_ready.index(st), phase)
        s = warpgroup_mma(q, k_smem.index(st).reshape([BLOCK_N, D]).permute((1, 0)), s, use_acc=False, is_async=True)
        s = warpgroup_mma_wait(num_outstanding=0, deps=[s])
        v_tile = v_smem.index(st).reshape([BLOCK_N, D])
        mbarrier.wait(v_ready.index(st), phase)
        if j == n_tiles - 1:  # rows past `end`: masked in the scores, zeroed in the V buffer
            n_valid = end - start - j * BLOCK_N
            cols = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
            s = gl.where(cols[None, :] < n_valid, s, -float("inf"))
            zero_rows(v_tile, n_valid, BLOCK_N, D)
        m_new = gl.maximum(m_i, gl.max(s, 1) * scale_log2)
        p = gl.exp2(s * scale_log2 - m_new[:, None])
        alpha = gl.exp2(m_i - m_new)
        l_i = l_i * alpha + gl.sum(p, 1)
        m_i = m_new
        acc = acc * gl.convert_layout(alpha, gl.SliceLayout(1, o_layout))[:, None]
        acc = warpgroup_mma(gl.convert_layout(p.to(dtype), p_op), v_tile, acc, is_async=True)
        acc = warpgroup_mma_wait(num_outstanding=0, deps=[acc])
        mbarrier.arrive(kv_free.index(st), count=1)

    # A split past its sequence's end saw no token (l = 0): zeros and lse -inf, as split_kv.store_split.
    has_tokens = l_i > 0.0
    l_safe = gl.where(has_tokens, l_i, 1.0)
    lse = gl.where(has_tokens, m_i + gl.log2(l_safe), -float("inf"))
    if num_splits == 1:
        lse = lse * 0.6931471805599453  # the final lse is natural-log; partial ones stay in log2 units
    out = acc / gl.convert_layout(l_safe, gl.SliceLayout(1, o_layout))[:, None]
    rows_o = gl.arange(0, ROWS, layout=gl.SliceLayout(1, o_layout))
    cols_o = gl.arange(0, D, layout=gl.SliceLayout(0, o_layout))
    o_ptrs = (
        out_ptr
        + b.to(gl.int64) * stride_ob
        + (head0 + rows_o)[:, None] * stride_oh
        + split * stride_os
        + cols_o[None, :] * stride_od
    )
    gl.store(o_ptrs, out.to(out_ptr.dtype.element_ty), mask=(rows_o < n_heads)[:, None])
    rows_l = gl.arange(0, ROWS, layout=gl.SliceLayout(1, s_layout))
    gl.store(
        lse_ptr + b.to(gl.int64) * stride_lb + (head0 + rows_l) * stride_lh + split * stride_ls,
        lse,
        mask=rows_l < n_heads,
    )
    if CHUNK > 0:
        _combine_if_last(
            counters_ptr,
            counter,
            out_ptr,
            lse_ptr,
            final_out_ptr,
            final_lse_ptr,
            b,
            head0,
            n_heads,
            num_splits,
            stride_ob,
            stride_oh,
            stride_os,
            stride_od,
            stride_lb,
            stride_lh,
            stride_ls,
            stride_fb,
            stride_fh,
            stride_fd,
            stride_flb,
            stride_flh,
            D,
            MERGE_H,
            CHUNK,
        )


@gluon.jit
def _combine_if_last(
    counters_ptr,
    counter,
    part_o_ptr,
    part_lse_ptr,
    out_ptr,
    lse_ptr,
    b,
    head0,
    n_heads,
    num_splits,
    stride_pb,
    stride_ph,
    stride_ps,
    stride_pd,
    stride_plb,
    stride_plh,
    stride_pls,
    stride_ob,
    stride_oh,
    stride_od,
    stride_lb,
    stride_lh,
    D: gl.constexpr,
    MERGE_H: gl.constexpr,
    CHUNK: gl.constexpr,
):
    """`split_kv.combine_if_last` for this kernel's consumer warpgroup: a ticket per (sequence, head tile) after the
    partials are stored (a barrier of the warpgroup, then a release-acquire atomic); the last split resets it and merges
    the num_splits partials of its n_heads heads, CHUNK splits per load, online (the split count is a runtime argument
    here)."""
    gl.thread_barrier()
    ticket = gl.atomic_add(counters_ptr + counter, 1, sem="acq_rel", scope="gpu")
    if ticket == num_splits - 1:
        gl.atomic_xchg(counters_ptr + counter, 0, sem="relaxed", scope="gpu")
        cols_t: gl.constexpr = D // 4  # threads along a row, four fp32 columns each
        layout: gl.constexpr = gl.BlockedLayout([1, 1, 4], [1, 32 // cols_t, cols_t], [4, 1, 1], [2, 1, 0])
        w_layout: gl.constexpr = gl.SliceLayout(2, layout)
        o_layout: gl.constexpr = gl.SliceLayout(1, layout)
        rows = gl.arange(0, MERGE_H, layout=gl.SliceLayout(1, w_layout))
        offs_c = gl.arange(0, CHUNK, layout=gl.SliceLayout(0, w_layout))
        cols = gl.arange(0, D, layout=gl.SliceLayout(0, o_layout))
        mask_h = rows < n_heads
        heads = (head0 + rows).to(gl.int64)
        lse_row = part_lse_ptr + b.to(gl.int64) * stride_plb + heads[:, None] * stride_plh
        o_rows = part_o_ptr + b.to(gl.int64) * stride_pb + heads[:, None, None] * stride_ph
        cols3 = gl.convert_layout(cols, gl.SliceLayout(0, gl.SliceLayout(1, layout)))
        m = gl.full([MERGE_H], -float("inf"), gl.float32, gl.SliceLayout(1, w_layout))
        denom = gl.zeros([MERGE_H], gl.float32, gl.SliceLayout(1, w_layout))
        acc = gl.zeros([MERGE_H, D], gl.float32, o_layout)
        for c in range(0, num_splits, CHUNK):
            mask = mask_h[:, None] & ((c + offs_c) < num_splits)[None, :]
            lse_c = gl.load(
                lse_row + (c + offs_c)[None, :] * stride_pls, mask=mask, other=-float("inf"), cache_modifier=".cg"
            )  # (MERGE_H, CHUNK), log2 units
            o = gl.load(
                o_rows + (c + offs_c)[None, :, None] * stride_ps + cols3[None, None, :] * stride_pd,
                mask=mask[:, :, None],
                other=0.0,
                cache_modifier=".cg",
            )  # (MERGE_H, CHUNK, D)
            m_new = gl.maximum(m, gl.max(lse_c, 1))
            m_use = gl.where(m_new == -float("inf"), 0.0, m_new)  # masked heads only
            alpha = gl.exp2(m - m_use)
            w = gl.exp2(lse_c - m_use[:, None])
            denom = denom * alpha + gl.sum(w, 1)
            acc = acc * gl.convert_layout(alpha, gl.SliceLayout(1, o_layout))[:, None] + gl.sum(o * w[:, :, None], 1)
            m = m_new
        has_tokens = denom > 0.0
        d_safe = gl.where(has_tokens, denom, 1.0)
        out = acc / gl.convert_layout(d_safe, gl.SliceLayout(1, o_layout))[:, None]
        rows_o = gl.convert_layout(rows, gl.SliceLayout(1, o_layout))
        heads_o = (head0 + rows_o).to(gl.int64)
        gl.store(
            out_ptr + b.to(gl.int64) * stride_ob + heads_o[:, None] * stride_oh + cols[None, :] * stride_od,
            out.to(out_ptr.dtype.element_ty),
            mask=(rows_o < n_heads)[:, None],
        )
        lse = gl.where(has_tokens, (m + gl.log2(d_safe)) * 0.6931471805599453, -float("inf"))
        gl.store(lse_ptr + b.to(gl.int64) * stride_lb + heads * stride_lh, lse, mask=mask_h)


@gluon.jit
def _grouped_decode_sm90_kernel(
    q_ptr,
    k_desc,
    v_desc,
    seq_lens_ptr,
    table_ptr,
    out_ptr,
    lse_ptr,
    final_out_ptr,
    final_lse_ptr,
    counters_ptr,
    stride_qb,
    stride_qh,
    stride_qd,
    stride_tb,
    stride_tp,
    stride_ob,
    stride_oh,
    stride_os,
    stride_od,
    stride_lb,
    stride_lh,
    stride_ls,
    stride_fb,
    stride_fh,
    stride_fd,
    stride_flb,
    stride_flh,
    scale_log2,
    group,
    block_h,
    num_splits,
    BLOCK_N: gl.constexpr,
    D: gl.constexpr,
    STAGES: gl.constexpr,
    PAGE_SIZE: gl.constexpr,
    PAGE_ROWS: gl.constexpr,
    MERGE_H: gl.constexpr = 1,
    CHUNK: gl.constexpr = 0,
    WAIT: gl.constexpr = False,
):
    """grid (head tiles, num_splits, B): a head tile is block_h (at most 64) query heads of one KV group of
    `group`. The group, the tile and the split count are plain arguments, so one compiled kernel serves every GQA
    shape and split count of a head dim and page size. WAIT: launched as a programmatic dependent of the kernel
    before it (`_host.pdl`); every thread waits for that kernel's outputs before the first memory access."""
    if WAIT:
        gdc_wait()
    tile = gl.program_id(0)
    split = gl.program_id(1)
    b = gl.program_id(2)
    tiles_per_group = gl.cdiv(group, block_h)
    kv_head = tile // tiles_per_group
    in_group = (tile % tiles_per_group) * block_h
    head0 = kv_head * group + in_group
    n_heads = gl.minimum(block_h, group - in_group)

    start, end, n_tiles = split_range(seq_lens_ptr, b, split, num_splits, BLOCK_N)

    dtype: gl.constexpr = k_desc.dtype
    # [stage, 1, BLOCK_N, D]: BLOCK_N // PAGE_ROWS row slices, one per copy.
    k_smem = gl.allocate_shared_memory(dtype, [STAGES, 1, BLOCK_N, D], k_desc.layout)
    v_smem = gl.allocate_shared_memory(dtype, [STAGES, 1, BLOCK_N, D], v_desc.layout)
    k_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    v_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    kv_free = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(k_ready.index(i), count=1)
        mbarrier.init(v_ready.index(i), count=1)
        mbarrier.init(kv_free.index(i), count=1)
    fence_async_shared()

    gl.warp_specialize(
        [
            (
                _consumer,
                (
                    q_ptr,
                    k_smem,
                    v_smem,
                    k_ready,
                    v_ready,
                    kv_free,
                    out_ptr,
                    lse_ptr,
                    stride_qb,
                    stride_qh,
                    stride_qd,
                    stride_ob,
                    stride_oh,
                    stride_os,
                    stride_od,
                    stride_lb,
                    stride_lh,
                    stride_ls,
                    b,
                    head0,
                    n_heads,
                    split,
                    num_splits,
                    start,
                    end,
                    n_tiles,
                    scale_log2,
                    final_out_ptr,
                    final_lse_ptr,
                    counters_ptr,
                    b * gl.num_programs(0) + tile,
                    stride_fb,
                    stride_fh,
                    stride_fd,
                    stride_flb,
                    stride_flh,
                    BLOCK_N,
                    D,
                    STAGES,
                    MERGE_H,
                    CHUNK,
                ),
            ),
            (
                _loader,
                (
                    k_desc,
                    v_desc,
                    k_smem,
                    v_smem,
                    k_ready,
                    v_ready,
                    kv_free,
                    table_ptr,
                    stride_tb,
                    stride_tp,
                    b,
                    kv_head,
                    start,
                    end,
                    n_tiles,
                    BLOCK_N,
                    D,
                    STAGES,
                    PAGE_SIZE,
                    PAGE_ROWS,
                ),
            ),
        ],
        [1],
        [LOADER_REGS],
    )


def enabled() -> bool:
    """ZOO_DECODE_SM90=0 turns this kernel off (decode.py then runs the Triton kernel on Hopper too)."""
    return os.environ.get("ZOO_DECODE_SM90", "1") != "0"


def supports(q, k_pages, v_pages, q_rope) -> bool:
    """Does decode.py's paged launcher run this kernel for these inputs? On an sm_90 GPU with the Triton release
    Gluon's kernels were verified against (`flash_sm90.on_hopper`), when `eligible`."""
    return enabled() and on_hopper(q) and eligible(q, k_pages, v_pages, q_rope)


def eligible(q, k_pages, v_pages, q_rope) -> bool:
    """fp16/bf16, D_qk == D_v in HEAD_DIMS, no RoPE term, and pools (num_pages, page_size, H_kv, D) that TMA reads
    as (num_pages, page_size, H_kv * D): each slot's heads side by side (head stride D), 16-byte aligned strides."""
    d = q.shape[-1]
    if q.dtype not in (torch.float16, torch.bfloat16) or q_rope is not None:
        return False
    if d not in HEAD_DIMS or k_pages.shape[-1] != d or v_pages.shape[-1] != d:
        return False
    if any(t.stride(2) != d or t.stride(3) != 1 for t in (k_pages, v_pages)):
        return False
    return all(_checks.tma_readable(t) for t in (k_pages, v_pages))  # as (.., H_kv * D) too: D * itemsize >= 128


def shared_bytes(d: int, itemsize: int) -> int:
    """Shared memory of one program with CONFIGS' ring (the barriers are a few bytes): what the split model counts
    programs per SM by. A crowded launch's shorter ring (`launch_config`) does not add a program per SM: at
    MAX_REGS the registers hold two."""
    block_n, stages = CONFIGS[d]
    return stages * block_n * 2 * d * itemsize


def launch_config(d: int, programs: int, device: torch.device) -> tuple[int, int]:
    """(BLOCK_N, STAGES) of a launch of `programs` programs: CONFIGS, with CROWDED_STAGES where there are more
    programs than SMs."""
    block_n, stages = CONFIGS[d]
    if programs > num_sms(device):
        stages = CROWDED_STAGES.get(d, stages)
    return block_n, stages


def launch(
    q,
    k_pages,
    v_pages,
    block_table,
    seq_lens,
    part_o,
    part_lse,
    scale_log2: float,
    num_splits: int,
    block_h: int,
    config: tuple[int, int] | None = None,
    fused: tuple | None = None,
):
    """On inputs `supports` accepted, block_table (B, max_pages) int32 and seq_lens (B,) int32 contiguous: each
    split's output into part_o (B, H_q, splits, D) and its lse into part_lse (B, H_q, splits), as
    decode._launch_decode's Triton kernel; block_h query heads per program. With fused = (out, lse, counters,
    chunk) the launch combines its splits into out / lse too. `config` overrides CONFIGS (benchmarks)."""
    batch, h_q, d = q.shape
    page_size, h_kv = k_pages.shape[1], k_pages.shape[2]
    group = h_q // h_kv
    grid = (h_kv * cdiv(group, block_h), num_splits, batch)
    block_n, stages = config or launch_config(d, grid[0] * num_splits * batch, q.device)
    if block_n == d:
        raise ValueError(f"BLOCK_N = D = {d}: miscompiled on the H200 (see CONFIGS); take another tile width")
    rows = min(page_size, block_n)  # rows per TMA copy: one page (or a tile's slice of one)
    out, lse, counters, chunk = fused if fused is not None else (part_o[:, :, 0], part_lse[:, :, 0], seq_lens, 0)
    wait = pdl(q.device)
    launcher(_grouped_decode_sm90_kernel)[grid](
        q,
        descriptor(k_pages.flatten(2), [1, rows, d]),
        descriptor(v_pages.flatten(2), [1, rows, d]),
        seq_lens,
        block_table,
        part_o,
        part_lse,
        out,
        lse,
        counters,
        *q.stride(),
        *block_table.stride(),
        *part_o.stride(),
        *part_lse.stride(),
        *out.stride(),
        *lse.stride(),
        scale_log2,
        group,
        block_h,
        num_splits,
        BLOCK_N=block_n,
        D=d,
        STAGES=stages,
        PAGE_SIZE=page_size,
        PAGE_ROWS=rows,
        MERGE_H=next_power_of_2(min(group, block_h)) if chunk else 1,
        CHUNK=chunk,
        WAIT=wait,
        num_warps=4,
        maxnreg=MAX_REGS,
        launch_pdl=wait,
    )
