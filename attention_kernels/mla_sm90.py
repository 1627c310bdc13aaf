"""Absorbed MLA decode for Hopper (sm_90) in Gluon: 64 heads per program (the compute-bound case, many heads) or,
for at most 32 heads, a narrow program with every product transposed (the memory-bound case).

Same math, inputs and outputs as `mla._mla_decode_kernel` (see mla.py, whose launcher runs this kernel
instead on an sm_90 GPU for fp16/bf16, D_c = 512, D_r = 64, at most 64 heads or a multiple of 64, and
TMA-readable strides, contiguous or paged; everything else keeps the Triton kernel).

Why: at 128 heads the Triton kernel reaches 350-370 TFLOP/s on an H200. Its eight warps share one program and
run each phase together, and the latent tile, used both as K (in the scores) and as V (in the output), is
reloaded from shared memory by both warpgroups for every product. Here each role has its own warps
(`gl.warp_specialize`), FlashMLA's division of the work:
- a loader warp streams each 64-token block of the latent cache (as two 256-column halves) and of the RoPE keys
  through TMA into a two-stage ring;
- consumer 0 (a warpgroup) computes the scores of the 64 heads, S = Qc C^T + Qr R^T (k = 576, one score tile,
  never duplicated), the online softmax, writes P (bf16) and the rescale factor to shared memory, and
  accumulates the left half of the output, O0 += P C[:, :256];
- consumer 1 waits for P and accumulates the right half, O1 += P C[:, 256:]. Each consumer's (64, 256) fp32
  accumulator takes 128 of its 240 registers.

The narrow program (`_mla_narrow_consumer`, tiles of 16 or 32 heads: DeepSeek's 128 heads over 8 or 4 GPUs): a
wgmma's M is at least 64, so a 64-head tile pads 16 heads with 48 rows of zeros and does four times the
tensor-core work, which at 16 heads costs about as long as streaming the block. Swapping the operands makes the
heads the N (16) and the tokens the M (64): S^T = C Qc^T + R Qr^T, the softmax down the columns, P^T through
shared memory, and O^T += C^T P^T with the latent tile read transposed (M-major) from the same shared memory.
One consumer warpgroup does it all; the loader is the same. Its launches are programmatic dependents of the kernel
before them (`_host.pdl`; the 64-head tile's measured slower that way, see `launch`).

No row past a sequence's end ever meets a zero probability (the tests' poisoned caches hold NaN there):
- contiguous: the last block of a split is loaded ending at the split's last token (rows end-64 .. end-1, TMA
  zero-fills rows before 0), and its columns that the previous block already covered are masked;
- paged: the loader reads the block table and copies each block as 64 // min(page_size, 64) copies of whole
  pages (or 64-row slices of larger pages), each into its own 8-row-aligned rows of the tile. A copy wholly past
  the end re-reads the last valid page, so every block moves the same bytes (the mbarrier expects a constant).
  The last block is not shifted (it could straddle pages): its rows past the end are masked in the scores and
  zeroed in the shared-memory latent tile before P C (`decode_sm90.zero_rows`).

On an H200, at 128 heads it runs 470-540 TFLOP/s where the Triton kernel runs 300-365, and at 16 heads the narrow
program reads 3.9-4.5 TB/s, level with or ahead of the Triton kernel (benchmarks/RESULTS.md).

Gluon has no CPU interpreter: the GPU test suite runs every 512 + 64 case of tests/test_mla.py with fp16/bf16
caches through these kernels, except those that turn them off (5-32 heads the narrow program, 40, 64 and 128
heads the 64-head tiles); on the CPU, tests/test_mla.py compiles both for sm_90 and checks their structure (warp
roles, wgmma shapes and transposes, one score tile per block, shared memory, no spills).
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
from attention_kernels._host import LOG2E, cdiv, launcher, pdl
from attention_kernels.decode_sm90 import gdc_wait, split_range, tile_pages, zero_rows
from attention_kernels.sm90 import descriptor, on_hopper, wgmma_layout

HEADS_PER_PROGRAM = 64  # the M of every wgmma of the 64-head tile
NARROW_HEADS = 16  # heads per program of the narrow kernel (twice that from 17 heads): the N of its wgmma
HALF_COLUMNS = 256  # latent columns per half: each consumer's share of the output
ROPE_DIM = 64
BLOCK_N, STAGES = 64, 2  # tokens per block, ring stages: 224 KB of shared memory with Q and P
HEADS = gl.constexpr(HEADS_PER_PROGRAM)
HALF = gl.constexpr(HALF_COLUMNS)
LOADER_REGS = gl.constexpr(40)  # 24 spilled the paged loader's block-table arithmetic
CONSUMER_REGS = gl.constexpr(240)


@gluon.jit
def _block_rows(j, n_blocks, start, end, BLOCK_N: gl.constexpr):
    """First cache row loaded for block j: start + j*BLOCK_N, except the last block, which ends at `end`."""
    row0 = start + j * BLOCK_N
    if j == n_blocks - 1:
        row0 = end - BLOCK_N
    return row0


@gluon.jit
def _valid_rows(j, start, end, BLOCK_N: gl.constexpr):
    """Paged: how many rows of the split's last block j, from the top, hold tokens before `end` (the rest are
    masked in the scores and zeroed in the latent tile)."""
    return end - start - j * BLOCK_N


@gluon.jit
def _last_block_read(offs_n, j, start, end, PAGED: gl.constexpr, BLOCK_N: gl.constexpr):
    """Which rows offs_n of the split's last block j the scores keep. Paged: those before `end`. Contiguous: the
    block was loaded to end at `end` (`_block_rows`), so its rows before block j's own start were block j-1's."""
    if PAGED:
        keep = offs_n < _valid_rows(j, start, end, BLOCK_N)
    else:
        keep = offs_n >= start + j * BLOCK_N - (end - BLOCK_N)
    return keep


@gluon.jit
def _mla_loader(
    qc_desc,
    qr_desc,
    c_desc,
    r_desc,
    qc0_smem,
    qc1_smem,
    qr_smem,
    c0_smem,
    c1_smem,
    r_smem,
    q_ready,
    kv_ready,
    kv_free,
    table_ptr,
    stride_tb,
    stride_tp,
    b,
    h0,
    start,
    end,
    n_blocks,
    BLOCK_N: gl.constexpr,
    STAGES: gl.constexpr,
    PAGED: gl.constexpr,
    PAGE_SIZE: gl.constexpr,
    PAGE_ROWS: gl.constexpr,
):
    """One warp: the program's 64 query heads once, then each block's latent halves and RoPE keys into the ring,
    block j into stage j % STAGES once both consumers have released block j - STAGES."""
    mbarrier.expect(q_ready, 2 * qc_desc.block_type.nbytes + qr_desc.block_type.nbytes)
    tma.async_copy_global_to_shared(qc_desc, [b, h0, 0], q_ready, qc0_smem)
    tma.async_copy_global_to_shared(qc_desc, [b, h0, HALF], q_ready, qc1_smem)
    tma.async_copy_global_to_shared(qr_desc, [b, h0, 0], q_ready, qr_smem)
    copy_bytes: gl.constexpr = 2 * c_desc.block_type.nbytes + r_desc.block_type.nbytes
    copies: gl.constexpr = BLOCK_N // PAGE_ROWS
    if PAGED:
        # Block j's rows as `copies` TMA copies of PAGE_ROWS rows, each inside one page. The block-table entries
        # of block j + 1 are loaded while block j's copies fly and the loader waits for a free stage: loaded just
        # before use, each entry's latency (one L2 round trip per page) stalled the copies behind it.
        copy_idx = gl.arange(0, copies, layout=gl.BlockedLayout([1], [32], [1], [0]))
        table_row = table_ptr + b.to(gl.int64) * stride_tb  # this sequence's block-table row
        pages, slots = tile_pages(table_row, stride_tp, start, end, 0, copy_idx, BLOCK_N, PAGE_SIZE, PAGE_ROWS)
    for j in range(n_blocks):
        s = j % STAGES
        mbarrier.wait(kv_free.index(s), ((j // STAGES) & 1) ^ 1, pred=j >= STAGES)
        if PAGED:
            mbarrier.expect(kv_ready.index(s), copies * copy_bytes)
            for k in gl.static_range(copies):
                page, slot = pages, slots  # scalars for one copy per block, else this copy's entries
                if copies > 1:
                    page = gl.sum(gl.where(copy_idx == k, pages, 0), axis=0)
                    slot = gl.sum(gl.where(copy_idx == k, slots, 0), axis=0)
                tma.async_copy_global_to_shared(
                    c_desc, [page, slot, 0], kv_ready.index(s), c0_smem.index(s).slice(k * PAGE_ROWS, PAGE_ROWS, dim=1)
                )
                tma.async_copy_global_to_shared(
                    c_desc,
                    [page, slot, HALF],
                    kv_ready.index(s),
                    c1_smem.index(s).slice(k * PAGE_ROWS, PAGE_ROWS, dim=1),
                )
                tma.async_copy_global_to_shared(
                    r_desc, [page, slot, 0], kv_ready.index(s), r_smem.index(s).slice(k * PAGE_ROWS, PAGE_ROWS, dim=1)
                )
            pages, slots = tile_pages(table_row, stride_tp, start, end, j + 1, copy_idx, BLOCK_N, PAGE_SIZE, PAGE_ROWS)
        else:
            row0 = _block_rows(j, n_blocks, start, end, BLOCK_N)
            mbarrier.expect(kv_ready.index(s), copy_bytes)
            tma.async_copy_global_to_shared(c_desc, [b, row0, 0], kv_ready.index(s), c0_smem.index(s))
            tma.async_copy_global_to_shared(c_desc, [b, row0, HALF], kv_ready.index(s), c1_smem.index(s))
            tma.async_copy_global_to_shared(r_desc, [b, row0, 0], kv_ready.index(s), r_smem.index(s))


@gluon.jit
def _store_half(
    o, l_o, out_ptr, b, h0, num_heads, split, col0, stride_ob, stride_oh, stride_os, stride_od, o_layout: gl.constexpr
):
    """O / l for 64 heads and 256 columns: the final output for one split, else a partial in fp32; a split that
    saw no token (l = 0) writes zeros (as attention_kernels.decode)."""
    rows: gl.constexpr = gl.SliceLayout(1, o_layout)
    l_o = gl.convert_layout(l_o, rows)
    out = o / gl.where(l_o > 0.0, l_o, 1.0)[:, None]
    heads = h0 + gl.arange(0, HEADS, layout=rows)
    cols = col0 + gl.arange(0, HALF, layout=gl.SliceLayout(0, o_layout))
    ptrs = (
        out_ptr
        + b.to(gl.int64) * stride_ob
        + heads[:, None] * stride_oh
        + split * stride_os
        + cols[None, :] * stride_od
    )
    gl.store(ptrs, out.to(out_ptr.dtype.element_ty), mask=(heads < num_heads)[:, None])


@gluon.jit
def _mla_softmax_consumer(
    qc0_smem,
    qc1_smem,
    qr_smem,
    c0_smem,
    c1_smem,
    r_smem,
    p_smem,
    stat_smem,
    q_ready,
    kv_ready,
    kv_free,
    p_ready,
    p_free,
    l_ready,
    out_ptr,
    lse_ptr,
    stride_ob,
    stride_oh,
    stride_os,
    stride_od,
    stride_lb,
    stride_lh,
    stride_ls,
    b,
    h0,
    num_heads,
    split,
    start,
    end,
    n_blocks,
    scale_log2,
    BLOCK_N: gl.constexpr,
    STAGES: gl.constexpr,
    NUM_SPLITS: gl.constexpr,
    PAGED: gl.constexpr,
):
    """Warpgroup 0: scores, softmax, P for both consumers, the left half of the output, and the lse."""
    s_layout: gl.constexpr = wgmma_layout(BLOCK_N)
    o_layout: gl.constexpr = wgmma_layout(HALF)
    rows_s: gl.constexpr = gl.SliceLayout(1, s_layout)
    vec: gl.constexpr = gl.BlockedLayout([1], [32], [4], [0])
    qc0 = qc0_smem.reshape([HEADS, HALF])
    qc1 = qc1_smem.reshape([HEADS, HALF])
    qr = qr_smem.reshape([HEADS, qr_smem.shape[2]])
    m_i = gl.full([HEADS], -float("inf"), gl.float32, rows_s)
    l_i = gl.zeros([HEADS], gl.float32, rows_s)
    o = gl.zeros([HEADS, HALF], gl.float32, o_layout)
    s = gl.zeros([HEADS, BLOCK_N], gl.float32, s_layout)
    mbarrier.wait(q_ready, 0)
    for j in range(n_blocks):
        st = j % STAGES
        mbarrier.wait(kv_ready.index(st), (j // STAGES) & 1)
        c0 = c0_smem.index(st).reshape([BLOCK_N, HALF])
        s = warpgroup_mma(qc0, c0.permute((1, 0)), s, use_acc=False, is_async=True)
        s = warpgroup_mma(qc1, c1_smem.index(st).reshape([BLOCK_N, HALF]).permute((1, 0)), s, is_async=True)
        s = warpgroup_mma(qr, r_smem.index(st).reshape([BLOCK_N, qr_smem.shape[2]]).permute((1, 0)), s, is_async=True)
        s = warpgroup_mma_wait(num_outstanding=0, deps=[s])
        if j == n_blocks - 1:
            offs_n = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
            s = gl.where(_last_block_read(offs_n, j, start, end, PAGED, BLOCK_N)[None, :], s, -float("inf"))
            if PAGED:  # rows past `end` zeroed in the latent tile too (C1's by consumer 1)
                zero_rows(c0, _valid_rows(j, start, end, BLOCK_N), BLOCK_N, HALF)
        m_new = gl.maximum(m_i, gl.max(s, 1) * scale_log2)
        p = gl.exp2(s * scale_log2 - m_new[:, None])
        alpha = gl.exp2(m_i - m_new)
        l_i = l_i * alpha + gl.sum(p, 1)
        m_i = m_new
        # P and alpha go to shared memory once consumer 1 has finished P C1 of block j-1.
        mbarrier.wait(p_free, (j & 1) ^ 1, pred=j > 0)
        p_smem.store(p.to(p_smem.dtype))
        stat_smem.store(gl.convert_layout(alpha, vec))
        fence_async_shared()
        mbarrier.arrive(p_ready, count=1)
        o = o * gl.convert_layout(alpha, gl.SliceLayout(1, o_layout))[:, None]
        o = warpgroup_mma(p_smem, c0, o, is_async=True)
        o = warpgroup_mma_wait(num_outstanding=0, deps=[o])
        mbarrier.arrive(kv_free.index(st), count=1)
    # The row sums for consumer 1, once it has read the last alpha (it arrives on p_free after its last P C1).
    mbarrier.wait(p_free, (n_blocks - 1) & 1, pred=n_blocks > 0)
    stat_smem.store(gl.convert_layout(l_i, vec))
    mbarrier.arrive(l_ready, count=1)
    _store_half(o, l_i, out_ptr, b, h0, num_heads, split, 0, stride_ob, stride_oh, stride_os, stride_od, o_layout)
    lse = gl.where(l_i > 0.0, m_i + gl.log2(gl.where(l_i > 0.0, l_i, 1.0)), -float("inf"))
    if NUM_SPLITS == 1:
        lse = lse * 0.6931471805599453  # the final lse is natural-log; partial ones stay in log2 units
    heads = h0 + gl.arange(0, HEADS, layout=rows_s)
    gl.store(lse_ptr + b.to(gl.int64) * stride_lb + heads * stride_lh + split * stride_ls, lse, mask=heads < num_heads)


@gluon.jit
def _mla_pv_consumer(
    c1_smem,
    p_smem,
    stat_smem,
    kv_ready,
    kv_free,
    p_ready,
    p_free,
    l_ready,
    out_ptr,
    stride_ob,
    stride_oh,
    stride_os,
    stride_od,
    b,
    h0,
    num_heads,
    split,
    start,
    end,
    n_blocks,
    BLOCK_N: gl.constexpr,
    STAGES: gl.constexpr,
    PAGED: gl.constexpr,
):
    """Warpgroup 1: the right half of the output, O1 = alpha O1 + P C1 per block."""
    o_layout: gl.constexpr = wgmma_layout(HALF)
    vec: gl.constexpr = gl.BlockedLayout([1], [32], [4], [0])
    o = gl.zeros([HEADS, HALF], gl.float32, o_layout)
    for j in range(n_blocks):
        st = j % STAGES
        mbarrier.wait(p_ready, j & 1)
        alpha = stat_smem.load(vec)
        c1 = c1_smem.index(st).reshape([BLOCK_N, HALF])
        if PAGED:
            if j == n_blocks - 1:
                zero_rows(c1, _valid_rows(j, start, end, BLOCK_N), BLOCK_N, HALF)
        o = o * gl.convert_layout(alpha, gl.SliceLayout(1, o_layout))[:, None]
        o = warpgroup_mma(p_smem, c1, o, is_async=True)
        o = warpgroup_mma_wait(num_outstanding=0, deps=[o])
        mbarrier.arrive(p_free, count=1)
        mbarrier.arrive(kv_free.index(st), count=1)
    mbarrier.wait(l_ready, 0)
    _store_half(
        o,
        stat_smem.load(vec),
        out_ptr,
        b,
        h0,
        num_heads,
        split,
        HALF,
        stride_ob,
        stride_oh,
        stride_os,
        stride_od,
        o_layout,
    )


@gluon.jit
def _mla_narrow_consumer(
    qc0_smem,
    qc1_smem,
    qr_smem,
    c0_smem,
    c1_smem,
    r_smem,
    pt_smem,
    q_ready,
    kv_ready,
    kv_free,
    out_ptr,
    lse_ptr,
    stride_ob,
    stride_oh,
    stride_os,
    stride_od,
    stride_lb,
    stride_lh,
    stride_ls,
    b,
    h0,
    num_heads,
    split,
    start,
    end,
    n_blocks,
    scale_log2,
    BLOCK_N: gl.constexpr,
    STAGES: gl.constexpr,
    NUM_SPLITS: gl.constexpr,
    PAGED: gl.constexpr,
):
    """One warpgroup, a tile of n_h = 16 or 32 heads (the Q descriptor's block), every product transposed so that
    the heads are the wgmma's N and the block's tokens (or latent columns) its M: S^T = C Qc^T + R Qr^T (BLOCK_N x
    n_h), the online softmax down its columns, P^T to shared memory, then O^T += C^T P^T for both latent halves
    (256 x n_h each; C^T is the latent tile read M-major from the same shared memory). A 64-row head tile would pad
    16 heads to 64 and do four times the tensor-core work."""
    n_h: gl.constexpr = qc0_smem.shape[1]
    s_layout: gl.constexpr = wgmma_layout(n_h)
    cols_s: gl.constexpr = gl.SliceLayout(0, s_layout)  # one value per head (the output tiles share the layout)
    dtype: gl.constexpr = c0_smem.dtype
    qc0 = qc0_smem.reshape([n_h, HALF]).permute((1, 0))
    qc1 = qc1_smem.reshape([n_h, HALF]).permute((1, 0))
    qr = qr_smem.reshape([n_h, qr_smem.shape[2]]).permute((1, 0))
    m_i = gl.full([n_h], -float("inf"), gl.float32, cols_s)
    l_i = gl.zeros([n_h], gl.float32, cols_s)
    o0 = gl.zeros([HALF, n_h], gl.float32, s_layout)
    o1 = gl.zeros([HALF, n_h], gl.float32, s_layout)
    s = gl.zeros([BLOCK_N, n_h], gl.float32, s_layout)
    mbarrier.wait(q_ready, 0)
    for j in range(n_blocks):
        st = j % STAGES
        mbarrier.wait(kv_ready.index(st), (j // STAGES) & 1)
        c0 = c0_smem.index(st).reshape([BLOCK_N, HALF])
        c1 = c1_smem.index(st).reshape([BLOCK_N, HALF])
        s = warpgroup_mma(c0, qc0, s, use_acc=False, is_async=True)
        s = warpgroup_mma(c1, qc1, s, is_async=True)
        s = warpgroup_mma(r_smem.index(st).reshape([BLOCK_N, qr_smem.shape[2]]), qr, s, is_async=True)
        s = warpgroup_mma_wait(num_outstanding=0, deps=[s])
        if j == n_blocks - 1:
            offs_n = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, s_layout))
            s = gl.where(_last_block_read(offs_n, j, start, end, PAGED, BLOCK_N)[:, None], s, -float("inf"))
            if PAGED:  # rows past `end` zeroed in the latent tile too
                n_valid = _valid_rows(j, start, end, BLOCK_N)
                zero_rows(c0, n_valid, BLOCK_N, HALF)
                zero_rows(c1, n_valid, BLOCK_N, HALF)
        m_new = gl.maximum(m_i, gl.max(s, 0) * scale_log2)
        p = gl.exp2(s * scale_log2 - m_new[None, :])
        alpha = gl.exp2(m_i - m_new)
        l_i = l_i * alpha + gl.sum(p, 0)
        m_i = m_new
        pt_smem.store(p.to(dtype))
        fence_async_shared()
        o0 = warpgroup_mma(c0.permute((1, 0)), pt_smem, o0 * alpha[None, :], is_async=True)
        o1 = warpgroup_mma(c1.permute((1, 0)), pt_smem, o1 * alpha[None, :], is_async=True)
        o0, o1 = warpgroup_mma_wait(num_outstanding=0, deps=[o0, o1])
        mbarrier.arrive(kv_free.index(st), count=1)
    has_tokens = l_i > 0.0  # a split that saw no token writes zeros and lse -inf (as attention_kernels.decode)
    l_safe = gl.where(has_tokens, l_i, 1.0)
    heads = h0 + gl.arange(0, n_h, layout=cols_s)
    cols = gl.arange(0, HALF, layout=gl.SliceLayout(1, s_layout))
    o_ptrs = (
        out_ptr
        + b.to(gl.int64) * stride_ob
        + heads[None, :] * stride_oh
        + split * stride_os
        + cols[:, None] * stride_od
    )
    mask = (heads < num_heads)[None, :]
    gl.store(o_ptrs, (o0 / l_safe[None, :]).to(out_ptr.dtype.element_ty), mask=mask)
    gl.store(o_ptrs + HALF * stride_od, (o1 / l_safe[None, :]).to(out_ptr.dtype.element_ty), mask=mask)
    lse = gl.where(has_tokens, m_i + gl.log2(l_safe), -float("inf"))
    if NUM_SPLITS == 1:
        lse = lse * 0.6931471805599453  # the final lse is natural-log; partial ones stay in log2 units
    gl.store(lse_ptr + b.to(gl.int64) * stride_lb + heads * stride_lh + split * stride_ls, lse, mask=heads < num_heads)


@gluon.jit
def _mla_decode_sm90_kernel(
    qc_desc,
    qr_desc,
    c_desc,
    r_desc,
    seq_lens_ptr,
    table_ptr,
    out_ptr,
    lse_ptr,
    num_heads,
    stride_tb,
    stride_tp,
    stride_ob,
    stride_oh,
    stride_os,
    stride_od,
    stride_lb,
    stride_lh,
    stride_ls,
    scale_log2,
    BLOCK_N: gl.constexpr,
    STAGES: gl.constexpr,
    NUM_SPLITS: gl.constexpr,
    PAGED: gl.constexpr,
    PAGE_SIZE: gl.constexpr,
    PAGE_ROWS: gl.constexpr,
    WAIT: gl.constexpr = False,
):
    """grid (head tiles, splits, B). The Q descriptors' block sets the head tile: 64 heads (two consumer
    warpgroups, heads as the wgmma's M) or NARROW_HEADS (one consumer, heads as the N). WAIT: launched as a
    programmatic dependent of the kernel before it (`_host.pdl`; the narrow program only, see `launch`); every
    thread waits for that kernel's outputs before the first memory access."""
    if WAIT:
        gdc_wait()
    n_h: gl.constexpr = qc_desc.block_type.shape[1]
    h0 = gl.program_id(0) * n_h
    split = gl.program_id(1)
    b = gl.program_id(2)
    start, end, n_blocks = split_range(seq_lens_ptr, b, split, NUM_SPLITS, BLOCK_N)

    dtype: gl.constexpr = qc_desc.dtype
    qc0_smem = gl.allocate_shared_memory(dtype, qc_desc.block_type.shape, qc_desc.layout)
    qc1_smem = gl.allocate_shared_memory(dtype, qc_desc.block_type.shape, qc_desc.layout)
    qr_smem = gl.allocate_shared_memory(dtype, qr_desc.block_type.shape, qr_desc.layout)
    # [stage, 1, BLOCK_N, columns]: one contiguous copy per block, or BLOCK_N // PAGE_ROWS row slices when paged.
    c0_smem = gl.allocate_shared_memory(dtype, [STAGES, 1, BLOCK_N, HALF], c_desc.layout)
    c1_smem = gl.allocate_shared_memory(dtype, [STAGES, 1, BLOCK_N, HALF], c_desc.layout)
    r_smem = gl.allocate_shared_memory(dtype, [STAGES, 1, BLOCK_N, r_desc.block_type.shape[2]], r_desc.layout)
    q_ready = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    kv_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    kv_free = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    consumers: gl.constexpr = 2 if n_h == HEADS else 1
    mbarrier.init(q_ready, count=1)
    for i in gl.static_range(STAGES):
        mbarrier.init(kv_ready.index(i), count=1)
        mbarrier.init(kv_free.index(i), count=consumers)
    if n_h == HEADS:
        p_smem = gl.allocate_shared_memory(
            dtype, [HEADS, BLOCK_N], gl.NVMMASharedLayout.get_default_for([HEADS, BLOCK_N], dtype)
        )
        stat_smem = gl.allocate_shared_memory(gl.float32, [HEADS], gl.SwizzledSharedLayout(1, 1, 1, [0]))
        p_ready = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        p_free = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        l_ready = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        mbarrier.init(p_ready, count=1)
        mbarrier.init(p_free, count=1)
        mbarrier.init(l_ready, count=1)
        fence_async_shared()
        gl.warp_specialize(
            [
                (
                    _mla_softmax_consumer,
                    (
                        qc0_smem,
                        qc1_smem,
                        qr_smem,
                        c0_smem,
                        c1_smem,
                        r_smem,
                        p_smem,
                        stat_smem,
                        q_ready,
                        kv_ready,
                        kv_free,
                        p_ready,
                        p_free,
                        l_ready,
                        out_ptr,
                        lse_ptr,
                        stride_ob,
                        stride_oh,
                        stride_os,
                        stride_od,
                        stride_lb,
                        stride_lh,
                        stride_ls,
                        b,
                        h0,
                        num_heads,
                        split,
                        start,
                        end,
                        n_blocks,
                        scale_log2,
                        BLOCK_N,
                        STAGES,
                        NUM_SPLITS,
                        PAGED,
                    ),
                ),
                (
                    _mla_pv_consumer,
                    (
                        c1_smem,
                        p_smem,
                        stat_smem,
                        kv_ready,
                        kv_free,
                        p_ready,
                        p_free,
                        l_ready,
                        out_ptr,
                        stride_ob,
                        stride_oh,
                        stride_os,
                        stride_od,
                        b,
                        h0,
                        num_heads,
                        split,
                        start,
                        end,
                        n_blocks,
                        BLOCK_N,
                        STAGES,
                        PAGED,
                    ),
                ),
                (
                    _mla_loader,
                    (
                        qc_desc,
                        qr_desc,
                        c_desc,
                        r_desc,
                        qc0_smem,
                        qc1_smem,
                        qr_smem,
                        c0_smem,
                        c1_smem,
                        r_smem,
                        q_ready,
                        kv_ready,
                        kv_free,
                        table_ptr,
                        stride_tb,
                        stride_tp,
                        b,
                        h0,
                        start,
                        end,
                        n_blocks,
                        BLOCK_N,
                        STAGES,
                        PAGED,
                        PAGE_SIZE,
                        PAGE_ROWS,
                    ),
                ),
            ],
            [4, 1],
            [CONSUMER_REGS, LOADER_REGS],
        )
    else:
        pt_smem = gl.allocate_shared_memory(
            dtype, [BLOCK_N, n_h], gl.NVMMASharedLayout.get_default_for([BLOCK_N, n_h], dtype)
        )
        fence_async_shared()
        gl.warp_specialize(
            [
                (
                    _mla_narrow_consumer,
                    (
                        qc0_smem,
                        qc1_smem,
                        qr_smem,
                        c0_smem,
                        c1_smem,
                        r_smem,
                        pt_smem,
                        q_ready,
                        kv_ready,
                        kv_free,
                        out_ptr,
                        lse_ptr,
                        stride_ob,
                        stride_oh,
                        stride_os,
                        stride_od,
                        stride_lb,
                        stride_lh,
                        stride_ls,
                        b,
                        h0,
                        num_heads,
                        split,
                        start,
                        end,
                        n_blocks,
                        scale_log2,
                        BLOCK_N,
                        STAGES,
                        NUM_SPLITS,
                        PAGED,
                    ),
                ),
                (
                    _mla_loader,
                    (
                        qc_desc,
                        qr_desc,
                        c_desc,
                        r_desc,
                        qc0_smem,
                        qc1_smem,
                        qr_smem,
                        c0_smem,
                        c1_smem,
                        r_smem,
                        q_ready,
                        kv_ready,
                        kv_free,
                        table_ptr,
                        stride_tb,
                        stride_tp,
                        b,
                        h0,
                        start,
                        end,
                        n_blocks,
                        BLOCK_N,
                        STAGES,
                        PAGED,
                        PAGE_SIZE,
                        PAGE_ROWS,
                    ),
                ),
            ],
            [1],
            [LOADER_REGS],
        )


def enabled() -> bool:
    """ZOO_MLA_SM90=0 turns this kernel off."""
    return os.environ.get("ZOO_MLA_SM90", "1") != "0"


def supports(q_absorbed, q_rope, c_kv, k_rope, paged: bool = False) -> bool:
    """Do mla_decode (paged=False) and paged_mla_decode (paged=True; c_kv and k_rope are then the page pools)
    launch this kernel for these inputs? On an sm_90 GPU with the Triton release Gluon's kernels were verified
    against (`sm90.on_hopper`), when `eligible`."""
    return enabled() and on_hopper(q_absorbed) and eligible(q_absorbed, q_rope, c_kv, k_rope, paged)


def eligible(q_absorbed, q_rope, c_kv, k_rope, paged: bool = False) -> bool:
    """fp16/bf16, D_c = 512, D_r = 64, strides TMA can read, and a head count that is at most 64 or a multiple of
    64: up to 32 heads run the narrow program (a tile of 16 or 32 heads as the wgmma's N), 33-63 one 64-head tile
    (missing heads: TMA fills their queries with zeros and the stores skip them). At 32 heads both programs ran
    ahead of the Triton kernel on an H200 (benchmarks/RESULTS.md)."""
    h = q_absorbed.shape[1]
    if q_absorbed.dtype not in (torch.float16, torch.bfloat16):
        return False
    if h % HEADS_PER_PROGRAM and h > HEADS_PER_PROGRAM:
        return False
    if q_absorbed.shape[2] != 2 * HALF_COLUMNS or q_rope.shape[2] != ROPE_DIM:
        return False
    return all(_checks.tma_readable(t) for t in (q_absorbed, q_rope, c_kv, k_rope))


def tile_seconds(tile_flops: int) -> float:
    """Per-tile time of one program alone for the split model (`split_kv.auto_num_splits`): the FLOPs at 4 TFLOP/s,
    one SM's share of the kernel's rate at 128 heads, with a 1.5 us floor (where the narrow program's tiles sit).
    With it the model picks the measured best split on the H200 sweep's shapes (benchmarks/RESULTS.md)."""
    return max(1.5e-6, tile_flops / 4e12)


def tile_heads(h: int) -> int:
    """Heads per program: NARROW_HEADS or twice that for at most 32 heads (the narrow consumer), else
    HEADS_PER_PROGRAM. ZOO_MLA_NARROW=0 gives every head count the 64-head tile (benchmarks compare the two)."""
    if h <= 2 * NARROW_HEADS and os.environ.get("ZOO_MLA_NARROW", "1") != "0":
        return NARROW_HEADS if h <= NARROW_HEADS else 2 * NARROW_HEADS
    return HEADS_PER_PROGRAM


def launch(
    q_absorbed,
    q_rope,
    c_kv,
    k_rope,
    seq_lens,
    part_o,
    part_lse,
    scale: float,
    num_splits: int,
    block_table=None,
    heads: int | None = None,
):
    """On inputs `supports` accepted, seq_lens (B,) int32 contiguous: each split's output into part_o (B, H,
    splits, D_c) (the final output, in q's dtype, for one split; fp32 partials otherwise) and its lse into
    part_lse (B, H, splits) (natural log for one split, log2 units for partials), as split_kv's splits.
    With block_table (B, max_pages) int32, c_kv and k_rope are the page pools (num_pages, page_size, D), page_size
    a power of two from 8 to 256. `heads`: heads per program (default `tile_heads`)."""
    batch, h, _ = q_absorbed.shape
    paged = block_table is not None
    page_size = c_kv.shape[1] if paged else 1
    rows = min(page_size, BLOCK_N) if paged else BLOCK_N  # rows per TMA copy: one page (or block) at most
    table = block_table if paged else seq_lens  # unused when contiguous
    heads = heads or tile_heads(h)
    # A programmatic dependent launch for the narrow program only: it measured faster there on an H200, and slower
    # for the 64-head tile (benchmarks/RESULTS.md).
    wait = heads < HEADS_PER_PROGRAM and pdl(q_absorbed.device)
    launcher(_mla_decode_sm90_kernel)[(cdiv(h, heads), num_splits, batch)](
        descriptor(q_absorbed, [1, heads, HALF_COLUMNS]),
        descriptor(q_rope, [1, heads, ROPE_DIM]),
        descriptor(c_kv, [1, rows, HALF_COLUMNS]),
        descriptor(k_rope, [1, rows, ROPE_DIM]),
        seq_lens,
        table,
        part_o,
        part_lse,
        h,
        *(block_table.stride() if paged else (0, 0)),
        *part_o.stride(),
        *part_lse.stride(),
        float(scale) * LOG2E,
        BLOCK_N=BLOCK_N,
        STAGES=STAGES,
        NUM_SPLITS=num_splits,
        PAGED=paged,
        PAGE_SIZE=page_size,
        PAGE_ROWS=rows,
        WAIT=wait,
        num_warps=4,
        launch_pdl=wait,
    )
