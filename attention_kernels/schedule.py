"""Launch order of the attention kernels' programs: heavy causal blocks first, without losing L2 reuse.

A flash-attention grid is n_r blocks (rank r: a query block of the forward and dQ, a key block of dK/dV) times
n_pairs (head, batch) pairs. Causal blocks differ in work: the last query block reads every key, the first key
block is read by every query. The GPU starts programs in order of their number, so a grid numbered rank fastest
(every pair's blocks together, heaviest first within the pair) starts the heavy blocks of the last pairs last,
and they run on alone at the end. Numbering rank slowest (longest work first over the whole grid) removes that
tail, but then the programs that run at the same time belong to different pairs: none of them shares its K/V (or
Q/dO) stream in L2 with another, and for MHA the traffic then leaves L2.

`ranked` takes the middle: ranks in buckets, heaviest bucket first; inside a bucket each pair's blocks side by
side. `bucket_size` gives a KV group of `group` query heads (neighbouring pairs, which read the same K/V) buckets
of 8 // group ranks, so that about eight programs that run together still read one K/V stream. MHA keeps one
bucket: its heads share nothing, and buckets of eight measured 1-1.5% slower there.

On an H200 the buckets made the causal GQA backward up to 8% faster than numbering rank fastest, and left the
forward within the run's noise (benchmarks/RESULTS.md).
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def ranked(flat, n_r, n_pairs, bucket):
    """Program (or persistent tile) number `flat` -> (rank r, pair). Buckets of `bucket` ranks, lowest ranks first;
    inside one, pair-major with the bucket's ranks fastest. bucket = n_r: every pair's n_r blocks together."""
    per_bucket = bucket * n_pairs
    first = flat // per_bucket * bucket
    size = tl.minimum(bucket, n_r - first)  # the last bucket may be short
    rem = flat % per_bucket
    return first + rem % size, rem // size


def bucket_size(n_r: int, group: int, causal: bool) -> int:
    """The `ranked` bucket of a launch with n_r blocks per pair and `group` query heads per KV head. Full
    attention has no heavy blocks, and MHA no shared K/V: one bucket (each pair's blocks together)."""
    if not causal or group == 1:
        return n_r
    return max(1, min(n_r, 8 // group))
