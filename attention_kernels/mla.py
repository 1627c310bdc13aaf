"""Absorbed multi-head latent attention (DeepSeek-V2 MLA) decode over a latent cache, contiguous or paged.

Math, per sequence b and head h, with the key up-projection absorbed into the query (q_absorbed = q_nope W_UK[h])
and the value up-projection applied after attention (out = latent W_UV[h]^T, `reference.unabsorb_output`), by the
caller or, given w_uv, in the combine of the splits (`_combine_up_kernel`):
    s_n = scale * (q_absorbed_h . c_kv_n + q_rope_h . k_rope_n)     for n < seq_lens[b]
    latent_h = sum_n softmax(s)_n c_kv_n,   lse_h = log sum_n exp(s_n)
Every head reads the same cache row, so this is grouped decode with one KV head, all H query heads in its group,
and V = K's latent part. The kernel reads each c_kv tile once and uses it twice: as K in the scores (the 512-wide
latent and the 64-wide RoPE key as two dots) and as V in the output. Splits, their combine and the interpreter's
compile-time trip count are split_kv.py's (Flash-Decoding, Dao et al. 2023; DeepSeek-V2, 2024).

Layouts:
    contiguous  q_absorbed (B, H, D_c)  q_rope (B, H, D_r)  c_kv (B, S_max, D_c)  k_rope (B, S_max, D_r)
    paged       c_kv_pages (num_pages, page_size, D_c) and k_rope_pages (num_pages, page_size, D_r): one pool
                each, shared by all heads (a latent cache has no head axis); block_table (B, max_pages) int32
                maps token n of sequence b to page block_table[b, n // page_size], slot n % page_size, and the
                same (page, slot) indexes both pools.
Outputs: latent (B, H, D_c) in q_absorbed's dtype, or with w_uv (H, D_v, D_c) the values (B, H, D_v); lse (B, H)
fp32, natural log.

On Hopper, 512 + 64 in fp16/bf16 with up to 64 heads or heads in multiples of 64 run the warp-specialized Gluon
kernels of mla_sm90.py instead, which measured 1.0-1.9x this kernel's speed on an H200 (benchmarks/RESULTS.md);
everything else runs the Triton kernel below.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_wait

from attention_kernels import _checks, split_kv
from attention_kernels._host import LOG2E, cdiv, device_guard, launcher, next_power_of_2, num_sms, pdl
from attention_kernels.split_kv import (
    MAX_SPLITS,
    auto_num_splits,
    combine_if_last,
    combine_splits,
    dot_precision,
    fused_combine_chunk,
    heads_per_program,
    online_softmax_step,
    pow2,
    split_counters,
    split_range,
    store_split,
    tile_count,
    tile_rows,
    tile_seconds,
)

try:  # Gluon (triton.experimental) is missing from some Triton builds; the Triton kernel then runs everywhere.
    from attention_kernels import mla_sm90
except ImportError:  # pragma: no cover
    mla_sm90 = None


@triton.jit
def _cut_chain(s, cond):
    """s, unchanged, passed out of a runtime branch (`cond` is true whenever the result is used). Triton 3.6 lays
    out a dot whose result reaches another dot (the scores reach P V) with every warp along M, and the 64-head
    tile has M = 64: with eight warps both warpgroups then computed the same 64 x 64 scores. The compiler's rule
    follows values, not branch results, so behind the branch the score dots get a 4 x 2 warp grid and each
    warpgroup computes half the columns once (half the score instructions: 36 m64n32k16 wgmma per tile instead
    of 72 in the sm_90 PTX). `+ 0.0` keeps the branch from folding into a select. At 128 heads on an H200 the kernel
    runs about 20% faster for it (benchmarks/RESULTS.md)."""
    out = s
    if cond:
        out = s + 0.0
    return out


@triton.jit
def _mla_tile(
    CKV,
    KR,
    BLOCK_TABLE,
    q,
    q_rope,
    m_i,
    l_i,
    acc,
    b,
    tile_start,
    end,
    offs_c,
    offs_r,
    stride_cp,
    stride_cn,
    stride_cd,
    stride_rp,
    stride_rn,
    stride_rd,
    stride_tb,
    stride_tp,
    scale_log2,
    D_C: tl.constexpr,
    D_R: tl.constexpr,
    BLOCK_N: tl.constexpr,
    PAGED: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    EVICT: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """One online-softmax step over BLOCK_N latent rows: the c_kv tile serves as K and as V."""
    offs_n, mask_n, page, slot = tile_rows(
        BLOCK_TABLE, b, tile_start, end, stride_tb, stride_tp, BLOCK_N, PAGED, PAGE_SIZE
    )
    kv = tl.load(
        CKV + page * stride_cp + slot[:, None] * stride_cn + offs_c[None, :] * stride_cd,
        mask=mask_n[:, None] & (offs_c[None, :] < D_C),
        other=0.0,
        eviction_policy=EVICT,
    )  # (BLOCK_N, D_c)
    kr = tl.load(
        KR + page * stride_rp + slot[:, None] * stride_rn + offs_r[None, :] * stride_rd,
        mask=mask_n[:, None] & (offs_r[None, :] < D_R),
        other=0.0,
        eviction_policy=EVICT,
    )
    # Each product scaled on its own: a bare dot added to another becomes the other's accumulator, which would
    # chain the two score dots (see _cut_chain).
    s = (
        tl.dot(q, tl.trans(kv), input_precision=DOT_PRECISION) * scale_log2
        + tl.dot(q_rope, tl.trans(kr), input_precision=DOT_PRECISION) * scale_log2
    )
    s = _cut_chain(s, tile_start < end)
    return online_softmax_step(s, mask_n, kv, m_i, l_i, acc, DOT_PRECISION)


@triton.jit
def _mla_decode_kernel(
    QA,
    QR,
    CKV,
    KR,
    BLOCK_TABLE,
    SEQ_LENS,
    OUT,
    LSE,
    FINAL_OUT,
    FINAL_LSE,
    COUNTERS,
    stride_qab,
    stride_qah,
    stride_qad,
    stride_qrb,
    stride_qrh,
    stride_qrd,
    stride_cp,
    stride_cn,
    stride_cd,
    stride_rp,
    stride_rn,
    stride_rd,
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
    H: tl.constexpr,
    D_C: tl.constexpr,
    D_R: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_DC: tl.constexpr,
    BLOCK_DR: tl.constexpr,
    PAGED: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    STATIC_ITERS: tl.constexpr,
    EVICT: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    FUSE_CHUNK: tl.constexpr,
):
    # grid (head tiles, splits, B): the head tiles of one (sequence, split) run side by side and share its
    # tiles through L2.
    tile = tl.program_id(0)
    split = tl.program_id(1)
    b = tl.program_id(2)
    heads = tile * BLOCK_H + tl.arange(0, BLOCK_H)
    mask_h = heads < H
    offs_c = tl.arange(0, BLOCK_DC)
    offs_r = tl.arange(0, BLOCK_DR)
    q = tl.load(
        QA + b * stride_qab + heads[:, None] * stride_qah + offs_c[None, :] * stride_qad,
        mask=mask_h[:, None] & (offs_c[None, :] < D_C),
        other=0.0,
    )  # (BLOCK_H, BLOCK_DC)
    q_rope = tl.load(
        QR + b * stride_qrb + heads[:, None] * stride_qrh + offs_r[None, :] * stride_qrd,
        mask=mask_h[:, None] & (offs_r[None, :] < D_R),
        other=0.0,
    )  # (BLOCK_H, BLOCK_DR)

    start, end = split_range(SEQ_LENS, b, split, NUM_SPLITS, BLOCK_N)
    m_i = tl.full([BLOCK_H], -float("inf"), tl.float32)  # running max, log2 units
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_DC], tl.float32)
    for i in range(0, tile_count(start, end, BLOCK_N, STATIC_ITERS)):  # split_kv's trip count
        m_i, l_i, acc = _mla_tile(
            CKV,
            KR,
            BLOCK_TABLE,
            q,
            q_rope,
            m_i,
            l_i,
            acc,
            b,
            start + i * BLOCK_N,
            end,
            offs_c,
            offs_r,
            stride_cp,
            stride_cn,
            stride_cd,
            stride_rp,
            stride_rn,
            stride_rd,
            stride_tb,
            stride_tp,
            scale_log2,
            D_C,
            D_R,
            BLOCK_N,
            PAGED,
            PAGE_SIZE,
            EVICT,
            DOT_PRECISION,
        )
    store_split(
        OUT,
        LSE,
        acc,
        m_i,
        l_i,
        b,
        heads,
        mask_h,
        split,
        offs_c,
        D_C,
        stride_ob,
        stride_oh,
        stride_os,
        stride_od,
        stride_lb,
        stride_lh,
        stride_ls,
        NUM_SPLITS,
    )
    if FUSE_CHUNK > 0:  # the split combine in this launch (split_kv.combine_if_last)
        combine_if_last(
            COUNTERS,
            b * tl.num_programs(0) + tile,
            OUT,
            LSE,
            FINAL_OUT,
            FINAL_LSE,
            b,
            tile * BLOCK_H,
            H,
            offs_c,
            D_C,
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
            NUM_SPLITS,
            triton.next_power_of_2(min(H, BLOCK_H)),
            FUSE_CHUNK,
        )


@triton.jit
def _combine_up_kernel(
    PART_O,
    PART_LSE,
    W_UV,
    OUT,
    LSE,
    B,
    stride_pb,
    stride_ph,
    stride_ps,
    stride_pd,
    stride_plb,
    stride_plh,
    stride_pls,
    stride_wh,
    stride_wv,
    stride_wc,
    stride_ob,
    stride_oh,
    stride_od,
    stride_lb,
    stride_lh,
    NUM_SPLITS: tl.constexpr,
    D_C: tl.constexpr,
    D_V: tl.constexpr,
    BLOCK_B: tl.constexpr,
    BLOCK_S: tl.constexpr,
    SPLIT_CHUNK: tl.constexpr,
    BLOCK_C: tl.constexpr,
    BLOCK_V: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    WAIT: tl.constexpr,
):
    """The split combine with the value up-projection applied: out[b, h] = latent[b, h] W_UV[h]^T, the latent the
    merge of the NUM_SPLITS partials (weights exp2(lse_s - max), as split_kv's combine), kept in registers. A program
    takes BLOCK_B rows of one head and BLOCK_V of its value columns, and walks the latent in BLOCK_C-wide chunks;
    16 rows or more make the product an MMA, so W_UV's tile is read once for all of them. With one split the
    partial is the decode's final latent and lse (natural log), which the merge's weight of 1 passes through."""
    h = tl.program_id(0)
    rows = tl.program_id(1) * BLOCK_B + tl.arange(0, BLOCK_B)
    cols = tl.program_id(2) * BLOCK_V + tl.arange(0, BLOCK_V)
    mask_b = rows < B
    mask_v = cols < D_V
    offs_c = tl.arange(0, BLOCK_C)
    w_ptrs = W_UV + h * stride_wh + cols[:, None] * stride_wv + offs_c[None, :] * stride_wc
    # The grid that may still run is the decode launch, which does not write W_UV: its first chunk is read before
    # the wait for the decode's partials, and callers need not order anything before the call.
    w = tl.load(w_ptrs, mask=mask_v[:, None] & (offs_c[None, :] < D_C), other=0.0)  # (BLOCK_V, BLOCK_C)
    if WAIT:
        gdc_wait()
    lse_row = PART_LSE + rows[:, None] * stride_plb + h * stride_plh
    offs_s = tl.arange(0, BLOCK_S)
    lse2 = tl.load(
        lse_row + offs_s[None, :] * stride_pls,
        mask=mask_b[:, None] & (offs_s[None, :] < NUM_SPLITS),
        other=-float("inf"),
    )  # (BLOCK_B, BLOCK_S)
    m = tl.max(lse2, axis=1)
    m = tl.where(m == -float("inf"), 0.0, m)  # padding rows only: split 0 of a sequence holds a token
    denom = tl.sum(tl.math.exp2(lse2 - m[:, None]), axis=1)
    inv = 1.0 / tl.where(denom > 0.0, denom, 1.0)
    offs_k = tl.arange(0, SPLIT_CHUNK)
    o_row = PART_O + rows[:, None, None] * stride_pb + h * stride_ph
    acc = tl.zeros([BLOCK_B, BLOCK_V], tl.float32)
    for c0 in tl.static_range(0, D_C, BLOCK_C):
        if c0 > 0:
            w = tl.load(w_ptrs + c0 * stride_wc, mask=mask_v[:, None] & ((c0 + offs_c)[None, :] < D_C), other=0.0)
        mask_c = (c0 + offs_c) < D_C
        latent = tl.zeros([BLOCK_B, BLOCK_C], tl.float32)
        for s0 in range(0, NUM_SPLITS, SPLIT_CHUNK):
            splits = s0 + offs_k
            mask_s = splits < NUM_SPLITS
            lse_k = tl.load(
                lse_row + splits[None, :] * stride_pls, mask=mask_b[:, None] & mask_s[None, :], other=-float("inf")
            )
            o = tl.load(
                o_row + splits[None, :, None] * stride_ps + (c0 + offs_c)[None, None, :] * stride_pd,
                mask=mask_b[:, None, None] & mask_s[None, :, None] & mask_c[None, None, :],
                other=0.0,
            )  # (BLOCK_B, SPLIT_CHUNK, BLOCK_C)
            latent += tl.sum(o.to(tl.float32) * tl.math.exp2(lse_k - m[:, None])[:, :, None], axis=1)
        latent = latent * inv[:, None]
        if BLOCK_B >= 16:  # both rounded to the output's half dtype for the MMA, as a matmul under autocast takes them
            dt = OUT.dtype.element_ty
            acc += tl.dot(latent.to(dt), tl.trans(w.to(dt)), input_precision=DOT_PRECISION)
        else:
            acc += tl.sum(latent[:, None, :] * w.to(tl.float32)[None, :, :], axis=2)
    out_ptrs = OUT + rows[:, None] * stride_ob + h * stride_oh + cols[None, :] * stride_od
    tl.store(out_ptrs, acc.to(OUT.dtype.element_ty), mask=mask_b[:, None] & mask_v[None, :])
    if NUM_SPLITS > 1:
        if tl.program_id(2) == 0:
            lse = tl.where(
                denom > 0.0, (m + tl.math.log2(tl.where(denom > 0.0, denom, 1.0))) * 0.6931471805599453, -float("inf")
            )
            tl.store(LSE + rows * stride_lb + h * stride_lh, lse, mask=mask_b)


# ---- Launch heuristics ------------------------------------------------------------------------------------------


def _mla_config(h: int, d_c: int) -> dict:
    """Heads per program and tile sizes; the (BLOCK_H, D_c) fp32 accumulator lives in registers. At 512 + 64, the
    fastest of an H200 sweep (benchmarks/RESULTS.md): 16 heads (memory-bound) take 64-row tiles, four warps and
    three stages; 64 heads (compute-bound) 64-row tiles, eight warps and two stages (three stages of 64 rows do
    not fit)."""
    block_h = heads_per_program(h)
    if d_c > 256:
        if block_h == 16:
            return dict(BLOCK_H=16, BLOCK_N=64, num_warps=4, num_stages=3)
        return dict(BLOCK_H=block_h, BLOCK_N=64, num_warps=8 if block_h == 64 else 4, num_stages=2)
    return dict(BLOCK_H=block_h, BLOCK_N=64, num_warps=4, num_stages=3)


# ---- The step's inputs: W_UK absorbed into the query, RoPE, the latent's norm, the cache write ------------------

INPUT_ROWS = 16  # rows a program takes: the MMA's least M


def input_columns(d_n: int, itemsize: int) -> int:
    """Absorbed-query columns a program computes: 64 (a one-row step then spreads W_UK, a few hundred KB, over four
    programs a head), fewer where the D_n x columns tile of W_UK would pass 16 KB of registers (wide fp32 heads
    spill at 64)."""
    return max(16, min(64, 16384 // (pow2(d_n) * itemsize)))


@triton.jit
def _inputs_kernel(
    Q,
    KV,
    COS,
    SIN,
    NORM_W,
    W_UK,
    Q_ABS,
    Q_ROPE,
    C_CACHE,
    R_CACHE,
    PAGES,
    SLOTS,
    B,
    stride_qb,
    stride_qh,
    stride_kvb,
    stride_ab,
    stride_wh,
    stride_wn,
    stride_cp,
    stride_cs,
    stride_rp,
    stride_rs,
    stride_pb,
    stride_sb,
    stride_angle,
    eps,
    H: tl.constexpr,
    D_N: tl.constexpr,
    D_C: tl.constexpr,
    HALF: tl.constexpr,
    BLOCK_B: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_C: tl.constexpr,
    BLOCK_LATENT: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    # grid (cdiv(B, BLOCK_B), H + 1, cdiv(D_c, BLOCK_C)). Head h < H: BLOCK_C columns of q_nope W_UK[h] for BLOCK_B
    # rows as one MMA (the weight tile is read once for all of them), and at column block 0 the head's RoPE part.
    # "Head" H, column block 0: the latent's norm and the RoPE key, stored at each row's (page, slot) in the cache.
    rows = tl.program_id(0) * BLOCK_B + tl.arange(0, BLOCK_B)
    h = tl.program_id(1)
    j = tl.program_id(2)
    row_ok = rows < B
    rows = rows.to(tl.int64)
    i = tl.arange(0, BLOCK_HALF)
    half_ok = row_ok[:, None] & (i < HALF)[None, :]
    cos_row, sin_row = COS + rows[:, None] * stride_angle, SIN + rows[:, None] * stride_angle
    if h < H:
        n = tl.arange(0, BLOCK_N)
        c = j * BLOCK_C + tl.arange(0, BLOCK_C)
        q_ok = row_ok[:, None] & (n < D_N)[None, :]
        w_ok = (n < D_N)[:, None] & (c < D_C)[None, :]
        w = tl.load(W_UK + h * stride_wh + n[:, None] * stride_wn + c[None, :], mask=w_ok, other=0.0)
        q_nope = tl.load(Q + rows[:, None] * stride_qb + h * stride_qh + n[None, :], mask=q_ok, other=0.0)
        q_abs = tl.dot(q_nope, w.to(q_nope.dtype), input_precision=DOT_PRECISION)
        q_abs_ptr = Q_ABS + rows[:, None] * stride_ab + h * D_C + c[None, :]
        tl.store(q_abs_ptr, q_abs.to(Q_ABS.dtype.element_ty), mask=row_ok[:, None] & (c < D_C)[None, :])
        if j == 0:
            q_rope_src = Q + rows[:, None] * stride_qb + h * stride_qh + D_N + i[None, :]
            q_rope_dst = Q_ROPE + (rows[:, None] * H + h) * 2 * HALF + i[None, :]
            _rotate_into(q_rope_src, q_rope_dst, cos_row, sin_row, i, half_ok, HALF)
    elif j == 0:
        c = tl.arange(0, BLOCK_LATENT)
        latent_ok = row_ok[:, None] & (c < D_C)[None, :]
        gain = tl.load(NORM_W + c, mask=c < D_C, other=0.0).to(tl.float32)
        latent = tl.load(KV + rows[:, None] * stride_kvb + c[None, :], mask=latent_ok, other=0.0).to(tl.float32)
        rms = tl.rsqrt(tl.sum(latent * latent, axis=1) / D_C + eps)
        page = tl.load(PAGES + rows * stride_pb, mask=row_ok, other=0).to(tl.int64)
        slot = tl.load(SLOTS + rows * stride_sb, mask=row_ok, other=0).to(tl.int64)
        c_dst = C_CACHE + page[:, None] * stride_cp + slot[:, None] * stride_cs + c[None, :]
        tl.store(c_dst, (latent * rms[:, None] * gain[None, :]).to(C_CACHE.dtype.element_ty), mask=latent_ok)
        k_rope_src = KV + rows[:, None] * stride_kvb + D_C + i[None, :]
        k_rope_dst = R_CACHE + page[:, None] * stride_rp + slot[:, None] * stride_rs + i[None, :]
        _rotate_into(k_rope_src, k_rope_dst, cos_row, sin_row, i, half_ok, HALF)


@triton.jit
def _rotate_into(src, dst, cos_row, sin_row, i, mask, HALF: tl.constexpr):
    """dst = RoPE of the pairs (src[i], src[i + HALF]) at each row's angles (rotate-half, as rope.py's), in fp32."""
    cos = tl.load(cos_row + i[None, :], mask=mask, other=0.0)
    sin = tl.load(sin_row + i[None, :], mask=mask, other=0.0)
    x1 = tl.load(src, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(src + HALF, mask=mask, other=0.0).to(tl.float32)
    tl.store(dst, (x1 * cos - x2 * sin).to(dst.dtype.element_ty), mask=mask)
    tl.store(dst + HALF, (x2 * cos + x1 * sin).to(dst.dtype.element_ty), mask=mask)


# ---- Launcher ---------------------------------------------------------------------------------------------------


def _launch_mla(
    q_absorbed,
    q_rope,
    c_kv,
    k_rope,
    block_table,
    seq_lens,
    scale: float,
    num_splits,
    *,
    paged: bool,
    page_size: int,
    capacity: int,
    w_uv: torch.Tensor | None = None,
    config: dict | None = None,
):
    batch, h, d_c = q_absorbed.shape
    d_r = q_rope.shape[-1]
    seq_lens = seq_lens.contiguous()  # the kernel reads seq_lens[b] at SEQ_LENS + b (no stride)
    # Hopper, fp16/bf16, 512 + 64, heads in tiles of 64: the warp-specialized Gluon kernel (mla_sm90.py).
    # `config` (benchmark sweeps) always means the Triton kernel.
    sm90 = config is None and mla_sm90 is not None and mla_sm90.supports(q_absorbed, q_rope, c_kv, k_rope, paged)
    cfg = dict(_mla_config(h, d_c), **(config or {}))
    block_h, block_n = cfg.pop("BLOCK_H"), cfg.pop("BLOCK_N")
    if sm90:
        block_h, block_n = mla_sm90.tile_heads(h), mla_sm90.BLOCK_N
    head_tiles = cdiv(h, block_h)
    n_tiles = cdiv(capacity, block_n)
    if num_splits is None:
        tile_bytes = block_n * (d_c + d_r) * c_kv.element_size()
        # The MMA's work per tile: a head tile is padded to 64 rows, except the narrow Hopper kernel's (heads as N).
        rows = block_h if sm90 and block_h < mla_sm90.HEADS_PER_PROGRAM else max(64, block_h)
        tile_flops = 2 * rows * block_n * (d_c + d_r + d_c)
        # One program per SM: the 64-row head tile's accumulator fills the register file, and the 16-head tile's
        # three stages of 64 x 576 latent rows fill shared memory. Paged 16-head launches of the Triton kernel use
        # grouped decode's paged rule (slower tiles, twice the programs), which matches their best measured splits.
        # Paged launches of the narrow Hopper program (under 64 heads) count twice the programs too, though it runs
        # one per SM: that matches its best measured splits, and one per SM picks the same splits on the bench grid.
        smem_bound_paged = paged and block_h < 64
        slots = num_sms(q_absorbed.device) * (2 if smem_bound_paged else 1)
        tile_time = mla_sm90.tile_seconds(tile_flops) if sm90 else tile_seconds(tile_flops, smem_bound_paged)
        num_splits = auto_num_splits(
            batch * head_tiles, n_tiles, tile_bytes, tile_time, batch * h * (d_c + 1) * 4, slots
        )
    up = w_uv is not None  # the combine applies W_UV (`_combine_up`), after one split as after several
    out = split_kv.new_empty((batch, h, w_uv.shape[1] if up else d_c), q_absorbed.device, q_absorbed.dtype)
    lse = split_kv.new_empty((batch, h), q_absorbed.device, torch.float32)
    if num_splits == 1:
        latent = split_kv.new_empty((batch, h, d_c), out.device, out.dtype) if up else out
        part_o, part_lse = latent[:, :, None], lse[:, :, None]
    else:
        part_o = split_kv.new_empty((batch, h, num_splits, d_c), out.device, torch.float32)
        part_lse = split_kv.new_empty((batch, h, num_splits), out.device, torch.float32)
    fused = False
    if sm90:
        with device_guard(q_absorbed):
            mla_sm90.launch(
                q_absorbed,
                q_rope,
                c_kv,
                k_rope,
                seq_lens,
                part_o,
                part_lse,
                scale,
                num_splits,
                block_table=block_table if paged else None,
                heads=block_h,
            )
    else:
        chunk = 0 if up else fused_combine_chunk(num_splits, min(h, block_h), d_c, batch * h, out.device)
        counters = split_counters(out.device, batch * head_tiles) if chunk else None
        fused = counters is not None
        final_o, final_lse = (out, lse) if fused else (part_o[:, :, 0], part_lse[:, :, 0])
        table = block_table if paged else seq_lens  # unused when contiguous
        table_strides = block_table.stride() if paged else (0, 0)
        static_iters = cdiv(n_tiles, num_splits) if _checks.interpreting() else 0
        launcher(_mla_decode_kernel)[(head_tiles, num_splits, batch)](
            q_absorbed,
            q_rope,
            c_kv,
            k_rope,
            table,
            seq_lens,
            part_o,
            part_lse,
            final_o,
            final_lse,
            counters if fused else seq_lens,
            *q_absorbed.stride(),
            *q_rope.stride(),
            *c_kv.stride(),
            *k_rope.stride(),
            *table_strides,
            *part_o.stride(),
            *part_lse.stride(),
            *final_o.stride(),
            *final_lse.stride(),
            float(scale) * LOG2E,
            H=h,
            D_C=d_c,
            D_R=d_r,
            BLOCK_H=block_h,
            BLOCK_N=block_n,
            BLOCK_DC=pow2(d_c),
            BLOCK_DR=pow2(d_r),
            PAGED=paged,
            PAGE_SIZE=page_size,
            NUM_SPLITS=num_splits,
            STATIC_ITERS=static_iters,
            # One head tile: each latent tile is read once, so stream it past L2. Several: they share it through L2.
            EVICT="evict_first" if head_tiles == 1 else "",
            DOT_PRECISION=dot_precision(q_absorbed.dtype),
            FUSE_CHUNK=chunk if fused else 0,
            **cfg,
        )
    if up:
        _combine_up(part_o, part_lse, w_uv, out, lse)
    elif num_splits > 1 and not fused:
        combine_splits(part_o, part_lse, out, lse)
    return out, lse


UP_MMA_ROWS = 16  # batches from this size take the up-projection 16 rows a program, as one MMA


def _combine_up(part_o: torch.Tensor, part_lse: torch.Tensor, w_uv: torch.Tensor, out: torch.Tensor, lse: torch.Tensor):
    """part_o (B, H, splits, D_c) and part_lse (B, H, splits): the decode's partials (fp32, log2 units) or its one
    split's final latent and lse; w_uv (H, D_v, D_c) -> out (B, H, D_v), and lse (B, H) from several splits. A batch
    under UP_MMA_ROWS takes one row a program over 16 value columns, so a one-row step spreads a layer's W_UV over
    H x D_v / 16 programs; larger ones in fp16/bf16 take 16 rows a program. Launched as a programmatic dependent of
    the decode launch where `pdl` says so."""
    batch, heads, splits, d_c = part_o.shape
    d_v = w_uv.shape[1]
    cfg = up_config(batch, splits, d_c, d_v, out.dtype)
    wait = pdl(out.device)
    with device_guard(out):
        launcher(_combine_up_kernel)[(heads, cdiv(batch, cfg["BLOCK_B"]), cdiv(d_v, cfg["BLOCK_V"]))](
            part_o,
            part_lse,
            w_uv,
            out,
            lse,
            batch,
            *part_o.stride(),
            *part_lse.stride(),
            *w_uv.stride(),
            *out.stride(),
            *lse.stride(),
            WAIT=wait,
            launch_pdl=wait,
            **cfg,
        )


def up_config(batch: int, splits: int, d_c: int, d_v: int, dtype: torch.dtype) -> dict:
    """`_combine_up_kernel`'s constants. Registers: the weight tile (BLOCK_V x BLOCK_C) and a load of partials
    (BLOCK_B x SPLIT_CHUNK x BLOCK_C) of at most 8,192 and 4,096 values; a one-row program takes the whole latent in
    one chunk (up to 512 wide). fp32 outputs keep one row a program: an fp32 MMA tile with its operands spills
    registers on sm_90."""
    block_b = 16 if batch >= UP_MMA_ROWS and dtype != torch.float32 else 1
    block_c = pow2(d_c) if block_b == 1 else 64
    return dict(
        NUM_SPLITS=splits,
        D_C=d_c,
        D_V=d_v,
        BLOCK_B=block_b,
        BLOCK_S=next_power_of_2(splits),
        SPLIT_CHUNK=max(1, min(next_power_of_2(splits), 4096 // (block_b * block_c))),
        BLOCK_C=block_c,
        BLOCK_V=16 if block_b == 1 else min(64, pow2(d_v)),
        DOT_PRECISION=dot_precision(dtype),
        num_warps=4,
    )


# ---- Custom ops (torch.compile traces through them) --------------------------------------------------------------


@torch.library.custom_op("zoo::mla_decode", mutates_args=())
def _mla_decode_op(
    q_absorbed: torch.Tensor,
    q_rope: torch.Tensor,
    c_kv: torch.Tensor,
    k_rope: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    num_splits: int | None,
    w_uv: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    return _launch_mla(
        q_absorbed,
        q_rope,
        c_kv,
        k_rope,
        None,
        seq_lens,
        scale,
        num_splits,
        paged=False,
        page_size=1,
        capacity=c_kv.shape[1],
        w_uv=w_uv,
    )


def _fake_outputs(q_absorbed, w_uv):
    batch, h, d_c = q_absorbed.shape
    out = q_absorbed.new_empty(batch, h, d_c if w_uv is None else w_uv.shape[1])
    return out, q_absorbed.new_empty(batch, h, dtype=torch.float32)


@_mla_decode_op.register_fake
def _(q_absorbed, q_rope, c_kv, k_rope, seq_lens, scale, num_splits, w_uv):
    return _fake_outputs(q_absorbed, w_uv)


@torch.library.custom_op("zoo::paged_mla_decode", mutates_args=())
def _paged_mla_decode_op(
    q_absorbed: torch.Tensor,
    q_rope: torch.Tensor,
    c_kv_pages: torch.Tensor,
    k_rope_pages: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    num_splits: int | None,
    w_uv: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    page_size = c_kv_pages.shape[1]
    return _launch_mla(
        q_absorbed,
        q_rope,
        c_kv_pages,
        k_rope_pages,
        block_table,
        seq_lens,
        scale,
        num_splits,
        paged=True,
        page_size=page_size,
        capacity=block_table.shape[1] * page_size,
        w_uv=w_uv,
    )


@_paged_mla_decode_op.register_fake
def _(q_absorbed, q_rope, c_kv_pages, k_rope_pages, block_table, seq_lens, scale, num_splits, w_uv):
    return _fake_outputs(q_absorbed, w_uv)


@torch.library.custom_op("zoo::mla_decode_inputs", mutates_args=("c_cache", "r_cache"))
def _inputs_op(
    q: torch.Tensor,
    kv: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    norm_weight: torch.Tensor,
    eps: float,
    w_uk: torch.Tensor,
    c_cache: torch.Tensor,
    r_cache: torch.Tensor,
    pages: torch.Tensor,
    slots: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    B, H, width = q.shape
    _, d_n, d_c = w_uk.shape
    d_r = width - d_n
    q_absorbed, q_rope = q.new_empty(B, H, d_c), q.new_empty(B, H, d_r)
    columns = input_columns(d_n, q.element_size())
    with device_guard(q):
        launcher(_inputs_kernel)[(cdiv(B, INPUT_ROWS), H + 1, cdiv(d_c, columns))](
            q,
            kv,
            cos,
            sin,
            norm_weight,
            w_uk,
            q_absorbed,
            q_rope,
            c_cache,
            r_cache,
            pages,
            slots,
            B,
            q.stride(0),
            q.stride(1),
            kv.stride(0),
            q_absorbed.stride(0),
            w_uk.stride(0),
            w_uk.stride(1),
            c_cache.stride(0),
            c_cache.stride(1),
            r_cache.stride(0),
            r_cache.stride(1),
            pages.stride(0),
            slots.stride(0),
            cos.stride(0) if cos.shape[0] > 1 else 0,
            eps,
            H=H,
            D_N=d_n,
            D_C=d_c,
            HALF=d_r // 2,
            BLOCK_B=INPUT_ROWS,
            BLOCK_N=pow2(d_n),
            BLOCK_C=columns,
            BLOCK_LATENT=pow2(d_c),
            BLOCK_HALF=next_power_of_2(d_r // 2),
            DOT_PRECISION=dot_precision(q.dtype),
            num_warps=4,
        )
    return q_absorbed, q_rope


@_inputs_op.register_fake
def _(q, kv, cos, sin, norm_weight, eps, w_uk, c_cache, r_cache, pages, slots):
    B, H, width = q.shape
    return q.new_empty(B, H, w_uk.shape[2]), q.new_empty(B, H, width - w_uk.shape[1])


# ---- Input checks -------------------------------------------------------------------------------------------------


def _check_mla(q_absorbed, q_rope, ckv, kr, seq_lens, scale, num_splits, *, ckv_name: str, kr_name: str, paged: bool):
    _checks.check_rank("q_absorbed", q_absorbed, 3, "(B, H, D_c)")
    _checks.check_rank("q_rope", q_rope, 3, "(B, H, D_r)")
    rows = "(num_pages, page_size" if paged else "(B, S_max"
    _checks.check_rank(ckv_name, ckv, 3, rows + ", D_c)")
    _checks.check_rank(kr_name, kr, 3, rows + ", D_r)")
    b, h, d_c = q_absorbed.shape
    d_r = q_rope.shape[2]
    if tuple(q_rope.shape[:2]) != (b, h):
        _checks.fail("q_rope", f"shape {tuple(q_rope.shape)}", f"(B, H, D_r) with (B, H) = {(b, h)} from q_absorbed")
    if (not paged and ckv.shape[0] != b) or ckv.shape[2] != d_c:
        _checks.fail(
            ckv_name,
            f"shape {tuple(ckv.shape)}",
            f"{rows}, D_c) with D_c = {d_c}" + ("" if paged else f" and B = {b}") + " from q_absorbed",
        )
    if tuple(kr.shape) != (*ckv.shape[:2], d_r):
        _checks.fail(kr_name, f"shape {tuple(kr.shape)}", f"{(*ckv.shape[:2], d_r)}: {ckv_name}'s rows, D_r of q_rope")
    _checks.check_head_dim("q_absorbed", d_c, 1, 512)
    _checks.check_head_dim("q_rope", d_r, 1, 128)
    _checks.check_float("q_absorbed", q_absorbed)
    for name, x in (("q_rope", q_rope), (ckv_name, ckv), (kr_name, kr)):
        _checks.check_float(name, x, q_absorbed, "q_absorbed")
    _checks.check_int32("seq_lens", seq_lens, (b,), "(B,)")
    _checks.check_same_device(
        {"q_absorbed": q_absorbed, "q_rope": q_rope, ckv_name: ckv, kr_name: kr, "seq_lens": seq_lens}
    )
    _checks.check_num_splits(num_splits, MAX_SPLITS)
    _checks.check_scale(scale)


def _check_w_uv(w_uv, q_absorbed):
    if w_uv is None:
        return
    _checks.check_rank("w_uv", w_uv, 3, "(H, D_v, D_c)")
    _, h, d_c = q_absorbed.shape
    if w_uv.shape[0] != h or w_uv.shape[2] != d_c or not 1 <= w_uv.shape[1] <= 512:
        _checks.fail(
            "w_uv", f"shape {tuple(w_uv.shape)}", f"(H={h}, D_v, D_c={d_c}) from q_absorbed, D_v from 1 to 512"
        )
    # any float dtype, as W_UK's in mla_decode_inputs: fp32 weights under autocast are products in fp32
    _checks.check_float("w_uv", w_uv)
    _checks.check_same_device({"q_absorbed": q_absorbed, "w_uv": w_uv})


def _check_inputs(q, kv, cos, sin, norm_weight, eps, w_uk, c_cache, r_cache, pages, slots):
    _checks.check_rank("q", q, 3, "(B, H, D_n + D_r)")
    _checks.check_rank("kv", kv, 2, "(B, D_c + D_r)")
    _checks.check_rank("w_uk", w_uk, 3, "(H, D_n, D_c)")
    _checks.check_rank("norm_weight", norm_weight, 1, "(D_c,)")
    _checks.check_rank("c_cache", c_cache, 3, "(P, S, D_c)")
    _checks.check_rank("r_cache", r_cache, 3, "(P, S, D_r)")
    _checks.check_float("q", q)
    _checks.check_float("kv", kv, q, "q")
    # The weights may be in another float dtype than the activations (fp32 weights under autocast): the kernel
    # rounds W_UK to q's dtype for the MMA, and the norm's gain and the cache's stores convert as a copy would.
    for name, t in (("w_uk", w_uk), ("norm_weight", norm_weight), ("c_cache", c_cache), ("r_cache", r_cache)):
        _checks.check_float(name, t)
    B, H, width = q.shape
    h, d_n, d_c = w_uk.shape
    d_r = width - d_n
    if B < 1:
        _checks.fail("q", f"shape {tuple(q.shape)}", "at least one row")
    if h != H:
        _checks.fail("w_uk", f"shape {tuple(w_uk.shape)}", f"(H={H}, D_n, D_c): one W_UK per query head of q")
    if not (1 <= d_n <= 256 and 1 <= d_c <= 512):
        _checks.fail("w_uk", f"shape {tuple(w_uk.shape)}", "(H, D_n, D_c) with D_n from 1 to 256 and D_c from 1 to 512")
    if d_r < 2 or d_r % 2:
        _checks.fail("q", f"last dim {width} with D_n={d_n}", "D_n + D_r with an even D_r >= 2")
    if tuple(kv.shape) != (B, d_c + d_r):
        _checks.fail("kv", f"shape {tuple(kv.shape)}", f"(B={B}, D_c + D_r={d_c + d_r})")
    if tuple(norm_weight.shape) != (d_c,):
        _checks.fail("norm_weight", f"shape {tuple(norm_weight.shape)}", f"(D_c={d_c},)")
    if c_cache.shape[2] != d_c:
        _checks.fail("c_cache", f"shape {tuple(c_cache.shape)}", f"(P, S, D_c={d_c})")
    if tuple(r_cache.shape) != (*c_cache.shape[:2], d_r):
        _checks.fail("r_cache", f"shape {tuple(r_cache.shape)}", f"{(*c_cache.shape[:2], d_r)}: c_cache's (P, S), D_r")
    for name, t in (
        ("q", q),
        ("kv", kv),
        ("w_uk", w_uk),
        ("norm_weight", norm_weight),
        ("c_cache", c_cache),
        ("r_cache", r_cache),
    ):
        if t.stride(-1) != 1:
            _checks.fail(name, f"strides {tuple(t.stride())}", "unit stride along the last dim")
    _checks.check_write_indices(pages, slots, (B,), f"(B={B},)")
    _checks.check_angles(cos, sin, B, (d_r // 2,), "(B or 1, D_r/2)", f"D_r/2={d_r // 2}", "D_r/2")
    _checks.check_scale(eps, "a finite float > 0", name="eps")
    _checks.check_same_device(
        dict(
            q=q,
            kv=kv,
            cos=cos,
            sin=sin,
            norm_weight=norm_weight,
            w_uk=w_uk,
            c_cache=c_cache,
            r_cache=r_cache,
            pages=pages,
            slots=slots,
        )
    )


# ---- Public functions ---------------------------------------------------------------------------------------------


def mla_decode(
    q_absorbed: torch.Tensor,
    q_rope: torch.Tensor,
    c_kv: torch.Tensor,
    k_rope: torch.Tensor,
    seq_lens: torch.Tensor,
    *,
    scale: float,
    num_splits: int | None = None,
    w_uv: torch.Tensor | None = None,
    validate: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Absorbed MLA decode over a contiguous latent cache. q_absorbed (B, H, D_c), q_rope (B, H, D_r),
    c_kv (B, S_max, D_c), k_rope (B, S_max, D_r), seq_lens (B,) int32. D_c from 1 to 512, D_r from 1 to 128.
    Returns latent out (B, H, D_c) in q_absorbed's dtype and lse (B, H) fp32. With w_uv (H, D_v, D_c), W_UV, the
    value up-projection per head (any float dtype), out is the heads' values (B, H, D_v) = latent[b, h] W_UV[h]^T,
    applied as the splits are combined (with several splits the merged latent is never stored). validate=False skips
    the seq_lens value check (a device sync)."""
    _check_mla(
        q_absorbed, q_rope, c_kv, k_rope, seq_lens, scale, num_splits, ckv_name="c_kv", kr_name="k_rope", paged=False
    )
    _check_w_uv(w_uv, q_absorbed)
    if validate and _checks.can_read_values(seq_lens):
        _checks.check_seq_lens_values(seq_lens, c_kv.shape[1], f"S_max of c_kv is {c_kv.shape[1]}")
    return torch.ops.zoo.mla_decode(q_absorbed, q_rope, c_kv, k_rope, seq_lens, float(scale), num_splits, w_uv)


def paged_mla_decode(
    q_absorbed: torch.Tensor,
    q_rope: torch.Tensor,
    c_kv_pages: torch.Tensor,
    k_rope_pages: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    *,
    scale: float,
    num_splits: int | None = None,
    w_uv: torch.Tensor | None = None,
    validate: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """mla_decode over a paged latent cache: c_kv_pages (num_pages, page_size, D_c) and k_rope_pages
    (num_pages, page_size, D_r), one pool each shared by all heads, indexed by one block table (B, max_pages)
    int32. page_size is a power of two from 8 to 256. w_uv: as mla_decode's."""
    _check_mla(
        q_absorbed,
        q_rope,
        c_kv_pages,
        k_rope_pages,
        seq_lens,
        scale,
        num_splits,
        ckv_name="c_kv_pages",
        kr_name="k_rope_pages",
        paged=True,
    )
    _check_w_uv(w_uv, q_absorbed)
    _checks.check_page_size("c_kv_pages", c_kv_pages.shape[1])
    _checks.check_rank("block_table", block_table, 2, "(B, max_pages)")
    _checks.check_int32("block_table", block_table, (q_absorbed.shape[0], block_table.shape[1]), "(B, max_pages)")
    _checks.check_same_device({"q_absorbed": q_absorbed, "block_table": block_table})
    if validate and _checks.can_read_values(seq_lens):
        _checks.check_seq_lens_values(seq_lens, 2**31 - 1, "a positive length")
        _checks.check_block_table_values(block_table, seq_lens, c_kv_pages.shape[1], c_kv_pages.shape[0])
    return torch.ops.zoo.paged_mla_decode(
        q_absorbed, q_rope, c_kv_pages, k_rope_pages, block_table, seq_lens, float(scale), num_splits, w_uv
    )


def mla_decode_inputs(
    q: torch.Tensor,
    kv: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    norm_weight: torch.Tensor,
    eps: float,
    w_uk: torch.Tensor,
    c_cache: torch.Tensor,
    r_cache: torch.Tensor,
    pages: torch.Tensor,
    slots: torch.Tensor,
    *,
    validate: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """What MLA's decode kernel needs from a step's projections, one new token a row, in one launch.

    q (B, H, D_n + D_r): each query head's [nope | rope] parts; kv (B, D_c + D_r): the token's latent, then its RoPE
    key (views of the projections' outputs); w_uk (H, D_n, D_c): W_UK, the key up-projection per head. Returns, in
    q's dtype, q_absorbed (B, H, D_c) = q_nope[b, h] W_UK[h] and the heads' RoPE parts rotated (B, H, D_r). In
    place, the latent RMS-normalized with norm_weight (D_c,) goes to c_cache[pages[b], slots[b]] and the rotated RoPE
    key to r_cache[pages[b], slots[b]]: c_cache (P, S, D_c) and r_cache (P, S, D_r) are token-major views of a latent
    cache (rows and positions, or pages and slots), stored in their dtype. w_uk, norm_weight and the cache may be in
    any float dtype (fp32 weights under autocast, say); W_UK is rounded to q's dtype for the product. cos, sin
    (B or 1, D_r/2) fp32 are the token's angles (rotate-half pairing, as rope_qkv's); the norm is the model's RMSNorm
    (fp32, eps). No gradient. validate=False skips the check that reads pages and slots (a device sync).

    A plain launch, not a programmatic dependent of the projection before it: as a dependent, MLA's batch-1 step
    measured slower (docs/kernel-notes.md)."""
    _check_inputs(q, kv, cos, sin, norm_weight, eps, w_uk, c_cache, r_cache, pages, slots)
    if validate and _checks.can_read_values(pages):
        _checks.check_write_index_values(c_cache, pages, slots)
    return torch.ops.zoo.mla_decode_inputs(
        q, kv, cos, sin, norm_weight, float(eps), w_uk, c_cache, r_cache, pages, slots
    )
