"""Grouped decode: one query token per sequence against a KV cache, contiguous or paged, split-KV (Flash-Decoding).

Math, per sequence b and query head h (KV head g = h // group):
    s_n = scale * (q_h . k_{g,n} + q_rope_h . k_rope_{g,n})      for n < seq_lens[b]
    out_h = sum_n softmax(s)_n v_{g,n},   lse_h = log sum_n exp(s_n)
The keys are cut into NUM_SPLITS contiguous chunks, each reduced by one program with the online softmax and merged
by split_kv.py's combine (FlashAttention, Dao et al. 2022; Flash-Decoding, Dao et al. 2023). With one split the
decode program writes the final output itself.

Structure:
- the query heads of one KV group are packed into the M dimension of the MMA (BLOCK_H rows, at least 16), so each
  K/V tile is read from memory once for the whole group;
- tiles are sized for the memory stream (`_tile_config`): a contiguous cache streams 128 tokens of K and V per step
  through three pipeline stages, fewer stages or tokens where the launch's programs per SM call for it, a paged one
  64 tokens through two;
- each sequence's own length is cut evenly into the splits, so a short sequence in a ragged batch spreads its few
  tiles over all its programs instead of leaving them to the first one;
- the split count comes from the SM count and the shapes (the cache's capacity, never the lengths' values), so the
  launch needs no device sync and can be captured in a CUDA graph (`grouped_num_splits`: split_kv's wave cost model,
  and for the Hopper paged kernel `ragged_num_splits`);
- paged caches: when a page holds at least one tile, the tile's page id is one scalar load; smaller pages are
  gathered per token from the block-table row (a few distinct addresses, served by L1). On Hopper, paged caches in
  fp16/bf16 with D 64 or 128 (no RoPE) run decode_sm90.py instead, whose loader warp copies whole pages by TMA so
  that no tile waits on a table load;
- on sm_90 the decode launch is a programmatic dependent of the kernel before it (`_host.pdl`): its start overlaps
  that kernel's end;
- a decode step's new token may come with the call (k_new, v_new, as FlashAttention's kvcache call takes it): the
  splits cut the seq_len - 1 cached tokens, the last split folds the new one in from registers, and one program per
  KV head stores it at seq_len - 1, so the step's cache write needs no launch of its own.

Layouts (as in reference.py):
    q (B, H_q, D)  k (B, H_kv, S_max, D)  v (B, H_kv, S_max, D_v)  seq_lens (B,) int32
    paged: k_pages (num_pages, page_size, H_kv, D)  v_pages (num_pages, page_size, H_kv, D_v)
           block_table (B, max_pages) int32: token n of sequence b lives in page block_table[b, n // page_size],
           slot n % page_size.
One kernel serves both: a token's address is page * stride_page + slot * stride_slot, where a contiguous cache
has page = b and slot = n. Head dims are tiled in power-of-two blocks of at least 16 columns, masked past D.
"""

from __future__ import annotations

import functools
import heapq

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_wait

from attention_kernels import _checks, split_kv
from attention_kernels._host import LOG2E, cdiv, launcher, num_sms, pdl
from attention_kernels.split_kv import (
    MAX_SPLITS,
    SPLIT_CHOICES,
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
    from attention_kernels import decode_sm90
except ImportError:  # pragma: no cover
    decode_sm90 = None


@triton.jit
def _grouped_decode_kernel(
    Q,
    K,
    V,
    Q_ROPE,
    K_ROPE,
    BLOCK_TABLE,
    SEQ_LENS,
    OUT,
    LSE,
    FINAL_OUT,
    FINAL_LSE,
    COUNTERS,
    K_NEW,
    V_NEW,
    stride_qb,
    stride_qh,
    stride_qd,
    stride_kp,
    stride_kn,
    stride_kh,
    stride_kd,
    stride_vp,
    stride_vn,
    stride_vh,
    stride_vd,
    stride_qrb,
    stride_qrh,
    stride_qrd,
    stride_krp,
    stride_krn,
    stride_krh,
    stride_krd,
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
    stride_nkb,
    stride_nkh,
    stride_nkd,
    stride_nvb,
    stride_nvh,
    stride_nvd,
    scale_log2,
    GROUP_SIZE: tl.constexpr,
    D_QK: tl.constexpr,
    D_ROPE: tl.constexpr,
    D_V: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_DQK: tl.constexpr,
    BLOCK_DR: tl.constexpr,
    BLOCK_DV: tl.constexpr,
    PAGED: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    STATIC_ITERS: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    FUSE_CHUNK: tl.constexpr,
    WAIT: tl.constexpr,
    APPEND: tl.constexpr,
):
    # grid (head tiles, splits, B): a head tile is BLOCK_H query heads of one KV group. WAIT: launched as a
    # programmatic dependent of the kernel before it (`pdl`), so the programs may start before that kernel's
    # outputs (the query, the cache) are stored; every memory access waits here. APPEND: the sequence's last token
    # is K_NEW / V_NEW (B, H_kv, D), which the last split folds in from registers and stores into the cache, so the
    # cache write needs no launch of its own; no program reads that slot from the cache.
    if WAIT:
        gdc_wait()
    tile = tl.program_id(0)
    split = tl.program_id(1)
    b = tl.program_id(2)
    TILES_PER_GROUP: tl.constexpr = (GROUP_SIZE + BLOCK_H - 1) // BLOCK_H
    kv_head = tile // TILES_PER_GROUP
    heads = kv_head * GROUP_SIZE + (tile % TILES_PER_GROUP) * BLOCK_H + tl.arange(0, BLOCK_H)
    mask_h = heads < (kv_head + 1) * GROUP_SIZE

    offs_d = tl.arange(0, BLOCK_DQK)
    offs_dv = tl.arange(0, BLOCK_DV)
    q = tl.load(
        Q + b * stride_qb + heads[:, None] * stride_qh + offs_d[None, :] * stride_qd,
        mask=mask_h[:, None] & (offs_d[None, :] < D_QK),
        other=0.0,
    )  # (BLOCK_H, BLOCK_DQK)
    offs_dr = tl.arange(0, BLOCK_DR)
    if D_ROPE > 0:
        q_rope = tl.load(
            Q_ROPE + b * stride_qrb + heads[:, None] * stride_qrh + offs_dr[None, :] * stride_qrd,
            mask=mask_h[:, None] & (offs_dr[None, :] < D_ROPE),
            other=0.0,
        )
    else:
        q_rope = q  # unused

    start, end = split_range(SEQ_LENS, b, split, NUM_SPLITS, BLOCK_N, APPEND)
    m_i = tl.full([BLOCK_H], -float("inf"), tl.float32)  # running max, log2 units
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_DV], tl.float32)
    for i in range(0, tile_count(start, end, BLOCK_N, STATIC_ITERS)):
        m_i, l_i, acc = _attend_tile(
            K,
            V,
            K_ROPE,
            BLOCK_TABLE,
            q,
            q_rope,
            m_i,
            l_i,
            acc,
            b,
            kv_head,
            start + i * BLOCK_N,
            end,
            offs_d,
            offs_dr,
            offs_dv,
            stride_kp,
            stride_kn,
            stride_kh,
            stride_kd,
            stride_vp,
            stride_vn,
            stride_vh,
            stride_vd,
            stride_krp,
            stride_krn,
            stride_krh,
            stride_krd,
            stride_tb,
            stride_tp,
            scale_log2,
            D_QK,
            D_ROPE,
            D_V,
            BLOCK_N,
            PAGED,
            PAGE_SIZE,
            DOT_PRECISION,
        )
    if APPEND:
        if split == NUM_SPLITS - 1:  # the split with the fewest cached tokens
            m_i, l_i, acc = _append_token(
                K_NEW,
                V_NEW,
                K,
                V,
                BLOCK_TABLE,
                SEQ_LENS,
                q,
                m_i,
                l_i,
                acc,
                b,
                kv_head,
                tile % TILES_PER_GROUP == 0,
                offs_d,
                offs_dv,
                stride_nkb,
                stride_nkh,
                stride_nkd,
                stride_nvb,
                stride_nvh,
                stride_nvd,
                stride_kp,
                stride_kn,
                stride_kh,
                stride_kd,
                stride_vp,
                stride_vn,
                stride_vh,
                stride_vd,
                stride_tb,
                stride_tp,
                scale_log2,
                D_QK,
                D_V,
                PAGED,
                PAGE_SIZE,
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
        offs_dv,
        D_V,
        stride_ob,
        stride_oh,
        stride_os,
        stride_od,
        stride_lb,
        stride_lh,
        stride_ls,
        NUM_SPLITS,
    )
    if FUSE_CHUNK > 0:
        combine_if_last(
            COUNTERS,
            b * tl.num_programs(0) + tile,
            OUT,
            LSE,
            FINAL_OUT,
            FINAL_LSE,
            b,
            kv_head * GROUP_SIZE + (tile % TILES_PER_GROUP) * BLOCK_H,
            (kv_head + 1) * GROUP_SIZE,
            offs_dv,
            D_V,
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
            triton.next_power_of_2(min(GROUP_SIZE, BLOCK_H)),
            FUSE_CHUNK,
        )


@triton.jit
def _attend_tile(
    K,
    V,
    K_ROPE,
    BLOCK_TABLE,
    q,
    q_rope,
    m_i,
    l_i,
    acc,
    b,
    kv_head,
    tile_start,
    end,
    offs_d,
    offs_dr,
    offs_dv,
    stride_kp,
    stride_kn,
    stride_kh,
    stride_kd,
    stride_vp,
    stride_vn,
    stride_vh,
    stride_vd,
    stride_krp,
    stride_krn,
    stride_krh,
    stride_krd,
    stride_tb,
    stride_tp,
    scale_log2,
    D_QK: tl.constexpr,
    D_ROPE: tl.constexpr,
    D_V: tl.constexpr,
    BLOCK_N: tl.constexpr,
    PAGED: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """One online-softmax step over the BLOCK_N tokens from tile_start (those at or past `end` masked off)."""
    offs_n, mask_n, page, slot = tile_rows(
        BLOCK_TABLE, b, tile_start, end, stride_tb, stride_tp, BLOCK_N, PAGED, PAGE_SIZE
    )
    k = tl.load(
        K + page * stride_kp + kv_head * stride_kh + slot[:, None] * stride_kn + offs_d[None, :] * stride_kd,
        mask=mask_n[:, None] & (offs_d[None, :] < D_QK),
        other=0.0,
        eviction_policy="evict_first",
    )  # (BLOCK_N, BLOCK_DQK); each tile is read by one program only
    v = tl.load(
        V + page * stride_vp + kv_head * stride_vh + slot[:, None] * stride_vn + offs_dv[None, :] * stride_vd,
        mask=mask_n[:, None] & (offs_dv[None, :] < D_V),
        other=0.0,
        eviction_policy="evict_first",
    )
    s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)  # (BLOCK_H, BLOCK_N)
    if D_ROPE > 0:
        k_rope = tl.load(
            K_ROPE
            + page * stride_krp
            + kv_head * stride_krh
            + slot[:, None] * stride_krn
            + offs_dr[None, :] * stride_krd,
            mask=mask_n[:, None] & (offs_dr[None, :] < D_ROPE),
            other=0.0,
            eviction_policy="evict_first",
        )
        s += tl.dot(q_rope, tl.trans(k_rope), input_precision=DOT_PRECISION)
    return online_softmax_step(s * scale_log2, mask_n, v, m_i, l_i, acc, DOT_PRECISION)


@triton.jit
def _append_token(
    K_NEW,
    V_NEW,
    K,
    V,
    BLOCK_TABLE,
    SEQ_LENS,
    q,
    m_i,
    l_i,
    acc,
    b,
    kv_head,
    store,
    offs_d,
    offs_dv,
    stride_nkb,
    stride_nkh,
    stride_nkd,
    stride_nvb,
    stride_nvh,
    stride_nvd,
    stride_kp,
    stride_kn,
    stride_kh,
    stride_kd,
    stride_vp,
    stride_vn,
    stride_vh,
    stride_vd,
    stride_tb,
    stride_tp,
    scale_log2,
    D_QK: tl.constexpr,
    D_V: tl.constexpr,
    PAGED: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
):
    """The online-softmax step of one token held in registers: sequence b's new K/V, rounded to the cache's dtype as
    the cache will hold them, then (if `store`, one program per KV head) written at position seq_len - 1."""
    k = tl.load(K_NEW + b * stride_nkb + kv_head * stride_nkh + offs_d * stride_nkd, mask=offs_d < D_QK, other=0.0)
    v = tl.load(V_NEW + b * stride_nvb + kv_head * stride_nvh + offs_dv * stride_nvd, mask=offs_dv < D_V, other=0.0)
    k, v = k.to(K.dtype.element_ty), v.to(V.dtype.element_ty)
    s = tl.sum(q.to(tl.float32) * k.to(tl.float32)[None, :], axis=1) * scale_log2  # (BLOCK_H,)
    m_new = tl.maximum(m_i, s)  # finite: s is
    alpha = tl.math.exp2(m_i - m_new)
    p = tl.math.exp2(s - m_new)
    l_i = l_i * alpha + p
    acc = acc * alpha[:, None] + p[:, None] * v.to(tl.float32)[None, :]
    if store:
        pos = tl.load(SEQ_LENS + b) - 1
        if PAGED:
            page = tl.load(BLOCK_TABLE + b * stride_tb + (pos // PAGE_SIZE) * stride_tp).to(tl.int64)
            slot = pos % PAGE_SIZE
        else:
            page = b.to(tl.int64)
            slot = pos
        tl.store(
            K + page * stride_kp + slot * stride_kn + kv_head * stride_kh + offs_d * stride_kd, k, mask=offs_d < D_QK
        )
        tl.store(
            V + page * stride_vp + slot * stride_vn + kv_head * stride_vh + offs_dv * stride_vd, v, mask=offs_dv < D_V
        )
    return m_new, l_i, acc


@triton.jit
def _store_new_kernel(
    K_NEW,
    V_NEW,
    K,
    V,
    BLOCK_TABLE,
    SEQ_LENS,
    stride_nkb,
    stride_nkh,
    stride_nkd,
    stride_nvb,
    stride_nvh,
    stride_nvd,
    stride_kp,
    stride_kn,
    stride_kh,
    stride_kd,
    stride_vp,
    stride_vn,
    stride_vh,
    stride_vd,
    stride_tb,
    stride_tp,
    D_QK: tl.constexpr,
    D_V: tl.constexpr,
    BLOCK_DQK: tl.constexpr,
    BLOCK_DV: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
):
    # grid (B, H_kv): the paged append before a decode kernel that reads every token from the cache (decode_sm90)
    b = tl.program_id(0)
    kv_head = tl.program_id(1)
    offs_d = tl.arange(0, BLOCK_DQK)
    offs_dv = tl.arange(0, BLOCK_DV)
    pos = tl.load(SEQ_LENS + b) - 1
    page = tl.load(BLOCK_TABLE + b * stride_tb + (pos // PAGE_SIZE) * stride_tp).to(tl.int64)
    slot = pos % PAGE_SIZE
    k = tl.load(K_NEW + b * stride_nkb + kv_head * stride_nkh + offs_d * stride_nkd, mask=offs_d < D_QK)
    v = tl.load(V_NEW + b * stride_nvb + kv_head * stride_nvh + offs_dv * stride_nvd, mask=offs_dv < D_V)
    dst_k = K + page * stride_kp + slot * stride_kn + kv_head * stride_kh + offs_d * stride_kd
    dst_v = V + page * stride_vp + slot * stride_vn + kv_head * stride_vh + offs_dv * stride_vd
    tl.store(dst_k, k.to(K.dtype.element_ty), mask=offs_d < D_QK)
    tl.store(dst_v, v.to(V.dtype.element_ty), mask=offs_dv < D_V)


# ---- Launch heuristics ------------------------------------------------------------------------------------------


SMEM_PER_SM = 228 * 1024  # Hopper: shared memory per SM (at most 227 KB of it for one program)
_SMEM_PER_PROGRAM = 200 * 1024  # what the pipelined K/V tiles may take, leaving room for the rest of a program


ONE_WAVE = 4  # programs per SM of D=128 decode with 64-token tiles through two stages (`_tile_config`)


def _one_wave(d_qk: int, d_v: int, paged: bool, load: float) -> bool:
    """Does a launch take `_tile_config`'s one-wave tiles: a contiguous cache, heads wider than 64, 3 to ONE_WAVE
    programs per SM?"""
    return not paged and max(d_qk, d_v) > 64 and 3 <= load <= ONE_WAVE


@functools.lru_cache(maxsize=1024)  # a pure function of the shapes, asked three times per decode launch
def _tile_config(d_qk: int, d_v: int, itemsize: int, paged: bool, load: float = 0.0) -> tuple[int, int, int]:
    """(BLOCK_N, num_warps, num_stages) of a grouped-decode launch; `load`: programs (sequences x head tiles) per SM
    of a contiguous launch (`_load`).

    Contiguous caches stream 128-token tiles through three stages with four warps; the launch's load moves that
    where a smaller program lets more of them share an SM: heads of at most 64 at three or more programs per SM
    take two stages, wider heads take 64-token tiles at one to three programs per SM and 64-token tiles through two
    stages at three to four (the launch then fits one wave). Paged caches take 64-token tiles with two stages: a
    tile of small pages is gathered token by token. Heads wider than 128 take 32-token tiles. Each of these was the
    fastest beside SDPA in the H200 sweeps of benchmarks/bench_decode.py --tune (benchmarks/RESULTS.md). Stages
    (then tokens) shrink until `stages` K/V tiles fit in 200 KB (fp32 caches; Triton allocates one buffer fewer, so
    this errs on the safe side)."""
    d_max = max(d_qk, d_v)
    row_bytes = _kv_row_bytes(d_qk, d_v, itemsize)
    if d_max > 128:
        block_n, stages = 32, 3
    elif paged:
        block_n, stages = 64, 2
    else:
        block_n, stages = 128, 3
        if d_max <= 64 and load >= 3:
            stages = 2
        elif d_max > 64 and 1 < load < 3:
            block_n = 64
        elif _one_wave(d_qk, d_v, paged, load):
            block_n, stages = 64, 2
    while stages * block_n * row_bytes > _SMEM_PER_PROGRAM:
        if stages > 1:
            stages -= 1
        elif block_n > 16:
            block_n //= 2
        else:
            break
    return block_n, 4, stages


def _load(programs: int, paged: bool, device: torch.device) -> float:
    """Programs per SM of a contiguous launch, which `_tile_config` sizes tiles by (0 for paged caches)."""
    return 0.0 if paged else programs / num_sms(device)


def programs_per_sm(d_qk: int, d_v: int, itemsize: int, paged: bool, load: float = 0.0) -> int:
    """How many grouped-decode programs the split model counts per SM: shared memory over `stages` K/V tiles. It is
    a fitted count, not the exact occupancy: Triton allocates stages - 1 tile buffers, so at D=64 an SM holds three
    contiguous programs, not two; on the sweep's grid either count gives the same picks. Paged launches count
    twice as many, with tile_seconds' slower paged tiles: that is what fitted the paged sweep, and the compiled
    code agrees. A paged tile's K/V addresses come from a block-table load inside the loop, so the pipeliner keeps
    no tile in flight (it waits for each tile before it starts the next) and allocates a single K/V buffer: a
    paged program is slower per tile but small (39 KB at D=128: five per SM, not three), and the SM hides its
    latency with more programs instead of with stages. The one-wave tiles of wider heads (`_tile_config`, from
    three to ONE_WAVE programs per SM) count ONE_WAVE: that they all run at once is what they were measured for."""
    block_n, _, stages = _tile_config(d_qk, d_v, itemsize, paged, load)
    if _one_wave(d_qk, d_v, paged, load):
        return ONE_WAVE
    return max(1, SMEM_PER_SM // (stages * block_n * _kv_row_bytes(d_qk, d_v, itemsize))) * (2 if paged else 1)


def _kv_row_bytes(d_qk: int, d_v: int, itemsize: int) -> int:
    """Shared memory one token of K and V takes in a tile (head dims padded to the block's power of two)."""
    return (pow2(d_qk) + pow2(d_v)) * itemsize


def grouped_num_splits(
    batch: int,
    h_q: int,
    h_kv: int,
    capacity: int,
    d_qk: int,
    d_v: int,
    itemsize: int,
    device: torch.device,
    paged: bool = False,
    sm90: bool = False,
) -> int:
    """The split count grouped and paged decode use with num_splits=None (d_qk includes a RoPE part); sm90: a
    paged launch of the Hopper kernel (decode_sm90.py), which `ragged_num_splits` models."""
    group = h_q // h_kv
    block_h = heads_per_program(group)
    programs = batch * h_kv * cdiv(group, block_h)
    load = _load(programs, paged, device)
    block_n = decode_sm90.CONFIGS[d_qk][0] if sm90 else _tile_config(d_qk, d_v, itemsize, paged, load)[0]
    tile_bytes = block_n * (d_qk + d_v) * itemsize
    tile_flops = 2 * max(64, block_h) * block_n * (d_qk + d_v)
    partial_bytes = batch * h_q * (d_v + 1) * 4
    if sm90:  # per-tile floor 1 us (fitted with ragged_num_splits); the ring's shared memory sets programs per SM
        slots = num_sms(device) * max(1, SMEM_PER_SM // decode_sm90.shared_bytes(d_qk, itemsize))
        return ragged_num_splits(
            batch,
            h_kv * cdiv(group, block_h),
            capacity,
            block_n,
            tile_bytes,
            max(1e-6, tile_flops / 2e12),
            partial_bytes,
            slots,
        )
    slots = num_sms(device) * programs_per_sm(d_qk, d_v, itemsize, paged, load)
    return auto_num_splits(
        programs, cdiv(capacity, block_n), tile_bytes, tile_seconds(tile_flops, paged), partial_bytes, slots
    )


@functools.lru_cache(maxsize=256)  # a pure function of the shapes; 5-30 ms per new shape
def ragged_num_splits(
    batch: int,
    heads: int,
    capacity: int,
    block_n: int,
    tile_bytes: int,
    tile_time: float,
    partial_bytes: int,
    slots: int,
) -> int:
    """Split count for a paged launch of the Hopper kernel: the one whose launch time, simulated for a full-length
    batch and for a ragged one, is worst off against the best split of each by the least (minimax regret).

    A paged cache is what a server uses for ragged batches, and the lengths' values never enter (the launch can be
    captured in a CUDA graph), so the split must serve both kinds: a full-length batch of 64 x 8K tokens (H_kv 8)
    runs fastest unsplit, the same batch with lengths spread over [S/8, S] with four splits. The simulation
    (`_simulate`) runs the launch's programs (heads per sequence x splits, in grid order) on `slots` at once,
    sharing the bandwidth; the ragged batch spreads its lengths evenly over [capacity/8, capacity] in a scrambled
    order. Each split adds the combine: a launch and the partials' traffic
    (partial_bytes per split, written and read). Fitted to an H200 sweep of every power-of-two split on the paged
    shapes of benchmarks/bench_decode.py: within 4% of the best split on most (benchmarks/RESULTS.md)."""
    bandwidth, combine_latency = 4e12, 4e-6
    full = [capacity] * batch
    ragged = [int(capacity / 8 + capacity * 7 / 8 * ((i * 0.6180339887) % 1.0)) for i in range(batch)]
    times = {}
    for splits in SPLIT_CHOICES:
        if splits > 1 and (splits > cdiv(capacity, block_n) or batch * heads * splits > 16 * slots):
            break  # never more splits than tiles, nor more than 16 waves of programs
        combine = combine_latency + 2 * partial_bytes * splits / bandwidth if splits > 1 else 0.0
        times[splits] = [
            _simulate(lens, heads, splits, block_n, tile_bytes, tile_time, slots, bandwidth) + combine
            for lens in (full, ragged)
        ]
    best = [min(t[i] for t in times.values()) for i in range(2)]
    return min(times, key=lambda n: max(times[n][i] / best[i] for i in range(2)))


def _simulate(
    lengths: list[int],
    heads: int,
    splits: int,
    block_n: int,
    tile_bytes: int,
    tile_time: float,
    slots: int,
    bandwidth: float,
) -> float:
    """Seconds one decode launch takes, as processor sharing: `slots` programs run at once, started in grid order
    as others finish; n running programs each read min(1 / tile_time, bandwidth / (n * tile_bytes)) tiles per
    second, and each program costs one tile more than it reads (its start and its stores)."""
    work = []
    for n in lengths:
        chunk = cdiv(cdiv(n, splits), block_n) * block_n
        for split in range(splits):
            tiles = cdiv(max(0, min(chunk, n - split * chunk)), block_n)
            work += [tiles + 1] * heads
    # All running programs advance at the same rate, so each one's finish is a point on a shared progress axis.
    now, progress, started, running = 0.0, 0.0, 0, []
    while started < len(work) and len(running) < slots:
        heapq.heappush(running, progress + work[started])
        started += 1
    while running:
        rate = min(1 / tile_time, bandwidth / (len(running) * tile_bytes))
        done = heapq.heappop(running)
        now += (done - progress) / rate
        progress = done
        if started < len(work):
            heapq.heappush(running, progress + work[started])
            started += 1
    return now


def _sm90_supports(q, k_pages, v_pages, q_rope) -> bool:
    return decode_sm90 is not None and decode_sm90.supports(q, k_pages, v_pages, q_rope)


# ---- Launchers ------------------------------------------------------------------------------------------------


def _launch_decode(
    q,
    k,
    v,
    q_rope,
    k_rope,
    block_table,
    seq_lens,
    scale: float,
    num_splits,
    *,
    paged: bool,
    page_size: int,
    capacity: int,
    config: dict | None = None,
    new: tuple | None = None,
):
    """Shared by the contiguous and the paged op. k/v/k_rope strides are passed as (page, slot, head, dim).
    new = (k_new, v_new): each sequence's last token, appended to the cache by the launch (`_append_token`)."""
    batch, h_q, d_qk = q.shape
    h_kv = k.shape[2] if paged else k.shape[1]
    d_v = v.shape[-1]
    d_rope = q_rope.shape[-1] if q_rope is not None else 0
    seq_lens = seq_lens.contiguous()  # the kernel reads seq_lens[b] at SEQ_LENS + b (no stride)
    block_h = heads_per_program(h_q // h_kv)
    # Paged on Hopper, fp16/bf16, D 64 or 128 without RoPE: the TMA-fed Gluon kernel (decode_sm90.py). The
    # tuning sweeps pass their own config: {"sm90": (BLOCK_N, STAGES)} for it, else the Triton kernel's BLOCK_N,
    # num_warps and num_stages.
    sm90 = paged and (config is None or "sm90" in config) and _sm90_supports(q, k, v, q_rope)
    if num_splits is None:
        num_splits = grouped_num_splits(
            batch, h_q, h_kv, capacity, d_qk + d_rope, d_v, k.element_size(), q.device, paged, sm90
        )
    out = split_kv.new_empty((batch, h_q, d_v), q.device, q.dtype)
    lse = split_kv.new_empty((batch, h_q), q.device, torch.float32)
    if num_splits == 1:
        part_o, part_lse = out[:, :, None], lse[:, :, None]
    else:
        part_o = split_kv.new_empty((batch, h_q, num_splits, d_v), q.device, torch.float32)
        part_lse = split_kv.new_empty((batch, h_q, num_splits), q.device, torch.float32)
    programs = batch * h_kv * cdiv(h_q // h_kv, block_h)
    chunk = fused_combine_chunk(num_splits, min(h_q // h_kv, block_h), d_v, batch * h_q, q.device)
    counters = split_counters(q.device, programs) if chunk else None
    fused = counters is not None
    if sm90:
        if new is not None:  # its loader copies whole pages from the cache: the new tokens must be there first
            _store_new(*new, k, v, block_table, seq_lens)
        decode_sm90.launch(
            q,
            k,
            v,
            block_table,
            seq_lens,
            part_o,
            part_lse,
            float(scale) * LOG2E,
            num_splits,
            block_h,
            (config or {}).get("sm90"),
            fused=(out, lse, counters, chunk) if fused else None,
        )
    else:
        _launch_triton(
            q,
            k,
            v,
            q_rope,
            k_rope,
            block_table,
            seq_lens,
            part_o,
            part_lse,
            scale,
            num_splits,
            paged=paged,
            page_size=page_size,
            capacity=capacity,
            config=config,
            fused=(out, lse, counters, chunk) if fused else None,
            new=new,
        )
    if num_splits > 1 and not fused:
        combine_splits(part_o, part_lse, out, lse)
    return out, lse


def _launch_triton(
    q,
    k,
    v,
    q_rope,
    k_rope,
    block_table,
    seq_lens,
    part_o,
    part_lse,
    scale: float,
    num_splits: int,
    *,
    paged: bool,
    page_size: int,
    capacity: int,
    config: dict | None,
    fused: tuple | None,
    new: tuple | None,
):
    """`_grouped_decode_kernel` into part_o / part_lse (the split outputs `_launch_decode` allocated); with
    fused = (out, lse, counters, chunk) the launch also combines the splits into out / lse (`combine_if_last`), with
    new = (k_new, v_new) it appends them."""
    batch, h_q, d_qk = q.shape
    h_kv = k.shape[2] if paged else k.shape[1]
    d_v = v.shape[-1]
    d_rope = q_rope.shape[-1] if q_rope is not None else 0
    group = h_q // h_kv
    block_h = heads_per_program(group)
    load = _load(batch * h_kv * cdiv(group, block_h), paged, q.device)
    block_n, warps, stages = _tile_config(d_qk + d_rope, d_v, k.element_size(), paged, load)
    if config is not None:
        block_n, warps, stages = config["BLOCK_N"], config["num_warps"], config["num_stages"]
    if paged:
        k_strides, v_strides = k.stride(), v.stride()  # (page, slot, head, dim)
        kr_strides = k_rope.stride() if k_rope is not None else (0, 0, 0, 0)
        table, table_strides = block_table, block_table.stride()
    else:
        k_strides = (k.stride(0), k.stride(2), k.stride(1), k.stride(3))  # (B, H_kv, S, D) -> (page=b, slot=n, ...)
        v_strides = (v.stride(0), v.stride(2), v.stride(1), v.stride(3))
        kr_strides = (
            (k_rope.stride(0), k_rope.stride(2), k_rope.stride(1), k_rope.stride(3))
            if k_rope is not None
            else (0, 0, 0, 0)
        )
        table, table_strides = seq_lens, (0, 0)  # unused
    qr_strides = q_rope.stride() if q_rope is not None else (0, 0, 0)
    static_iters = cdiv(cdiv(capacity, block_n), num_splits) if _checks.interpreting() else 0
    out, lse, counters, chunk = fused if fused is not None else (part_o[:, :, 0], part_lse[:, :, 0], seq_lens, 0)
    k_new, v_new = new if new is not None else (q, q)  # unused without APPEND
    wait = pdl(q.device)
    launcher(_grouped_decode_kernel)[(h_kv * cdiv(group, block_h), num_splits, batch)](
        q,
        k,
        v,
        q_rope if q_rope is not None else q,
        k_rope if k_rope is not None else k,
        table,
        seq_lens,
        part_o,
        part_lse,
        out,
        lse,
        counters,
        k_new,
        v_new,
        *q.stride(),
        *k_strides,
        *v_strides,
        *qr_strides,
        *kr_strides,
        *table_strides,
        *part_o.stride(),
        *part_lse.stride(),
        *out.stride(),
        *lse.stride(),
        *k_new.stride(),
        *v_new.stride(),
        float(scale) * LOG2E,
        GROUP_SIZE=group,
        D_QK=d_qk,
        D_ROPE=d_rope,
        D_V=d_v,
        BLOCK_H=block_h,
        BLOCK_N=block_n,
        BLOCK_DQK=pow2(d_qk),
        BLOCK_DR=pow2(d_rope),
        BLOCK_DV=pow2(d_v),
        PAGED=paged,
        PAGE_SIZE=page_size,
        NUM_SPLITS=num_splits,
        STATIC_ITERS=static_iters,
        DOT_PRECISION=dot_precision(q.dtype),
        FUSE_CHUNK=chunk,
        WAIT=wait,
        APPEND=new is not None,
        num_warps=warps,
        num_stages=stages,
        launch_pdl=wait,
    )


def _store_new(k_new, v_new, k_pages, v_pages, block_table, seq_lens):
    """k_new / v_new (B, H_kv, D) into the paged cache at each sequence's position seq_lens - 1."""
    batch, h_kv, d_qk = k_new.shape
    d_v = v_new.shape[-1]
    launcher(_store_new_kernel)[(batch, h_kv)](
        k_new,
        v_new,
        k_pages,
        v_pages,
        block_table,
        seq_lens,
        *k_new.stride(),
        *v_new.stride(),
        *k_pages.stride(),
        *v_pages.stride(),
        *block_table.stride(),
        D_QK=d_qk,
        D_V=d_v,
        BLOCK_DQK=pow2(d_qk),
        BLOCK_DV=pow2(d_v),
        PAGE_SIZE=k_pages.shape[1],
        num_warps=1,
    )


# ---- Custom ops (torch.compile traces through them) --------------------------------------------------------------


@torch.library.custom_op("zoo::grouped_decode", mutates_args=())
def _grouped_decode_op(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    num_splits: int | None,
    q_rope: torch.Tensor | None,
    k_rope: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    return _launch_decode(
        q, k, v, q_rope, k_rope, None, seq_lens, scale, num_splits, paged=False, page_size=1, capacity=k.shape[2]
    )


@_grouped_decode_op.register_fake
def _(q, k, v, seq_lens, scale, num_splits, q_rope, k_rope):
    return q.new_empty((*q.shape[:2], v.shape[-1])), q.new_empty(q.shape[:2], dtype=torch.float32)


@torch.library.custom_op("zoo::paged_grouped_decode", mutates_args=())
def _paged_grouped_decode_op(
    q: torch.Tensor,
    k_pages: torch.Tensor,
    v_pages: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    num_splits: int | None,
    q_rope: torch.Tensor | None,
    k_rope_pages: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    page_size = k_pages.shape[1]
    return _launch_decode(
        q,
        k_pages,
        v_pages,
        q_rope,
        k_rope_pages,
        block_table,
        seq_lens,
        scale,
        num_splits,
        paged=True,
        page_size=page_size,
        capacity=block_table.shape[1] * page_size,
    )


@_paged_grouped_decode_op.register_fake
def _(q, k_pages, v_pages, block_table, seq_lens, scale, num_splits, q_rope, k_rope_pages):
    return q.new_empty((*q.shape[:2], v_pages.shape[-1])), q.new_empty(q.shape[:2], dtype=torch.float32)


@torch.library.custom_op("zoo::grouped_decode_append", mutates_args=("k", "v"))
def _grouped_decode_append_op(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    num_splits: int | None,
    k_new: torch.Tensor,
    v_new: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    return _launch_decode(
        q,
        k,
        v,
        None,
        None,
        None,
        seq_lens,
        scale,
        num_splits,
        paged=False,
        page_size=1,
        capacity=k.shape[2],
        new=(k_new, v_new),
    )


@_grouped_decode_append_op.register_fake
def _(q, k, v, seq_lens, scale, num_splits, k_new, v_new):
    return q.new_empty((*q.shape[:2], v.shape[-1])), q.new_empty(q.shape[:2], dtype=torch.float32)


@torch.library.custom_op("zoo::paged_grouped_decode_append", mutates_args=("k_pages", "v_pages"))
def _paged_grouped_decode_append_op(
    q: torch.Tensor,
    k_pages: torch.Tensor,
    v_pages: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    num_splits: int | None,
    k_new: torch.Tensor,
    v_new: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    page_size = k_pages.shape[1]
    return _launch_decode(
        q,
        k_pages,
        v_pages,
        None,
        None,
        block_table,
        seq_lens,
        scale,
        num_splits,
        paged=True,
        page_size=page_size,
        capacity=block_table.shape[1] * page_size,
        new=(k_new, v_new),
    )


@_paged_grouped_decode_append_op.register_fake
def _(q, k_pages, v_pages, block_table, seq_lens, scale, num_splits, k_new, v_new):
    return q.new_empty((*q.shape[:2], v_pages.shape[-1])), q.new_empty(q.shape[:2], dtype=torch.float32)


# ---- Input checks -------------------------------------------------------------------------------------------------


def _check_common(q, k, v, seq_lens, scale, num_splits, q_rope, k_rope, *, k_name, v_name, kr_name, head_axis, batch):
    """Checks shared by both ops once k/v ranks are known; head_axis is the H_kv axis of k (1 or 2)."""
    _checks.check_float("q", q)
    _checks.check_float(k_name, k, q, "q")
    _checks.check_float(v_name, v, q, "q")
    h_q, d_qk, h_kv = q.shape[1], q.shape[2], k.shape[head_axis]
    if h_kv == 0 or h_q % h_kv:
        _checks.fail(
            "q",
            f"H_q = {h_q} query heads for H_kv = {h_kv} KV heads ({k_name} dim {head_axis})",
            "H_kv >= 1 and H_q a multiple of H_kv",
        )
    _checks.check_head_dim("q", d_qk, 1, 256)
    _checks.check_head_dim(v_name, v.shape[-1], 1, 256)
    _checks.check_int32("seq_lens", seq_lens, (batch,), "(B,)")
    tensors = {"q": q, k_name: k, v_name: v, "seq_lens": seq_lens}
    if (q_rope is None) != (k_rope is None):
        _checks.fail("q_rope" if q_rope is None else kr_name, "only one of q_rope and " + kr_name, "both or neither")
    if q_rope is not None:
        _checks.check_rank("q_rope", q_rope, 3, "(B, H_q, D_r)")
        _checks.check_float("q_rope", q_rope, q, "q")
        _checks.check_float(kr_name, k_rope, q, "q")
        _checks.check_head_dim("q_rope", q_rope.shape[-1], 1, 256)
        if tuple(q_rope.shape[:2]) != tuple(q.shape[:2]):
            _checks.fail("q_rope", f"shape {tuple(q_rope.shape)}", f"(B, H_q, D_r) with B, H_q = {tuple(q.shape[:2])}")
        tensors.update(q_rope=q_rope, **{kr_name: k_rope})
    _checks.check_same_device(tensors)
    _checks.check_num_splits(num_splits, MAX_SPLITS)
    _checks.check_scale(scale)


def _check_new(k_new, v_new, k, v, q_rope, *, batch: int, head_axis: int, k_name: str, v_name: str):
    """The appended tokens: k_new (B, H_kv, D) and v_new (B, H_kv, D_v) of any float dtype (stored in the cache's,
    as a copy converts), on the cache's device."""
    if (k_new is None) != (v_new is None):
        _checks.fail("k_new" if k_new is None else "v_new", "only one of k_new and v_new", "both or neither")
    if k_new is None:
        return
    if q_rope is not None:
        _checks.fail("k_new", "a token to append with q_rope", "no q_rope (append without the RoPE terms)")
    h_kv = k.shape[head_axis]
    for name, x, cache, cache_name in (("k_new", k_new, k, k_name), ("v_new", v_new, v, v_name)):
        _checks.check_rank(name, x, 3, "(B, H_kv, D)")
        _checks.check_float(name, x)
        want = (batch, h_kv, cache.shape[-1])
        if tuple(x.shape) != want:
            _checks.fail(name, f"shape {tuple(x.shape)}", f"{want}: (B, H_kv, D) as q and {cache_name}")
    _checks.check_same_device({k_name: k, "k_new": k_new, "v_new": v_new})


def _check_grouped(q, k, v, seq_lens, scale, num_splits, q_rope, k_rope):
    _checks.check_rank("q", q, 3, "(B, H_q, D)")
    _checks.check_rank("k", k, 4, "(B, H_kv, S_max, D)")
    _checks.check_rank("v", v, 4, "(B, H_kv, S_max, D_v)")
    b, _, d = q.shape
    if k.shape[0] != b or k.shape[3] != d:
        _checks.fail("k", f"shape {tuple(k.shape)}", f"(B, H_kv, S_max, D) with B = {b}, D = {d} from q")
    if tuple(v.shape[:3]) != tuple(k.shape[:3]):
        _checks.fail(
            "v", f"shape {tuple(v.shape)}", f"(B, H_kv, S_max, D_v) with (B, H_kv, S_max) = {tuple(k.shape[:3])} from k"
        )
    if k_rope is not None:
        _checks.check_rank("k_rope", k_rope, 4, "(B, H_kv, S_max, D_r)")
        if q_rope is not None and tuple(k_rope.shape) != (*k.shape[:3], q_rope.shape[-1]):
            _checks.fail("k_rope", f"shape {tuple(k_rope.shape)}", f"{(*k.shape[:3], q_rope.shape[-1])}")
    _check_common(
        q,
        k,
        v,
        seq_lens,
        scale,
        num_splits,
        q_rope,
        k_rope,
        k_name="k",
        v_name="v",
        kr_name="k_rope",
        head_axis=1,
        batch=b,
    )


def _check_paged(q, k_pages, v_pages, block_table, seq_lens, scale, num_splits, q_rope, k_rope_pages):
    _checks.check_rank("q", q, 3, "(B, H_q, D)")
    _checks.check_rank("k_pages", k_pages, 4, "(num_pages, page_size, H_kv, D)")
    _checks.check_rank("v_pages", v_pages, 4, "(num_pages, page_size, H_kv, D_v)")
    b, _, d = q.shape
    if k_pages.shape[3] != d:
        _checks.fail("k_pages", f"shape {tuple(k_pages.shape)}", f"(num_pages, page_size, H_kv, D) with D = {d}")
    if tuple(v_pages.shape[:3]) != tuple(k_pages.shape[:3]):
        _checks.fail(
            "v_pages",
            f"shape {tuple(v_pages.shape)}",
            f"(num_pages, page_size, H_kv, D_v) with {tuple(k_pages.shape[:3])} from k_pages",
        )
    _checks.check_page_size("k_pages", k_pages.shape[1])
    if k_rope_pages is not None:
        _checks.check_rank("k_rope_pages", k_rope_pages, 4, "(num_pages, page_size, H_kv, D_r)")
        if q_rope is not None and tuple(k_rope_pages.shape) != (*k_pages.shape[:3], q_rope.shape[-1]):
            _checks.fail(
                "k_rope_pages", f"shape {tuple(k_rope_pages.shape)}", f"{(*k_pages.shape[:3], q_rope.shape[-1])}"
            )
    _checks.check_rank("block_table", block_table, 2, "(B, max_pages)")
    _checks.check_int32("block_table", block_table, (b, block_table.shape[1]), "(B, max_pages)")
    _check_common(
        q,
        k_pages,
        v_pages,
        seq_lens,
        scale,
        num_splits,
        q_rope,
        k_rope_pages,
        k_name="k_pages",
        v_name="v_pages",
        kr_name="k_rope_pages",
        head_axis=2,
        batch=b,
    )
    _checks.check_same_device({"q": q, "block_table": block_table})


# ---- Public functions ---------------------------------------------------------------------------------------------


def grouped_decode(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    seq_lens: torch.Tensor,
    *,
    scale: float,
    num_splits: int | None = None,
    q_rope: torch.Tensor | None = None,
    k_rope: torch.Tensor | None = None,
    k_new: torch.Tensor | None = None,
    v_new: torch.Tensor | None = None,
    validate: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Decode one query token per sequence over a contiguous cache (MHA, GQA or MQA).

    q (B, H_q, D), k (B, H_kv, S_max, D), v (B, H_kv, S_max, D_v), seq_lens (B,) int32: sequence b attends to
    its first seq_lens[b] tokens; D and D_v from 1 to 256. q_rope (B, H_q, D_r) and k_rope (B, H_kv, S_max, D_r)
    add a second score term. Returns out (B, H_q, D_v) in q's dtype and lse (B, H_q) fp32 (natural log).
    num_splits=None picks the split count from the device and the shapes. validate=False skips the checks that
    read seq_lens (a device sync); they are skipped anyway under CUDA graph capture and torch.compile.

    k_new (B, H_kv, D) and v_new (B, H_kv, D_v), as FlashAttention's kvcache call takes them: each sequence's
    newest token, written into k and v in place at position seq_lens[b] - 1 by the same launch (the step's cache
    write costs no launch of its own) and attended from registers. Not with q_rope.
    """
    _check_grouped(q, k, v, seq_lens, scale, num_splits, q_rope, k_rope)
    _check_new(k_new, v_new, k, v, q_rope, batch=q.shape[0], head_axis=1, k_name="k", v_name="v")
    if validate and _checks.can_read_values(seq_lens):
        _checks.check_seq_lens_values(seq_lens, k.shape[2], f"S_max of k is {k.shape[2]}")
    if k_new is not None:
        return torch.ops.zoo.grouped_decode_append(q, k, v, seq_lens, float(scale), num_splits, k_new, v_new)
    return torch.ops.zoo.grouped_decode(q, k, v, seq_lens, float(scale), num_splits, q_rope, k_rope)


def paged_grouped_decode(
    q: torch.Tensor,
    k_pages: torch.Tensor,
    v_pages: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    *,
    scale: float,
    num_splits: int | None = None,
    q_rope: torch.Tensor | None = None,
    k_rope_pages: torch.Tensor | None = None,
    k_new: torch.Tensor | None = None,
    v_new: torch.Tensor | None = None,
    validate: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """grouped_decode over a paged cache: pools (num_pages, page_size, H_kv, D) shared by every sequence and a
    block table (B, max_pages) int32 mapping each sequence's logical pages to pool pages. page_size is a power of
    two from 8 to 256. k_new / v_new: appended as grouped_decode's, into the page that holds position
    seq_lens[b] - 1. validate=False skips the value checks of seq_lens and block_table (a device sync)."""
    _check_paged(q, k_pages, v_pages, block_table, seq_lens, scale, num_splits, q_rope, k_rope_pages)
    kw = dict(k_name="k_pages", v_name="v_pages")
    _check_new(k_new, v_new, k_pages, v_pages, q_rope, batch=q.shape[0], head_axis=2, **kw)
    if validate and _checks.can_read_values(seq_lens):
        page_size = k_pages.shape[1]
        _checks.check_seq_lens_values(seq_lens, 2**31 - 1, "a positive length")
        _checks.check_block_table_values(block_table, seq_lens, page_size, k_pages.shape[0])
    if k_new is not None:
        return torch.ops.zoo.paged_grouped_decode_append(
            q, k_pages, v_pages, block_table, seq_lens, float(scale), num_splits, k_new, v_new
        )
    return torch.ops.zoo.paged_grouped_decode(
        q, k_pages, v_pages, block_table, seq_lens, float(scale), num_splits, q_rope, k_rope_pages
    )
