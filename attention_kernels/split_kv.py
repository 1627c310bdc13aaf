"""Split-KV decode (Flash-Decoding): the pieces grouped decode (decode.py) and MLA decode (mla.py) share.

Math: a decode step attends one query row per head over a sequence's cached tokens [0, seq_len). The tokens are
cut into NUM_SPLITS contiguous chunks of whole tiles; one program reduces a chunk with the online softmax
(FlashAttention, Dao et al. 2022) into a partial output o_s and its log-sum-exp l_s (log2 units), and the chunks
are merged as (Flash-Decoding, Dao et al. 2023)

    out = sum_s w_s o_s / sum_s w_s,   w_s = exp2(l_s - max_s l_s),   lse = ln 2 * (max_s l_s + log2 sum_s w_s)

either by the last program of each (sequence, head tile) to finish, inside the decode launch (`combine_if_last`,
where its partials are small: `fused_combine_chunk`), or by a second kernel (`combine_splits`). With one split the
decode program writes the final output itself.

Here: the kernels' per-tile helpers (`split_range`, `tile_count`, `tile_rows`, `online_softmax_step`,
`store_split`), the two combines, and on the host the split-count cost model (`auto_num_splits`), the ticket
counters of the in-launch combine (`split_counters`), the tile sizes (`heads_per_program`, `pow2`) and the
allocation of every output (`new_empty`).

The Triton 3.6 interpreter (numpy 2) cannot run a loop whose trip count is a tensor or a plain int argument, so
there (STATIC_ITERS > 0) each program runs a compile-time number of tiles, the most any split can need, and the
masks switch off the tiles past its chunk (`tile_count`); on the GPU the trip count is the chunk's own tile count.
The masks and the arithmetic are the same in both places.
"""

from __future__ import annotations

import math
import os

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_wait

from attention_kernels._host import cdiv, launcher, next_power_of_2, pdl

MAX_SPLITS = 128


@triton.jit
def split_range(SEQ_LENS, b, split, NUM_SPLITS: tl.constexpr, BLOCK_N: tl.constexpr, APPEND: tl.constexpr = False):
    """The tokens [start, end) of sequence b that this split reduces: whole tiles, the sequence's own length cut
    evenly into NUM_SPLITS (empty for a split past the end of a short sequence). With APPEND the last token comes
    from the launch's inputs, not the cache, and only the seq_len - 1 before it are cut."""
    seq_len = tl.load(SEQ_LENS + b)
    if APPEND:
        seq_len -= 1
    chunk = tl.cdiv(tl.cdiv(seq_len, NUM_SPLITS), BLOCK_N) * BLOCK_N
    start = split * chunk
    return start, tl.minimum(start + chunk, seq_len)


@triton.jit
def tile_count(start, end, BLOCK_N: tl.constexpr, STATIC_ITERS: tl.constexpr):
    """Tiles a program runs from start to end: on the GPU this chunk's own (none for a split past the end of its
    sequence); under the interpreter (STATIC_ITERS > 0) a compile-time count, the most any split can need, whose
    tiles past `end` the masks switch off (see the module docstring). It is returned, never assigned: the
    interpreter turns every assigned value into a tensor, which `range` does not take."""
    if STATIC_ITERS > 0:
        return STATIC_ITERS
    return tl.cdiv(end - start, BLOCK_N)


@triton.jit
def tile_rows(
    BLOCK_TABLE,
    b,
    tile_start,
    end,
    stride_tb,
    stride_tp,
    BLOCK_N: tl.constexpr,
    PAGED: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
):
    """Where the BLOCK_N tokens from tile_start live: (offs_n, mask_n, page, slot), the cache row of token n
    being (page, slot) — (b, n) in a contiguous cache, (block_table[b, n // PAGE_SIZE], n % PAGE_SIZE) paged."""
    offs_n = tile_start + tl.arange(0, BLOCK_N)
    mask_n = offs_n < end
    if PAGED:
        if PAGE_SIZE >= BLOCK_N:  # the tile lies inside one page: one table entry
            page = tl.load(
                BLOCK_TABLE + b * stride_tb + (tile_start // PAGE_SIZE) * stride_tp, mask=tile_start < end, other=0
            ).to(tl.int64)
        else:  # BLOCK_N // PAGE_SIZE pages, gathered per token (repeated addresses hit L1)
            page = tl.load(BLOCK_TABLE + b * stride_tb + (offs_n // PAGE_SIZE) * stride_tp, mask=mask_n, other=0).to(
                tl.int64
            )[:, None]
        slot = offs_n % PAGE_SIZE
    else:
        page = b.to(tl.int64)
        slot = offs_n
    return offs_n, mask_n, page, slot


@triton.jit
def online_softmax_step(s, mask_n, v, m_i, l_i, acc, DOT_PRECISION: tl.constexpr):
    """Fold one tile of scores s (BLOCK_H, BLOCK_N), already scaled by scale * log2(e) (exp2 then gives e^x), and
    values v (BLOCK_N, D_v) into the running max m_i, normalizer l_i (both in the log2 domain) and unnormalized
    output acc."""
    s = tl.where(mask_n[None, :], s, -float("inf"))
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    m_use = tl.where(m_new == -float("inf"), 0.0, m_new)  # a fully masked tile: exp2(-inf) = 0, not NaN
    alpha = tl.math.exp2(m_i - m_use)
    p = tl.math.exp2(s - m_use[:, None])
    l_i = l_i * alpha + tl.sum(p, axis=1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
    return m_new, l_i, acc


@triton.jit
def store_split(
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
    D_V: tl.constexpr,
    stride_ob,
    stride_oh,
    stride_os,
    stride_od,
    stride_lb,
    stride_lh,
    stride_ls,
    NUM_SPLITS: tl.constexpr,
):
    """One split's result: the final output (one split) or a partial output with its log2-sum-exp."""
    has_tokens = l_i > 0.0  # a split past the end of its sequence saw no token
    l_safe = tl.where(has_tokens, l_i, 1.0)
    out = acc / l_safe[:, None]
    lse2 = tl.where(has_tokens, m_i + tl.math.log2(l_safe), -float("inf"))
    if NUM_SPLITS == 1:
        lse2 = lse2 * 0.6931471805599453  # the final lse is natural-log
    o_ptrs = OUT + b * stride_ob + heads[:, None] * stride_oh + split * stride_os + offs_dv[None, :] * stride_od
    tl.store(o_ptrs, out.to(OUT.dtype.element_ty), mask=mask_h[:, None] & (offs_dv[None, :] < D_V))
    tl.store(LSE + b * stride_lb + heads * stride_lh + split * stride_ls, lse2, mask=mask_h)


@triton.jit
def combine_if_last(
    COUNTERS,
    counter,
    PART_O,
    PART_LSE,
    OUT,
    LSE,
    b,
    head0,
    head_end,
    offs_dv,
    D_V: tl.constexpr,
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
    NUM_SPLITS: tl.constexpr,
    MERGE_H: tl.constexpr,
    CHUNK: tl.constexpr,
):
    """The split combine inside the decode launch: the last program of a (sequence, head tile) to finish merges
    the NUM_SPLITS partials of its heads [head0, head_end), which saves the combine launch (`fused_combine_chunk`
    says when that pays).

    Every program counts itself in on COUNTERS[counter] after its partial is stored (all threads' stores, a
    barrier, then one release-acquire atomic: the last program's loads see every other program's stores). The
    program that takes the last ticket resets the counter to 0 for the next launch, reads the partials (L2 hits,
    `.cg` past L1) of its real heads only (MERGE_H rows: a KV group of four is not padded to the MMA's 16),
    CHUNK splits per load, and writes the final output and the natural-log lse."""
    tl.debug_barrier()
    ticket = tl.atomic_add(COUNTERS + counter, 1, sem="acq_rel", scope="gpu")
    if ticket == NUM_SPLITS - 1:
        tl.atomic_xchg(COUNTERS + counter, 0, sem="relaxed", scope="gpu")
        heads = head0 + tl.arange(0, MERGE_H)
        mask_h = heads < head_end
        lse_row = PART_LSE + b * stride_plb + heads[:, None] * stride_plh
        BLOCK_S: tl.constexpr = triton.next_power_of_2(NUM_SPLITS)
        offs_s = tl.arange(0, BLOCK_S)
        lse2 = tl.load(
            lse_row + offs_s[None, :] * stride_pls,
            mask=mask_h[:, None] & (offs_s[None, :] < NUM_SPLITS),
            other=-float("inf"),
            cache_modifier=".cg",
        )  # (MERGE_H, BLOCK_S), log2 units
        m = tl.max(lse2, axis=1)
        m = tl.where(m == -float("inf"), 0.0, m)  # masked heads only: split 0 of a sequence holds a token
        denom = tl.sum(tl.math.exp2(lse2 - m[:, None]), axis=1)
        offs_c = tl.arange(0, CHUNK)
        o_ptrs = PART_O + b * stride_pb + heads[:, None, None] * stride_ph + offs_dv[None, None, :] * stride_pd
        acc = tl.zeros([MERGE_H, offs_dv.shape[0]], tl.float32)
        for c in tl.static_range(0, NUM_SPLITS, CHUNK):  # unrolled: the chunks' loads are independent
            mask_s = (c + offs_c) < NUM_SPLITS
            lse_c = tl.load(
                lse_row + (c + offs_c)[None, :] * stride_pls,
                mask=mask_h[:, None] & mask_s[None, :],
                other=-float("inf"),
                cache_modifier=".cg",
            )
            w = tl.math.exp2(lse_c - m[:, None])  # (MERGE_H, CHUNK)
            o = tl.load(
                o_ptrs + (c + offs_c)[None, :, None] * stride_ps,
                mask=mask_h[:, None, None] & mask_s[None, :, None] & (offs_dv[None, None, :] < D_V),
                other=0.0,
                cache_modifier=".cg",
            )  # (MERGE_H, CHUNK, BLOCK_DV)
            acc += tl.sum(o * w[:, :, None], axis=1)
        has_tokens = denom > 0.0
        out = acc / tl.where(has_tokens, denom, 1.0)[:, None]
        tl.store(
            OUT + b * stride_ob + heads[:, None] * stride_oh + offs_dv[None, :] * stride_od,
            out.to(OUT.dtype.element_ty),
            mask=mask_h[:, None] & (offs_dv[None, :] < D_V),
        )
        lse = tl.where(
            has_tokens, (m + tl.math.log2(tl.where(has_tokens, denom, 1.0))) * 0.6931471805599453, -float("inf")
        )
        tl.store(LSE + b * stride_lb + heads * stride_lh, lse, mask=mask_h)


@triton.jit
def _combine_splits_kernel(
    PARTIAL_O,
    PARTIAL_LSE,
    OUT,
    LSE,
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
    NUM_SPLITS: tl.constexpr,
    D_V: tl.constexpr,
    BLOCK_S: tl.constexpr,
    BLOCK_DV: tl.constexpr,
    WAIT: tl.constexpr,
):
    """Merge the splits of one (sequence, head) over BLOCK_DV of its output columns: the partials in one 2-D load,
    weights exp2(lse_s - max). Column blocks are separate programs, so a (splits, columns) tile stays in
    registers even at 128 splits and 512 columns. WAIT: launched as a programmatic dependent of the decode
    launch (`pdl`), so the programs may start before its partials are stored, and wait for them here."""
    h = tl.program_id(0)
    b = tl.program_id(1)
    col_block = tl.program_id(2)
    if WAIT:
        gdc_wait()
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = col_block * BLOCK_DV + tl.arange(0, BLOCK_DV)
    mask_s = offs_s < NUM_SPLITS
    lse2 = tl.load(
        PARTIAL_LSE + b * stride_plb + h * stride_plh + offs_s * stride_pls, mask=mask_s, other=-float("inf")
    )
    m = tl.max(lse2, axis=0)  # finite: the first split of every sequence holds at least one token
    w = tl.math.exp2(lse2 - m)
    o = tl.load(
        PARTIAL_O + b * stride_pb + h * stride_ph + offs_s[:, None] * stride_ps + offs_d[None, :] * stride_pd,
        mask=mask_s[:, None] & (offs_d[None, :] < D_V),
        other=0.0,
    )
    denom = tl.sum(w, axis=0)
    out = tl.sum(o * w[:, None], axis=0) / denom
    tl.store(OUT + b * stride_ob + h * stride_oh + offs_d * stride_od, out.to(OUT.dtype.element_ty), mask=offs_d < D_V)
    if col_block == 0:
        tl.store(LSE + b * stride_lb + h * stride_lh, (m + tl.math.log2(denom)) * 0.6931471805599453)


SPLIT_CHOICES = (1, 2, 4, 8, 16, 32, 64, 128)  # powers of two: few compiled variants (NUM_SPLITS is constexpr)


def auto_num_splits(
    programs: int, n_tiles: int, tile_bytes: int, tile_time: float, partial_bytes: int, slots: int
) -> int:
    """Split count from a small cost model of one launch (FlashAttention-3's wave-efficiency rule, with costs).

    programs: (sequence, head tile) pairs; n_tiles: KV tiles per pair at full capacity; tile_bytes: what one tile
    reads; tile_time: seconds one program alone needs per tile (`tile_seconds`); partial_bytes: bytes one split
    adds to the partial outputs (written, then read by the combine); slots: programs the GPU runs at once (SMs
    times `programs_per_sm`). The programs run in waves of `slots`; in a wave of c programs each tile takes the
    longer of its share of the bandwidth (tile_bytes * c / bandwidth) and tile_time. Splitting adds the combine:
    a launch and the partials' traffic. Only shapes enter, never sequence lengths, so no device sync is needed
    and the launch can be captured in a CUDA graph. The constants are fitted to an H200 sweep of every power-of-two
    split count on the grid of benchmarks/bench_decode.py, where the pick lands within 6% of the best split on
    every shape (benchmarks/RESULTS.md).
    """
    bandwidth, combine_latency = 4e12, 4e-6
    best, best_time = 1, math.inf
    for splits in SPLIT_CHOICES:
        if splits > max(1, n_tiles):
            break
        waves, last = divmod(programs * splits, slots)
        tiles = math.ceil(n_tiles / splits)
        time = waves * tiles * max(tile_bytes * slots / bandwidth, tile_time)
        if last:
            time += tiles * max(tile_bytes * last / bandwidth, tile_time)
        if splits > 1:
            time += combine_latency + 2 * partial_bytes * splits / bandwidth
        if time < best_time * 0.95:  # a split must win by 5% (more splits: more combine traffic and variance)
            best, best_time = splits, time
    return best


def tile_seconds(tile_flops: int, paged: bool) -> float:
    """What one program alone needs per KV tile: a latency floor of 1.5 us, or its MMA work at one SM's rate
    (2 TFLOP/s, with FLOPs counted at the MMA's 64-row minimum); 3.5 times that when paged, where each tile's
    rows wait on block-table loads (fitted to the same sweep)."""
    return max(1.5e-6, tile_flops / 2e12) * (3.5 if paged else 1)


def heads_per_program(group: int) -> int:
    """Query heads per program: the KV group packed into the MMA's M dimension (at least 16 rows)."""
    return max(16, min(64, next_power_of_2(group)))


def dot_precision(dtype: torch.dtype) -> str:
    return "ieee" if dtype == torch.float32 else "tf32"  # fp32 inputs: exact fp32 dots, not tf32


FUSED_COMBINE_MAX_VALUES = 16384  # fp32 partials (64 KB) one program may merge at the end of the launch
_FUSED_COMBINE_CHUNK = 8192  # fp32 partials per load of that merge: 64 registers per thread at four warps
FUSED_COMBINE_MIN_ROWS = 1024  # (sequence, query head) rows below which a dependent-launch combine is faster


def fused_combine_chunk(num_splits: int, heads: int, d_v: int, rows: int, device: torch.device) -> int:
    """Splits per load when the launch combines its own splits (`combine_if_last`), or 0 for the separate
    combine kernel: with one split, with ZOO_FUSED_COMBINE=0, when a program's partials (num_splits x heads x D_v,
    heads: the real ones of its tile, D_v padded to a power of two) exceed FUSED_COMBINE_MAX_VALUES, two loads,
    or when the separate combine runs as a programmatic dependent (`pdl`) and has fewer than FUSED_COMBINE_MIN_ROWS
    rows to merge (rows: batch x query heads). The last program merges alone after the others finish, so the
    merge is the launch's tail, and its loads wait one after the other: it saves the second launch where the
    partials are small, and the separate kernel, which spreads a merge over (sequence, head, column block)
    programs, wins on larger merges and, as a dependent launch, on small batches. Both limits are where the merge
    in the launch measured faster on an H200 (benchmarks/RESULTS.md)."""
    if num_splits == 1 or os.environ.get("ZOO_FUSED_COMBINE", "1") == "0":
        return 0
    if rows < FUSED_COMBINE_MIN_ROWS and pdl(device):
        return 0
    row = next_power_of_2(heads) * pow2(d_v)
    if num_splits * row > FUSED_COMBINE_MAX_VALUES:  # two splits or more: one split's row fits a chunk
        return 0
    return min(next_power_of_2(num_splits), _FUSED_COMBINE_CHUNK // row)


_COUNTERS: dict[str, torch.Tensor] = {}


_RETIRED: list[torch.Tensor] = []


def split_counters(device: torch.device, n: int) -> torch.Tensor | None:
    """At least n int32 zeros on `device`, kept between launches: the tickets of `combine_if_last`, which
    every fused launch leaves at zero again. None while a CUDA graph is being captured and no buffer is large
    enough yet (a buffer allocated there would be zeroed only when the graph replays; the launch then uses the
    separate combine). A buffer that grows keeps its old one alive: a captured graph may still point at it.
    One buffer per device: fused launches on two streams of one GPU at the same time would share tickets, so
    decode launches of one device must run on one stream (as everything in this repository does)."""
    key = str(device)
    counters = _COUNTERS.get(key)
    if counters is None or counters.numel() < n:
        if _capturing(device):
            return None
        if counters is not None:
            _RETIRED.append(counters)
        counters = torch.zeros(max(n, 4096), device=device, dtype=torch.int32)
        _COUNTERS[key] = counters
    return counters


def _capturing(device: torch.device) -> bool:
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()


def combine_splits(part_o: torch.Tensor, part_lse: torch.Tensor, out: torch.Tensor, lse: torch.Tensor):
    """part_o (B, H, splits, D_v) fp32, part_lse (B, H, splits) log2 units -> out (B, H, D_v), lse (B, H). Launched
    right after the decode launch that wrote the partials, as its programmatic dependent where `pdl` says so."""
    batch, heads, splits, d_v = part_o.shape
    block_dv = min(pow2(d_v), max(16, 4096 // pow2(splits, 2)))  # at most 4096 fp32 values per program
    wait = pdl(part_o.device)
    launcher(_combine_splits_kernel)[(heads, batch, cdiv(d_v, block_dv))](
        part_o,
        part_lse,
        out,
        lse,
        *part_o.stride(),
        *part_lse.stride(),
        *out.stride(),
        *lse.stride(),
        NUM_SPLITS=splits,
        D_V=d_v,
        BLOCK_S=pow2(splits, 2),
        BLOCK_DV=block_dv,
        WAIT=wait,
        num_warps=4,
        launch_pdl=wait,
    )


def new_empty(shape: tuple[int, ...], device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """Every output and partial buffer of the decode ops comes from here (the tests poison them with NaN to check
    that every element is written)."""
    return torch.empty(shape, device=device, dtype=dtype)


def pow2(n: int, minimum: int = 16) -> int:
    return max(minimum, next_power_of_2(n)) if n > 0 else minimum
