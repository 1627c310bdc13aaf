"""Flash attention for Hopper (sm_90), warp-specialized, in Gluon: FlashAttention-3's structure.

Same math, inputs and outputs as the Triton kernels in flash.py, which launches these instead on an sm_90
GPU for fp16/bf16 with TMA-compatible strides: the forward for D_qk == D_v = 128 and 64 (causal from MIN_KEYS keys up)
and for MLA's D_qk = 192 (128 + 64 RoPE), D_v = 128 and D_qk = 96 (64 + 32), D_v = 64; the backward (dQ and dK/dV)
for D = 128 and 64 and MLA's 96/64 and 192/128. The portable Triton kernels run everywhere else (other GPUs and head
dims, fp32, the CPU interpreter, other Triton releases).

Why a second set of kernels: the Triton-language forward stops at 440-490 TFLOP/s at D=128 on an H200, while SDPA
runs at 530-690. Its warps issue their own loads and all run the same phase of the loop at the same time, so the
tensor cores idle during every softmax. Triton 3.6's automatic warp specialization does not apply to those kernels
(see flash.py). Gluon, Triton's lower-level language, states the layouts, shared memory, barriers and warp roles
explicitly, so the kernels can have FlashAttention-3's structure (Shah et al. 2024).

Forward (`forward`):
- persistent: one program per SM takes tiles of 128 query rows of one (query head, batch) from a global counter,
  so programs that drew light causal tiles take more of them; while the consumers finish a tile (its last P V,
  the output store) the loader already streams the next tile's Q and K/V.
- three warp roles per program (`gl.warp_specialize`):
  - a loader warp streams Q and K/V blocks through TMA into shared memory, K and V each through a ring of its own
    (CONFIGS: K_STAGES and V_STAGES buffers), waiting on an mbarrier until the consumers have released a buffer
    before it refills it. The consumers release a K buffer once its scores are in and a V buffer once its P V is,
    so a K buffer turns over half a step sooner than V's, and D=128 streams as well through 2 K and 3 V buffers
    as it did through 3 of both (released together);
  - two consumer warpgroups of four warps, each owning 64 query rows: Q K^T and P V on the tensor cores (wgmma),
    the online softmax in registers. The loader warp gives its registers to them (setmaxnreg: 24 for the
    loader, 240 per consumer thread).
- inside a consumer, the scores of key block j+1 and P V of block j are issued together; P stays in registers as
  the A operand of the P V wgmma. The source waits for that P V only after block j+1's softmax
  (FlashAttention-3's intra-warpgroup overlap), but ptxas moves the wait up to just after the scores' (the SASS:
  WARPGROUP.DEPBAR.LE gsb0 0x0 before the first FMNMX), so each consumer's softmax runs while the *other*
  consumer's products are on the tensor cores. Keeping the wait in place (the softmax in a basic block of its
  own) made the overlap real in the SASS and measured -3% to +1.3% (session 15, benchmarks/RESULTS.md): the
  two warpgroups already keep the tensor cores busy.
- the output leaves through shared memory: each consumer writes its 64 rows into a buffer of its own and one
  thread hands it to a TMA store, which runs while the consumer goes on (and clips the rows past S_q). Before, the
  consumers stored the output from registers (4-byte stores, and ptxas spilled 32-316 bytes of the tile state
  around them): against that, the TMA store measured 1.00-1.09x at D=128 and 0.995-1.07x at D=64 on the grid's
  shapes, most where tiles are short (session 18).
- each consumer releases its Q buffer as soon as the tile's last scores are in, so the loader brings the next
  tile's Q while the consumer finishes this one (the last P V, the output). Until session 45, D=128's three
  stages of K and V together left no room for output buffers: the output went out through the Q buffer, and the
  next tile's Q could come only once the store had read it. A tile then cost about 1.6 steps more than its key
  blocks (0.9 for SDPA, from the TFLOP/s at 1024 and 4096 keys). The split rings (2 K + 3 V stages) make room for
  the output buffers; against the old kernel (GPU alone, three rounds, bitwise the same outputs): D=128 B16 S1024
  full 1.068-1.071x, causal 1.043-1.045x, B4 S4096 1.012-1.016x; MLA's 192/128 1.010-1.019x, 96/64 1.038-1.043x;
  D=64 0.993-1.013x (benchmarks/RESULTS.md, session 45).
- MLA's 192/128: a TMA tile's width must be a power of two, so Q and K arrive as two tiles each, their first 128
  columns and their last 64, and the scores are two wgmma chains into one accumulator. 64-key blocks in three
  stages with separate output buffers (205 KB); 128-key blocks in two stages needed the output in the Q buffers
  and spilled 4 bytes, and measured slower. Against the Triton kernel and SDPA (V padded to 192) in one run
  (session 27, TFLOP/s GPU alone): B4 H16 S4096 causal 576 vs 471 and 453, full 637 vs 530 and 547; B16 S1024
  causal 444 vs 317 and 264. The GPT-2-small MLA's 96/64 (64 + 32 columns) takes 128-key blocks in three stages
  with separate output buffers (164 KB), at every length, causal too (session 28, GPU alone, against the Triton
  kernel and SDPA with V padded to 96): B8 H12 S1024 causal 282 vs 250 and 235, B4 H16 S4096 causal 480 vs 418
  and 362, full 537 vs 491 and 440.
- causal masking: blocks wholly above the diagonal are never loaded; only blocks on the diagonal or past the
  sequence end are masked (a runtime branch per block), with one compare per score against a per-row limit. A
  program's 128 rows are two warpgroups' 64, so where blocks are 64 wide a warpgroup skips the products of those
  its own rows never see and only releases their ring slots: the first consumer the tile's last key block in the
  forward (MLA's 192/128) and in dQ (D=128 and 192/128), and in MHA's dK/dV the second consumer the query blocks
  before its keys (`_release_kv`, `_dkdv_lead`; session 32: the whole backward 1.02-1.07x at 1024 keys causal,
  1.03-1.04x for MHA and MLA at 4096, bitwise the same gradients).
- launch order (forward tiles and both backward grids): schedule.py, causal blocks heaviest first in
  buckets that keep a KV group's programs together.

Backward, two launches with the same roles (a loader warp, two consumer warpgroups of 64 rows), or at D=128 and 64
one (`backward_fused`, below, where `fused_backward_wins`):
- `backward_dq`: per 128 query rows, delta = rowsum(dO * Out) - dlse and the lse in log2 units first (for the
  dK/dV kernel, into buffers padded to whole programs of rows), then per key block S = Q K^T and dP = dO V^T
  issued together, dS = P (dP - delta), dQ += dS K. At D=64 the programs are persistent (tiles from a global
  counter, two Q/dO buffers per consumer): 1.00-1.13x as fast as one program per tile (session 19).
- `backward_dkdv`: per 128 key rows of a KV head, Q and dO blocks of every query head of the group stream through
  a ring of two stages (no per-query-head partials; three for GQA's causal D=64, BWD_CAUSAL_GQA_STAGES), each
  Q block with its rows' lse and delta (TMA copies on Q's barrier, read by the consumers straight from shared
  memory in the layout of the score columns), with transposed products so that the key rows are the wgmma's M:
  S^T = K Q^T, then dP^T = V dO^T issued with dV += P^T dO, then dK += dS^T Q; the steps (query head, query block)
  are software-pipelined: S^T of the next step is issued right after dK of this one. At D=64 the programs are
  persistent, as in the forward (tiles from a global counter, two K/V buffers: the next tile's K/V and first steps
  arrive while the consumers finish the current one and store its dK and dV): 1.00-1.07x as fast as one program
  per tile on the grid's ten shapes (session 19). At D=128 the persistent kernel measured 0.94-0.99x when its tile
  loop's state spilled 72-160 bytes (session 19), and 0.95-0.99x again with the causal mask against immediates,
  which brings those spills to 4-12 bytes for MHA (session 34), so there each program keeps its one tile. Those
  programs (D=128 and 192/128) write dK and dV through their own K and V buffers, which the tile no longer reads,
  by TMA store: the whole backward 1.03-1.08x for MHA at D=128, 1.03x for GQA and 1.07x for 192/128 at 1024 keys,
  1.01x at 16384 (session 33, best of five, GPU alone, against the stores from registers); for GQA at 4096 keys
  1.01-1.07x (best of seven; session 34). Its two or three more descriptors per launch cost host time, unmeasured.
- MLA: Q and K arrive as two TMA tiles each, as in the forward, so S (S^T) is two products into one accumulator
  and dQ (dK) two accumulators, one per tile. The GPT-2-small MLA's 96/64 runs both kernels (persistent; dK/dV in
  64-query steps: 128-query steps spill 236-556 bytes); 192/128's dK/dV takes 32-query steps, the only size whose
  64 x 192 and 64 x 128 accumulators fit beside S^T and dP^T without spills (BWD_CONFIGS). The whole backward
  against the Triton kernels and SDPA (V padded to D_qk) in one run (session 29, GPU alone, TFLOP/s): 96/64 B16 H16
  S1024 causal 274 vs 207 and 177, B4 H16 S4096 causal 404 vs 326 and 291, full 452 vs 370 and 355; 192/128 B16
  H16 S1024 causal 280 vs 217 and 162, B4 H16 S4096 causal 413 vs 309 and 252.

Backward in one launch (`backward_fused`, D=128 and 64; session 40, FlashAttention-3's backward): the one-tile dK/dV
program also takes dQ. Each step, each consumer stores its dS^T (64 keys x the step's queries, bf16) into a shared
buffer of the tile's 128 keys, and once both halves are in, computes its 64 x 64 share of dQ = dS K (A = the buffer
read transposed, B = K): at D=128 (64-query steps) the step's rows and its own 64 of the 128 columns, at D=64
(128-query steps) its own 64 of the step's rows and every column. It scales the share and stages it in shared memory;
a writer warp adds the two tiles into an fp32 dQ by TMA reduce-add (`_async_reduce_add`) and releases each buffer
once the reduce has read it. At D=64, 64-query steps measured 0.83-0.97x the two launches (session 40), 128-query
steps with dQ split by columns (128 x 32 each) 0.89-1.05x, and split by rows 1.03-1.05x faster than that (session
42; 224 KB of shared memory). Five products per step instead of the two launches' seven, and no recomputed P. A
Triton pre-pass writes delta and lse2 and zeroes the fp32 dQ, which a final cast copies into dq: 0.24 ms per 2^19
query rows of 128 columns together on an H200, so short causal launches keep the two launches. Causal programs walk
their query blocks from the last down, the group's heads inside each (`_fused_step`): every program of a (batch, KV
head) then adds into the same dQ tiles at the same time, in L2. Against head by head with query blocks in order (one
run, three rounds): +2.7-7.8% at 1024-4096 keys with groups of 4 and for MHA at 4096, -0.8% to -2.6% at 8192-16384 keys,
with groups of 8 and for MHA at 1024. Groups of more than 4 walk it in two passes, each over half the heads
(session 43): a group of 8 puts 8 heads' Q, dO and dQ tiles (512 KB) behind each query block, and once a wave's
programs drift apart their windows outgrow the L2 (Nsight Compute at B4 S4096: 6.2 GB of DRAM traffic against 5.2
with groups of 4); halves of 4 heads measured 1.05x at D=64 B1 S16384, 1.01-1.03x at D=128 with 4096-8192 keys, 1.00x
at 16384 (one launch against one launch, interleaved). Full attention keeps the plain order, in which its programs
already move together. Tried and not kept: dQ one step later (after the next step's products, three dS^T
buffers), slower on all 14 shapes (0.85-1.06x the two launches against 0.88-1.14x), with 164-304 bytes of spills;
session 41: the cast inside the kernel (each dQ tile's last program, counted by an atomic once its reduces had
completed, brought the fp32 tile back by TMA and wrote dq), 0.81-0.99x of this kernel on 12 shapes: waiting for the
reduces' writes rather than their reads before releasing a buffer stalls the consumers while a KV group's programs
all add into the same tiles; MHA's second consumer skipping its fully masked last step (as the two launches'
`_dkdv_lead` does): 0.995-1.002x. Sessions 11-13 had tried one launch on the older kernels with atomics from the
consumers (0.76-0.88x) and with TMA reduces the consumers issued themselves (0.74-1.01x).

Measured on an H200 beside SDPA and the Triton kernels in one run (bf16, H_q 32, TFLOP/s; benchmarks/RESULTS.md
has the grid and the history). Forward, persistent vs the previous one-program-per-tile version: B4 H_kv 8 S4096
D128 causal 558 vs 538 (SDPA 603), B16 S1024 causal 409 vs 359 (SDPA 455), MHA B4 S4096 causal 578 vs 530 (SDPA
555); D64 B4 S4096 causal 421 vs the Triton kernel's 387 (SDPA 426). Backward, whole (dQ + dK/dV), Gluon vs
Triton: B4 H_kv 8 S4096 causal 397 vs 353 (SDPA 460), full 436 vs 415 (514), B16 S1024 causal 300 vs 219 (304),
B1 S16384 causal 439 vs 372 (521), MHA B4 S4096 causal 394 vs 367 (466). Taking dK/dV's dS^T from the fp32 P^T
(session 16) made the whole backward 4-9% faster, old vs new in one run: B4 H_kv 8 S4096 causal 390 -> 412 (SDPA
449), full 440 -> 467 (510), B16 S1024 causal 293 -> 304 (304), B1 S16384 full 453 -> 491 (533). Bringing lse and
delta into dK/dV by TMA (session 17; before, each step loaded them from global memory and moved them into the
columns' layout through shared memory, five warpgroup barriers per step, now three) made that kernel 4-16% faster
(B4 H_kv 8 S4096 causal 1.97 -> 1.76 ms, full 3.42 -> 3.06 ms).

Tried and dropped, each beside the kept version in one run: FlashAttention-3's ping-pong between the two forward
consumers (within +-3%); a static persistent schedule (tile p, p + programs, ...: -15% for MHA, as tiles sharing
K/V no longer ran side by side); the two-compare mask (3% slower); dK/dV with 32-query blocks (no spills, but
322-366 TFLOP/s) and without the step pipelining (140-300 bytes of spills, 0-3% slower); dQ inside the dK/dV
kernel (dS^T of both warpgroups through shared memory, dQ = dS K per step added into fp32 with global atomics,
FlashAttention-2/3's single backward launch): correct, but 0.76-0.88x of the two launches, because pushing 32 KB of
dQ per step from the consumers costs 30% (without that write it ran 1.08-1.24x; session 11, on the kernels of the
time; session 40's one launch, above, adds dQ by TMA reduce from a writer warp instead). In the forward (session 16):
the row sums of P on the tensor cores (a second wgmma against a block of ones; 1-14% slower), pipelining across
tiles (the next tile's first scores beside this tile's last P V; +1-5% at D=64 causal, -2% to +4%
elsewhere, more spills at D=128), three consumer warpgroups at D=64 (3-19% slower); session 30: one or two of every
eight exponentials on the FMA units by a polynomial (FlashAttention-4's trick, for the D=64 forward whose 16 MUFU.EX2
a clock per SM take as many clocks as its products): 0.94-0.997x, so the MUFU is not what bounds it; session 33:
with 128-key blocks, the first consumer's last causal block (of which its rows see 64 keys at most) over 64 keys
(wgmma N = 64 and K = 64 on slices of the K and V buffers): 0.98-1.003x (a guess: the second consumer's path sets
a tile's end). In the backward: persistent dQ and dK/dV programs at D=128 (above); session 34: the causal dK/dV
mask against immediates at D=128 and 192/128 too (no spills left; 0.974-1.003x, GQA causal lowest).

No kernel spills registers inside its step loops. The causal dK/dV keeps a few setup values in local memory outside
them: at D=128 one to three (4 bytes with a KV group, 12/16 for MHA), at D=64 16 bytes (4 for MHA), where it spilled
196 bytes inside the loop before its mask was written against immediates (session 34; tests/test_flash.py bounds
them). The one launch spills nothing at D=128 and 24-72 bytes outside its loop at D=64, since its K and V tiles'
wgmma descriptors are rebuilt each step instead of held as loop invariants (`_fused_kv`, session 44: held, they left
ptxas short of registers, and it spilled other loop invariants and reloaded 5-11 values a step; 1.00-1.04x at D=128,
1.03-1.08x at D=64).

Gluon has no CPU interpreter, so these kernels' numerics are tested on the GPU (every forward and backward test in
tests/test_flash.py runs through them on an H100/H200); on the CPU, tests/test_flash.py compiles them for sm_90
and checks their structure (warp roles, registers, shared memory, spills).
"""

import functools
import os

import torch
import triton
import triton.language as tl
from triton._C.libtriton import ir
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language._core import builtin
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from attention_kernels import _checks
from attention_kernels._host import LOG2E, cdiv, launcher, num_sms
from attention_kernels.schedule import bucket_size, ranked

SMEM_PER_PROGRAM = 227 * 1024  # Hopper: the most shared memory one program may take
ROWS_PER_CONSUMER = 64  # query rows per consumer warpgroup: the M of one wgmma
ROWS = gl.constexpr(ROWS_PER_CONSUMER)
CONSUMERS = gl.constexpr(2)  # consumer warpgroups per program
PROGRAM_ROWS = 2 * ROWS_PER_CONSUMER  # rows a program owns: query rows in the forward, key rows in dK/dV
LOADER_REGS = gl.constexpr(24)
# The SM's 64K registers over three warpgroups once the loader's keeps 24 per thread: (512 - 24) / 2 = 244,
# rounded down to setmaxnreg's multiple of 8.
CONSUMER_REGS = gl.constexpr(240)


@gluon.constexpr_function
def wgmma_layout(n):
    """The registers of a wgmma result of n columns over one warpgroup (four warps of 16 rows): every accumulator,
    score tile and probability tile of these kernels and mla_sm90.py's and decode_sm90.py's."""
    return gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, n, 16])


# Per (D_qk, D_v): (BLOCK_N, K stages, V stages), measured on an H200 (see benchmarks/RESULTS.md). Until session 45
# K and V shared one ring, (BLOCK_N, STAGES) below. MLA's 192/128 (session 27, forward TFLOP/s GPU alone, B4 H16
# S4096 causal / full): (64, 3) 576 / 637, (64, 4) 568 / 630, (128, 2) 521 / 597. MLA's 96/64 (the GPT-2-small MLA
# of configs/mla.py and the benchmarks; session 28, same measure, B8 H12 S1024 causal / B4 H16 S4096 causal / full):
# (128, 3) 282 / 480 / 537, (128, 2) 246 / 399 / 482, (64, 3) 257 / 406 / 452. D=128 (session 45): 2 K and 3 V
# stages, which leave room for the output's own buffers (the module docstring).
CONFIGS = {
    (64, 64): (128, 3, 3),
    (96, 64): (128, 3, 3),
    (128, 128): (128, 2, 3),
    (192, 128): (64, 3, 3),
}
# Fewest keys for which flash._forward prefers this kernel, per (head dim, causal); 0 where absent. At D=64 a short
# causal tile has too few key blocks to hide its start and end. B16 H32/8 S1024 causal, TFLOP/s against the Triton
# kernel: 293-300 vs 303-317 in three earlier runs; with the output's TMA store (session 19) 310 vs 303 in an
# A/B run and 287 vs 306 in the grid's run. Full attention is ahead at every length, and from 2048 keys causal too
# (B8 S2048 386 vs 357, B4 S4096 422 vs 389). Session 45, with Q released with a tile's last scores (GPU alone,
# H32/8, three interleaved rounds): B16 S1024 322 vs 316 (pairs 1.020-1.022), B8 S2048 395 vs 386, B32 S512 227 vs
# 232 (0.978-0.980), B64 S256 138 vs 128. So causal D=64 takes it from 1024 keys. benchmarks/RESULTS.md has the runs.
MIN_KEYS = {
    (64, True): 1024,
}


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
    n_blocks, n_unmasked = _key_blocks(start_m, M, N, CAUSAL, BLOCK_M, BLOCK_N)
    return batch, head, start_m, n_blocks, n_unmasked


@gluon.jit
def _key_blocks(start_m, M, N, CAUSAL: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr):
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
def _publish(tile_smem, tile_ready, tile_free, tc, t):
    """Loader: hand tile t (the tc-th of this program; t >= n_tiles means stop) to the consumers."""
    slot = tc % 2
    mbarrier.wait(tile_free.index(slot), ((tc // 2) & 1) ^ 1, pred=tc >= 2)
    tile_smem.index(slot).store(gl.full([1], t, gl.int32, gl.BlockedLayout([1], [32], [1], [0])))
    mbarrier.arrive(tile_ready.index(slot), count=1)


@gluon.jit
def _receive(tile_smem, tile_ready, tile_free, tc):
    """Consumer: the tc-th tile the loader published."""
    slot = tc % 2
    mbarrier.wait(tile_ready.index(slot), (tc // 2) & 1)
    t = gl.max(tile_smem.index(slot).load(gl.BlockedLayout([1], [32], [4], [0])), 0)
    mbarrier.arrive(tile_free.index(slot), count=1)
    return t


@gluon.jit
def _tile_handover():
    """The shared memory through which a persistent program's loader hands its tiles to the consumers
    (`_publish`, `_receive`): two slots, each with a ready barrier (the loader's arrival) and a free one (one
    arrival per consumer warpgroup)."""
    tile_smem = gl.allocate_shared_memory(gl.int32, [2, 1], gl.SwizzledSharedLayout(1, 1, 1, [0]))
    tile_ready = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    tile_free = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(2):
        mbarrier.init(tile_ready.index(i), count=1)
        mbarrier.init(tile_free.index(i), count=CONSUMERS)
    return tile_smem, tile_ready, tile_free


@gluon.jit
def _load_kv(
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
    V's once every consumer has released those stages' previous blocks (`_load_kv`); a consumer's Q buffer is
    refilled once that consumer has the previous tile's last scores."""
    g = 0
    tc = 0
    t = gl.program_id(0)
    while t < n_tiles:
        _publish(tile_smem, tile_ready, tile_free, tc, t)
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
            _load_kv(
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
    _publish(tile_smem, tile_ready, tile_free, tc, t)


@gluon.jit
def _visible(j, start_m, q_shift, N, CAUSAL: gl.constexpr, BLOCK_N: gl.constexpr, s_layout: gl.constexpr):
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
def _mask(s, j, n_unmasked, start_m, q_shift, N, CAUSAL: gl.constexpr, BLOCK_N: gl.constexpr, s_layout: gl.constexpr):
    """Scores of key block j with the causal diagonal and the sequence end masked; blocks before n_unmasked are
    wholly visible to every row of the tile and pass through untouched."""
    if j >= n_unmasked:
        s = gl.where(_visible(j, start_m, q_shift, N, CAUSAL, BLOCK_N, s_layout), s, -float("inf"))
    return s


@gluon.jit
def _scores(q, qr, k_smem, kr_smem, st, s, BLOCK_N: gl.constexpr, D: gl.constexpr, DR: gl.constexpr):
    """Issue Q K^T of the block in stage st into s's registers (its old values unused): with DR > 0, as the first D
    columns' product plus the last DR columns' (MLA's RoPE part, its own TMA tile)."""
    s = warpgroup_mma(q, k_smem.index(st).reshape([BLOCK_N, D]).permute((1, 0)), s, use_acc=False, is_async=True)
    if DR > 0:
        s = warpgroup_mma(qr, kr_smem.index(st).reshape([BLOCK_N, DR]).permute((1, 0)), s, is_async=True)
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
    s = _scores(q, qr, k_smem, kr_smem, st, p, BLOCK_N, D, DR)
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
    """The forward's `_release_kv`: blocks [j0, n_blocks) of the tile whose first is the program's g0-th lie wholly
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
    t = _receive(tile_smem, tile_ready, tile_free, 0)
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
        s = _scores(q, qr, k_smem, kr_smem, st, p, BLOCK_N, D, DR)
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
        t = _receive(tile_smem, tile_ready, tile_free, tc)
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
    tile_smem, tile_ready, tile_free = _tile_handover()
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


# --------------------------------------------------------------------------------------------------------------
# Launcher
# --------------------------------------------------------------------------------------------------------------


def on_hopper(t: torch.Tensor) -> bool:
    """Can Gluon's Hopper kernels (this module's and mla_sm90.py's) run on t's device? An sm_90 GPU, and
    the Triton release they were written and verified against (3.6): Gluon is experimental and its API moves
    between releases, so with another one the Triton kernels run."""
    return t.is_cuda and triton.__version__.startswith("3.6") and _is_sm90(t.device.index)


def enabled() -> bool:
    """ZOO_FLASH_SM90=0 turns these kernels off (flash.py then uses the Triton kernels on Hopper too)."""
    return os.environ.get("ZOO_FLASH_SM90", "1") != "0"


@functools.cache
def _is_sm90(device_index: int) -> bool:
    return torch.cuda.get_device_capability(device_index) == (9, 0)


def supports(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool) -> bool:
    """Does flash._forward launch this kernel for these inputs? On an sm_90 GPU, when `eligible` and there are at
    least MIN_KEYS keys."""
    return enabled() and on_hopper(q) and eligible(q, k, v) and k.shape[2] >= MIN_KEYS.get((q.shape[-1], causal), 0)


# dK/dV per (D_qk, D_v): (BLOCK_M, STAGES, PERSISTENT), query rows per streamed step, ring stages, and the schedule.
# H200 (session 17, beside the Triton backward in one run): at D=64, 128-query steps read 1.02-1.10x the Triton
# kernels on the grid's ten shapes and 64-query steps 0.99-1.07x; at D=128, 128-query steps would not fit the
# registers (S^T, dP^T, dK and dV accumulators: 256 per thread). Persistent programs, against one program per
# tile in the same run (session 19): at D=64 the kernel 1.00-1.07x as fast on the grid's ten shapes; at D=128, where
# the tile loop's state made ptxas spill 72-160 bytes, 0.94-0.99x, and 0.95-0.99x with those spills at 4-12 bytes
# for MHA (session 34), so D=128 keeps one program per tile. MLA's
# 96/64 (session 29, the whole backward GPU alone beside the Triton kernels, B16 H16 S1024 causal / B4 H16 S4096
# causal / full): (64, 2, True) 1.33 / 1.24 / 1.22x, (64, 3, True) 1.30 / 1.18 / 1.19x, (64, 2, False) 1.16 / 1.10 /
# 1.15x, (128, 2, True), which spills 236-556 bytes, 1.17 / 1.14 / 1.16x. MLA's 192/128: 64-query steps hold 64 x 192
# and 64 x 128 accumulators besides S^T and dP^T, and ptxas spills 108-604 bytes and serializes the wgmma; 32-query
# steps do not spill (persistent, 20-184 bytes). The whole backward beside the Triton kernels (B16 H16 S1024 causal /
# B4 H16 S4096 causal): (32, 4, False) 1.29 / 1.34x, (32, 2, False) 1.28 / 1.31x, (32, 3, False) 1.26 / 1.29x,
# (32, 3, True) 1.32 / 1.30x, the Triton dK/dV kernel beside the Hopper dQ kernel 1.18 / 1.16x.
BWD_CONFIGS = {
    (64, 64): (128, 2, True),
    (96, 64): (64, 2, True),
    (128, 128): (64, 2, False),
    (192, 128): (32, 4, False),
}
# Ring stages of the causal dK/dV with a KV group, where they differ from BWD_CONFIGS'. At D=64 (session 38, the
# whole backward GPU alone against two stages, the median of seven paired rounds, bitwise the same gradients), three
# stages: H_q 32 over H_kv 8 1.025x at B16 S1024, 1.020x at B4 S4096, 1.023x at B1 S16384; over H_kv 4 1.003x. MHA
# (B4 H32 S4096) read 0.988x, and full attention 0.98-1.00x in an earlier run, so those keep two. At D=128 (session
# 42, three rounds), three stages spill 36 bytes in the step loop: 1.022x for H_kv 4 at B4 S4096, 0.97-0.99x at
# 1024-16384 keys elsewhere, so D=128 keeps two.
BWD_CAUSAL_GQA_STAGES = {
    (64, 64): 3,
}


def dkdv_config(d: int, d_v: int, causal: bool, group: int) -> tuple[int, int, bool]:
    """`backward_dkdv`'s (BLOCK_M, STAGES, PERSISTENT) for head dims (d, d_v) and `group` query heads per KV head."""
    block_m, stages, persistent = BWD_CONFIGS[(d, d_v)]
    if causal and group > 1:
        stages = BWD_CAUSAL_GQA_STAGES.get((d, d_v), stages)
    return block_m, stages, persistent


def backward_mode() -> str:
    """ZOO_FLASH_SM90_BWD: "1" (default) runs the one-launch backward where `fused_backward_wins`, else dQ in
    `backward_dq` and dK/dV in `backward_dkdv` where the latter's programs fill about a wave of the SMs
    (`flash._hopper_dkdv`; else the Triton dK/dV kernel, which can split a KV group's heads over programs); "force"
    runs the two Gluon launches wherever they can (tests); "fused" the one-launch backward wherever it can
    (FUSED_PAIRS; elsewhere as "force"); "0" keeps the whole backward on the Triton kernels."""
    mode = os.environ.get("ZOO_FLASH_SM90_BWD", "1")
    if mode not in ("0", "1", "force", "fused"):
        raise ValueError(
            f"ZOO_FLASH_SM90_BWD={mode!r}: expected 0 (off), 1 (on; dK/dV where it fills a wave, one "
            "launch where it is faster), force (two launches everywhere) or fused (one launch wherever "
            "it can)"
        )
    return mode


def supports_backward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, do: torch.Tensor) -> bool:
    """Can `backward_dq` run these inputs (and `backward_dkdv`, where (D_qk, D_v) is in BWD_CONFIGS too)? On an
    sm_90 GPU, `eligible` with (D_qk, D_v) in DQ_CONFIGS and dO TMA-readable too (its shape and dtype are out's,
    checked by the caller)."""
    return (
        enabled()
        and on_hopper(q)
        and (q.shape[-1], v.shape[-1]) in DQ_CONFIGS
        and eligible(q, k, v)
        and _checks.tma_readable(do)
    )


def eligible(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
    """fp16/bf16, (D_qk, D_v) in CONFIGS, and strides TMA can read (`_checks.tma_readable`)."""
    if q.dtype not in (torch.float16, torch.bfloat16) or (q.shape[-1], v.shape[-1]) not in CONFIGS:
        return False
    if k.shape[-1] != q.shape[-1]:
        return False
    return all(_checks.tma_readable(t) for t in (q, k, v))


def descriptor(t: torch.Tensor, block: list[int]) -> TensorDescriptor:
    """A TMA descriptor over t with its own strides, one `block` tile per copy, zero-filled outside the tensor
    (so a tile never reads the next head's or sequence's rows), in the NVMMA layout wgmma reads. Every caller has
    checked t with `_checks.tma_readable`, so this builds what `TensorDescriptor.from_tensor` builds without its
    checks (alignment, block shape), which cost about as much host time as the launch's own work per descriptor."""
    desc = TensorDescriptor.__new__(TensorDescriptor)
    desc.__dict__.update(
        base=t,
        shape=t.shape,
        strides=t.stride(),
        block_shape=block,
        layout=_nvmma_layout(tuple(block), t.dtype),
        padding="zero",
    )
    return desc


@functools.cache
def _nvmma_layout(block: tuple[int, ...], dtype: torch.dtype) -> gl.NVMMASharedLayout:
    """The shared-memory layout of a TMA tile, once per (block, dtype): building it costs more host time than
    the launch it is for (a backward takes ten to seventeen descriptors)."""
    gl_dtype = {torch.bfloat16: gl.bfloat16, torch.float16: gl.float16, torch.float32: gl.float32}[dtype]
    return gl.NVMMASharedLayout.get_default_for(list(block), gl_dtype)


def _descriptor(t: torch.Tensor, rows: int) -> TensorDescriptor:
    """Over (B, H, S, D): one (rows, D) tile of one (batch, head) per copy."""
    return descriptor(t, [1, 1, rows, t.shape[-1]])


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


_RING_SIZE = 1024
# int32s per counter: 16 bytes apart. Triton specializes a pointer on 16-byte alignment, so counters 4 bytes apart
# compiled every persistent kernel twice, and the launch cache's key changed with a counter's place in the ring
# (session 31).
_SLOT = 4
_RINGS: dict[tuple[torch.device, int], list] = {}


@functools.cache
def _unread_counter(device: torch.device) -> torch.Tensor:
    return torch.zeros(1, dtype=torch.int32, device=device)


def forward_smem(d: int, d_v: int, block_n: int, k_stages: int, v_stages: int, itemsize: int = 2) -> int:
    """Bytes of shared memory a forward program takes (the barriers aside): both consumers' Q and output buffers,
    and the K and V rings (D=128 with CONFIGS' 2 + 3 stages: 32 + 32 + 64 + 96 KB)."""
    return (PROGRAM_ROWS * (d + d_v) + block_n * (k_stages * d + v_stages * d_v)) * itemsize


def qk_tiles(d: int) -> tuple[int, int]:
    """The widths of Q's and K's two TMA tiles for head dim d (a tile's width must be a power of two): the largest
    power of two in d and the rest (0 when d is itself a power of two; MLA's 192: 128 + 64, 96: 64 + 32)."""
    main = 1 << (d.bit_length() - 1)
    return main, d - main


def forward(q, k, v, out, lse, qk_scale: float, causal: bool, config=None):
    """Launch on inputs `supports` accepted; out (B, H_q, S_q, D) and lse (B, H_q, S_q) fp32 any strides (an out
    TMA cannot write is filled from a contiguous one). qk_scale is the softmax scale times log2(e). `config`
    (BLOCK_N, K stages, V stages) overrides CONFIGS (benchmarks)."""
    if not _checks.tma_readable(out):
        staged = torch.empty(out.shape, device=out.device, dtype=out.dtype)
        forward(q, k, v, staged, lse, qk_scale, causal, config)
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
    launcher(_flash_fwd_sm90_kernel)[grid](
        *_qk_descriptors(q, ROWS_PER_CONSUMER),
        *_qk_descriptors(k, block_n),
        _descriptor(v, block_n),
        _descriptor(out, ROWS_PER_CONSUMER),
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


# --------------------------------------------------------------------------------------------------------------
# Backward: dK and dV
# --------------------------------------------------------------------------------------------------------------


@gluon.jit
def _dkdv_tile(t, n_kb, n_tiles, bucket, H_KV, M, N, CAUSAL: gl.constexpr, BLOCK_M: gl.constexpr):
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
def _dkdv_lead(start_n, m_start, M, N, CAUSAL: gl.constexpr, BLOCK_M: gl.constexpr):
    """Causal dK/dV with query blocks of at most 64 rows: how many query blocks from m_start on end before the
    second consumer's keys [start_n + 64, +64), so that they are wholly masked for that warpgroup. With 64-query
    blocks, 1 wherever the tile's first key sits at or past the first query's position (else 0); with 32, up to 2.

    Only MHA skips them (GROUP_SIZE 1, where they are the tile's first steps): with a KV group they are each query
    head's first steps, and skipped slots between a warpgroup's own steps would stall it (each step issues the next
    step's S^T before it releases its own slot, so with two ring stages it would wait for a slot the loader can
    only fill after that release). Bringing the group's skipped blocks first (query block by query block over the
    heads) made the GQA backward 4-8% slower at 4096 keys (session 32, benchmarks/RESULTS.md)."""
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
    # When not persistent, step0 is a constexpr 0 and this is, instruction for instruction, the one-tile loader it
    # replaced. Small changes here (the step count made a tensor up front, the query-block count computed here)
    # moved ptxas's register choices in a consumer warpgroup's loop and cost that kernel 3-7% at D=128
    # (benchmarks/RESULTS.md, session 19).
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
            _load_qdo(
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
def _load_qdo(
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
            _publish(tile_smem, tile_ready, tile_free, tc, t)
            batch, kv_head, start_n, m_start = _dkdv_tile(t, n_kb, n_tiles, bucket, H_KV, M, N, CAUSAL, BLOCK_M)
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
        _publish(tile_smem, tile_ready, tile_free, tc, t)
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
            _release_kv(q_ready, do_ready, qdo_free, it, 0, t0, STAGES, True)
        mbarrier.wait(q_ready.index((it + t0) % STAGES), ((it + t0) // STAGES) & 1, pred=t0 < total)
        st = _scores_t(
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
    else:  # (as before the skip, so that these kernels compile to the same code)
        t0 = 0
        mbarrier.wait(q_ready.index(it % STAGES), (it // STAGES) & 1)
        st = _scores_t(
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
            pt = _causal_mask_t(pt, m, kv_pos, q_shift, start_n, BLOCK_M, BLOCK_M > ROWS, cols)
        mbarrier.wait(do_ready.index(s), phase)
        do_t = do_smem.index(s).reshape([BLOCK_M, DV])
        dpt = warpgroup_mma(v_wg, do_t.permute((1, 0)), st, use_acc=False, is_async=True)
        dv = warpgroup_mma(gl.convert_layout(pt.to(dtype), v_op_layout), do_t, dv, is_async=True)
        dpt = warpgroup_mma_wait(num_outstanding=1, deps=[dpt])
        # dS^T from the fp32 P^T: its bf16 copy feeds dV only. Taking dS^T from that copy (round trip through
        # bf16) made ptxas convert one score at a time and unpack again: 64 (full) to 110 (causal) more
        # instructions per 64-query step, and a 4-9% slower backward (benchmarks/RESULTS.md, session 16).
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
        st = _scores_t(k_wg, kr_wg, q_smem, qr_smem, s1, dpt, BLOCK_M, D, DR)
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

        # Persistent (D=64, 96/64): the stores from registers. dK's first D columns (and dV when DV == D) keep them
        # as written before the RoPE part existed: through `_store_rows` the D = 64 kernels' PTX came out in another
        # order (session 29), and session 19 measured such reorderings at 3-7%.
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
            _store_rows(
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
            _store_rows(
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
def _causal_mask_t(
    pt, m, kv_pos, q_shift, start_n, BLOCK_M: gl.constexpr, IMMEDIATES: gl.constexpr, cols: gl.constexpr
):
    """P^T of query block m (rows: the consumer's keys at kv_pos; columns: the block's BLOCK_M queries) with the
    keys past each query zeroed, where the block crosses the causal diagonal of the program's keys from start_n.
    IMMEDIATES: qc >= first written as (qc & ~6) >= first - (qc & 6). A column's index is its thread's
    2 * (lane % 4) (bits 1-2) plus a constant, so each compare takes an immediate against the row's
    first - 2 * (lane % 4). Written plainly, the 32 column indices of a thread's 128-query step were hoisted out of
    the dK/dV loop, stayed live across it, and ptxas spilled 196 bytes inside the loop (D=64 causal; now 16, outside
    it)."""
    if q_shift + m * BLOCK_M < start_n + CONSUMERS * ROWS - 1:  # the block crosses the diagonal
        first = kv_pos - q_shift - m * BLOCK_M
        qc = gl.arange(0, BLOCK_M, layout=cols)
        if IMMEDIATES:
            pt = gl.where((qc & ~6)[None, :] >= first[:, None] - (qc & 6)[None, :], pt, 0.0)
        else:
            pt = gl.where(qc[None, :] >= first[:, None], pt, 0.0)
    return pt


@gluon.jit
def _scores_t(k_wg, kr_wg, q_smem, qr_smem, stage, st, BLOCK_M: gl.constexpr, D: gl.constexpr, DR: gl.constexpr):
    """Issue S^T = K Q^T of the Q block in `stage` into st's registers (its old values unused): with DR > 0, the
    first D columns' product plus the last DR columns' (two wgmma groups)."""
    st = warpgroup_mma(
        k_wg, q_smem.index(stage).reshape([BLOCK_M, D]).permute((1, 0)), st, use_acc=False, is_async=True
    )
    if DR > 0:
        st = warpgroup_mma(kr_wg, qr_smem.index(stage).reshape([BLOCK_M, DR]).permute((1, 0)), st, is_async=True)
    return st


@gluon.jit
def _store_rows(base, x, row0, n_rows, stride_r, stride_c, col0, COLS: gl.constexpr, layout: gl.constexpr):
    """Store x (64 rows from row0, COLS columns from col0, in `layout`) at base, the rows past n_rows left out."""
    offs_r = row0 + gl.arange(0, ROWS, layout=gl.SliceLayout(1, layout))
    offs_c = col0 + gl.arange(0, COLS, layout=gl.SliceLayout(0, layout))
    gl.store(
        base + offs_r[:, None] * stride_r + offs_c[None, :] * stride_c,
        x.to(base.dtype.element_ty),
        mask=(offs_r < n_rows)[:, None],
    )


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
        tile = _receive(tile_smem, tile_ready, tile_free, 0)
        while tile < n_tiles:
            batch, kv_head, start_n, m_start = _dkdv_tile(tile, n_kb, n_tiles, bucket, H_KV, M, N, CAUSAL, BLOCK_M)
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
            tile = _receive(tile_smem, tile_ready, tile_free, tc)
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
    batch, kv_head, start_n, m_start = _dkdv_tile(
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
        tile_smem, tile_ready, tile_free = _tile_handover()
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


def backward_dkdv(q, k, v, do, lse2, delta, dk, dv, sm_scale: float, causal: bool, config=None):
    """dK and dV into dk (B, H_kv, S_kv, D) and dv; q, k, v, do as `supports` accepted them (and do too); lse2 (lse
    in log2 units) and delta = rowsum(dO * Out) - dlse as `backward_dq` wrote them, contiguous (B, H_q,
    padded_rows(S_q)) fp32. The one-tile kernels (not `persistent`) write dK and dV by TMA in q's dtype: a dk or dv
    that TMA cannot write (its strides) or of another dtype is filled from a contiguous buffer in q's dtype."""
    b, h_q, s_q, d = q.shape
    h_kv, s_kv, d_v = k.shape[1], k.shape[2], v.shape[3]
    block_m, stages, persistent = config or dkdv_config(d, d_v, causal, h_q // h_kv)
    # dK and dV by TMA, in q's dtype: each through a contiguous buffer where it cannot go so.
    if not persistent and _staged(
        lambda dk_, dv_: backward_dkdv(q, k, v, do, lse2, delta, dk_, dv_, sm_scale, causal, config), q.dtype, dk, dv
    ):
        return
    rows = padded_rows(s_q)
    assert lse2.shape == delta.shape == (b, h_q, rows) and lse2.is_contiguous() and delta.is_contiguous()
    n_kb = cdiv(s_kv, PROGRAM_ROWS)
    n_tiles = n_kb * h_kv * b
    counter = tile_counter(q.device, persistent)
    q_desc, qr_desc = _qk_descriptors(q, block_m)
    k_desc, kr_desc = _qk_descriptors(k, PROGRAM_ROWS)
    d_main, d_rope = qk_tiles(d)
    # The persistent kernels store dK and dV from registers (their K/V buffers take the next tiles).
    dk_desc, dkr_desc = (None, None) if persistent else _qk_descriptors(dk, ROWS_PER_CONSUMER)
    dv_desc = None if persistent else _descriptor(dv, ROWS_PER_CONSUMER)
    launcher(_flash_bwd_dkdv_sm90_kernel)[(min(n_tiles, num_sms(q.device)) if persistent else n_tiles,)](
        q_desc,
        qr_desc,
        _descriptor(do, block_m),
        k_desc,
        kr_desc,
        _descriptor(v, PROGRAM_ROWS),
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


def _staged(launch, dtype: torch.dtype, dk: torch.Tensor, dv: torch.Tensor) -> bool:
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


def _qk_descriptors(t: torch.Tensor, rows: int) -> tuple[TensorDescriptor, TensorDescriptor | None]:
    """Q's or K's two TMA descriptors over (B, H, S, D): (rows, first `qk_tiles` columns) tiles and (rows, rest)
    ones; None for the second when D is a power of two (a constexpr, which the kernels never touch without a RoPE
    part, so Triton's launcher encodes no descriptor for it on every call)."""
    d_main, d_rest = qk_tiles(t.shape[-1])
    return descriptor(t, [1, 1, rows, d_main]), (descriptor(t, [1, 1, rows, d_rest]) if d_rest else None)


def padded_rows(s_q: int) -> int:
    """Rows per (batch, head) of the lse2/delta buffers the dK/dV kernel reads: S_q rounded up to whole dQ programs,
    every row written by `backward_dq` (rows past S_q hold 0), so a query block's rows are one in-bounds TMA copy."""
    return cdiv(s_q, PROGRAM_ROWS) * PROGRAM_ROWS


# --------------------------------------------------------------------------------------------------------------
# Backward: dQ and delta
# --------------------------------------------------------------------------------------------------------------


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
    n_blocks, n_unmasked = _key_blocks(start_m, M, N, CAUSAL, BLOCK_M, BLOCK_N)
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
        _load_kv(
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
            _publish(tile_smem, tile_ready, tile_free, tc, t)
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
        _publish(tile_smem, tile_ready, tile_free, tc, t)
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
        s = _scores(q, qr, k_smem, kr_smem, st, s, BLOCK_N, D, DR)
        mbarrier.wait(v_ready.index(st), phase)
        dp = warpgroup_mma(
            do, v_smem.index(st).reshape([BLOCK_N, DV]).permute((1, 0)), dp, use_acc=False, is_async=True
        )
        s = warpgroup_mma_wait(num_outstanding=1, deps=[s])
        p = gl.exp2(s * qk_scale - lse[:, None])
        if j >= n_unmasked:
            p = gl.where(_visible(j, start_m, q_shift, N, CAUSAL, BLOCK_N, s_layout), p, 0.0)
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
        _release_kv(k_ready, v_ready, kv_free, it0, n_own, n_blocks, STAGES, PERSISTENT)
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
        _store_rows(
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
def _release_kv(k_ready, v_ready, kv_free, it0, j0, n_blocks, STAGES: gl.constexpr, PERSISTENT: gl.constexpr):
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
        tile = _receive(tile_smem, tile_ready, tile_free, 0)
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
            tile = _receive(tile_smem, tile_ready, tile_free, tc)
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
        tile_smem, tile_ready, tile_free = _tile_handover()
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


# Per (D_qk, D_v): (BLOCK_N, STAGES, PERSISTENT) of the dQ kernel, keys per streamed block, ring stages and the
# schedule. No register spills; 128-key blocks spill at D=128, and at D=64 they made the whole backward 1.02-1.04x
# faster than 64-key blocks on the grid's ten D=64 shapes (H200, session 18, benchmarks/RESULTS.md). Persistent
# programs, against one program per tile in the same run (session 19): at D=64 0.996-1.126x on the grid's ten
# shapes (most where tiles are short: B16 S1024 1.13x causal, 1.06x full); at D=128, where the tile loop's state
# makes ptxas spill, 0.997-1.020x, inside the run's noise (the one-tile kernel read 0.964-1.011x of its own
# identical build), so D=128 keeps one program per tile. MLA (session 29, as BWD_CONFIGS): at 96/64, with
# (64, 2, True) dK/dV, (128, 2, True) 1.33 / 1.24 / 1.22x the Triton kernels, (128, 3, True) 1.32 / 1.23 / 1.22x,
# (64, 2, True) 1.27 / 1.19 / 1.18x; at 192/128, beside the Triton dK/dV kernel, (64, 2, False) 1.19 / 1.18 / 1.14x
# (B16 H16 S1024 causal / B4 H16 S4096 causal / full), (64, 3, False) 1.18 / 1.18 / 1.11x.
DQ_CONFIGS = {
    (64, 64): (128, 2, True),
    (96, 64): (128, 2, True),
    (128, 128): (64, 2, False),
    (192, 128): (64, 2, False),
}


def backward_dq(q, k, v, out, do, lse, dlse, delta, dq, sm_scale: float, causal: bool, lse2=None, config=None):
    """dQ into dq (B, H_q, S_q, D, any strides) and delta = rowsum(dO * Out) - dlse into delta, a contiguous fp32
    (B, H_q, R) with R = S_q, or R = padded_rows(S_q) for `backward_dkdv`, which also takes lse2 (the lse in log2
    units, written here, same shape). q, k, v, do as `supports_backward` accepted them, dlse None or
    (B, H_q, S_q) fp32."""
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
    q_desc, qr_desc = _qk_descriptors(q, ROWS_PER_CONSUMER)
    k_desc, kr_desc = _qk_descriptors(k, block_n)
    d_main, d_rope = qk_tiles(d)
    launcher(_flash_bwd_dq_sm90_kernel)[(min(n_tiles, num_sms(q.device)) if persistent else n_tiles,)](
        q_desc,
        qr_desc,
        _descriptor(do, ROWS_PER_CONSUMER),
        k_desc,
        kr_desc,
        _descriptor(v, block_n),
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


# --------------------------------------------------------------------------------------------------------------
# Backward in one launch (D = 128 and 64): dQ added into fp32 by TMA reduce from a writer warp
# --------------------------------------------------------------------------------------------------------------


@builtin
def _async_reduce_add(tensor_desc, coord, src, _semantic=None):
    """TMA bulk reduce-add of a shared-memory tile into global memory (`cp.reduce.async.bulk.tensor...add`),
    completed like a TMA store (`tma.store_wait`). Gluon 3.6's `tma` modules (Hopper's and Blackwell's) do not wrap
    the op; its op builder has it, which this reaches (FlashAttention-3 adds dQ the same way)."""
    coord = _semantic._convert_to_ir_values(coord, require_i64=False)
    _semantic.builder.create_async_tma_reduce(ir.DESCRIPTOR_REDUCE_KIND.ADD, tensor_desc.handle, coord, src.handle)


@gluon.jit
def _fused_step(t, kv_head, m_start, n_m, GROUP_SIZE: gl.constexpr, CAUSAL: gl.constexpr):
    """(query head, query block) of a one-launch program's step t. Full attention: head by head, query blocks in
    order. Causal: query blocks from the last down, the group's heads inside each, so that every program of a
    (batch, KV head) walks the same dQ tiles at the same time (each stops at its own first block) and their
    reduce-adds meet in L2. Groups of more than 4 (even) take two such passes, each over half the heads: a
    program's window of Q, dO and dQ tiles per query block is then a group of 4's."""
    if CAUSAL:
        if GROUP_SIZE > 4 and GROUP_SIZE % 2 == 0:
            HALF: gl.constexpr = GROUP_SIZE // 2
            per_pass = HALF * (n_m - m_start)
            second = (t >= per_pass).to(gl.int32)
            u = t - second * per_pass
            return kv_head * GROUP_SIZE + second * HALF + u % HALF, n_m - 1 - u // HALF
        else:
            return kv_head * GROUP_SIZE + t % GROUP_SIZE, n_m - 1 - t // GROUP_SIZE
    else:
        nb = n_m - m_start
        return kv_head * GROUP_SIZE + t // nb, m_start + t % nb


@gluon.jit
def _fused_loader(
    q_desc,
    do_desc,
    k_desc,
    v_desc,
    lse_desc,
    delta_desc,
    q_smem,
    do_smem,
    k_smem,
    v_smem,
    lse_smem,
    delta_smem,
    kv_ready,
    q_ready,
    do_ready,
    qdo_free,
    batch,
    kv_head,
    start_n,
    m_start,
    n_m,
    H,
    M_PAD,
    GROUP_SIZE: gl.constexpr,
    CAUSAL: gl.constexpr,
    BLOCK_M: gl.constexpr,
    STAGES: gl.constexpr,
):
    """One warp: the tile's K and V, then each step's Q (with its rows' lse2 and delta, on Q's barrier) and dO into
    the ring, in `_fused_step`'s order."""
    mbarrier.expect(kv_ready.index(0), k_desc.block_type.nbytes + v_desc.block_type.nbytes)
    tma.async_copy_global_to_shared(k_desc, [batch, kv_head, start_n, 0], kv_ready.index(0), k_smem.index(0))
    tma.async_copy_global_to_shared(v_desc, [batch, kv_head, start_n, 0], kv_ready.index(0), v_smem.index(0))
    for it in range(GROUP_SIZE * (n_m - m_start)):
        head, m = _fused_step(it, kv_head, m_start, n_m, GROUP_SIZE, CAUSAL)
        _load_qdo(
            q_desc,
            q_desc,
            do_desc,
            lse_desc,
            delta_desc,
            q_smem,
            q_smem,
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
            0,
        )


@gluon.jit
def _fused_dq(
    u,
    ds_smem,
    k_tile,
    dq_smem,
    ds_ready,
    dq_ready,
    dq_free,
    sm_scale,
    WG: gl.constexpr,
    BLOCK_M: gl.constexpr,
    D: gl.constexpr,
):
    """Consumer WG, step u: its share of the step's dQ = dS K over the tile's 128 keys (dS^T of both warpgroups
    from shared memory, the wgmma's A read transposed), scaled, into this warpgroup's staging buffer (two,
    alternating) for the writer warp. The share is a 64 x 64 product (`fused_dq_block`): with 64-query steps (D = 128)
    every query row and this warpgroup's D/2 columns, with 128-query steps (D = 64) this warpgroup's 64 query rows
    and every column."""
    SPLIT_ROWS: gl.constexpr = BLOCK_M > ROWS
    DQ_M: gl.constexpr = BLOCK_M // CONSUMERS if SPLIT_ROWS else BLOCK_M
    DQ_N: gl.constexpr = D if SPLIT_ROWS else D // 2
    dq_layout: gl.constexpr = wgmma_layout(DQ_N)
    b = u % 2
    mbarrier.wait(ds_ready.index(b), (u // 2) & 1)  # the other warpgroup's half of dS^T is in too
    qb = WG * 2 + b
    mbarrier.wait(dq_free.index(qb), ((u // 2) & 1) ^ 1, pred=u >= 2)  # the writer's reduce has read it
    if SPLIT_ROWS:
        ds_t = ds_smem.index(b).slice(WG * DQ_M, DQ_M, dim=1).permute((1, 0))
        k_op = k_tile
    else:
        ds_t = ds_smem.index(b).permute((1, 0))
        k_op = k_tile.slice(WG * DQ_N, DQ_N, dim=1)
    dq = warpgroup_mma(ds_t, k_op, gl.zeros([DQ_M, DQ_N], gl.float32, dq_layout), use_acc=False, is_async=True)
    dq = warpgroup_mma_wait(num_outstanding=0, deps=[dq])  # (the next step's S^T, issued before, completes too)
    dq_smem.index(qb).reshape([DQ_M, DQ_N]).store(dq * sm_scale)
    fence_async_shared()
    mbarrier.arrive(dq_ready.index(qb), count=1)


@gluon.jit
def _fused_kv(k_smem, v_smem, m, M, WG: gl.constexpr, BLOCK_M: gl.constexpr, D: gl.constexpr):
    """The one-launch consumer's K tile (128 keys), and its warpgroup's 64 rows of K and V, as the step with query
    block m reads them. Their buffer index is always 0 (block m starts before row M), but the compiler cannot know
    it, so the wgmma descriptors are rebuilt each step from the buffer's address by a few integer instructions.
    Built once before the loop, as loop invariants, they stayed live across it, and ptxas, short of registers,
    spilled other loop invariants (60-92 bytes at D = 128) and reloaded 5-11 values a step; this way D = 128 spills
    nothing and the backward measured 1.00-1.04x at D = 128 and 1.03-1.08x at D = 64 (session 44,
    benchmarks/RESULTS.md)."""
    kv = (m * BLOCK_M >= M).to(gl.int32)
    k_tile = k_smem.index(kv).reshape([CONSUMERS * ROWS, D])
    v_tile = v_smem.index(kv).reshape([CONSUMERS * ROWS, D])
    return k_tile, k_tile.slice(WG * ROWS, ROWS), v_tile.slice(WG * ROWS, ROWS)


@gluon.jit
def _fused_consumer(
    q_smem,
    do_smem,
    k_smem,
    v_smem,
    lse_smem,
    delta_smem,
    ds_smem,
    dq_smem,
    kv_ready,
    q_ready,
    do_ready,
    qdo_free,
    ds_ready,
    dq_ready,
    dq_free,
    k_read,
    dk_desc,
    dv_desc,
    batch,
    kv_head,
    start_n,
    m_start,
    n_m,
    M,
    N,
    sm_scale,
    qk_scale,
    WG: gl.constexpr,
    GROUP_SIZE: gl.constexpr,
    CAUSAL: gl.constexpr,
    BLOCK_M: gl.constexpr,
    D: gl.constexpr,
    STAGES: gl.constexpr,
):
    """One warpgroup: `_bwd_tile`'s dK and dV of key rows [start_n + WG*64, +64) (one tile per program, D = DV, no
    RoPE part, no skipped steps), and per step also `_fused_dq`: each warpgroup stores its dS^T (64 keys x BLOCK_M
    queries, bf16) into a shared buffer of the step's 128 keys (two, alternating) before it issues the next step's
    S^T, then takes its share of dQ."""
    st_layout: gl.constexpr = wgmma_layout(BLOCK_M)
    acc_layout: gl.constexpr = wgmma_layout(D)
    op_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=acc_layout, k_width=2)
    cols: gl.constexpr = gl.SliceLayout(0, st_layout)
    dtype: gl.constexpr = q_smem.dtype
    q_shift = N - M
    k_tile = k_smem.index(0).reshape([CONSUMERS * ROWS, D])
    k_wg = k_tile.slice(WG * ROWS, ROWS)
    v_wg = v_smem.index(0).reshape([CONSUMERS * ROWS, D]).slice(WG * ROWS, ROWS)
    kv0 = start_n + WG * ROWS
    kv_pos = kv0 + gl.arange(0, ROWS, layout=gl.SliceLayout(1, st_layout))
    dk = gl.zeros([ROWS, D], gl.float32, acc_layout)
    dv = gl.zeros([ROWS, D], gl.float32, acc_layout)
    total = GROUP_SIZE * (n_m - m_start)
    mbarrier.wait(kv_ready.index(0), 0)
    mbarrier.wait(q_ready.index(0), 0)
    st = _scores_t(k_wg, k_wg, q_smem, q_smem, 0, gl.zeros([ROWS, BLOCK_M], gl.float32, st_layout), BLOCK_M, D, 0)
    for t in range(0, total):
        s = t % STAGES
        _, m = _fused_step(t, kv_head, m_start, n_m, GROUP_SIZE, CAUSAL)
        k_tile_t, k_wg_t, v_wg_t = _fused_kv(k_smem, v_smem, m, M, WG, BLOCK_M, D)
        st = warpgroup_mma_wait(num_outstanding=0, deps=[st])
        q_t = q_smem.index(s).reshape([BLOCK_M, D])
        pt = gl.exp2(st * qk_scale - lse_smem.index(s).load(cols)[None, :])
        if CAUSAL:
            # Against immediates at 64-query steps too: written plainly, the column indices stayed live across the
            # loop and ptxas spilled 168 bytes (80 this way, and none since `_fused_kv`).
            pt = _causal_mask_t(pt, m, kv_pos, q_shift, start_n, BLOCK_M, True, cols)
        mbarrier.wait(do_ready.index(s), (t // STAGES) & 1)
        do_t = do_smem.index(s).reshape([BLOCK_M, D])
        dpt = warpgroup_mma(v_wg_t, do_t.permute((1, 0)), st, use_acc=False, is_async=True)
        dv = warpgroup_mma(gl.convert_layout(pt.to(dtype), op_layout), do_t, dv, is_async=True)
        dpt = warpgroup_mma_wait(num_outstanding=1, deps=[dpt])
        dst = (pt * (dpt - delta_smem.index(s).load(cols)[None, :])).to(dtype)
        dk = warpgroup_mma(gl.convert_layout(dst, op_layout), q_t, dk, is_async=True)
        ds_smem.index(t % 2).slice(WG * ROWS, ROWS).store(dst)
        fence_async_shared()
        mbarrier.arrive(ds_ready.index(t % 2), count=1)
        s1 = (t + 1) % STAGES
        mbarrier.wait(q_ready.index(s1), ((t + 1) // STAGES) & 1, pred=t + 1 < total)
        st = _scores_t(k_wg_t, k_wg_t, q_smem, q_smem, s1, dpt, BLOCK_M, D, 0)  # (past the last step: drained)
        dv, dk = warpgroup_mma_wait(num_outstanding=1, deps=[dv, dk])
        mbarrier.arrive(qdo_free.index(s), count=1)
        # dS^T buffer t % 2 is written again at step t + 2, after this warpgroup's dQ of step t + 1, which waits
        # for the other's half of dS^T t + 1; the other stores that after its own dQ of step t, the buffer's last
        # read. So two buffers suffice.
        _fused_dq(t, ds_smem, k_tile_t, dq_smem, ds_ready, dq_ready, dq_free, sm_scale, WG, BLOCK_M, D)
    st = warpgroup_mma_wait(num_outstanding=0, deps=[st])
    # dK and dV out through this warpgroup's K and V rows, by TMA, as `_bwd_tile` does. The other warpgroup's dQ
    # products read these K rows too (every key, its columns), up to its last step: each warpgroup has waited for
    # its own last dQ product, and both say so (k_read) before either overwrites its rows.
    mbarrier.arrive(k_read.index(0), count=1)
    mbarrier.wait(k_read.index(0), 0)
    k_wg.store((dk * sm_scale).to(dtype))
    v_wg.store(dv.to(dtype))
    fence_async_shared()
    tma.async_copy_shared_to_global(dk_desc, [batch, kv_head, kv0, 0], k_smem.index(0).slice(WG * ROWS, ROWS, dim=2))
    tma.async_copy_shared_to_global(dv_desc, [batch, kv_head, kv0, 0], v_smem.index(0).slice(WG * ROWS, ROWS, dim=2))
    tma.store_wait(0)


@gluon.jit
def _fused_writer(
    dq_desc,
    dq_smem,
    dq_ready,
    dq_free,
    batch,
    kv_head,
    m_start,
    n_m,
    GROUP_SIZE: gl.constexpr,
    CAUSAL: gl.constexpr,
    BLOCK_M: gl.constexpr,
    D: gl.constexpr,
):
    """One warp: each step's two dQ tiles (64 x 64 fp32, one per consumer: `_fused_dq`) added into the fp32 dQ by
    TMA reduce, which clips the rows past S_q. A buffer is released once its reduce has read it, checked one step
    later so that the reduces overlap. Each tile's reduce is one bulk group (two messages of 32 fp32 columns, the
    128-byte swizzle, committed together), so a step is two groups: once step u's are issued, at most two pending
    means step u - 1's have read their buffers, which the consumers fill again at step u + 1."""
    for u in range(GROUP_SIZE * (n_m - m_start)):
        head, m = _fused_step(u, kv_head, m_start, n_m, GROUP_SIZE, CAUSAL)
        for wg in gl.static_range(2):
            qb = wg * 2 + u % 2
            mbarrier.wait(dq_ready.index(qb), (u // 2) & 1)
            if BLOCK_M > ROWS:  # `_fused_dq`'s shares: query rows
                _async_reduce_add(dq_desc, [batch, head, m * BLOCK_M + wg * (BLOCK_M // 2), 0], dq_smem.index(qb))
            else:  # columns
                _async_reduce_add(dq_desc, [batch, head, m * BLOCK_M, wg * (D // 2)], dq_smem.index(qb))
        tma.store_wait(CONSUMERS)  # step u - 1's reduces have read their buffers
        for wg in gl.static_range(2):
            mbarrier.arrive(dq_free.index(wg * 2 + (u + 1) % 2), count=1, pred=u >= 1)
    tma.store_wait(0)


@gluon.jit
def _flash_bwd_fused_sm90_kernel(
    q_desc,
    do_desc,
    k_desc,
    v_desc,
    lse_desc,
    delta_desc,
    dk_desc,
    dv_desc,
    dq_desc,
    M,
    M_PAD,
    N,
    H_KV,
    bucket,
    sm_scale,
    qk_scale,
    GROUP_SIZE: gl.constexpr,
    CAUSAL: gl.constexpr,
    BLOCK_M: gl.constexpr,
    D: gl.constexpr,
    STAGES: gl.constexpr,
):
    """One program per tile of (128 key rows, KV head, batch), in `_dkdv_tile`'s order, BLOCK_M query rows per step:
    dK and dV as the one-tile dK/dV kernel, dQ added into an fp32 (B, H_q, S_q, D) buffer. Roles: two consumer
    warpgroups, the loader warp and the dQ writer warp (setmaxnreg 240 / 24 / 24)."""
    n_kb = gl.cdiv(N, CONSUMERS * ROWS)
    n_m = gl.cdiv(M, BLOCK_M)
    batch, kv_head, start_n, m_start = _dkdv_tile(
        gl.program_id(0), n_kb, gl.num_programs(0), bucket, H_KV, M, N, CAUSAL, BLOCK_M
    )
    q_smem = gl.allocate_shared_memory(q_desc.dtype, [STAGES] + q_desc.block_type.shape, q_desc.layout)
    do_smem = gl.allocate_shared_memory(do_desc.dtype, [STAGES] + do_desc.block_type.shape, do_desc.layout)
    k_smem = gl.allocate_shared_memory(k_desc.dtype, [1] + k_desc.block_type.shape, k_desc.layout)
    v_smem = gl.allocate_shared_memory(v_desc.dtype, [1] + v_desc.block_type.shape, v_desc.layout)
    lse_smem = gl.allocate_shared_memory(lse_desc.dtype, [STAGES] + lse_desc.block_type.shape, lse_desc.layout)
    delta_smem = gl.allocate_shared_memory(delta_desc.dtype, [STAGES] + delta_desc.block_type.shape, delta_desc.layout)
    ds_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([CONSUMERS * ROWS, BLOCK_M], q_desc.dtype)
    ds_smem = gl.allocate_shared_memory(q_desc.dtype, [2, CONSUMERS * ROWS, BLOCK_M], ds_layout)
    dq_smem = gl.allocate_shared_memory(dq_desc.dtype, [2 * CONSUMERS] + dq_desc.block_type.shape, dq_desc.layout)
    kv_ready = gl.allocate_shared_memory(gl.int64, [1, 1], mbarrier.MBarrierLayout())
    q_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    do_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    qdo_free = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    ds_ready = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    dq_ready = gl.allocate_shared_memory(gl.int64, [2 * CONSUMERS, 1], mbarrier.MBarrierLayout())
    dq_free = gl.allocate_shared_memory(gl.int64, [2 * CONSUMERS, 1], mbarrier.MBarrierLayout())
    k_read = gl.allocate_shared_memory(gl.int64, [1, 1], mbarrier.MBarrierLayout())
    mbarrier.init(kv_ready.index(0), count=1)
    mbarrier.init(k_read.index(0), count=CONSUMERS)
    for i in gl.static_range(STAGES):
        mbarrier.init(q_ready.index(i), count=1)
        mbarrier.init(do_ready.index(i), count=1)
        mbarrier.init(qdo_free.index(i), count=CONSUMERS)
    for i in gl.static_range(2):
        mbarrier.init(ds_ready.index(i), count=CONSUMERS)
    for i in gl.static_range(2 * CONSUMERS):
        mbarrier.init(dq_ready.index(i), count=1)
        mbarrier.init(dq_free.index(i), count=1)
    fence_async_shared()
    gl.warp_specialize(
        [
            (
                _fused_consumer,
                (
                    q_smem,
                    do_smem,
                    k_smem,
                    v_smem,
                    lse_smem,
                    delta_smem,
                    ds_smem,
                    dq_smem,
                    kv_ready,
                    q_ready,
                    do_ready,
                    qdo_free,
                    ds_ready,
                    dq_ready,
                    dq_free,
                    k_read,
                    dk_desc,
                    dv_desc,
                    batch,
                    kv_head,
                    start_n,
                    m_start,
                    n_m,
                    M,
                    N,
                    sm_scale,
                    qk_scale,
                    gl.constexpr(0),
                    GROUP_SIZE,
                    CAUSAL,
                    BLOCK_M,
                    D,
                    STAGES,
                ),
            ),
            (
                _fused_consumer,
                (
                    q_smem,
                    do_smem,
                    k_smem,
                    v_smem,
                    lse_smem,
                    delta_smem,
                    ds_smem,
                    dq_smem,
                    kv_ready,
                    q_ready,
                    do_ready,
                    qdo_free,
                    ds_ready,
                    dq_ready,
                    dq_free,
                    k_read,
                    dk_desc,
                    dv_desc,
                    batch,
                    kv_head,
                    start_n,
                    m_start,
                    n_m,
                    M,
                    N,
                    sm_scale,
                    qk_scale,
                    gl.constexpr(1),
                    GROUP_SIZE,
                    CAUSAL,
                    BLOCK_M,
                    D,
                    STAGES,
                ),
            ),
            (
                _fused_loader,
                (
                    q_desc,
                    do_desc,
                    k_desc,
                    v_desc,
                    lse_desc,
                    delta_desc,
                    q_smem,
                    do_smem,
                    k_smem,
                    v_smem,
                    lse_smem,
                    delta_smem,
                    kv_ready,
                    q_ready,
                    do_ready,
                    qdo_free,
                    batch,
                    kv_head,
                    start_n,
                    m_start,
                    n_m,
                    H_KV * GROUP_SIZE,
                    M_PAD,
                    GROUP_SIZE,
                    CAUSAL,
                    BLOCK_M,
                    STAGES,
                ),
            ),
            (
                _fused_writer,
                (dq_desc, dq_smem, dq_ready, dq_free, batch, kv_head, m_start, n_m, GROUP_SIZE, CAUSAL, BLOCK_M, D),
            ),
        ],
        [4, 1, 1],
        [CONSUMER_REGS, LOADER_REGS, LOADER_REGS],
    )


@triton.jit
def _fused_prep_kernel(
    out_ptr,
    do_ptr,
    lse_ptr,
    dlse_ptr,
    delta_ptr,
    lse2_ptr,
    dq_acc_ptr,
    stride_ob,
    stride_oh,
    stride_om,
    stride_od,
    stride_gb,
    stride_gh,
    stride_gm,
    stride_gd,
    stride_lb,
    stride_lh,
    stride_lm,
    stride_tb,
    stride_th,
    stride_tm,
    H,
    M,
    M_PAD,
    HAS_DLSE: tl.constexpr,
    D: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """Before the one-launch backward, per BLOCK rows of one (batch, head): delta = rowsum(dO * Out) - dlse and lse2
    (the lse in log2 units) into contiguous (B, H, M_PAD) buffers (0 past M), and zeros into the rows' fp32 dQ."""
    bh = tl.program_id(1)
    b = (bh // H).to(tl.int64)
    h = (bh % H).to(tl.int64)
    rows = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = rows < M
    cols = tl.arange(0, D)
    o = tl.load(
        out_ptr + b * stride_ob + h * stride_oh + rows[:, None] * stride_om + cols[None, :] * stride_od,
        mask=ok[:, None],
        other=0.0,
    )
    do = tl.load(
        do_ptr + b * stride_gb + h * stride_gh + rows[:, None] * stride_gm + cols[None, :] * stride_gd,
        mask=ok[:, None],
        other=0.0,
    )
    delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), axis=1)
    if HAS_DLSE:
        delta -= tl.load(dlse_ptr + b * stride_tb + h * stride_th + rows * stride_tm, mask=ok, other=0.0)
    lse2 = tl.load(lse_ptr + b * stride_lb + h * stride_lh + rows * stride_lm, mask=ok, other=0.0) * 1.4426950408889634
    padded = bh.to(tl.int64) * M_PAD + rows
    tl.store(delta_ptr + padded, tl.where(ok, delta, 0.0), mask=rows < M_PAD)
    tl.store(lse2_ptr + padded, tl.where(ok, lse2, 0.0), mask=rows < M_PAD)
    tl.store(
        dq_acc_ptr + (bh.to(tl.int64) * M + rows[:, None]) * D + cols[None, :],
        tl.zeros([BLOCK, D], tl.float32),
        mask=ok[:, None],
    )


# (D_qk, D_v) pairs the one-launch backward runs: query rows per step (BLOCK_M).
FUSED_PAIRS = {(64, 64): 128, (128, 128): 64}


def fused_backward_wins(d: int, d_v: int, causal: bool, s_kv: int, group: int, programs: int, sms: int) -> bool:
    """Does `flash._backward` take the one-launch backward (`backward_fused`) instead of the two launches? Where its
    programs (128 keys of a KV head each) fill a wave of the SMs: full attention at every length; causal from 4096
    keys with at most 4 query heads per KV head at D = 128 and from 16384 keys with 5-8; at D = 64 from 8192 keys, or
    where the group's query heads times the keys reach 16384 (groups of 4 from 4096 keys, of 8 from 2048).
    Measured on an H200 (benchmarks/RESULTS.md; the whole backward GPU alone, one launch over two, median of three
    paired rounds):
    - D = 128 (session 40): full attention 1.01-1.16x on all 7 shapes (B16 S1024 1.01, B8 S2048 1.03, 4096 keys
      1.07-1.16, B1 S16384 1.08); causal at 4096-16384 keys 1.07-1.10x with groups of 4 (MHA 1.01-1.08); causal
      with groups of 8 (H_kv 4 of 32) at 4096 keys 0.89-0.92x, and every causal shape at 1024-2048 keys 0.92-0.97x:
      there the pre-pass and the final cast of dQ (0.24 ms per 2^19 query rows of 128 columns, in proportion to the
      rows) weigh most against the causal half of the products. Session 43, causal with groups of 8: 0.96x at
      4096 keys, 1.00-1.01x at 8192 (pairs 0.97-1.01), 1.06x at 16384 and 1.07x at 32768 (and with the two
      launches' calls interleaved: 0.99x at 8192, 1.04x at 16384, 1.08x at 32768). A group of 8 fills a
      program with 8 steps per query block, and its programs' reads and dQ adds leave L2 more (Nsight Compute at
      B4 S4096: 6.2 GB of DRAM traffic against 5.2 with groups of 4, 2.86 ms against 2.45); from 16384 keys the
      five products against the two launches' seven outweigh that. Full attention, timed both ways in session 43:
      1.08-1.11x in events, but 0.98-0.99x with a KV group (MHA 1.03x) when the two launches' calls run between
      the one launch's; kept on the one launch, the question open (benchmarks/RESULTS.md, session 43).
    - D = 64 (session 42, 128-query steps): full attention 1.00-1.08x on all 5 shapes (B16 S1024 1.00, 4096 keys
      1.00-1.03, B1 S16384 1.08); causal at 16384 keys 1.02-1.08x (groups of 1, 4, 8), at 8192 keys 0.99-1.05x
      (groups of 8 0.987), at 4096 keys 0.95-0.98x and 0.91x at B16 S1024, where the two launches' persistent
      programs with three ring stages for a KV group (session 38) keep ahead. Session 44, after `_fused_kv` made the
      one launch 1.03-1.08x faster at D = 64, causal, interleaved / events: MHA 0.93 / 0.95 at 1024 keys, 0.97 / 1.02
      at 2048, 1.00 / 1.07 at 4096, 1.01 / 1.11 at 8192; groups of 4 0.97 / 1.01, 0.99 / 1.04, 1.01 / 1.06, 1.01 /
      1.06; groups of 8 0.99 / 1.00, 1.02 / 1.05, 1.05 / 1.09, 1.07 / 1.10. The rule takes the shapes where both
      measures read above 1. At D = 128 causal (1024-8192 keys where the rule keeps the two launches) they part: the
      one launch 0.91-1.00x interleaved and 0.95-1.06x in events, so the rule stays."""
    if (d, d_v) not in FUSED_PAIRS or programs < sms:
        return False
    if not causal:
        return True
    if d == 64:
        return s_kv >= 8192 or group * s_kv >= 16384
    return s_kv >= 4096 and group <= 4 or s_kv >= 16384 and group <= 8


def fused_dq_block(d: int, block_m: int) -> list[int]:
    """The TMA block of one consumer's dQ share in the one-launch backward (`_fused_dq`, `_fused_writer`): with
    64-query steps every row and half the columns, with 128-query steps half the rows and every column (two
    consumers)."""
    return [1, 1, block_m // 2, d] if block_m > ROWS_PER_CONSUMER else [1, 1, block_m, d // 2]


def backward_fused(q, k, v, out, lse, do, dlse, dq, dk, dv, sm_scale: float, causal: bool):
    """The whole backward in one Gluon launch (plus a Triton pre-pass and dQ's cast): dq, dk, dv any strides and
    dtypes (dK and dV go through contiguous buffers in q's dtype where TMA cannot write them). q, k, v, do as
    `supports_backward` accepted them with (D_qk, D_v) in FUSED_PAIRS (its query rows per step); lse and dlse (or
    None) (B, H_q, S_q) fp32.
    dQ's fp32 sum over the key blocks is taken in the order their programs finish, so its last bits may differ
    from call to call (dK and dV do not); it takes an fp32 buffer of dQ's shape for the call."""
    if _staged(
        lambda dk_, dv_: backward_fused(q, k, v, out, lse, do, dlse, dq, dk_, dv_, sm_scale, causal), q.dtype, dk, dv
    ):
        return
    b, h_q, s_q, d = q.shape
    h_kv, s_kv = k.shape[1], k.shape[2]
    block_m, stages = FUSED_PAIRS[(d, v.shape[3])], 2
    rows = padded_rows(s_q)
    delta = torch.empty((b, h_q, rows), device=q.device, dtype=torch.float32)
    lse2 = torch.empty_like(delta)
    dq_acc = torch.empty((b, h_q, s_q, d), device=q.device, dtype=torch.float32)
    dlse_arg = dlse if dlse is not None else lse
    launcher(_fused_prep_kernel)[(cdiv(rows, block_m), b * h_q)](
        out,
        do,
        lse,
        dlse_arg,
        delta,
        lse2,
        dq_acc,
        *out.stride(),
        *do.stride(),
        *lse.stride(),
        *dlse_arg.stride(),
        h_q,
        s_q,
        rows,
        HAS_DLSE=dlse is not None,
        D=d,
        BLOCK=block_m,
        num_warps=4,
    )
    n_kb = cdiv(s_kv, PROGRAM_ROWS)
    launcher(_flash_bwd_fused_sm90_kernel)[(n_kb * h_kv * b,)](
        _descriptor(q, block_m),
        _descriptor(do, block_m),
        _descriptor(k, PROGRAM_ROWS),
        _descriptor(v, PROGRAM_ROWS),
        descriptor(lse2.view(-1), [block_m]),
        descriptor(delta.view(-1), [block_m]),
        _descriptor(dk, ROWS_PER_CONSUMER),
        _descriptor(dv, ROWS_PER_CONSUMER),
        descriptor(dq_acc, fused_dq_block(d, block_m)),
        s_q,
        rows,
        s_kv,
        h_kv,
        bucket_size(n_kb, h_q // h_kv, causal),
        sm_scale,
        sm_scale * LOG2E,
        GROUP_SIZE=h_q // h_kv,
        CAUSAL=causal,
        BLOCK_M=block_m,
        D=d,
        STAGES=stages,
        num_warps=4,
    )
    dq.copy_(dq_acc)
