"""Differentiable flash attention for MHA, GQA and MQA (training and prefill): the op, its launchers and autograd.

Math (one query head h reading KV head h // GROUP_SIZE, scores scaled by `scale`, default 1/sqrt(D_qk)):

    S = scale * Q K^T          P = softmax(S)          Out = P V          lse = logsumexp(S)   (natural log)
    dV = P^T dO                dP = dO V^T             dS = P * (dP - delta),  delta = rowsum(dO * Out)
    dQ = scale * dS K          dK = scale * dS^T Q

Causal masking is bottom-right aligned: with S_q <= S_kv, query row i sits at position S_kv - S_q + i and sees
keys at positions <= its own (a cached prefix of S_kv - S_q tokens is visible to every query).

Where it runs:
- on Hopper (sm_90, fp16/bf16, Triton 3.6), the warp-specialized Gluon kernels of flash_sm90.py (FlashAttention-3's
  structure, Shah et al. 2024) for D = 128 and 64 and MLA's 192/128 and 96/64; at D = 128 and 64 the backward runs
  in one launch where `flash_sm90.fused_backward_wins`;
- everywhere else, the portable Triton kernels of flash_triton.py (FlashAttention-2, Dao 2023), on the CPU too
  under TRITON_INTERPRET=1.

Head dims: D_qk and D_v each from 1 to 256 (MIN_HEAD_DIM, MAX_HEAD_DIM). The kernels take multiples of 16; any
other head dim is zero-padded to the next one inside the op (`_forward_padded`, `_backward_padded`): zero columns
of Q and K leave Q K^T unchanged, the softmax scale stays that of the true D_qk, and V's zero columns give output
and gradient columns that are dropped. It costs a copy of each input and output per call, and keeps every kernel
launch on head dims the GPU tests cover.

Launch heuristics: block sizes, warps and pipeline stages come from a handful of configs per head dim (`_CONFIGS`),
timed on the GPU alone (`_gpu_ms`) once per (kernel, head dims, causal, dtype, sequence-length bucket) and cached
for the process. A dK/dV launch with fewer than two programs per SM shares each KV group's query heads among a few
programs (`_head_splits`). The tiles the loops stream come through TMA descriptors in the two backward kernels on
Hopper and through pointers in the forward, the faster choice of each on an H200 (benchmarks/RESULTS.md);
ZOO_FLASH_TMA=0/1 forces one path everywhere (1 also under the interpreter, where the tests use it).

Every op is a `torch.library` custom op, traceable by torch.compile with fullgraph=True; eager calls go through an
equivalent autograd.Function (`_FlashAttention`), which costs less host time per call, and eager calls with nothing
to differentiate (inference) through the launcher alone. A call's checks and kernel choice are made once per input
signature and kept (`_signature`, `_ROUTES`).
"""

import functools
import math
import os

import torch
import triton

from attention_kernels import _checks
from attention_kernels._host import (
    LOG2E,
    MAX_LAUNCH_KEYS,
    behind_sleep,
    capability,
    cdiv,
    device_guard,
    launcher,
    next_power_of_2,
    num_sms,
    synced_seconds,
    tensor_signature,
)
from attention_kernels.flash_triton import flash_bwd_dkdv_kernel, flash_bwd_dq_kernel, flash_fwd_kernel
from attention_kernels.schedule import bucket_size

try:
    from attention_kernels import flash_sm90
except ImportError:  # a triton without Gluon's Hopper API: the Triton kernel runs on every GPU
    flash_sm90 = None

MIN_HEAD_DIM, MAX_HEAD_DIM = 1, 256  # the head dims the ops take (D_qk and D_v each)
# The kernels take head dims in multiples of 16; the ops zero-pad any other head dim to the next one inside
# (`_forward_padded`, `_backward_padded`), so that every kernel launch is of a shape the GPU tests cover.
KERNEL_HEAD_DIM_MULTIPLE = 16


# --------------------------------------------------------------------------------------------------------------
# Triton kernels
# --------------------------------------------------------------------------------------------------------------


# --------------------------------------------------------------------------------------------------------------
# Launch heuristics: a few configs per kernel and head dim, timed once per shape bucket and cached
# --------------------------------------------------------------------------------------------------------------

# (BLOCK_M, BLOCK_N, num_warps, num_stages). For dK/dV, BLOCK_N is the owned key block and BLOCK_M the streamed
# query block; for the forward and dQ it is the other way round. The first entry is the default used untimed
# (interpreter, short sequences); later entries are alternatives the timer may pick on the GPU. Larger head dims
# get fewer stages: each stage holds one K and one V tile in shared memory.
_CONFIGS = {
    "fwd": {
        64: [(128, 64, 8, 4), (128, 64, 4, 3), (128, 128, 4, 3), (64, 64, 4, 3)],
        128: [(128, 128, 8, 3), (128, 64, 8, 3), (128, 64, 8, 4), (64, 64, 4, 3)],
        256: [(64, 64, 4, 2), (128, 64, 8, 2), (64, 32, 4, 3), (128, 32, 8, 2), (128, 64, 8, 3)],
    },
    "dkdv": {
        64: [(64, 128, 8, 3), (32, 128, 4, 3), (64, 64, 4, 3), (32, 64, 4, 4)],
        128: [(64, 128, 8, 2), (64, 128, 8, 3), (32, 128, 8, 3), (64, 64, 4, 3)],
        256: [(32, 64, 4, 2), (32, 128, 8, 1), (16, 64, 4, 2), (32, 32, 4, 2), (64, 64, 8, 2)],
    },
    "dq": {
        64: [(128, 64, 8, 3), (128, 32, 4, 3), (64, 64, 4, 3), (64, 32, 4, 4)],
        128: [(128, 64, 8, 3), (128, 128, 8, 2), (128, 32, 8, 3), (64, 64, 4, 3)],
        256: [(64, 32, 4, 2), (128, 32, 8, 1), (64, 16, 4, 2), (32, 32, 4, 2), (128, 64, 8, 2)],
    },
}
# A config that fits any head dim and dtype (fp32 at D=256 included) in shared memory.
_SMALL_CONFIG = (32, 32, 4, 1)
# The interpreter pays per block operation, not per element: large tiles mean fewer loop trips on the CPU.
_INTERPRETER_CONFIG = (64, 64, 4, 1)
_TUNE_MIN_SEQ = 512  # below this a launch is tens of microseconds: the default config is not worth timing
_TUNED: dict[tuple, tuple] = {}
# Raised when a config needs more shared memory or registers than the GPU has: the tuner skips that config.
_RESOURCE_ERRORS = tuple(
    e
    for e in (
        getattr(triton.runtime.errors, "OutOfResources", None),
        getattr(triton.runtime.errors, "PTXASError", None),
        triton.compiler.errors.CompilationError,
    )
    if e is not None
)


def _dim_bucket(d_qk: int, d_v: int) -> int:
    d = max(d_qk, d_v)
    return 64 if d <= 64 else 128 if d <= 128 else 256


def _autotune_enabled() -> bool:
    return os.environ.get("ZOO_FLASH_AUTOTUNE", "1") != "0"


def _pick_config(kind: str, q: torch.Tensor, d_qk: int, d_v: int, causal: bool, m: int, n: int, use_tma: bool, launch):
    """The config for this launch, cached per (kind, head dims, causal, dtype, sequence-length bucket, TMA). On the GPU
    for long sequences each candidate is timed on the GPU alone (`_gpu_ms`), in two alternating rounds (a few ms
    in all, plus the compiles); otherwise the first one that compiles is taken. The length buckets are powers of
    two (below 512: untimed), so a training run tunes once per kernel and a benchmark grid a handful of times, not
    once per shape."""
    if _checks.interpreting():
        return _INTERPRETER_CONFIG
    # Short: untimed. Longer: one bucket per power of two of the longer sequence (capped at 16k): the best tile
    # can move with the length, and a grid tuned once on its first, shortest shape kept that shape's pick.
    s_bucket = "short" if max(m, n) < _TUNE_MIN_SEQ else min(next_power_of_2(max(m, n)), 16384)
    key = (kind, d_qk, d_v, causal, q.dtype, s_bucket, use_tma, q.device.index)
    if key in _TUNED:
        return _TUNED[key]
    timed = _autotune_enabled() and s_bucket != "short" and not torch.cuda.is_current_stream_capturing()
    candidates = list(_CONFIGS[kind][_dim_bucket(d_qk, d_v)])
    if q.dtype == torch.float32:  # fp32 tiles are twice the bytes: the small config always fits
        candidates = [_SMALL_CONFIG] + candidates
    best, fits = None, []
    for cfg in candidates:
        try:
            launch(cfg)  # compiles it; a config too large for the GPU raises here
        except _RESOURCE_ERRORS:
            continue  # too much shared memory or registers for this head dim and dtype
        if not timed:
            best = cfg
            break
        fits.append(cfg)
    if timed and fits:  # two alternating rounds; each config's faster one
        first = {cfg: _gpu_ms(lambda: launch(cfg)) for cfg in fits}
        ms = {cfg: min(first[cfg], _gpu_ms(lambda: launch(cfg))) for cfg in fits}
        best = min(fits, key=ms.get)
    if best is None:  # nothing larger fit: the small config does for every head dim and dtype
        best = _SMALL_CONFIG
    _TUNED[key] = best
    return best


def _gpu_ms(fn, n: int = 8) -> float:
    """Milliseconds per call of fn (compiled, run once already) on the GPU alone: n calls enqueued while the GPU
    sleeps, then run back to back between two events. At training sizes a launch's host time is about its kernel's
    GPU time, so timing each call between its own events (do_bench) measures the host too, and such tunings of one
    launch picked different configs from run to run, up to 21% apart (benchmarks/RESULTS.md). The sleep is sized
    from one call; if the GPU wakes before the calls are
    enqueued, a longer one, and after the third such try the last timing is kept (host time in it or not: a pick
    then is no worse than do_bench's). `benchmarks/common.bench_gpu_ms` is the benchmarks' version of the same
    method, per call and from a cold L2."""
    per_call = synced_seconds(fn)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)

    def enqueue():
        start.record()
        for _ in range(n):
            fn()
        end.record()

    for attempt in range(3):
        if behind_sleep(enqueue, (2 * n * per_call + 1e-3) * 4**attempt):
            break
    return start.elapsed_time(end) / n


def _scratch(size: int, alignment: int, stream):
    return torch.empty(size, dtype=torch.int8, device="cuda")


def _use_tma(backward: bool, *tensors: torch.Tensor) -> bool:
    """Stream these tensors through TMA tensor descriptors? ZOO_FLASH_TMA=auto (default): for the backward kernels
    on Hopper or newer when the layout allows (the forward is faster with pointers, see the module docstring);
    0: never (plain pointers); 1: whenever the layout allows, also under the interpreter (the tests use it to run
    the descriptor path on the CPU). TMA needs a unit last-dim stride, 16-byte aligned other strides and base
    address (each (batch, head) slice becomes one 2-d descriptor)."""
    mode = os.environ.get("ZOO_FLASH_TMA", "auto")
    t0 = tensors[0]
    if mode == "0" or (mode != "1" and not (backward and t0.is_cuda and capability(t0.device.index)[0] >= 9)):
        return False
    if not all(_checks.tma_readable(t) for t in tensors):
        return False
    if t0.is_cuda:
        # Descriptors built inside a kernel need a little global scratch memory, which triton asks this allocator
        # for. It is a context variable, so it is set on every call: the backward runs on autograd's own thread.
        triton.set_allocator(_scratch)
    return True


def _precision(dtype: torch.dtype):
    # fp32 inputs get true fp32 products (the reference's precision, not tf32); fp16/bf16 use the default.
    return "ieee" if dtype == torch.float32 else None


@functools.cache
def _head_block(d: int) -> int:
    return max(16, next_power_of_2(d))


@functools.cache
def _qk_blocks(d_qk: int) -> dict:
    """How the kernels tile the Q/K head dim: one power-of-two block, or two (BLOCK_DK + BLOCK_DK2, SPLIT_DK) when
    that pads less, e.g. MLA's 192 = 128 + 64 (one block: 256) and 72 = 64 + 16 (one block: 128). Tiles must be
    powers of two; the second block's products go into the same scores and its own dQ/dK accumulator."""
    one = _head_block(d_qk)
    first = one // 2
    second = _head_block(d_qk - first) if d_qk > first else 0
    if first >= 16 and second and first + second < one:
        return dict(BLOCK_DK=first, BLOCK_DK2=second, SPLIT_DK=True)
    return dict(BLOCK_DK=one, BLOCK_DK2=16, SPLIT_DK=False)  # BLOCK_DK2 unused


# --------------------------------------------------------------------------------------------------------------
# Routes: a call's checks and kernel choices, made once per signature
# --------------------------------------------------------------------------------------------------------------

# A training step calls the same few signatures every iteration, and in a compiled step each call's host time is
# what the GPU waits for: the checks, the kernel choice and the launch keys of a signature are made once and kept.
_ROUTES: dict = {}


def _signature(op: str, scale, causal: bool, *tensors) -> tuple:
    """What an op's checks and kernel choices depend on: per tensor (or None) its shape, strides, dtype, device
    and 16-byte alignment (which TMA and Triton's specialization look at), the scale, causal, and the switches read
    from the environment. It also keys the op's launches (`Launcher.keyed`): their arguments are these tensors,
    buffers the op allocates from these shapes, and integers computed from them."""
    env = os.environ
    switches = (
        env.get("ZOO_FLASH_SM90"),
        env.get("ZOO_FLASH_SM90_BWD"),
        env.get("ZOO_FLASH_TMA"),
        torch.are_deterministic_algorithms_enabled(),
    )
    return op, scale, causal, switches, tensor_signature(tensors)


def _remember(key, route: str):
    if key is None:
        return
    if len(_ROUTES) >= MAX_LAUNCH_KEYS:  # a prefill per prompt length adds a signature each: start over
        _ROUTES.clear()
    _ROUTES[key] = route


# --------------------------------------------------------------------------------------------------------------
# Launchers: validate, allocate, pass strides
# --------------------------------------------------------------------------------------------------------------


def _check_head_dim(name: str, d: int):
    if not MIN_HEAD_DIM <= d <= MAX_HEAD_DIM:
        _checks.fail(name, f"head dim {d}", f"a head dim from {MIN_HEAD_DIM} to {MAX_HEAD_DIM}")


def _check_qkv(q, k, v, causal: bool, scale):
    """Validate the forward's inputs; returns (B, H_q, H_kv, S_q, S_kv, D_qk, D_v)."""
    _checks.check_rank("q", q, 4, "(B, H_q, S_q, D_qk)")
    _checks.check_rank("k", k, 4, "(B, H_kv, S_kv, D_qk)")
    _checks.check_rank("v", v, 4, "(B, H_kv, S_kv, D_v)")
    _checks.check_float("q", q)
    _checks.check_float("k", k, q, "q")
    _checks.check_float("v", v, q, "q")
    _checks.check_same_device({"q": q, "k": k, "v": v})
    if not isinstance(causal, bool):
        _checks.fail("causal", repr(causal), "True or False")
    b, h_q, s_q, d_qk = q.shape
    _, h_kv, s_kv, _ = k.shape
    d_v = v.shape[3]
    if k.shape[0] != b or k.shape[3] != d_qk:
        _checks.fail("k", f"shape {tuple(k.shape)}", f"(B={b}, H_kv, S_kv, D_qk={d_qk}) matching q")
    if tuple(v.shape[:3]) != tuple(k.shape[:3]):
        _checks.fail("v", f"shape {tuple(v.shape)}", f"(B, H_kv, S_kv) = {tuple(k.shape[:3])} matching k, then D_v")
    if h_kv == 0 or h_q % h_kv != 0:
        _checks.fail("k", f"H_kv={h_kv} for H_q={h_q}", "H_kv >= 1 dividing H_q (MHA, GQA or MQA)")
    if s_kv == 0:
        _checks.fail("k", "S_kv=0", "at least one key (S_kv >= 1)")
    if causal and s_q > s_kv:
        _checks.fail(
            "causal",
            f"True with S_q={s_q} > S_kv={s_kv}",
            "S_q <= S_kv (bottom-right alignment: query i sits at position S_kv - S_q + i)",
        )
    _check_head_dim("q", d_qk)
    _check_head_dim("v", d_v)
    if scale is not None:
        _checks.check_scale(scale, "None (1/sqrt(D_qk)) or a finite float > 0")
    return b, h_q, h_kv, s_q, s_kv, d_qk, d_v


def _check_backward(q, k, v, out, lse, do, causal: bool, scale):
    b, h_q, _, s_q, _, _, d_v = _check_qkv(q, k, v, causal, scale)
    for name, t in (("out", out), ("do", do)):
        _checks.check_rank(name, t, 4, "(B, H_q, S_q, D_v)")
        _checks.check_float(name, t, q, "q")
        if tuple(t.shape) != (b, h_q, s_q, d_v):
            _checks.fail(name, f"shape {tuple(t.shape)}", f"(B, H_q, S_q, D_v) = {(b, h_q, s_q, d_v)}")
    _checks.check_rank("lse", lse, 3, "(B, H_q, S_q)")
    if lse.dtype != torch.float32 or tuple(lse.shape) != (b, h_q, s_q):
        _checks.fail("lse", f"{lse.dtype} of shape {tuple(lse.shape)}", f"torch.float32 of shape {(b, h_q, s_q)}")
    _checks.check_same_device({"q": q, "out": out, "lse": lse, "do": do})


def _scale(scale, d_qk: int) -> float:
    return float(scale) if scale is not None else 1.0 / math.sqrt(d_qk)


def _empty_in_order(like: torch.Tensor, shape) -> torch.Tensor:
    """An empty (B, H, S, D) tensor in like's dtype whose first three dims lie in memory in the order of like's
    strides (largest first), D innermost. A model's q is a (B, S, H, D) projection seen as (B, H, S, D); the output
    and the gradients then come back in (B, S, H, D) memory, as SDPA's do, and the model's reshapes around the
    attention stay views instead of copies. Contiguous inputs give contiguous results."""
    st = like.stride()
    if st[0] >= st[1] >= st[2]:  # (B, H, S, D) memory; the two orders below cost the host 1-2 us instead of 14
        return torch.empty(shape, device=like.device, dtype=like.dtype)
    if st[0] >= st[2] > st[1]:  # (B, S, H, D) memory: the model's projections
        b, h, s, d = shape
        return torch.empty((b, s, h, d), device=like.device, dtype=like.dtype).transpose(1, 2)
    order = sorted(range(3), key=lambda i: (-st[i], i)) + [3]
    t = torch.empty([shape[i] for i in order], device=like.device, dtype=like.dtype)
    return t.permute([order.index(i) for i in range(4)])


def _grad_buffers(q, k, v) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return _empty_in_order(q, q.shape), _empty_in_order(k, k.shape), _empty_in_order(v, v.shape)


def _forward(q, k, v, scale: float | None, causal: bool, out=None, lse=None, checked: bool = False):
    """Launch the forward; `out` (B, H_q, S_q, D_v) and `lse` (B, H_q, S_q) fp32 may be passed preallocated
    (any strides), which the tests use to check that every element is written; else out is laid out like q
    (`_empty_in_order`). `checked`: the caller has validated the inputs (`_check_qkv`)."""
    key = _signature("fwd", scale, causal, q, k, v) if out is None and lse is None else None
    route = _ROUTES.get(key) if key is not None else None
    if route is None:
        if not checked:
            _check_qkv(q, k, v, causal, scale)
        route = _forward_route(q, k, v, causal)
        _remember(key, route)
    if route == "padded":
        return _forward_padded(q, k, v, scale, causal, out, lse)
    b, h_q, s_q, d_qk = q.shape
    h_kv, s_kv, d_v = k.shape[1], k.shape[2], v.shape[3]
    sm_scale = _scale(scale, d_qk)
    out = _empty_in_order(q, (b, h_q, s_q, d_v)) if out is None else out
    lse = torch.empty((b, h_q, s_q), device=q.device, dtype=torch.float32) if lse is None else lse
    if out.numel() == 0:
        return out, lse
    if route == "sm90":
        with device_guard(q):
            flash_sm90.forward(q, k, v, out, lse, sm_scale * LOG2E, causal, key=key)
        return out, lse
    use_tma = _use_tma(False, k, v)

    def launch(cfg):
        block_m, block_n, warps, stages = cfg
        n_m = cdiv(s_q, block_m)
        launcher(flash_fwd_kernel).keyed(key, (n_m * h_q * b,))(
            q,
            k,
            v,
            out,
            lse,
            *q.stride(),
            *k.stride(),
            *v.stride(),
            *out.stride(),
            *lse.stride(),
            s_q,
            s_kv,
            h_q,
            bucket_size(n_m, h_q // h_kv, causal),
            sm_scale * LOG2E,
            D_QK=d_qk,
            D_V=d_v,
            **_qk_blocks(d_qk),
            BLOCK_DV=_head_block(d_v),
            GROUP_SIZE=h_q // h_kv,
            CAUSAL=causal,
            PRECISION=_precision(q.dtype),
            INTERPRET=_checks.interpreting(),
            BLOCK_M=block_m,
            BLOCK_N=block_n,
            USE_TMA=use_tma,
            num_warps=warps,
            num_stages=stages,
        )

    with device_guard(q):
        cfg = _pick_config("fwd", q, d_qk, d_v, causal, s_q, s_kv, use_tma, launch)
        launch(cfg)
    return out, lse


def _forward_route(q, k, v, causal: bool) -> str:
    """Which kernel a forward of valid inputs takes: "padded" (a head dim off the kernels' multiple), "sm90" (on
    Hopper, fp16/bf16, D = 64 or 128 or MLA's 192/128 and 96/64: the warp-specialized Gluon kernel, flash_sm90.py)
    or "triton"."""
    if _needs_padding(q, v):
        return "padded"
    return "sm90" if flash_sm90 is not None and flash_sm90.supports(q, k, v, causal) else "triton"


def _kernel_head_dim(d: int) -> int:
    """The head dim a kernel launch takes for a true head dim d: the next multiple of KERNEL_HEAD_DIM_MULTIPLE."""
    return cdiv(d, KERNEL_HEAD_DIM_MULTIPLE) * KERNEL_HEAD_DIM_MULTIPLE


def _needs_padding(q: torch.Tensor, v: torch.Tensor) -> bool:
    return q.shape[3] % KERNEL_HEAD_DIM_MULTIPLE != 0 or v.shape[3] % KERNEL_HEAD_DIM_MULTIPLE != 0


def _pad_head_dim(x: torch.Tensor, d: int) -> torch.Tensor:
    """x (B, H, S, D) with zero columns appended to its head dim up to d, in x's memory order (`_empty_in_order`,
    so the kernels see the strides they would see without padding)."""
    if x.shape[3] == d:
        return x
    padded = _empty_in_order(x, (*x.shape[:3], d))
    padded[..., x.shape[3] :].zero_()
    padded[..., : x.shape[3]].copy_(x)
    return padded


def _forward_padded(q, k, v, scale: float | None, causal: bool, out=None, lse=None):
    """The forward at head dims that are not multiples of KERNEL_HEAD_DIM_MULTIPLE: Q and K zero-padded to the next
    one (zero columns add nothing to Q K^T, and the softmax scale stays that of the true D_qk), V too (P times V's
    zero columns is zero), and the output's padding columns dropped. out and lse as `_forward`'s."""
    d_qk, d_v = q.shape[3], v.shape[3]
    d_qk_kernel, d_v_kernel = _kernel_head_dim(d_qk), _kernel_head_dim(d_v)
    out_padded, lse = _forward(
        _pad_head_dim(q, d_qk_kernel),
        _pad_head_dim(k, d_qk_kernel),
        _pad_head_dim(v, d_v_kernel),
        _scale(scale, d_qk),
        causal,
        lse=lse,
        checked=True,
    )
    out = _empty_in_order(q, (*q.shape[:3], d_v)) if out is None else out
    out.copy_(out_padded[..., :d_v])
    return out, lse


def _backward_padded(q, k, v, out, lse, do, scale: float | None, causal: bool, dlse, grads, head_splits):
    """The backward at head dims that are not multiples of KERNEL_HEAD_DIM_MULTIPLE, on inputs padded as
    `_forward_padded` pads them (out and dO get zero columns as V's, which add nothing to delta = rowsum(dO * Out)).
    The padding columns of dQ, dK and dV (zero) are dropped; grads as `_backward`'s."""
    d_qk, d_v = q.shape[3], v.shape[3]
    d_qk_kernel, d_v_kernel = _kernel_head_dim(d_qk), _kernel_head_dim(d_v)
    padded = _backward(
        _pad_head_dim(q, d_qk_kernel),
        _pad_head_dim(k, d_qk_kernel),
        _pad_head_dim(v, d_v_kernel),
        _pad_head_dim(out, d_v_kernel),
        lse,
        _pad_head_dim(do, d_v_kernel),
        _scale(scale, d_qk),
        causal,
        dlse=dlse,
        head_splits=head_splits,
        checked=True,
    )
    grads = _grad_buffers(q, k, v) if grads is None else grads
    for grad, grad_padded in zip(grads, padded):
        grad.copy_(grad_padded[..., : grad.shape[3]])
    return grads


def _head_splits(programs: int, group: int, device: torch.device) -> int:
    """Into how many shares the dK/dV kernel cuts a KV group's query heads. One (each program sums the whole group,
    no partial buffers) unless the launch has fewer than two programs per SM: then enough shares to reach that,
    each program summing about group / shares heads into an fp32 partial. MQA at B8 S1k H_q12: 64 programs for 132
    SMs, four shares of three heads. The partials are at most 2 * SMs / programs times the KV gradient, and only
    where the whole launch is small; the group size alone never multiplies the memory."""
    sms = num_sms(device)
    if group == 1 or programs >= 2 * sms:
        return 1
    per_split = cdiv(group, min(group, cdiv(2 * sms, programs)))
    return cdiv(group, per_split)


def _hopper_dkdv(programs: int, group: int, device: torch.device, s_kv: int) -> bool:
    """Does the Hopper dK/dV kernel (one program per 128 keys of a KV head, summing its whole group) take this
    launch, or the Triton kernel, which shares a group's heads among programs (`_head_splits`)? The Hopper one for
    MHA, wherever its programs fill one wave of the SMs, and from SMs - SMs / 16 programs (124 of 132: a wave with
    a few SMs idle) for keys of at most 1024: where it measured faster on an H200, the whole backward on the GPU
    alone (benchmarks/RESULTS.md). With fewer programs, or a long causal diagonal that one program per SM cannot
    balance, the Triton kernel's head shares fill the GPU better."""
    sms = num_sms(device)
    if group == 1 or programs >= sms:
        return True
    return programs >= sms - sms // 16 and s_kv <= 1024


def _backward(
    q,
    k,
    v,
    out,
    lse,
    do,
    scale: float | None,
    causal: bool,
    dlse=None,
    grads=None,
    head_splits=None,
    checked: bool = False,
):
    """Launch dQ (which also writes delta), then dK/dV; or, on Hopper at D = 128 and 64 where it measured faster,
    the one-launch backward (`flash_sm90.backward_fused`). `grads` = (dq, dk, dv) may be preallocated (any strides;
    else each is laid out like its input, `_empty_in_order`);
    `head_splits` forces the dK/dV kernel's share count (tests), else `_head_splits` picks it. `checked`: the
    inputs are known valid (autograd: the forward checked q, k, v and made out and lse, and the engine gives do
    out's shape, dtype and device)."""
    key = (
        _signature("bwd", scale, causal, q, k, v, out, lse, do, dlse) if grads is None and head_splits is None else None
    )
    route = _ROUTES.get(key) if key is not None else None
    if route is None:
        if not checked:
            _check_backward(q, k, v, out, lse, do, causal, scale)
        route = _backward_route(q, k, v, do, causal, head_splits)
        _remember(key, route)
    if route == "padded":
        return _backward_padded(q, k, v, out, lse, do, scale, causal, dlse, grads, head_splits)
    b, h_q, s_q, d_qk = q.shape
    sm_scale = _scale(scale, d_qk)
    dq, dk, dv = _grad_buffers(q, k, v) if grads is None else grads
    if s_q == 0 or b == 0 or h_q == 0:
        return dq, dk.zero_(), dv.zero_()
    if route == "fused":
        with device_guard(q):
            flash_sm90.backward_fused(q, k, v, out, lse, do, dlse, dq, dk, dv, sm_scale, causal, key=key)
        return dq, dk, dv
    # The Hopper dK/dV kernel reads delta and the lse (in log2 units, written by the dQ kernel) as whole padded
    # blocks of rows (flash_sm90.padded_rows); the Triton one reads delta (B, H_q, S_q).
    sm90_dkdv = route == "sm90"
    rows = flash_sm90.padded_rows(s_q) if sm90_dkdv else s_q
    delta = torch.empty((b, h_q, rows), device=q.device, dtype=torch.float32)
    lse2 = torch.empty_like(delta) if sm90_dkdv else None
    with device_guard(q):
        if route in ("sm90", "sm90_dq"):
            flash_sm90.backward_dq(q, k, v, out, do, lse, dlse, delta, dq, sm_scale, causal, lse2=lse2, key=key)
        else:
            _triton_dq(q, k, v, out, lse, do, dlse, delta, dq, sm_scale, causal, key)
        if sm90_dkdv:
            flash_sm90.backward_dkdv(q, k, v, do, lse2, delta, dk, dv, sm_scale, causal, key=key)
        else:
            _triton_dkdv(q, k, v, lse, do, delta, dk, dv, sm_scale, causal, head_splits, key)
    return dq, dk, dv


def _backward_route(q, k, v, do, causal: bool, head_splits) -> str:
    """Which kernels a backward of valid inputs takes: "padded" (a head dim off the kernels' multiple), "fused"
    (`flash_sm90.backward_fused`), "sm90" (dQ and dK/dV in the Gluon kernels), "sm90_dq" (dQ in the Gluon kernel,
    dK/dV in the Triton one) or "triton".

    On Hopper, fp16/bf16, D = 64 or 128 or MLA's 96/64 and 192/128 (ZOO_FLASH_SM90_BWD, see
    flash_sm90.backward_mode): at D = 128 and 64 the whole backward in one launch where
    flash_sm90.fused_backward_wins ("fused": wherever it can; not under torch.use_deterministic_algorithms, since
    its dQ sums the key blocks in the order they finish); else dQ and delta in the Gluon kernel, and dK/dV too (for
    the pairs of flash_sm90.BWD_CONFIGS) when its programs (128 keys each) fill about a wave of the SMs
    (`_hopper_dkdv`), else the Triton kernel, which can split a KV group's heads over programs ("force": the Gluon
    kernel regardless). A forced `head_splits` (tests) keeps the whole backward on the Triton kernels."""
    if _needs_padding(q, v):
        return "padded"
    b, h_q, _, d_qk = q.shape
    h_kv, s_kv = k.shape[1], k.shape[2]
    mode = flash_sm90.backward_mode() if flash_sm90 is not None and head_splits is None else "0"
    if mode == "0" or not flash_sm90.supports_backward(q, k, v, do):
        return "triton"
    pair = (d_qk, v.shape[3])
    programs = cdiv(s_kv, flash_sm90.PROGRAM_ROWS) * h_kv * b
    if pair in flash_sm90.FUSED_PAIRS and (
        mode == "fused"
        or mode == "1"
        and flash_sm90.fused_backward_wins(*pair, causal, s_kv, h_q // h_kv, programs, num_sms(q.device))
        and not torch.are_deterministic_algorithms_enabled()
    ):
        return "fused"
    if pair in flash_sm90.BWD_CONFIGS and (
        mode in ("force", "fused") or _hopper_dkdv(programs, h_q // h_kv, q.device, s_kv)
    ):
        return "sm90"
    return "sm90_dq"


def _backward_constants(q, k, v, causal: bool) -> dict:
    d_qk, d_v = q.shape[3], v.shape[3]
    return dict(
        D_QK=d_qk,
        D_V=d_v,
        **_qk_blocks(d_qk),
        BLOCK_DV=_head_block(d_v),
        GROUP_SIZE=q.shape[1] // k.shape[1],
        CAUSAL=causal,
        PRECISION=_precision(q.dtype),
        INTERPRET=_checks.interpreting(),
    )


def _triton_dq(q, k, v, out, lse, do, dlse, delta, dq, sm_scale: float, causal: bool, key=None):
    """dQ and delta (B, H_q, S_q) in the Triton kernel, its config picked (and on the GPU timed) once per bucket."""
    b, h_q, s_q, d_qk = q.shape
    h_kv, s_kv, d_v = k.shape[1], k.shape[2], v.shape[3]
    use_tma = _use_tma(True, k, v)  # K and V stream through its loop
    dlse_arg = dlse if dlse is not None else lse  # a placeholder without an lse gradient (HAS_DLSE=False: unread)

    def launch(cfg):
        block_m, block_n, warps, stages = cfg
        n_m = cdiv(s_q, block_m)
        launcher(flash_bwd_dq_kernel).keyed(key, (n_m * h_q * b,))(
            q,
            k,
            v,
            do,
            lse,
            delta,
            dq,
            out,
            dlse_arg,
            *q.stride(),
            *k.stride(),
            *v.stride(),
            *do.stride(),
            *lse.stride(),
            *dq.stride(),
            *out.stride(),
            *dlse_arg.stride(),
            s_q,
            s_kv,
            h_q,
            bucket_size(n_m, h_q // h_kv, causal),
            sm_scale,
            sm_scale * LOG2E,
            **_backward_constants(q, k, v, causal),
            BLOCK_M=block_m,
            BLOCK_N=block_n,
            USE_TMA=use_tma,
            HAS_DLSE=dlse is not None,
            num_warps=warps,
            num_stages=stages,
        )

    launch(_pick_config("dq", q, d_qk, d_v, causal, s_q, s_kv, use_tma, launch))


def _triton_dkdv(q, k, v, lse, do, delta, dk, dv, sm_scale: float, causal: bool, head_splits=None, key=None):
    """dK and dV in the Triton kernel, a KV group's query heads split over `head_splits` (else `_head_splits`)
    programs that sum into fp32 partials when the launch alone would not fill the GPU."""
    b, h_q, s_q, d_qk = q.shape
    h_kv, s_kv, d_v = k.shape[1], k.shape[2], v.shape[3]
    use_tma = _use_tma(True, q, do)  # Q and dO stream through its loop

    def launch(cfg):
        block_m, block_n, warps, stages = cfg
        splits = head_splits or _head_splits(cdiv(s_kv, block_n) * h_kv * b, h_q // h_kv, q.device)
        dk_out, dv_out = dk, dv
        if splits > 1:  # fp32 partials, one per share of the group's heads: (B, H_kv * splits, S_kv, D)
            dk_out = torch.empty((b, h_kv * splits, s_kv, d_qk), device=q.device, dtype=torch.float32)
            dv_out = torch.empty((b, h_kv * splits, s_kv, d_v), device=q.device, dtype=torch.float32)
        n_kb = cdiv(s_kv, block_n)
        launcher(flash_bwd_dkdv_kernel).keyed(key, (n_kb * h_kv * splits * b,))(
            q,
            k,
            v,
            do,
            lse,
            delta,
            dk_out,
            dv_out,
            *q.stride(),
            *k.stride(),
            *v.stride(),
            *do.stride(),
            *lse.stride(),
            *dk_out.stride(),
            *dv_out.stride(),
            s_q,
            s_kv,
            h_q,
            bucket_size(n_kb, h_q // h_kv, causal),
            sm_scale,
            sm_scale * LOG2E,
            **_backward_constants(q, k, v, causal),
            BLOCK_M=block_m,
            BLOCK_N=block_n,
            USE_TMA=use_tma,
            HEAD_SPLITS=splits,
            num_warps=warps,
            num_stages=stages,
        )
        if splits > 1:
            dk.copy_(dk_out.view(b, h_kv, splits, s_kv, d_qk).sum(2))
            dv.copy_(dv_out.view(b, h_kv, splits, s_kv, d_v).sum(2))

    launch(_pick_config("dkdv", q, d_qk, d_v, causal, s_q, s_kv, use_tma, launch))


# --------------------------------------------------------------------------------------------------------------
# Custom ops (traceable by torch.compile with fullgraph=True), their autograd, and the eager autograd.Function
# --------------------------------------------------------------------------------------------------------------


@torch.library.custom_op("zoo::flash_fwd", mutates_args=())
def _flash_fwd_op(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, causal: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    return _forward(q, k, v, scale, causal)


@_flash_fwd_op.register_fake
def _(q, k, v, scale, causal):
    b, h_q, _, s_q, _, _, d_v = _check_qkv(q, k, v, causal, scale)
    return _empty_in_order(q, (b, h_q, s_q, d_v)), q.new_empty((b, h_q, s_q), dtype=torch.float32)


@torch.library.custom_op("zoo::flash_bwd", mutates_args=())
def _flash_bwd_op(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    do: torch.Tensor,
    dlse: torch.Tensor | None,
    scale: float,
    causal: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return _backward(q, k, v, out, lse, do, scale, causal, dlse=dlse)


@_flash_bwd_op.register_fake
def _(q, k, v, out, lse, do, dlse, scale, causal):
    _check_backward(q, k, v, out, lse, do, causal, scale)
    return _grad_buffers(q, k, v)


def _setup_context(ctx, inputs, output):
    q, k, v, scale, causal = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse)
    ctx.scale, ctx.causal = scale, causal
    # An unused output's gradient stays None instead of a zero tensor: the usual loss never touches lse, and then
    # the dQ kernel's delta skips reading it.
    ctx.set_materialize_grads(False)


def _grads(ctx, d_out, d_lse, backward):
    """The gradients of (q, k, v, scale, causal) from the saved tensors, through `backward` (the custom op, or the
    launcher directly on the eager path)."""
    q, k, v, out, lse = ctx.saved_tensors
    if d_out is None:
        d_out = torch.zeros_like(out)
    dq, dk, dv = backward(q, k, v, out, lse, d_out, d_lse, ctx.scale, ctx.causal)
    return dq, dk, dv, None, None


def _flash_fwd_backward(ctx, d_out, d_lse):
    return _grads(ctx, d_out, d_lse, _flash_bwd_op)


def _eager_backward(q, k, v, out, lse, do, dlse, scale, causal):
    return _backward(q, k, v, out, lse, do, scale, causal, dlse=dlse, checked=True)


_flash_fwd_op.register_autograd(_flash_fwd_backward, setup_context=_setup_context)


class _FlashAttention(torch.autograd.Function):
    """The eager path: the same launchers and autograd as the custom ops, without the custom-op dispatch. A small
    launch is bound by CPU time, not the GPU, and the custom op's dispatch measured about a quarter of a small
    forward's host time on an H200 host (benchmarks/RESULTS.md). torch.compile traces the custom ops instead."""

    @staticmethod
    def forward(ctx, q, k, v, scale, causal):
        out, lse = _forward(q, k, v, scale, causal, checked=True)  # flash_gqa_forward checked them
        _setup_context(ctx, (q, k, v, scale, causal), (out, lse))
        return out, lse

    @staticmethod
    def backward(ctx, d_out, d_lse):
        return _grads(ctx, d_out, d_lse, _eager_backward)


# --------------------------------------------------------------------------------------------------------------
# Public API
# --------------------------------------------------------------------------------------------------------------


def flash_gqa_forward(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, scale: float | None = None, causal: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """Flash attention forward for MHA/GQA/MQA. q (B, H_q, S_q, D_qk), k (B, H_kv, S_kv, D_qk),
    v (B, H_kv, S_kv, D_v), any strides, head dims from 1 to 256. Returns out (B, H_q, S_q, D_v) in q's dtype and
    lse (B, H_q, S_q) fp32 (natural log). Differentiable in both outputs."""
    if torch.compiler.is_compiling():
        _check_qkv(q, k, v, causal, scale)
        return _flash_fwd_op(q, k, v, _scale(scale, q.shape[-1]), causal)
    if not (isinstance(q, torch.Tensor) and isinstance(k, torch.Tensor) and isinstance(v, torch.Tensor)):
        _check_qkv(q, k, v, causal, scale)  # names the argument that is no tensor, before anything reads it
    if not (torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad)):
        # Nothing to differentiate (inference, a generation's prefill): the launcher alone, without the autograd
        # Function around it, which doubled a small call's host time. It checks a signature's first call (its route).
        return _forward(q, k, v, scale, causal)
    _check_qkv(q, k, v, causal, scale)
    return _FlashAttention.apply(q, k, v, _scale(scale, q.shape[-1]), causal)


def flash_gqa_backward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    do: torch.Tensor,
    *,
    scale: float | None = None,
    causal: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients (dq, dk, dv) of flash attention given the forward's out and lse and the output gradient do.
    dk and dv are summed over the query heads of each KV group."""
    _check_backward(q, k, v, out, lse, do, causal, scale)
    if torch.compiler.is_compiling():
        return _flash_bwd_op(q, k, v, out, lse, do, None, _scale(scale, q.shape[-1]), causal)
    return _backward(q, k, v, out, lse, do, _scale(scale, q.shape[-1]), causal)


def flash_gqa_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, scale: float | None = None, causal: bool = False
) -> torch.Tensor:
    """Differentiable flash attention (MHA/GQA/MQA, D_qk may differ from D_v, bottom-right causal alignment).
    Returns out (B, H_q, S_q, D_v)."""
    return flash_gqa_forward(q, k, v, scale=scale, causal=causal)[0]
