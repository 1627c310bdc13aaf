"""flash_gqa_attention / flash_gqa_forward / flash_gqa_backward against attention_kernels.reference.attention_reference.

Forward (out, lse) and backward (dq, dk, dv) on shapes that are not powers of two, MHA/GQA/MQA, D_qk != D_v,
causal and not, S_q < S_kv (bottom-right causal alignment over a cached prefix), non-contiguous inputs; outputs
are poisoned with NaN first so an unwritten element fails. Runs on the CPU (TRITON_INTERPRET=1, fp32/fp16) and on
the GPU (fp16/bf16): the same tests, the dtypes each machine computes right (conftest.KERNEL_DTYPES).
"""

import itertools
import math
import re

import pytest
import torch
import triton
import triton.language as tl
from conftest import (
    DEVICE,
    DTYPE_IDS,
    KERNEL_DTYPES,
    assert_close,
    compile_gluon_sm90,
    setmaxnreg_counts,
    spill_bytes,
)

from attention_kernels import flash_gqa_attention, flash_gqa_backward, flash_gqa_forward
from attention_kernels.flash import _backward, _forward
from attention_kernels.reference import attention_reference
from attention_kernels.schedule import bucket_size, ranked

# (B, H_q, H_kv, S_q, S_kv, D_qk, D_v, causal). Every S in {1, 17, 63, 65, 130}, D in {32, 48, 64, 80, 128},
# group sizes 1, 2, 3, 4 and MQA, D_qk != D_v (MLA's 192/128 included), S_q < S_kv, causal and not appear.
CASES = [
    (2, 4, 4, 1, 1, 32, 32, False),
    (1, 4, 2, 17, 17, 48, 48, True),
    (2, 6, 2, 63, 63, 80, 80, True),
    (1, 8, 2, 65, 65, 64, 64, False),
    (1, 4, 1, 130, 130, 128, 128, True),
    (1, 4, 4, 130, 130, 32, 32, False),
    (2, 4, 2, 17, 63, 64, 64, True),
    (1, 2, 1, 1, 65, 80, 80, True),
    (1, 4, 2, 63, 130, 48, 48, False),
    (1, 4, 1, 65, 65, 192, 128, True),
    (1, 2, 2, 17, 17, 64, 32, False),
    (1, 3, 3, 130, 130, 80, 80, True),
    (1, 4, 4, 64, 64, 64, 64, True),
    (1, 4, 4, 65, 130, 128, 64, True),
    (1, 2, 1, 130, 130, 16, 16, False),
    (1, 4, 2, 63, 63, 256, 256, True),
    # D = 128 runs through the Hopper kernel (flash_sm90) on an H100/H200: several query tiles, a partial one, more
    # key blocks than its ring has stages, the causal diagonal inside the sequence, S_q < S_kv.
    (1, 4, 2, 200, 520, 128, 128, True),
    (1, 2, 1, 130, 600, 128, 128, False),
    # Group 8, causal: the launch order puts every pair's heaviest blocks first (attention_kernels/schedule.py,
    # buckets of one).
    (1, 8, 1, 130, 130, 128, 128, True),
]


def case_id(case) -> str:
    b, h_q, h_kv, s_q, s_kv, d_qk, d_v, causal = case
    s = f"S{s_q}" if s_q == s_kv else f"Sq{s_q}-Skv{s_kv}"
    d = f"D{d_qk}" if d_qk == d_v else f"D{d_qk}x{d_v}"
    return f"B{b}-Hq{h_q}-Hkv{h_kv}-{s}-{d}" + ("-causal" if causal else "")


def make_inputs(case, dtype):
    b, h_q, h_kv, s_q, s_kv, d_qk, d_v, _ = case
    q = torch.randn(b, h_q, s_q, d_qk, device=DEVICE, dtype=dtype)
    k = torch.randn(b, h_kv, s_kv, d_qk, device=DEVICE, dtype=dtype)
    v = torch.randn(b, h_kv, s_kv, d_v, device=DEVICE, dtype=dtype)
    do = torch.randn(b, h_q, s_q, d_v, device=DEVICE, dtype=dtype)
    return q, k, v, do


def reference_grads(q, k, v, do, causal, scale=None, dlse=None):
    """Reference out, lse and the gradients of sum(out * do) (+ sum(lse * dlse)) in fp32."""
    q32, k32, v32 = (x.detach().float().requires_grad_() for x in (q, k, v))
    out, lse = attention_reference(q32, k32, v32, scale=scale, causal=causal)
    loss = (out * do.float()).sum()
    if dlse is not None:
        loss = loss + (lse * dlse.float()).sum()
    loss.backward()
    return out.detach(), lse.detach(), q32.grad, k32.grad, v32.grad


def poisoned(shape, dtype):
    return torch.full(shape, float("nan"), device=DEVICE, dtype=dtype)


@pytest.mark.parametrize("dtype", KERNEL_DTYPES, ids=DTYPE_IDS.get)
@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_forward_backward_matches_reference(case, dtype):
    """Launchers write into NaN-poisoned buffers: every element of out, lse, dq, dk, dv must be written."""
    check_forward_backward(case, dtype)


def check_forward_backward(case, dtype):
    """_forward and _backward of `case` into NaN-poisoned buffers against the fp32 reference."""
    causal = case[-1]
    q, k, v, do = make_inputs(case, dtype)
    out, lse = _forward(q, k, v, None, causal, out=poisoned(do.shape, dtype), lse=poisoned(do.shape[:3], torch.float32))
    grads = tuple(poisoned(x.shape, dtype) for x in (q, k, v))
    dq, dk, dv = _backward(q, k, v, out, lse, do, None, causal, grads=grads)
    ref_out, ref_lse, ref_dq, ref_dk, ref_dv = reference_grads(q, k, v, do, causal)
    assert_close(out, ref_out, dtype, "out")
    assert_close(lse, ref_lse, dtype, "lse")
    assert_close(dq, ref_dq, dtype, "dq", grad=True)
    assert_close(dk, ref_dk, dtype, "dk", grad=True)
    assert_close(dv, ref_dv, dtype, "dv", grad=True)


@triton.jit
def _ranked_probe(out_ptr, n_r, n_pairs, bucket):
    r, pair = ranked(tl.program_id(0), n_r, n_pairs, bucket)
    tl.store(out_ptr + 2 * tl.program_id(0), r)
    tl.store(out_ptr + 2 * tl.program_id(0) + 1, pair)


LAUNCH_ORDERS = [(8, 3, 8), (8, 3, 1), (7, 5, 2), (32, 4, 3), (5, 6, 8)]


@pytest.mark.parametrize(
    "n_r,n_pairs,bucket", LAUNCH_ORDERS, ids=["ranks{}-pairs{}-bucket{}".format(*c) for c in LAUNCH_ORDERS]
)
def test_launch_order(n_r, n_pairs, bucket):
    """schedule.ranked numbers every (rank, pair) once; buckets of ranks in increasing order, each pair's ranks of
    a bucket side by side; one bucket of n_r (or more) is the plain rank-fastest order."""
    got = torch.full((n_r * n_pairs, 2), -1, device=DEVICE, dtype=torch.int32)
    _ranked_probe[(n_r * n_pairs,)](got, n_r, n_pairs, bucket)
    order = [tuple(x) for x in got.tolist()]
    assert sorted(order) == [(r, p) for r in range(n_r) for p in range(n_pairs)], "not a permutation"
    buckets = [r // bucket for r, _ in order]
    assert buckets == sorted(buckets), "buckets out of order"
    for i in range(1, len(order)):  # inside a bucket: pair-major, rank fastest
        (r0, p0), (r1, p1) = order[i - 1], order[i]
        if r0 // bucket == r1 // bucket:
            assert (p1, r1) > (p0, r0), (i, order[i - 1], order[i])
    if bucket >= n_r:
        assert order == [(r, p) for p in range(n_pairs) for r in range(n_r)]


def test_launch_bucket_rule():
    """Full attention and MHA keep one bucket; a KV group of g heads gets buckets of 8 // g ranks, at most n_r."""
    assert bucket_size(10, 4, causal=False) == 10
    assert [bucket_size(10, g, causal=True) for g in (1, 2, 4, 8, 16)] == [10, 4, 2, 1, 1]
    assert bucket_size(3, 2, causal=True) == 3


def test_qk_head_dim_tiling():
    """The Q/K head dim is tiled as one power-of-two block, or as two when that pads less (MLA's 192 = 128 + 64):
    for every head dim the blocks cover every column, are powers of two from 16, and never pad more than the
    one block would."""
    from attention_kernels.flash import _head_block, _qk_blocks

    assert _qk_blocks(192) == dict(BLOCK_DK=128, BLOCK_DK2=64, SPLIT_DK=True)
    for d_qk in range(16, 257):
        blocks = _qk_blocks(d_qk)
        first, second, split = blocks["BLOCK_DK"], blocks["BLOCK_DK2"], blocks["SPLIT_DK"]
        width = first + second if split else first
        assert all(b >= 16 and b & (b - 1) == 0 for b in (first, second)), (d_qk, blocks)
        assert d_qk <= width <= _head_block(d_qk), (d_qk, blocks)
        assert split == (width < _head_block(d_qk)), (d_qk, blocks, "two blocks only when they pad less")
        assert not split or first < d_qk, (d_qk, blocks, "the second block must hold columns")


def spy_hopper(monkeypatch, *names: str) -> list[str]:
    """The names (of `names`, flash_sm90's launchers) that flash.py calls from now on, in order; none where
    flash_sm90 did not import."""
    from attention_kernels import flash

    ran, hopper = [], flash.flash_sm90
    for name in names if hopper is not None else ():
        fn = getattr(hopper, name)
        monkeypatch.setattr(hopper, name, lambda *a, _fn=fn, _name=name, **kw: ran.append(_name) or _fn(*a, **kw))
    return ran


def on_hopper(t: torch.Tensor) -> bool:
    """Do flash.py's Hopper kernels run on t's device (an H100/H200 with the Triton they were verified against)?"""
    from attention_kernels import flash

    return flash.flash_sm90 is not None and flash.flash_sm90.on_hopper(t)


@pytest.mark.parametrize("tma", ["0", "1"], ids=["pointers", "descriptors"])
@pytest.mark.parametrize("case", [CASES[2], CASES[7], CASES[9]], ids=case_id)
def test_pointer_and_descriptor_paths(case, tma, monkeypatch):
    """Both ways the loops can stream tiles: plain pointers with masks, and TMA tensor descriptors (zero-filled
    out of bounds). The GPU picks descriptors for the backward on Hopper by itself; ZOO_FLASH_TMA=1 forces them,
    also under the interpreter, and ZOO_FLASH_TMA=0 forces pointers. A spy on `flash._use_tma` checks that every
    Triton kernel launched (the forward, dQ and dK/dV; on an H100/H200 those the Hopper kernels leave to Triton:
    the 192/128 case's one-program dK/dV) took the path asked for."""
    from attention_kernels import flash

    monkeypatch.setenv("ZOO_FLASH_TMA", tma)
    use_tma = flash._use_tma
    took = []  # _use_tma's answer per Triton launch
    monkeypatch.setattr(flash, "_use_tma", lambda *a: took.append(use_tma(*a)) or took[-1])
    dtype = KERNEL_DTYPES[-1]
    causal = case[-1]
    q, k, v, do = make_inputs(case, dtype)
    out, lse = _forward(q, k, v, None, causal, out=poisoned(do.shape, dtype), lse=poisoned(do.shape[:3], torch.float32))
    grads = tuple(poisoned(x.shape, dtype) for x in (q, k, v))
    got = (out, lse, *_backward(q, k, v, out, lse, do, None, causal, grads=grads))
    for name, g, want in zip(("out", "lse", "dq", "dk", "dv"), got, reference_grads(q, k, v, do, causal)):
        assert_close(g, want, dtype, name, grad=name.startswith("d"))
    assert took and all(t == (tma == "1") for t in took), f"ZOO_FLASH_TMA={tma}: _use_tma answered {took}"


@pytest.mark.parametrize("head_splits", [2, 3], ids=lambda n: f"splits{n}")
@pytest.mark.parametrize("case", [CASES[2], CASES[4], CASES[9]], ids=case_id)
def test_dkdv_head_splits(case, head_splits):
    """The dK/dV kernel with a KV group's query heads shared out among programs (what a launch too small to fill
    the GPU gets, e.g. MQA): group 3 in shares of 2 + 1 or 1 + 1 + 1, group 4 in 2 + 2 or 2 + 2 + 0 (an empty
    share writes a zero partial). The fp32 partials sum to the same gradients."""
    dtype = KERNEL_DTYPES[-1]
    causal = case[-1]
    q, k, v, do = make_inputs(case, dtype)
    out, lse = _forward(q, k, v, None, causal)
    grads = tuple(poisoned(x.shape, dtype) for x in (q, k, v))
    dq, dk, dv = _backward(q, k, v, out, lse, do, None, causal, grads=grads, head_splits=head_splits)
    _, _, ref_dq, ref_dk, ref_dv = reference_grads(q, k, v, do, causal)
    assert_close(dq, ref_dq, dtype, "dq", grad=True)
    assert_close(dk, ref_dk, dtype, "dk", grad=True)
    assert_close(dv, ref_dv, dtype, "dv", grad=True)


def test_head_splits_rule(monkeypatch):
    """Shares only when the dK/dV launch has fewer than two programs per SM, never more than the group, and about
    the fewest that reach two programs per SM."""
    from attention_kernels import flash

    monkeypatch.setattr(flash, "num_sms", lambda device: 132)
    cuda = torch.device("cuda")
    assert flash._head_splits(64, 1, cuda) == 1  # MHA: nothing to share
    assert flash._head_splits(264, 12, cuda) == 1  # two programs per SM already
    assert flash._head_splits(64, 12, cuda) == 4  # MQA B8 S1k (BLOCK_N 128): 4 shares of 3 heads -> 256 programs
    assert flash._head_splits(8, 4, cuda) == 4  # capped at the group
    assert flash._head_splits(100, 3, cuda) == 3


def test_config_tuner_picks_the_fastest_that_fits(monkeypatch):
    """The tuner skips a config that does not fit the GPU, times the others in two alternating rounds and keeps each
    one's faster time (a config slowed once by noise is not lost), picks the fastest and caches it per bucket."""
    from attention_kernels import flash

    monkeypatch.setattr(flash._checks, "interpreting", lambda: False)  # as on a GPU: the tuner runs
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    monkeypatch.setattr(flash, "_TUNED", {})
    candidates = flash._CONFIGS["dkdv"][64]
    too_big, noisy, steady = candidates[0], candidates[1], candidates[2]
    times = {noisy: [9.0, 1.0], steady: [2.0, 2.0]}  # ms per round; every other config 5
    launched = []

    def launch(cfg):
        if cfg == too_big:
            raise flash._RESOURCE_ERRORS[0](232448, 227 * 1024, "shared memory")  # (required, limit, name)
        launched.append(cfg)

    def fake_gpu_ms(fn):
        fn()
        cfg = launched[-1]
        return times[cfg].pop(0) if cfg in times else 5.0

    monkeypatch.setattr(flash, "_gpu_ms", fake_gpu_ms)
    q = torch.empty(1, 4, 1024, 64, dtype=torch.bfloat16)
    assert flash._pick_config("dkdv", q, 64, 64, True, 1024, 1024, False, launch) == noisy
    assert flash._pick_config("dkdv", q, 64, 64, True, 1000, 1000, False, launch) == noisy  # same bucket: cached
    assert too_big not in launched and launched.count(noisy) == 3  # compiled once, timed twice


@pytest.mark.gpu
@pytest.mark.skipif(DEVICE != "cuda", reason="times GPU work; the tuner never times under the interpreter")
def test_gpu_ms_times_the_gpu_alone():
    """_gpu_ms of a call that keeps the GPU busy for about 1 ms reads about 1 ms."""
    from attention_kernels import flash

    ms = flash._gpu_ms(lambda: torch.cuda._sleep(2_000_000))  # 2e6 cycles: 1.0-1.3 ms at an H200's 1.5-2 GHz
    assert 0.5 < ms < 2.5, ms


def test_hopper_dkdv_rule(monkeypatch):
    """The Hopper dK/dV kernel takes MHA at any size, a GQA/MQA launch from one wave of programs up, and from 124
    programs (of 132 SMs) keys of at most 1024 (fewer go to the Triton kernel, which shares the group's heads:
    `_head_splits`)."""
    from attention_kernels import flash

    monkeypatch.setattr(flash, "num_sms", lambda device: 132)
    cuda = torch.device("cuda")
    assert flash._hopper_dkdv(16, 1, cuda, 4096)  # MHA: no heads to share
    assert flash._hopper_dkdv(256, 3, cuda, 1024)  # GPT-2-small GQA, B8 H_q12 H_kv4 S1k: 256 programs
    assert flash._hopper_dkdv(132, 8, cuda, 4096)
    assert not flash._hopper_dkdv(131, 8, cuda, 4096)
    assert not flash._hopper_dkdv(64, 12, cuda, 1024)  # GPT-2-small MQA: 64 programs, the Triton kernel in 4 shares
    assert flash._hopper_dkdv(128, 3, cuda, 1024)  # B4 H_q12 H_kv4 S1k
    assert flash._hopper_dkdv(124, 3, cuda, 1024)
    assert not flash._hopper_dkdv(123, 3, cuda, 1024)
    assert not flash._hopper_dkdv(128, 8, cuda, 4096)  # B1 H_q32 H_kv4 S4k causal: the Triton kernel's shares


AUTOGRAD_CASES = [CASES[2], CASES[6], CASES[9]]


@pytest.mark.parametrize("dtype", KERNEL_DTYPES, ids=DTYPE_IDS.get)
@pytest.mark.parametrize("case", AUTOGRAD_CASES, ids=case_id)
def test_autograd_with_lse_gradient(case, dtype):
    """The public differentiable path, with a loss on lse as well as out (lse's gradient folds into delta),
    and an explicit scale."""
    causal = case[-1]
    q, k, v, do = make_inputs(case, dtype)
    dlse = torch.randn(do.shape[:3], device=DEVICE, dtype=torch.float32)
    scale = 0.7 / math.sqrt(q.shape[-1])
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    out, lse = flash_gqa_forward(*leaves, scale=scale, causal=causal)
    ((out.float() * do.float()).sum() + (lse * dlse).sum()).backward()
    ref = reference_grads(q, k, v, do, causal, scale=scale, dlse=dlse)
    for name, got, want in zip(("out", "lse"), (out, lse), ref[:2]):
        assert_close(got.detach(), want, dtype, name)
    for name, leaf, want in zip(("dq", "dk", "dv"), leaves, ref[2:]):
        assert_close(leaf.grad, want, dtype, name, grad=True)


@pytest.mark.parametrize("dtype", KERNEL_DTYPES, ids=DTYPE_IDS.get)
def test_non_contiguous_inputs(dtype):
    """q from a (B, S, H, D) tensor, k sliced out of a wider last dim, v with a non-unit last-dim stride, do
    transposed: the kernels read all of them through their strides."""
    b, h_q, h_kv, s, d = 2, 4, 2, 65, 48
    q = torch.randn(b, s, h_q, d, device=DEVICE, dtype=dtype).transpose(1, 2)
    k = torch.randn(b, h_kv, s, 2 * d, device=DEVICE, dtype=dtype)[..., :d]
    v = torch.randn(b, h_kv, d, s, device=DEVICE, dtype=dtype).transpose(2, 3)
    do = torch.randn(b, s, h_q, d, device=DEVICE, dtype=dtype).transpose(1, 2)
    assert not any(x.is_contiguous() for x in (q, k, v, do))
    out, lse = flash_gqa_forward(q, k, v, causal=True)
    dq, dk, dv = flash_gqa_backward(q, k, v, out, lse, do, causal=True)
    ref = reference_grads(q, k, v, do, True)
    for name, got, want in zip(("out", "lse", "dq", "dk", "dv"), (out, lse, dq, dk, dv), ref):
        assert_close(got, want, dtype, name, grad=name.startswith("d"))


def projection_views(b, s, h_q, h_kv, d, dtype):
    """q, k, v as the model makes them: (B, H, S, D) views of one (B, S, (H_q + 2 H_kv) D) projection."""
    qkv = torch.randn(b, s, (h_q + 2 * h_kv) * d, device=DEVICE, dtype=dtype)
    return [t.view(b, s, -1, d).transpose(1, 2) for t in qkv.split([h_q * d, h_kv * d, h_kv * d], dim=-1)]


def in_bshd_memory(t) -> bool:
    return t.transpose(1, 2).is_contiguous()


@pytest.mark.parametrize("dtype", KERNEL_DTYPES, ids=DTYPE_IDS.get)
def test_outputs_in_the_inputs_memory_order(dtype):
    """Inputs that are (B, S, H, D) memory seen as (B, H, S, D), as the model passes them: out and dq, dk, dv come
    back in the same memory order (as SDPA's do), so the model's reshape to (B, S, H * D) is a view and not a copy,
    and they hold the reference's values. Contiguous inputs give contiguous results."""
    b, s, h_q, h_kv, d = 2, 65, 4, 2, 32
    q, k, v = projection_views(b, s, h_q, h_kv, d, dtype)
    do = torch.randn(b, s, h_q, d, device=DEVICE, dtype=dtype).transpose(1, 2)
    out, lse = flash_gqa_forward(q, k, v, causal=True)
    dq, dk, dv = flash_gqa_backward(q, k, v, out, lse, do, causal=True)
    for name, t in zip(("out", "dq", "dk", "dv"), (out, dq, dk, dv)):
        assert in_bshd_memory(t) and not t.is_contiguous(), f"{name}: strides {t.stride()}"
    assert out.transpose(1, 2).reshape(b, s, h_q * d).data_ptr() == out.data_ptr()  # a view
    ref = reference_grads(q, k, v, do, True)
    for name, got, want in zip(("out", "lse", "dq", "dk", "dv"), (out, lse, dq, dk, dv), ref):
        assert_close(got, want, dtype, name, grad=name.startswith("d"))
    q, k, v, do = make_inputs((1, 4, 2, 17, 17, 32, 32, True), dtype)
    out, lse = flash_gqa_forward(q, k, v, causal=True)
    assert all(t.is_contiguous() for t in (out, *flash_gqa_backward(q, k, v, out, lse, do, causal=True)))


def test_empty_in_order_for_every_memory_order():
    """`flash._empty_in_order` takes two orders by a shortcut ((B, H, S, D) and (B, S, H, D) memory); for every order
    of the first three dims, with size-1 dims (whose strides tie) too, its strides are those of a sort by stride."""
    from attention_kernels.flash import _empty_in_order

    for dims in [(2, 3, 5, 4), (1, 3, 5, 4), (2, 1, 5, 4), (2, 3, 1, 4), (1, 1, 1, 4), (3, 3, 3, 4)]:
        for perm in itertools.permutations(range(3)):
            like = torch.empty([dims[i] for i in perm] + [dims[3]]).permute([perm.index(i) for i in range(3)] + [3])
            for shape in (dims, dims[:3] + (7,)):
                order = sorted(range(3), key=lambda i: (-like.stride(i), i)) + [3]
                want = torch.empty([shape[i] for i in order]).permute([order.index(i) for i in range(4)])
                got = _empty_in_order(like, shape)
                assert got.shape == want.shape and got.stride() == want.stride(), (dims, perm, shape)


def test_custom_ops_fake_strides_match_the_kernels():
    """torch.compile plans the graph around the custom ops from their fake (meta) outputs; their shapes and strides
    must be the real outputs' (torch.library.opcheck compares them), for the model's (B, S, H, D)-ordered inputs
    and for contiguous ones."""
    from attention_kernels.flash import _flash_bwd_op, _flash_fwd_op

    dtype = KERNEL_DTYPES[0]
    views = projection_views(1, 17, 4, 2, 32, dtype)
    for q, k, v in (views, [t.contiguous() for t in views]):
        out, lse = _flash_fwd_op(q, k, v, 0.2, True)
        do = torch.randn_like(out)
        torch.library.opcheck(_flash_fwd_op, (q, k, v, 0.2, True), test_utils="test_faketensor")
        torch.library.opcheck(_flash_bwd_op, (q, k, v, out, lse, do, None, 0.2, True), test_utils="test_faketensor")


def test_torch_compile_fullgraph():
    """torch.compile traces through the custom ops without graph breaks, forward and backward (aot_eager on the
    CPU, where inductor would need a C++ toolchain; the default inductor backend on the GPU)."""
    dtype = KERNEL_DTYPES[0]
    q, k, v, do = make_inputs((1, 4, 2, 63, 63, 64, 64, True), dtype)

    def loss_fn(q, k, v):
        return (flash_gqa_attention(q, k, v, causal=True).float() * do.float()).sum()

    backend = "inductor" if DEVICE == "cuda" else "aot_eager"
    compiled = torch.compile(loss_fn, fullgraph=True, backend=backend)
    eager_leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    loss_fn(*eager_leaves).backward()
    compiled(*leaves).backward()
    for name, got, want in zip(("dq", "dk", "dv"), leaves, eager_leaves):
        assert_close(got.grad, want.grad.float(), dtype, name, grad=True)


def test_torch_compile_float_scale_argument():
    """A float scale passed into the compiled function: the second call with another value makes it a SymFloat,
    which the argument check must handle without a graph break."""
    dtype = KERNEL_DTYPES[0]
    q, k, v, _ = make_inputs((1, 2, 1, 17, 17, 32, 32, True), dtype)
    backend = "inductor" if DEVICE == "cuda" else "aot_eager"
    torch._dynamo.reset()
    compiled = torch.compile(
        lambda q, k, v, scale: flash_gqa_attention(q, k, v, scale=scale, causal=True), fullgraph=True, backend=backend
    )
    for scale in (0.2, 0.3, 0.4):
        ref, _ = attention_reference(q, k, v, scale=scale, causal=True)
        assert_close(compiled(q, k, v, scale), ref, dtype, f"compiled out, scale={scale}")


# ------------------------------------------------------------------------------------------------------------
# Bad input: ValueError naming the argument, what it got and what is valid; nothing is launched.
# ------------------------------------------------------------------------------------------------------------


def _t(*shape, dtype=torch.float16, device=DEVICE):
    return torch.randn(*shape, device=device, dtype=torch.float32).to(dtype)


Q, K, V = (2, 4, 8, 32), (2, 2, 8, 32), (2, 2, 8, 32)
BAD_FORWARD = {
    "q-rank": (lambda: (_t(4, 8, 32), _t(*K), _t(*V)), {}, "q: got shape"),
    "k-batch": (lambda: (_t(*Q), _t(3, 2, 8, 32), _t(3, 2, 8, 32)), {}, "k: got shape"),
    "k-head-dim": (lambda: (_t(*Q), _t(2, 2, 8, 48), _t(*V)), {}, "k: got shape"),
    "v-seq": (lambda: (_t(*Q), _t(*K), _t(2, 2, 9, 32)), {}, "v: got shape"),
    "heads-not-divisible": (lambda: (_t(*Q), _t(2, 3, 8, 32), _t(2, 3, 8, 32)), {}, "k: got H_kv=3 for H_q=4"),
    "dtype-mismatch": (lambda: (_t(*Q), _t(*K, dtype=torch.float32), _t(*V)), {}, "k: got dtype torch.float32"),
    "int-dtype": (lambda: (torch.ones(Q, dtype=torch.int32, device=DEVICE), _t(*K), _t(*V)), {}, "q: got dtype"),
    "device-mismatch": (lambda: (_t(*Q), _t(*K), _t(*V, device="meta")), {}, "v: got device meta"),
    "causal-sq-gt-skv": (lambda: (_t(2, 4, 9, 32), _t(*K), _t(*V)), {"causal": True}, "causal: got True with S_q=9"),
    "head-dim-too-small": (lambda: (_t(2, 4, 8, 0), _t(2, 2, 8, 0), _t(2, 2, 8, 8)), {}, "q: got head dim 0"),
    "head-dim-too-large": (lambda: (_t(2, 4, 2, 512), _t(2, 2, 2, 512), _t(2, 2, 2, 32)), {}, "head dim 512"),
    "v-head-dim-too-large": (lambda: (_t(*Q), _t(*K), _t(2, 2, 8, 320)), {}, "v: got head dim 320"),
    "empty-keys": (lambda: (_t(*Q), _t(2, 2, 0, 32), _t(2, 2, 0, 32)), {}, "S_kv=0"),
    "bad-scale": (lambda: (_t(*Q), _t(*K), _t(*V)), {"scale": -1.0}, "scale: got -1.0"),
    "nan-scale": (lambda: (_t(*Q), _t(*K), _t(*V)), {"scale": float("nan")}, "scale: got nan"),
    "inf-scale": (lambda: (_t(*Q), _t(*K), _t(*V)), {"scale": float("inf")}, "scale: got inf"),
    "str-scale": (lambda: (_t(*Q), _t(*K), _t(*V)), {"scale": "0.1"}, "scale: got '0.1'"),
    "str-causal": (lambda: (_t(*Q), _t(*K), _t(*V)), {"causal": "yes"}, "causal: got 'yes'; valid: True or False"),
    "numpy-q": (lambda: (_t(*Q).cpu().float().numpy(), _t(*K), _t(*V)), {}, "q: got ndarray"),
}


@pytest.mark.parametrize("name", list(BAD_FORWARD))
def test_bad_forward_input_raises(name):
    make, kwargs, message = BAD_FORWARD[name]
    for fn in (flash_gqa_forward, flash_gqa_attention):
        with pytest.raises(ValueError, match="valid") as err:
            fn(*make(), **kwargs)
        assert message in str(err.value), str(err.value)


def _good_backward_args():
    q, k, v = _t(*Q), _t(*K), _t(*V)
    return dict(q=q, k=k, v=v, out=_t(*Q), lse=torch.zeros(Q[:3], device=DEVICE), do=_t(*Q))


BAD_BACKWARD = {
    "out-shape": ("out", lambda a: _t(2, 4, 8, 16), "out: got shape (2, 4, 8, 16)"),
    "do-shape": ("do", lambda a: _t(2, 4, 7, 32), "do: got shape (2, 4, 7, 32)"),
    "do-dtype": ("do", lambda a: _t(*Q, dtype=torch.float32), "do: got dtype torch.float32"),
    "lse-dtype": ("lse", lambda a: torch.zeros(Q[:3], device=DEVICE, dtype=torch.float16), "lse: got torch.float16"),
    "lse-shape": ("lse", lambda a: torch.zeros(2, 4, 9, device=DEVICE), "lse: got torch.float32 of shape (2, 4, 9)"),
    "lse-rank": ("lse", lambda a: torch.zeros(2, 4, device=DEVICE), "lse: got shape (2, 4)"),
    "lse-device": ("lse", lambda a: torch.zeros(Q[:3], device="meta"), "lse: got device meta"),
    "do-device": ("do", lambda a: _t(*Q, device="meta"), "do: got device meta"),
    "q-heads": ("q", lambda a: _t(2, 3, 8, 32), "k: got H_kv=2 for H_q=3"),
}


@pytest.mark.parametrize("name", list(BAD_BACKWARD))
def test_bad_backward_input_raises(name):
    arg, make, message = BAD_BACKWARD[name]
    args = _good_backward_args()
    args[arg] = make(args)
    with pytest.raises(ValueError, match="valid") as err:
        flash_gqa_backward(
            args.pop("q"), args.pop("k"), args.pop("v"), args.pop("out"), args.pop("lse"), args.pop("do")
        )
    assert message in str(err.value), str(err.value)


def _compile_sm90(d, causal, which, d_v=None, group=4):
    """One of the Hopper kernels of attention_kernels/flash_sm90.py compiled for sm_90 (conftest.compile_gluon_sm90),
    with D_qk = d and D_v = d_v (default d), `group` query heads per KV head, Q and K as TMA tiles of their first
    power-of-two columns and of the rest (MLA's 128 + 64), as `flash_sm90.forward`, `backward_dq` and `backward_dkdv`
    launch them."""
    from attention_kernels import flash_sm90

    d_v = d_v or d
    d_main, d_rest = flash_sm90.qk_tiles(d)

    def desc(rows, cols):
        return dict(block=[1, 1, rows, cols], dtype="bfloat16")

    def qk(name, rows):  # Q's or K's two tiles (the second None when d is a power of two, as the launchers pass it)
        return {f"{name}_desc": desc(rows, d_main), **({f"{name}r_desc": desc(rows, d_rest)} if d_rest else {})}

    if which == "forward":
        block_n, k_stages, v_stages = flash_sm90.CONFIGS[(d, d_v)]
        const = dict(
            GROUP_SIZE=group,
            CAUSAL=causal,
            BLOCK_N=block_n,
            D=d_main,
            DR=d_rest,
            DV=d_v,
            K_STAGES=k_stages,
            V_STAGES=v_stages,
        )
        rows = flash_sm90.ROWS_PER_CONSUMER
        types = dict(
            **qk("q", rows),
            **qk("k", block_n),
            v_desc=desc(block_n, d_v),
            o_desc=desc(rows, d_v),
            lse_ptr="*fp32",
            counter_ptr="*i32",
            qk_scale="fp32",
        )
        module, kernel = "flash_sm90_fwd", "_flash_fwd_sm90_kernel"
    elif which == "dq":
        rows, (block_n, stages, persistent) = flash_sm90.ROWS_PER_CONSUMER, flash_sm90.DQ_CONFIGS[(d, d_v)]
        # Unit last strides of out, dq, lse and dlse, which Triton's launcher specializes as constants, as it does
        # for the tensors autograd passes.
        const = dict(
            GROUP_SIZE=group,
            CAUSAL=causal,
            HAS_DLSE=False,
            WRITE_LSE2=True,
            BLOCK_N=block_n,
            D=d_main,
            DR=d_rest,
            DV=d_v,
            STAGES=stages,
            PERSISTENT=persistent,
            stride_od=1,
            stride_qd=1,
            stride_lm=1,
            stride_gm=1,
        )
        types = dict(
            **qk("q", rows),
            do_desc=desc(rows, d_v),
            **qk("k", block_n),
            v_desc=desc(block_n, d_v),
            out_ptr="*bf16",
            lse_ptr="*fp32",
            dlse_ptr="*fp32",
            delta_ptr="*fp32",
            lse2_ptr="*fp32",
            dq_ptr="*bf16",
            counter_ptr="*i32",
            sm_scale="fp32",
            qk_scale="fp32",
        )
        module, kernel = "flash_sm90_bwd_dq", "_flash_bwd_dq_sm90_kernel"
    else:
        block_m, stages, persistent = flash_sm90.dkdv_config(d, d_v, causal, group)
        block_n = flash_sm90.PROGRAM_ROWS
        # dK and dV with a unit last stride, which Triton's launcher specializes as a constant, as it does for the
        # gradients autograd allocates: the store addresses then take no registers.
        const = dict(
            GROUP_SIZE=group,
            CAUSAL=causal,
            BLOCK_M=block_m,
            D=d_main,
            DR=d_rest,
            DV=d_v,
            STAGES=stages,
            PERSISTENT=persistent,
            stride_kd=1,
            stride_vd=1,
        )
        rows = dict(block=[block_m], dtype="float32")
        types = dict(
            **qk("q", block_m),
            do_desc=desc(block_m, d_v),
            **qk("k", block_n),
            v_desc=desc(block_n, d_v),
            lse_desc=rows,
            delta_desc=rows,
            dk_ptr="*bf16",
            dv_ptr="*bf16",
            counter_ptr="*i32",
            sm_scale="fp32",
            qk_scale="fp32",
        )
        if persistent:  # dK and dV stored from registers (the launcher passes no descriptors for them)
            const.update(dk_desc=None, dkr_desc=None, dv_desc=None)
        else:  # dK and dV by TMA, 64 rows per consumer
            rows_c = flash_sm90.ROWS_PER_CONSUMER
            types.update(dk_desc=desc(rows_c, d_main), dv_desc=desc(rows_c, d_v))
            if d_rest:
                types.update(dkr_desc=desc(rows_c, d_rest))
            else:
                const.update(dkr_desc=None)
        module, kernel = "flash_sm90_bwd_dkdv", "_flash_bwd_dkdv_sm90_kernel"
    if which == "fused":  # the one-launch backward (D = 64, 128): dK/dV's tiles, dQ by TMA reduce into fp32
        rows, keys = flash_sm90.ROWS_PER_CONSUMER, flash_sm90.PROGRAM_ROWS
        block_m = flash_sm90.FUSED_PAIRS[(d, d_v)]
        const = dict(GROUP_SIZE=group, CAUSAL=causal, BLOCK_M=block_m, D=d, STAGES=2)
        lse = dict(block=[block_m], dtype="float32")
        types = dict(
            q_desc=desc(block_m, d),
            do_desc=desc(block_m, d),
            k_desc=desc(keys, d),
            v_desc=desc(keys, d),
            lse_desc=lse,
            delta_desc=lse,
            dk_desc=desc(rows, d),
            dv_desc=desc(rows, d),
            dq_desc=dict(block=flash_sm90.fused_dq_block(d, block_m), dtype="float32"),
            sm_scale="fp32",
            qk_scale="fp32",
        )
        return compile_gluon_sm90(
            "attention_kernels.flash_sm90_bwd_fused", "_flash_bwd_fused_sm90_kernel", types, const
        )
    if not d_rest:
        const.update(qr_desc=None, kr_desc=None)
    return compile_gluon_sm90(f"attention_kernels.{module}", kernel, types, const)


@pytest.mark.slow
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize(
    "d,d_v", [(64, 64), (128, 128), (192, 128), (96, 64)], ids=["D64", "D128", "D192x128", "D96x64"]
)
def test_sm90_kernel_structure(d, d_v, causal):
    """The Hopper forward (Gluon, which has no CPU interpreter; its numerics run in every forward test above on an
    H100/H200) compiled for sm_90 on any machine: a loader warp that gives its registers to two consumer
    warpgroups (setmaxnreg 24 / 240), TMA loads, asynchronous wgmma with the scores of the next key block in
    flight while P V runs (wait_group 1), one global atomic per tile for the persistent schedule, the output
    written by TMA from shared memory (one store per warpgroup and tile, whose reads are waited for before the
    buffer is reused), within the 227 KB of shared memory, and no register spills (the persistent kernel keeps a
    tile's state live across its key loop, and per-thread output stores from registers would make ptxas spill
    around them). MLA's 192/128 reads Q and
    K as two TMA tiles each (128 + 64 columns: a tile's width must be a power of two), so its scores are two
    products, m64nBLOCK_Nk16 over 128 and over 64 columns; the GPT-2-small MLA's 96/64 likewise over 64 and 32."""
    from attention_kernels import flash_sm90

    assert (d, d_v) in flash_sm90.CONFIGS
    result = _compile_sm90(d, causal, "forward", d_v)
    ptx = result["ptx"]
    regs = setmaxnreg_counts(ptx)
    assert {"24", "240"} <= regs, f"warp roles' register counts {sorted(regs)}"
    assert "cp.async.bulk.tensor" in ptx, "no TMA load"
    assert ptx.count("cp.async.bulk.tensor.4d.global.shared") == 2, "the output: one TMA store per consumer"
    assert "cp.async.bulk.wait_group.read" in ptx, "no wait for the output's reads before its buffer is reused"
    assert "wgmma.mma_async" in ptx and "wgmma.wait_group.sync.aligned 1;" in ptx, "no overlapped wgmma"
    block_n = flash_sm90.CONFIGS[(d, d_v)][0]
    # Per consumer warpgroup (each has its own copy of the code): Q K^T (k = 16 per wgmma, over all d columns) in
    # two places, key block 0 alone and the loop's step, and P V in the step and after the loop.
    assert ptx.count("wgmma.mma_async") == 2 * (2 * (d // 16) + 2 * (block_n // 16)), "the products' wgmma count"
    assert ptx.count("atom.global") == 1, "the tile counter: one atomic add per tile, by one thread"
    assert result["shared"] <= 232448, f"{result['shared']} bytes of shared memory"
    spills = spill_bytes(result["ptxas"])
    assert spills and all(a == 0 and b == 0 for a, b in spills), result["ptxas"]


def test_sm90_forward_config_must_fit():
    """Every forward config fits a program's shared memory (Q and output buffers, K and V rings), and a config that
    does not (a benchmark's override) is refused with the sizes before anything launches: D=128 with three stages
    of K and of V would take 256 KB."""
    from attention_kernels import flash_sm90

    for (d, d_v), config in flash_sm90.CONFIGS.items():
        assert flash_sm90.forward_smem(d, d_v, *config) <= flash_sm90.SMEM_PER_PROGRAM, (d, d_v, config)
    q, k, v = (torch.zeros(1, 2, 128, 128, dtype=torch.bfloat16) for _ in range(3))
    out, lse = torch.empty_like(q), torch.empty(1, 2, 128)
    with pytest.raises(ValueError, match=r"\(128, 3, 3\) takes 256 KB .* at most 227 KB"):
        flash_sm90.forward(q, k, v, out, lse, 1.0, False, config=(128, 3, 3))


@pytest.mark.slow
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize(
    "which,d,d_v",
    [
        ("dq", 64, 64),
        ("dq", 128, 128),
        ("dq", 96, 64),
        ("dq", 192, 128),
        ("dkdv", 64, 64),
        ("dkdv", 128, 128),
        ("dkdv", 96, 64),
        ("dkdv", 192, 128),
    ],
    ids=["dq-D64", "dq-D128", "dq-D96x64", "dq-D192x128", "dkdv-D64", "dkdv-D128", "dkdv-D96x64", "dkdv-D192x128"],
)
def test_sm90_backward_kernel_structure(which, d, d_v, causal):
    """The Hopper dQ and dK/dV kernels compiled for sm_90 on any machine: a loader warp and two consumer
    warpgroups (setmaxnreg 24 / 240), TMA loads, within the 227 KB of shared memory, no register spills but one
    few measured exceptions, and ptxas does not serialize their wgmma (it does, with a warning, when a product's
    registers are read before the wait that covers it: dK/dV must issue dP^T before dV so that waiting for all but
    the newest group covers dP^T). The causal dK/dV kernel at D=64, whose 128-query steps hold a 64 x 128 S^T and
    dP^T per warpgroup, compares its mask against immediates (`causal_mask_t`), so that no column index stays live
    across the step loop: it keeps 16 bytes (4 for MHA) of tile setup in local memory, outside the loop, which the
    bound of 16 allows. The persistent kernels (dQ and dK/dV at D=64 and MLA's 96/64) take their tiles with one
    atomic add each, by one thread. MLA's Q and K arrive as two TMA tiles each (96: 64 + 32 columns, 192: 128 +
    64), so S (S^T) is two products and dQ (dK) two accumulators, the RoPE part's own.
    MLA's 192/128 dK/dV takes 32-query steps: with 64, its accumulators (64 x 192 and 64 x 128 per warpgroup) beside
    S^T and dP^T spill 108-604 bytes and serialize the wgmma. The one-program-per-tile dK/dV (D=128, 192/128)
    writes dK and dV through its K and V buffers by TMA, one store per tile of them and warpgroup; at D=128 causal
    ptxas keeps one value (4 bytes) in local memory there, stored and loaded after the step loop, which the bound
    of 8 allows."""
    from attention_kernels import flash_sm90

    configs = flash_sm90.BWD_CONFIGS if which == "dkdv" else flash_sm90.DQ_CONFIGS
    assert (d, d_v) in configs
    result = _compile_sm90(d, causal, which, d_v)
    regs = setmaxnreg_counts(result["ptx"])
    assert {"24", "240"} <= regs, f"warp roles' register counts {sorted(regs)}"
    assert "cp.async.bulk.tensor" in result["ptx"] and "wgmma.mma_async" in result["ptx"]
    assert result["shared"] <= 232448, f"{result['shared']} bytes of shared memory"
    assert "serialized" not in result["ptxas"], result["ptxas"]
    spills = spill_bytes(result["ptxas"])
    bound = {(64, True, "dkdv"): 16, (128, True, "dkdv"): 8}.get((d, causal, which), 0)
    persistent = configs[(d, d_v)][2]
    assert result["ptx"].count("atom.global") == (1 if persistent else 0), "the tile counter"
    block, tiles = configs[(d, d_v)][0], 1 + (flash_sm90.qk_tiles(d)[1] > 0)
    if which == "dkdv":  # dK (one or two tiles) and dV by TMA store, per warpgroup, where one program takes one tile
        stores = 0 if persistent else 2 * (1 + tiles)
        assert result["ptx"].count("cp.async.bulk.tensor.4d.global.shared") == stores, "dK and dV's TMA stores"
    # Per consumer warpgroup (each has its own copy of the code), k = 16 per wgmma: dQ issues S = Q K^T over d
    # columns, dP = dO V^T over d_v, and dQ = dS K over the block's keys once per Q/K tile (one, or two with a RoPE
    # part); dK/dV issues S^T = K Q^T over d columns twice (before the loop and in it), dP^T = V dO^T over d_v, and
    # dV += P^T dO and dK += dS^T Q over the step's queries (dK once per tile).
    products = (
        (d + d_v) // 16 + tiles * block // 16
        if which == "dq"
        else 2 * (d // 16) + d_v // 16 + (1 + tiles) * block // 16
    )
    assert result["ptx"].count("wgmma.mma_async") == 2 * products, "the products' wgmma count"
    assert spills and all(a <= bound and b <= bound for a, b in spills), result["ptxas"]


@pytest.mark.slow
@pytest.mark.parametrize("d,d_v", [(128, 128), (96, 64), (192, 128)], ids=["D128", "D96x64", "D192x128"])
def test_sm90_mha_causal_dkdv_structure(d, d_v):
    """MHA's causal dK/dV (one query head per KV head) has a prologue of its own: its second consumer skips the
    query blocks that end before its keys and only releases their ring slots (flash_sm90_bwd_dkdv._dkdv_lead; the
    kernels above compile a KV group of 4, which does not skip). Compiled for sm_90: the same products as with a
    group, wgmma not serialized, and no spills but at D=128 ptxas's 12/16 bytes of three setup values, stored at the
    kernel's entry, before the step loop and after it, and loaded outside the loop."""
    from attention_kernels import flash_sm90

    result = _compile_sm90(d, True, "dkdv", d_v, group=1)
    assert "serialized" not in result["ptxas"], result["ptxas"]
    block, tiles = flash_sm90.BWD_CONFIGS[(d, d_v)][0], 1 + (flash_sm90.qk_tiles(d)[1] > 0)
    products = 2 * (d // 16) + d_v // 16 + (1 + tiles) * block // 16  # as test_sm90_backward_kernel_structure
    assert result["ptx"].count("wgmma.mma_async") == 2 * products, "the products' wgmma count"
    spills = spill_bytes(result["ptxas"])
    assert spills and all(a <= 16 and b <= 16 for a, b in spills), result["ptxas"]


@pytest.mark.slow
@pytest.mark.parametrize("group", [1, 4, 8], ids=["MHA", "group4", "group8"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("d", [64, 128], ids=["D64", "D128"])
def test_sm90_fused_backward_structure(d, causal, group):
    """The one-launch backward (flash_sm90_bwd_fused._flash_bwd_fused_sm90_kernel: D = 128 with 64-query steps,
    D = 64 with 128) compiled for sm_90 on any machine: two consumer warpgroups (setmaxnreg 240) beside the loader
    and the dQ writer warps (24 each); per consumer the dK/dV products plus its 64 x 64 share of dQ = dS K over the
    tile's 128 keys (S^T before the loop and in it and dP^T over d columns, dV and dK over the step's queries, dQ
    over 128 keys: wgmma of k = 16); dQ added into fp32 by TMA reduce, four messages a step (two consumers, 32
    columns each of their 64), whose reads are waited for before a staging buffer is reused; dK and dV by TMA store;
    within the 227 KB of shared memory (225.5 KB at D = 128: Q, dO and their lse/delta in two stages, K, V, two
    dS^T buffers, four dQ buffers; 226.6 KB at D = 64); wgmma not serialized. Spills: none at D = 128, and 24-72
    bytes at D = 64, outside the step loop (`_fused_kv` rebuilds the K and V wgmma descriptors each step, so that
    they are not loop invariants that crowd out the registers)."""
    from attention_kernels import flash_sm90

    block_m = flash_sm90.FUSED_PAIRS[(d, d)]
    result = _compile_sm90(d, causal, "fused", group=group)
    ptx = result["ptx"]
    assert {"24", "240"} <= setmaxnreg_counts(ptx), f"warp roles' register counts {sorted(setmaxnreg_counts(ptx))}"
    products = 3 * (d // 16) + 2 * (block_m // 16) + 128 // 16
    assert ptx.count("wgmma.mma_async") == 2 * products, "the products' wgmma count"
    assert ptx.count("cp.reduce.async.bulk.tensor.4d.global.shared::cta.add") == 4, "dQ's TMA reduce-adds"
    # Each reduce call is one bulk group (its two messages committed together): two groups a step, so the writer
    # waits down to two pending (this step's) before it releases the previous step's buffers: waiting down to four
    # would let a buffer go back to its consumer before its reduce had surely read it.
    assert ptx.count("cp.async.bulk.commit_group") == 2 + 2 * 2, "one bulk group per reduce call (and dK, dV's)"
    waits = set(re.findall(r"cp\.async\.bulk\.wait_group\.read\s+(\d+);", ptx))
    assert waits == {"0", "2"}, f"bulk waits down to {sorted(waits)} pending: the reduces' reads need 2 (and 0)"
    # The barriers: K/V, Q and dO and their release (2 stages each), dS^T halves (2), dQ staging ready and free (4
    # each), and k_read, on which the two consumers meet before writing dK over K rows the other's dQ reads. With
    # two arrivals: qdo_free, ds_ready and k_read.
    inits = re.findall(r"mbarrier\.init\.shared::cta\.b64 \[[^]]+\], (\d+);", ptx)
    assert sorted(inits) == sorted(["1"] * 13 + ["2"] * 5), f"mbarrier arrival counts {sorted(inits)}"
    assert ptx.count("cp.async.bulk.tensor.4d.global.shared") == 4, "dK and dV's TMA stores"
    assert result["shared"] <= 232448, f"{result['shared']} bytes of shared memory"
    assert "serialized" not in result["ptxas"], result["ptxas"]
    spills = spill_bytes(result["ptxas"])
    bound = {128: 0, 64: 72}[d]
    assert spills and all(a <= bound and b <= bound for a, b in spills), result["ptxas"]


FUSED_CASES = [c for c in CASES if c[5:7] in ((64, 64), (128, 128))] + [
    (1, 2, 2, 200, 230, 128, 128, True),
    (2, 4, 2, 333, 333, 128, 128, False),
    (1, 16, 2, 300, 300, 128, 128, True),
    (3, 8, 8, 129, 129, 128, 128, True),
    # D = 64 takes 128-query steps: several of them, a partial one, the diagonal inside a step, S_q < S_kv.
    (1, 2, 2, 200, 230, 64, 64, True),
    (2, 4, 2, 333, 333, 64, 64, False),
    (1, 16, 2, 300, 300, 64, 64, True),
    (1, 4, 2, 300, 1000, 64, 64, True),
    (3, 8, 8, 129, 129, 64, 64, True),
]


@pytest.mark.parametrize("case", FUSED_CASES, ids=case_id)
def test_sm90_backward_fused(case, monkeypatch):
    """The whole backward in one launch (ZOO_FLASH_SM90_BWD=fused: on an H100/H200, `flash_sm90.backward_fused`,
    which a spy checks ran), with a loss on lse too (dlse folds into delta in its pre-pass), into NaN-poisoned
    gradients, dq and dk views whose row strides TMA cannot write (dK through a contiguous buffer, dQ cast from its
    fp32 accumulator through the strides), against the reference: query tiles of the causal diagonal in the order
    the kernel walks them (the last first), ragged ends (rows past S_q and S_kv clipped by the TMA reduce and
    stores), S_q < S_kv, groups of 1, 2, 4 and 8. On other machines the same call runs the Triton kernels."""
    from attention_kernels import flash

    monkeypatch.setenv("ZOO_FLASH_SM90_BWD", "fused")
    hopper = flash.flash_sm90
    ran = []
    if hopper is not None:
        fused = hopper.backward_fused
        monkeypatch.setattr(hopper, "backward_fused", lambda *a, **kw: ran.append(1) or fused(*a, **kw))
    causal = case[-1]
    for dtype in KERNEL_DTYPES:
        q, k, v, do = make_inputs(case, dtype)
        dlse = torch.randn(do.shape[:3], device=DEVICE, dtype=torch.float32)
        out, lse = _forward(q, k, v, None, causal)
        bases = [poisoned((*x.shape[:-1], x.shape[-1] + 1), dtype) for x in (q, k)] + [poisoned(v.shape, dtype)]
        grads = tuple(base[..., : x.shape[-1]] for base, x in zip(bases, (q, k, v)))
        got = _backward(q, k, v, out, lse, do, None, causal, dlse=dlse, grads=grads)
        ref = reference_grads(q, k, v, do, causal, dlse=dlse)[2:]
        for name, g, want, base in zip(("dq", "dk", "dv"), got, ref, bases):
            assert_close(g, want, dtype, name, grad=True)
            assert g.data_ptr() == base.data_ptr(), name
            if g.shape != base.shape:
                assert torch.isnan(base[..., -1]).all(), f"{name}: written outside its view"
    if hopper is not None and hopper.on_hopper(q):
        assert ran, "the one-launch backward did not run"


@pytest.mark.parametrize(
    "case",
    [c for c in CASES if c[5] == c[6] in (64, 128) or (c[5], c[6]) == (192, 128)]
    + [
        (1, 2, 2, 200, 200, 128, 128, True),
        (1, 4, 2, 200, 520, 64, 64, True),
        (1, 2, 1, 130, 600, 64, 64, False),
        (1, 8, 1, 130, 130, 64, 64, True),
        (1, 4, 2, 200, 520, 96, 64, True),
        (1, 2, 1, 130, 600, 96, 64, False),
        (1, 2, 2, 130, 330, 192, 128, False),
        # MHA, causal, S_q < S_kv off the blocks' grid (query row i at key 30 + i): the second
        # consumer of a dK/dV tile skips the query blocks that end before its keys, real keys
        # (flash_sm90_bwd_dkdv._dkdv_lead: one of 64 rows; one, then two of 32 at 192/128), and the first
        # consumer of a dQ tile (and of the forward's at 192/128) the key block of 64 past its rows
        # (_release_kv).
        (1, 2, 2, 200, 230, 128, 128, True),
        (1, 2, 2, 200, 230, 192, 128, True),
        (1, 2, 2, 200, 230, 96, 64, True),
    ],
    ids=case_id,
)
def test_sm90_backward(case, monkeypatch):
    """dQ and dK/dV through the Hopper kernels wherever they can run (ZOO_FLASH_SM90_BWD=force: on an H100/H200 in
    fp16 and bf16, dK/dV even where its launch would not fill the GPU; on other machines the same call runs the
    Triton kernels, which is what the check then covers), into NaN-poisoned buffers, against the reference:
    several key blocks, ragged ends, S_q < S_kv, GQA and MHA; MLA's 96/64 (Q and K as 64 + 32 columns) and
    192/128 (128 + 64; dK/dV in 32-query steps)."""
    monkeypatch.setenv("ZOO_FLASH_SM90_BWD", "force")
    ran = spy_hopper(monkeypatch, "backward_dq", "backward_dkdv", "backward_fused")
    causal = case[-1]
    for dtype in KERNEL_DTYPES:
        q, k, v, do = make_inputs(case, dtype)
        out, lse = _forward(q, k, v, None, causal)
        grads = tuple(poisoned(x.shape, dtype) for x in (q, k, v))
        ran.clear()
        dq, dk, dv = _backward(q, k, v, out, lse, do, None, causal, grads=grads)
        _, _, ref_dq, ref_dk, ref_dv = reference_grads(q, k, v, do, causal)
        assert_close(dq, ref_dq, dtype, "dq", grad=True)
        assert_close(dk, ref_dk, dtype, "dk", grad=True)
        assert_close(dv, ref_dv, dtype, "dv", grad=True)
        if on_hopper(q):
            assert ran == ["backward_dq", "backward_dkdv"], f"{dtype}: the Hopper launches were {ran}"


def test_sm90_forward_dispatch(monkeypatch):
    """Which inputs the Hopper forward takes (flash_sm90.supports, with the GPU check faked so that it runs
    anywhere): D = 128 and MLA's 192/128 and 96/64 at every length; D = 64 full attention at every length, causal
    from MIN_KEYS[(64, True)] keys (1024) up, where it measured ahead of the Triton kernel; no other pair of head
    dims."""
    from attention_kernels import flash_sm90

    monkeypatch.setattr(flash_sm90, "on_hopper", lambda t: True)
    monkeypatch.setenv("ZOO_FLASH_SM90", "1")

    def takes(d_qk, d_v, s_kv, causal):
        q = torch.zeros(1, 4, 64, d_qk, dtype=torch.bfloat16)
        k = torch.zeros(1, 2, s_kv, d_qk, dtype=torch.bfloat16)
        v = torch.zeros(1, 2, s_kv, d_v, dtype=torch.bfloat16)
        return flash_sm90.supports(q, k, v, causal)

    assert takes(128, 128, 64, True) and takes(128, 128, 64, False)
    assert takes(64, 64, 64, False) and takes(64, 64, 1024, False)
    assert not takes(64, 64, 1023, True) and takes(64, 64, 1024, True)
    assert takes(192, 128, 64, True) and takes(192, 128, 4096, False)
    assert takes(96, 64, 64, True) and takes(96, 64, 1024, True) and takes(96, 64, 4096, False)
    assert not takes(192, 64, 4096, False) and not takes(128, 64, 4096, False) and not takes(192, 192, 64, False)


def test_sm90_backward_dispatch(monkeypatch):
    """Which kernels `_backward` launches per pair of head dims on an sm_90 GPU (faked, with the launchers replaced
    by recorders, so that it runs anywhere): the Hopper dQ and dK/dV kernels at D = 64 and 128 and MLA's 96/64 and
    192/128, and the Triton kernels for any other pair; ZOO_FLASH_SM90_BWD=0 keeps every pair on the Triton
    kernels; at D = 128 and 64 the one-launch backward where its rule says so, or with "fused"."""
    from attention_kernels import flash, flash_sm90

    monkeypatch.setattr(flash_sm90, "on_hopper", lambda t: True)
    monkeypatch.setattr(flash, "_ROUTES", {})
    monkeypatch.setenv("ZOO_FLASH_SM90", "1")
    calls = []
    for module, name in (
        (flash_sm90, "backward_dq"),
        (flash_sm90, "backward_dkdv"),
        (flash_sm90, "backward_fused"),
        (flash, "_triton_dq"),
        (flash, "_triton_dkdv"),
    ):
        monkeypatch.setattr(module, name, lambda *args, _name=name, **kwargs: calls.append(_name))

    def launched(d_qk, d_v, mode="1"):
        monkeypatch.setenv("ZOO_FLASH_SM90_BWD", mode)
        q = torch.zeros(1, 4, 256, d_qk, dtype=torch.bfloat16)
        k = torch.zeros(1, 4, 256, d_qk, dtype=torch.bfloat16)
        v = torch.zeros(1, 4, 256, d_v, dtype=torch.bfloat16)
        out, do = torch.zeros(1, 4, 256, d_v, dtype=torch.bfloat16), torch.zeros(1, 4, 256, d_v, dtype=torch.bfloat16)
        calls.clear()
        flash._ROUTES.clear()  # the routes kept per signature: this test changes what decides them between calls
        # checked=True: the input checks would refuse CPU tensors on a GPU machine (no interpreter there).
        flash._backward(q, k, v, out, torch.zeros(1, 4, 256), do, None, True, checked=True)
        return calls[:]

    assert (
        launched(64, 64)
        == launched(128, 128)
        == launched(96, 64)
        == launched(192, 128)
        == ["backward_dq", "backward_dkdv"]
    )
    assert launched(64, 32) == launched(80, 80) == launched(192, 192) == ["_triton_dq", "_triton_dkdv"]
    assert launched(96, 64, "0") == launched(64, 64, "0") == ["_triton_dq", "_triton_dkdv"]
    # The one-launch backward: D = 128 and 64; by default where `fused_backward_wins` (not for these 8 programs).
    assert launched(128, 128, "fused") == launched(64, 64, "fused") == ["backward_fused"]
    assert launched(192, 128, "fused") == launched(96, 64, "fused") == ["backward_dq", "backward_dkdv"]
    assert launched(128, 128, "force") == ["backward_dq", "backward_dkdv"]
    # Where the rule picks the one launch, torch.use_deterministic_algorithms keeps the two (the one launch adds dQ
    # in the order its programs finish); an explicit "fused" still runs it.
    monkeypatch.setattr(flash_sm90, "fused_backward_wins", lambda *args: True)
    assert launched(128, 128) == ["backward_fused"]
    deterministic = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        assert launched(128, 128) == ["backward_dq", "backward_dkdv"]
        assert launched(128, 128, "fused") == ["backward_fused"]
    finally:
        torch.use_deterministic_algorithms(deterministic)


def test_sm90_fused_backward_rule():
    """Where the one-launch backward takes over by default (flash_sm90.fused_backward_wins, from H200
    measurements): D = 128 and 64 with at least a wave of programs (128 keys of a KV head each); full attention at
    every length; causal from 4096 keys with groups of at most 4 query heads at D = 128 and from 16384 keys with
    groups of 8; at D = 64 from 8192 keys, or where group x keys is 16384 or more; never for MLA's pairs."""
    from attention_kernels.flash_sm90 import fused_backward_wins

    def wins(causal, s_kv, group, programs=512, d=128, d_v=128):
        return fused_backward_wins(d, d_v, causal, s_kv, group, programs, 132)

    assert wins(False, 1024, 4) and wins(False, 16384, 8) and wins(False, 1024, 1)
    assert wins(True, 4096, 4) and wins(True, 16384, 4) and wins(True, 4096, 1)
    assert not wins(True, 2048, 4) and not wins(True, 4095, 1) and not wins(True, 8192, 8)
    assert wins(True, 16384, 8) and wins(True, 32768, 8) and not wins(True, 16384, 16)
    assert not wins(False, 4096, 4, programs=131) and wins(False, 4096, 4, programs=132)
    assert wins(False, 1024, 4, d=64, d_v=64) and wins(False, 4096, 8, d=64, d_v=64)
    assert wins(True, 16384, 4, d=64, d_v=64) and wins(True, 16384, 8, d=64, d_v=64)
    assert wins(True, 8192, 1, d=64, d_v=64) and wins(True, 4096, 4, d=64, d_v=64) and wins(True, 2048, 8, d=64, d_v=64)
    assert not wins(True, 4096, 1, d=64, d_v=64) and not wins(True, 2048, 4, d=64, d_v=64)
    assert not wins(True, 1024, 8, d=64, d_v=64)
    assert not wins(False, 4096, 4, programs=131, d=64, d_v=64)
    assert not wins(False, 4096, 4, d=192) and not wins(False, 4096, 4, d=96, d_v=64)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize(
    "d_qk,d_v,s_kv",
    [(64, 64, 2100), (64, 64, 1100), (192, 128, 700), (96, 64, 700)],
    ids=["D64", "D64-1100", "D192x128", "D96x64"],
)
def test_sm90_forward_many_blocks(d_qk, d_v, s_kv, causal, monkeypatch):
    """The Hopper forward over many key blocks where CASES has none: causal D = 64 takes it only from
    MIN_KEYS[(64, True)] keys (1024) up, which no shape in CASES reaches, CASES' one full-attention D = 64 shape has
    a single key block, its MLA 192/128 shape two, and none is 96/64. 200 queries over 2100 keys (D = 64; 17 key
    blocks) or 1100 (9, just above that threshold), or over 700 (192/128, whose Q and K arrive as 128 + 64 columns:
    11 blocks of 64 keys; 96/64, as 64 + 32 columns: 6 blocks of 128), a ragged last block, S_q < S_kv, GQA, fp16
    and bf16, into NaN-poisoned outputs, against the reference (on an H100/H200 a spy checks the Hopper forward
    ran). On other machines the Triton kernel runs the same check."""
    from attention_kernels import flash_sm90

    case = (1, 4, 2, 200, s_kv, d_qk, d_v, causal)
    assert (d_qk, d_v) in flash_sm90.CONFIGS and s_kv >= flash_sm90.MIN_KEYS.get((d_qk, causal), 0)
    ran = spy_hopper(monkeypatch, "forward")
    for dtype in KERNEL_DTYPES:
        q, k, v, _ = make_inputs(case, dtype)
        ran.clear()
        out, lse = _forward(
            q, k, v, None, causal, out=poisoned((1, 4, 200, d_v), dtype), lse=poisoned((1, 4, 200), torch.float32)
        )
        ref_out, ref_lse = attention_reference(q.float(), k.float(), v.float(), causal=causal)
        assert_close(out, ref_out, dtype, "out")
        assert_close(lse, ref_lse, dtype, "lse")
        if on_hopper(q):
            assert ran == ["forward"], f"{dtype}: the Hopper forward did not run"


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("d,d_v", [(64, 64), (128, 128), (96, 64)], ids=["D64", "D128", "D96x64"])
def test_sm90_persistent_tiles(d, d_v, causal, monkeypatch):
    """The persistent Hopper kernels (the forward; dQ and dK/dV at D = 64 and MLA's 96/64) with many tiles per
    program: the launch sized for a GPU of two SMs, so each program takes 6-12 tiles from the counter, handing each
    to its consumers and cycling the Q/dO or K/V buffers and barrier phases over tiles, which the other tests'
    launches (one tile per program or fewer) never do (causal D = 64, below MIN_KEYS, runs the Triton forward and
    the persistent backward kernels). Forward and backward (ZOO_FLASH_SM90_BWD=force) into NaN-poisoned buffers
    against the reference; on an H100/H200 a spy checks which Hopper launchers ran. On other machines the Triton
    kernels run the same check."""
    from attention_kernels import flash_sm90_bwd_dkdv, flash_sm90_bwd_dq, flash_sm90_common, flash_sm90_fwd

    for module in (flash_sm90_fwd, flash_sm90_bwd_dq, flash_sm90_bwd_dkdv):
        monkeypatch.setattr(module, "num_sms", lambda device: 2)
    monkeypatch.setenv("ZOO_FLASH_SM90_BWD", "force")
    # Tile counters from a ring of two, so it runs out and is zeroed again inside each call (three persistent
    # launches at D = 64, two at D = 128); a counter left unzeroed would skip tiles and leave NaN in the outputs.
    monkeypatch.setattr(flash_sm90_common, "_RING_SIZE", 2)
    monkeypatch.setattr(flash_sm90_common, "_RINGS", {})
    # 24 forward and dQ tiles of 128 queries, 12 dK/dV tiles of 128 keys; bf16 on the GPU, fp16 on the CPU (whose
    # interpreter computes bf16 wrong).
    shapes = [(2, 4, 2, 300, 300, d, d_v, causal)]
    if (d, causal) == (96, True):  # MHA: the second dK/dV consumer skips each tile's first query block
        shapes.append((2, 4, 4, 300, 300, d, d_v, causal))  # (flash_sm90_bwd_dkdv._dkdv_lead), tile after tile
    ran = spy_hopper(monkeypatch, "forward", "backward_dq", "backward_dkdv", "backward_fused")
    expected = ["forward"] * ((d, causal) != (64, True)) + ["backward_dq", "backward_dkdv"]  # on an H100/H200
    for shape in shapes:
        for _ in range(2):
            ran.clear()
            check_forward_backward(shape, KERNEL_DTYPES[-1])
            if on_hopper(torch.empty(0, device=DEVICE)):
                assert ran == expected, f"{shape}: the Hopper launches were {ran}"


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("d", [64, 128], ids=["D64", "D128"])
def test_forward_into_strided_out(d, causal, monkeypatch):
    """out and lse preallocated as views whose row strides TMA cannot write (D + 1 and S + 3 elements): the Hopper
    forward, which writes its output by TMA, fills them from a contiguous buffer; every element is written and
    nothing outside the views. On an H100/H200 that is every case but causal D=64, whose 130 keys are below
    MIN_KEYS (the Triton kernel runs it; a spy checks which ran); on other machines the Triton kernel writes
    through the strides."""
    b, h_q, h_kv, s = 2, 4, 2, 130
    ran = spy_hopper(monkeypatch, "forward")
    for dtype in KERNEL_DTYPES:
        q, k, v, _ = make_inputs((b, h_q, h_kv, s, s, d, d, causal), dtype)
        out_base, lse_base = poisoned((b, h_q, s, d + 1), dtype), poisoned((b, h_q, s + 3), torch.float32)
        ran.clear()
        out, lse = _forward(q, k, v, None, causal, out=out_base[..., :d], lse=lse_base[..., :s])
        if on_hopper(q):
            assert ran == ([] if (d, causal) == (64, True) else ["forward"]), f"{dtype}: Hopper launches {ran}"
        ref_out, ref_lse = attention_reference(q.float(), k.float(), v.float(), causal=causal)
        assert_close(out, ref_out, dtype, "out")
        assert_close(lse, ref_lse, dtype, "lse")
        assert out.data_ptr() == out_base.data_ptr() and lse.data_ptr() == lse_base.data_ptr()
        assert out_base[..., d:].isnan().all() and lse_base[..., s:].isnan().all()


def test_sm90_staged_grads():
    """flash_sm90.staged_grads, the host step of the kernels that write dK and dV by TMA (the one-tile dK/dV launch and
    the one-launch backward): a dk whose rows TMA cannot write (stride D + 1) goes through a contiguous buffer that
    is copied back, a dv of another dtype through one in the launch's dtype, a writable one is passed as it is; with
    both writable nothing is run."""
    from attention_kernels.flash_sm90 import staged_grads

    dk = torch.zeros(1, 2, 8, 65)[..., :64]
    dv = torch.zeros(1, 2, 8, 64, dtype=torch.float16)
    seen = []

    def launch(dk_, dv_):
        seen.append((dk_, dv_))
        dk_.fill_(1.0)
        dv_.fill_(2.0)

    assert staged_grads(launch, torch.float16, dk, dv)
    ((dk_, dv_),) = seen
    assert dk_ is not dk and dk_.is_contiguous() and dk_.dtype == torch.float16 and dv_ is dv
    assert (dk == 1.0).all() and (dv == 2.0).all()
    dv32 = torch.zeros(1, 2, 8, 64)
    assert staged_grads(launch, torch.float16, dv, dv32) and seen[-1][0] is dv and seen[-1][1].dtype == torch.float16
    assert (dv32 == 2.0).all()
    assert not staged_grads(launch, torch.float16, dv, dv.clone()) and len(seen) == 2


@pytest.mark.parametrize("d,d_v", [(128, 128), (192, 128), (64, 64)], ids=["D128", "D192x128", "D64"])
def test_backward_into_strided_grads(d, d_v, monkeypatch):
    """dq and dk preallocated as views whose row strides TMA cannot write (D + 1 elements), dv contiguous: the Hopper
    dK/dV kernel that writes dK and dV by TMA (D=128 and 192/128, one program per tile) fills dk from a contiguous
    buffer and dv directly (on an H100/H200 a spy checks that: the launcher runs again into the staged dk), the
    persistent one (D=64) stores through the strides; every element is written and nothing outside the views
    (ZOO_FLASH_SM90_BWD=force: the Hopper kernels even for this small launch). On other machines the Triton
    kernels write through the strides."""
    from attention_kernels import flash

    monkeypatch.setenv("ZOO_FLASH_SM90_BWD", "force")
    case = (2, 4, 2, 200, 200, d, d_v, True)
    dtype = KERNEL_DTYPES[-1]
    q, k, v, do = make_inputs(case, dtype)
    out, lse = _forward(q, k, v, None, True)
    bases = [poisoned((*x.shape[:-1], x.shape[-1] + 1), dtype) for x in (q, k)] + [poisoned(v.shape, dtype)]
    grads = tuple(base[..., : x.shape[-1]] for base, x in zip(bases, (q, k, v)))
    hopper = flash.flash_sm90
    launches = []  # per launch of backward_dkdv: (dk is the caller's view, dv is the caller's tensor)
    if hopper is not None:
        launch = hopper.backward_dkdv

        def spy(q_, k_, v_, do_, lse2, delta, dk, dv, *rest, **kwargs):
            launches.append((dk is grads[1], dv is grads[2]))
            return launch(q_, k_, v_, do_, lse2, delta, dk, dv, *rest, **kwargs)

        # flash.py calls the package's name, the staged relaunch its own module's: both go through the spy
        from attention_kernels import flash_sm90_bwd_dkdv

        monkeypatch.setattr(hopper, "backward_dkdv", spy)
        monkeypatch.setattr(flash_sm90_bwd_dkdv, "backward_dkdv", spy)
    got = _backward(q, k, v, out, lse, do, None, True, grads=grads)
    for name, g, want, base in zip(("dq", "dk", "dv"), got, reference_grads(q, k, v, do, True)[2:], bases):
        assert_close(g, want, dtype, name, grad=True)
        assert g.data_ptr() == base.data_ptr(), name
        if g.shape != base.shape:
            assert torch.isnan(base[..., -1]).all(), f"{name}: written outside the view"
    if hopper is not None and hopper.supports_backward(q, k, v, do):  # an H100/H200: the Hopper dK/dV ran
        persistent = hopper.BWD_CONFIGS[(d, d_v)][2]
        assert launches == ([(True, True)] if persistent else [(True, True), (False, True)]), launches


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=DTYPE_IDS.get)
def test_sm90_descriptor_matches_from_tensor(dtype):
    """flash_sm90.descriptor builds the TMA descriptor without TensorDescriptor's per-call checks (host time); it
    must be the object `TensorDescriptor.from_tensor` builds: same class, fields and layout, for a strided view."""
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    from attention_kernels.flash_sm90 import descriptor

    gl_dtype = {torch.bfloat16: gl.bfloat16, torch.float16: gl.float16, torch.float32: gl.float32}[dtype]
    t = torch.zeros(2, 8, 100, 256, dtype=dtype)[:, 1:5, :, :128]
    for block in ([1, 1, 64, 128], [1, 1, 128, 128], [64]):
        x = t if len(block) == 4 else t.reshape(-1)
        got = descriptor(x, block)
        want = TensorDescriptor.from_tensor(x, block, gl.NVMMASharedLayout.get_default_for(block, gl_dtype))
        assert type(got) is TensorDescriptor
        assert got.base is x and got.padding == want.padding
        assert list(got.shape) == list(want.shape) and list(got.strides) == list(want.strides)
        assert list(got.block_shape) == list(want.block_shape) and got.layout == want.layout


def test_sm90_backward_mode(monkeypatch):
    """ZOO_FLASH_SM90_BWD is 1 (default), 0, force or fused; anything else is an error that says what is valid."""
    from attention_kernels.flash_sm90 import backward_mode

    monkeypatch.delenv("ZOO_FLASH_SM90_BWD", raising=False)
    assert backward_mode() == "1"
    for mode in ("0", "1", "force", "fused"):
        monkeypatch.setenv("ZOO_FLASH_SM90_BWD", mode)
        assert backward_mode() == mode
    monkeypatch.setenv("ZOO_FLASH_SM90_BWD", "yes")
    with pytest.raises(ValueError, match="expected 0"):
        backward_mode()


def test_sm90_eligibility():
    """Which inputs the Hopper forward takes (on an sm_90 GPU): fp16/bf16 with D_qk == D_v in {64, 128} or MLA's
    D_qk, D_v = 192, 128 or 96, 64, and TMA-readable strides; everything else (fp32, other head dims, a head dim that
    is not contiguous, a misaligned stride) goes to the Triton kernel."""
    from attention_kernels.flash_sm90 import eligible

    def qkv(d_qk=128, d_v=128, dtype=torch.bfloat16, h=4, s=64):
        return (
            torch.zeros(1, h, s, d_qk, dtype=dtype),
            torch.zeros(1, 2, s, d_qk, dtype=dtype),
            torch.zeros(1, 2, s, d_v, dtype=dtype),
        )

    assert eligible(*qkv())
    assert eligible(*qkv(dtype=torch.float16))
    q, k, v = (torch.zeros(1, 64, h, 128, dtype=torch.bfloat16).transpose(1, 2) for h in (4, 2, 2))
    assert eligible(q, k, v), "the model's (B, S, H, D) layout seen as (B, H, S, D)"
    assert not eligible(*qkv(dtype=torch.float32))
    assert eligible(*qkv(d_qk=64, d_v=64))
    assert not eligible(*qkv(d_qk=96, d_v=96))
    assert eligible(*qkv(d_qk=192, d_v=128)) and eligible(*qkv(d_qk=96, d_v=64))
    assert not eligible(*qkv(d_qk=192, d_v=192)) and not eligible(*qkv(d_qk=128, d_v=64))
    q, k, v = qkv()
    assert not eligible(q.transpose(2, 3).contiguous().transpose(2, 3), k, v), "head dim not contiguous"
    big = torch.zeros(1, 4, 64, 136, dtype=torch.bfloat16)
    assert eligible(big[..., :128], k, v)
    odd = torch.zeros(1, 4, 64, 129, dtype=torch.bfloat16)
    assert not eligible(odd[..., :128], k, v), "row stride of 258 bytes is not 16-byte aligned"


def test_routes_are_kept_per_signature(monkeypatch):
    """A forward's and a backward's checks and kernel choice are made once per signature (shapes, strides, dtypes,
    devices, alignment, scale, causal and the ZOO_FLASH_* switches) and kept: a repeated call makes none, and a change
    of any of those makes them anew. Bad input is still refused: it never makes a route."""
    from attention_kernels import flash

    monkeypatch.setattr(flash, "_ROUTES", {})
    made = []
    for name in ("_forward_route", "_backward_route"):
        original = getattr(flash, name)
        monkeypatch.setattr(flash, name, lambda *a, _f=original, _n=name, **kw: made.append(_n) or _f(*a, **kw))
    dtype = KERNEL_DTYPES[0]
    q, k, v, do = make_inputs((1, 4, 2, 40, 40, 32, 32, True), dtype)

    def step(q, k, v):
        leaves = [x.clone().requires_grad_() for x in (q, k, v)]
        out = flash_gqa_attention(*leaves, causal=True)
        out.backward(do)

    step(q, k, v)
    step(q, k, v)
    assert made == ["_forward_route", "_backward_route"]
    monkeypatch.setenv("ZOO_FLASH_TMA", "0")
    step(q, k, v)
    assert len(made) == 4
    step(q.transpose(1, 2).contiguous().transpose(1, 2), k, v)  # the same values in (B, S, H, D) memory
    assert len(made) == 6
    with pytest.raises(ValueError, match="H_kv >= 1 dividing H_q"):
        flash_gqa_attention(q, k[:, :1].expand(-1, 3, -1, -1), v[:, :1].expand(-1, 3, -1, -1), causal=True)
    assert len(made) == 6 and len(flash._ROUTES) == 6


def test_inference_calls_skip_autograd_and_still_check(monkeypatch):
    """With nothing to differentiate (no_grad, or inputs that do not require grad) the forward runs the launcher
    without the autograd Function, with the same result; a bad input is refused as clearly as on the autograd path."""
    from attention_kernels import flash

    dtype = KERNEL_DTYPES[0]
    q, k, v, _ = make_inputs((1, 4, 2, 24, 24, 32, 32, True), dtype)
    want = flash_gqa_attention(q.clone().requires_grad_(), k, v, causal=True).detach()

    def refuse(*args):
        raise AssertionError("the autograd Function ran for a call with nothing to differentiate")

    monkeypatch.setattr(flash._FlashAttention, "apply", refuse)
    monkeypatch.setattr(flash, "_ROUTES", {})
    with torch.no_grad():
        got = flash_gqa_attention(q.clone().requires_grad_(), k, v, causal=True)
    assert torch.equal(got, want)
    assert torch.equal(flash_gqa_attention(q, k, v, causal=True), want)  # grad mode on, nothing requires grad
    with torch.no_grad(), pytest.raises(ValueError, match="H_kv >= 1 dividing H_q"):
        flash_gqa_attention(q, k[:, :1].expand(-1, 3, -1, -1), v[:, :1].expand(-1, 3, -1, -1), causal=True)
    with torch.no_grad(), pytest.raises(ValueError, match="scale"):
        flash_gqa_attention(q, k, v, scale=-1.0, causal=True)
