"""grouped_decode and paged_grouped_decode against attention_kernels.reference, on the CPU (interpreter, fp32/fp16) and
the GPU (fp16/bf16): head dims 32-128 including 48 and 80, D_qk != D_v, group sizes 1, 2, 3, 4, MQA and groups wider
than one head tile, ragged lengths including 1, explicit and automatic splits (more splits than tiles too), shuffled
block tables at page sizes 8-256, RoPE score terms, non-contiguous inputs, every bad input, torch.compile."""

import math

import pytest
import torch
import triton
from conftest import DEVICE, DTYPE_IDS, KERNEL_DTYPES, assert_close, check_dependent_chain, ragged_lens, spy_launches

from attention_kernels import decode, paged_grouped_decode, split_kv
from attention_kernels.decode import auto_num_splits, grouped_decode
from attention_kernels.reference import decode_reference, paged_decode_reference


@pytest.fixture(autouse=True)
def _poison(poison_decode_outputs):
    """Every output and partial of the decode kernels starts as NaN (conftest.poison_decode_outputs)."""


def _check(out, lse, ref_out, ref_lse, dtype, name):
    assert out.dtype == dtype and lse.dtype == torch.float32
    assert_close(out, ref_out, dtype, f"{name} out")
    assert_close(lse, ref_lse, torch.float32 if dtype == torch.float32 else dtype, f"{name} lse")


# (B, H_q, H_kv, S_max, D_qk, D_v, explicit splits): group sizes 1, 2, 3, 4, MQA (8 and 32 wide) and a group of
# 80 (two head tiles); 9 splits of 65 tokens leave splits with nothing to do; a one-token cache; 300 tokens in
# one split run the online softmax over several tiles in one program (tiles are 64 or 128 tokens).
CASES = [
    (2, 4, 2, 1, 32, 32, 2),
    (2, 4, 1, 300, 32, 32, 1),
    (2, 2, 2, 65, 32, 32, 9),
    (2, 8, 4, 63, 48, 48, 1),
    (2, 6, 2, 17, 80, 48, 2),
    (3, 8, 2, 130, 64, 64, 3),
    (2, 8, 1, 65, 128, 128, 5),
    (1, 32, 1, 40, 64, 32, 1),
    (1, 80, 1, 20, 32, 32, 2),
]
CASE_IDS = [f"B{b}-Hq{hq}-Hkv{hkv}-S{s}-D{d}" + (f"-Dv{dv}" if dv != d else "") for b, hq, hkv, s, d, dv, _ in CASES]


@pytest.mark.parametrize("auto", [True, False], ids=["splitsAuto", "splitsFixed"])
@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
@pytest.mark.parametrize("dtype", KERNEL_DTYPES, ids=DTYPE_IDS.get)
def test_grouped_decode_matches_reference(dtype, case, auto):
    b, hq, hkv, s, d, dv, splits = case
    q = torch.randn(b, hq, d, device=DEVICE, dtype=dtype)
    k = torch.randn(b, hkv, s, d, device=DEVICE, dtype=dtype)
    v = torch.randn(b, hkv, s, dv, device=DEVICE, dtype=dtype)
    seq_lens = ragged_lens(b, s)
    scale = 1 / math.sqrt(d)
    out, lse = grouped_decode(q, k, v, seq_lens, scale=scale, num_splits=None if auto else splits)
    ref_out, ref_lse = decode_reference(q, k, v, seq_lens, scale=scale)
    _check(out, lse, ref_out, ref_lse, dtype, "grouped_decode")


@pytest.mark.parametrize(
    "sms, tiles",
    [(28, (128, 4, 3)), (7, (64, 4, 3)), (4, (64, 4, 2)), (2, (128, 4, 3))],
    ids=["load0.5", "load2", "load3.5", "load7"],
)
def test_grouped_decode_at_every_load(sms, tiles, monkeypatch):
    """D=128 contiguous decode with each of `_tile_config`'s tiles (14 programs on a GPU of `sms` SMs: programs per
    SM 0.5, 2, 3.5, 7), ragged lengths over several tiles, against the reference; fp16, which both the GPU and the
    interpreter compute right."""
    monkeypatch.setattr(decode, "num_sms", lambda device: sms)
    b, hq, hkv, s, d = 7, 4, 2, 300, 128
    assert decode._tile_config(d, d, 2, False, decode._load(b * hkv, False, torch.device(DEVICE))) == tiles
    q = torch.randn(b, hq, d, device=DEVICE, dtype=torch.float16)
    k = torch.randn(b, hkv, s, d, device=DEVICE, dtype=torch.float16)
    v = torch.randn(b, hkv, s, d, device=DEVICE, dtype=torch.float16)
    seq_lens = ragged_lens(b, s)
    out, lse = grouped_decode(q, k, v, seq_lens, scale=d**-0.5)
    ref_out, ref_lse = decode_reference(q, k, v, seq_lens, scale=d**-0.5)
    _check(out, lse, ref_out, ref_lse, torch.float16, "grouped_decode")


@pytest.mark.parametrize("dtype", KERNEL_DTYPES, ids=DTYPE_IDS.get)
def test_grouped_decode_rope_term(dtype):
    b, hq, hkv, s, d, dr = 2, 6, 2, 37, 32, 16
    q, k, v = (
        torch.randn(b, hq, d, device=DEVICE, dtype=dtype),
        torch.randn(b, hkv, s, d, device=DEVICE, dtype=dtype),
        torch.randn(b, hkv, s, 48, device=DEVICE, dtype=dtype),
    )
    q_rope = torch.randn(b, hq, dr, device=DEVICE, dtype=dtype)
    k_rope = torch.randn(b, hkv, s, dr, device=DEVICE, dtype=dtype)
    seq_lens = ragged_lens(b, s)
    out, lse = grouped_decode(q, k, v, seq_lens, scale=0.15, num_splits=2, q_rope=q_rope, k_rope=k_rope)
    ref_out, ref_lse = decode_reference(q, k, v, seq_lens, scale=0.15, q_rope=q_rope, k_rope=k_rope)
    _check(out, lse, ref_out, ref_lse, dtype, "grouped_decode+rope")


@pytest.mark.parametrize("dtype", KERNEL_DTYPES, ids=DTYPE_IDS.get)
def test_grouped_decode_non_contiguous(dtype):
    """q a slice of a wider projection; the cache stored (B, S, H_kv, D) and viewed as (B, H_kv, S, D)."""
    b, hq, hkv, s, d = 2, 8, 2, 50, 64
    q = torch.randn(b, hq, 2 * d, device=DEVICE, dtype=dtype)[..., d:]
    k = torch.randn(b, s, hkv, d, device=DEVICE, dtype=dtype).transpose(1, 2)
    v = torch.randn(b, s, hkv, 2 * d, device=DEVICE, dtype=dtype).transpose(1, 2)[..., ::2]
    assert not (q.is_contiguous() or k.is_contiguous() or v.is_contiguous())
    seq_lens = ragged_lens(b, s)
    out, lse = grouped_decode(q, k, v, seq_lens, scale=0.125, num_splits=3)
    ref_out, ref_lse = decode_reference(q, k, v, seq_lens, scale=0.125)
    _check(out, lse, ref_out, ref_lse, dtype, "grouped_decode non-contiguous")


def _paged(k, v, page_size, extra_pages=3):
    """Scatter a contiguous cache (B, H_kv, S, D) into shuffled pages: (pool_k, pool_v, block_table)."""
    b, hkv, s, _ = k.shape
    max_pages = -(-s // page_size)
    num_pages = b * max_pages + extra_pages
    table = torch.randperm(num_pages, device=DEVICE)[: b * max_pages].reshape(b, max_pages).to(torch.int32)
    pools = []
    for x in (k, v):
        pool = torch.randn(num_pages, page_size, hkv, x.shape[-1], device=DEVICE, dtype=x.dtype)  # unused pages: noise
        padded = torch.zeros(b, hkv, max_pages * page_size, x.shape[-1], device=DEVICE, dtype=x.dtype)
        padded[:, :, :s] = x
        pool[table.long()] = padded.reshape(b, hkv, max_pages, page_size, -1).permute(0, 2, 3, 1, 4)
        pools.append(pool)
    return pools[0], pools[1], table


# (page_size, B, H_q, H_kv, S_max, D): tiles smaller than, equal to and larger than a page.
PAGED_CASES = [(8, 3, 6, 2, 70, 48), (16, 2, 8, 2, 100, 64), (64, 3, 4, 1, 150, 32), (256, 2, 4, 2, 300, 80)]


@pytest.mark.parametrize("num_splits", [None, 4], ids=lambda s: f"splits{s or 'Auto'}")
@pytest.mark.parametrize(
    "case", PAGED_CASES, ids=[f"page{p}-B{b}-Hq{hq}-Hkv{hkv}-S{s}-D{d}" for p, b, hq, hkv, s, d in PAGED_CASES]
)
@pytest.mark.parametrize("dtype", KERNEL_DTYPES, ids=DTYPE_IDS.get)
def test_paged_decode_matches_reference(dtype, case, num_splits):
    page_size, b, hq, hkv, s, d = case
    q = torch.randn(b, hq, d, device=DEVICE, dtype=dtype)
    k = torch.randn(b, hkv, s, d, device=DEVICE, dtype=dtype)
    v = torch.randn(b, hkv, s, d, device=DEVICE, dtype=dtype)
    k_pages, v_pages, table = _paged(k, v, page_size)
    seq_lens = ragged_lens(b, s)
    out, lse = paged_grouped_decode(q, k_pages, v_pages, table, seq_lens, scale=0.1, num_splits=num_splits)
    ref_out, ref_lse = decode_reference(q, k, v, seq_lens, scale=0.1)
    _check(out, lse, ref_out, ref_lse, dtype, "paged_grouped_decode")
    ref_out2, _ = paged_decode_reference(q, k_pages, v_pages, table, seq_lens, scale=0.1)
    assert_close(out, ref_out2, dtype, "paged_grouped_decode vs paged reference")


@pytest.mark.parametrize("dtype", KERNEL_DTYPES, ids=DTYPE_IDS.get)
def test_paged_decode_rope_and_non_contiguous_pool(dtype):
    """RoPE pool beside the K/V pools; the pools are views into one interleaved buffer (strided)."""
    b, hq, hkv, s, d, dr, page_size = 2, 4, 2, 40, 32, 16, 16
    q = torch.randn(b, hq, d, device=DEVICE, dtype=dtype)
    k, v = (torch.randn(b, hkv, s, d, device=DEVICE, dtype=dtype) for _ in range(2))
    k_rope = torch.randn(b, hkv, s, dr, device=DEVICE, dtype=dtype)
    q_rope = torch.randn(b, hq, dr, device=DEVICE, dtype=dtype)
    k_pages, v_pages, table = _paged(k, v, page_size)
    kr_pages = torch.empty(*k_pages.shape[:3], dr, device=DEVICE, dtype=dtype)
    kr_pages[table.long()] = (
        torch.nn.functional.pad(k_rope, (0, 0, 0, table.shape[1] * page_size - s))
        .reshape(b, hkv, table.shape[1], page_size, dr)
        .permute(0, 2, 3, 1, 4)
    )
    both = torch.stack([k_pages, v_pages], dim=2)  # (pages, page_size, 2, H_kv, D): K and V interleaved
    k_view, v_view = both[:, :, 0], both[:, :, 1]
    assert not k_view.is_contiguous()
    seq_lens = ragged_lens(b, s)
    out, lse = paged_grouped_decode(
        q, k_view, v_view, table, seq_lens, scale=0.2, num_splits=None, q_rope=q_rope, k_rope_pages=kr_pages
    )
    ref_out, ref_lse = decode_reference(q, k, v, seq_lens, scale=0.2, q_rope=q_rope, k_rope=k_rope)
    _check(out, lse, ref_out, ref_lse, dtype, "paged_grouped_decode+rope")


def test_paged_matches_contiguous_on_ragged_batch():
    """Same cache, same lengths: the paged op and the contiguous op agree to rounding."""
    dtype = KERNEL_DTYPES[-1]
    b, hq, hkv, s, d = 4, 8, 2, 96, 64
    q = torch.randn(b, hq, d, device=DEVICE, dtype=dtype)
    k, v = (torch.randn(b, hkv, s, d, device=DEVICE, dtype=dtype) for _ in range(2))
    k_pages, v_pages, table = _paged(k, v, 32)
    seq_lens = torch.tensor([96, 1, 33, 64], dtype=torch.int32, device=DEVICE)
    a, lse_a = grouped_decode(q, k, v, seq_lens, scale=0.1)
    p, lse_p = paged_grouped_decode(q, k_pages, v_pages, table, seq_lens, scale=0.1)
    assert_close(p, a, dtype, "paged vs contiguous")
    assert_close(lse_p, lse_a, dtype, "paged vs contiguous lse")


# The inputs the Hopper kernel (attention_kernels/decode_sm90.py) takes on an H100/H200 in fp16/bf16: D 64 or 128, no
# RoPE; (B, H_q, H_kv, S_max, D, page_size (0: contiguous), splits (None: automatic)). Group sizes 4, 32 (MQA), 1 and 80
# (two head tiles, the second one of 16 heads); pages smaller than, equal to and larger than a tile; 300 tokens in
# one split run several tiles per program. On the CPU the Triton kernel runs them (the interpreter), and on the GPU
# also with ZOO_DECODE_SM90=0.
SM90_CASES = [
    (3, 8, 2, 200, 128, 0, None),
    (2, 32, 1, 300, 64, 0, 3),
    (2, 4, 4, 70, 128, 0, 2),
    (1, 80, 1, 150, 64, 0, None),
    (3, 8, 2, 200, 128, 8, None),
    (2, 32, 1, 300, 64, 16, 3),
    (3, 8, 2, 200, 128, 64, 4),
    (2, 8, 2, 300, 64, 256, None),
]
SM90_KERNELS = ["default", "triton"] if DEVICE == "cuda" else ["default"]


def _nan_past_end(pools, table, seq_lens, page_size):
    """Copies of page pools (num_pages, page_size, H_kv, D) with NaN in every row no sequence uses: unused pages, and
    each sequence's slots past its length."""
    used = torch.zeros(pools[0].shape[:2], dtype=torch.bool, device=DEVICE)
    for b, n in enumerate(seq_lens.tolist()):
        rows = torch.arange(n, device=DEVICE)
        used[table[b, rows // page_size].long(), rows % page_size] = True
    return [p.masked_fill(~used[:, :, None, None], float("nan")) for p in pools]


@pytest.mark.parametrize("kernel", SM90_KERNELS)
@pytest.mark.parametrize(
    "case",
    SM90_CASES,
    ids=[
        f"B{b}-Hq{hq}-Hkv{hkv}-S{s}-D{d}-" + (f"page{p}" if p else "contig") + f"-splits{n or 'Auto'}"
        for b, hq, hkv, s, d, p, n in SM90_CASES
    ],
)
@pytest.mark.parametrize("dtype", KERNEL_DTYPES, ids=DTYPE_IDS.get)
def test_decode_never_reads_past_the_end(dtype, case, kernel, monkeypatch):
    """Every cache row past a sequence's end (and every unused page) holds NaN: a kernel that reads such a row and
    gives it zero weight returns NaN (0 * NaN), so the output must come from the valid rows alone."""
    if kernel == "triton":
        monkeypatch.setenv("ZOO_DECODE_SM90", "0")
    b, hq, hkv, s, d, page_size, splits = case
    q = torch.randn(b, hq, d, device=DEVICE, dtype=dtype)
    k, v = (torch.randn(b, hkv, s, d, device=DEVICE, dtype=dtype) for _ in range(2))
    seq_lens = ragged_lens(b, s)
    ref_out, ref_lse = decode_reference(q, k, v, seq_lens, scale=0.1)
    if page_size:
        k_pages, v_pages, table = _paged(k, v, page_size)
        k_pages, v_pages = _nan_past_end((k_pages, v_pages), table, seq_lens, page_size)
        out, lse = paged_grouped_decode(q, k_pages, v_pages, table, seq_lens, scale=0.1, num_splits=splits)
    else:
        past_end = torch.arange(s, device=DEVICE)[None, :] >= seq_lens[:, None]  # (B, S)
        k, v = (x.masked_fill(past_end[:, None, :, None], float("nan")) for x in (k, v))
        out, lse = grouped_decode(q, k, v, seq_lens, scale=0.1, num_splits=splits)
    _check(out, lse, ref_out, ref_lse, dtype, "decode" + (f" page {page_size}" if page_size else ""))
    if DEVICE == "cuda" and kernel == "default" and page_size:  # the Hopper kernel's inputs on an H100/H200
        from attention_kernels import decode_sm90

        assert decode._sm90_supports(q, k_pages, v_pages, None) == decode_sm90.on_hopper(q)


def _appended(k, v, k_new, v_new, seq_lens, table=None):
    """Copies of the cache (contiguous (B, H_kv, S, D) or pools with their table) holding each sequence's new token
    at position seq_lens[b] - 1, in the cache's dtype: what an append must leave."""
    k, v = k.clone(), v.clone()
    for b, n in enumerate(seq_lens.tolist()):
        if table is None:
            k[b, :, n - 1], v[b, :, n - 1] = k_new[b], v_new[b]
        else:
            page_size = k.shape[1]
            page = int(table[b, (n - 1) // page_size])
            k[page, (n - 1) % page_size], v[page, (n - 1) % page_size] = k_new[b], v_new[b]
    return k, v


@pytest.mark.parametrize("kernel", SM90_KERNELS)
@pytest.mark.parametrize(
    "case",
    SM90_CASES + [(2, 6, 2, 17, 80, 0, 2), (2, 4, 2, 1, 32, 0, 2), (3, 6, 2, 70, 48, 8, 9)],
    ids=lambda c: (
        f"B{c[0]}-Hq{c[1]}-Hkv{c[2]}-S{c[3]}-D{c[4]}-"
        + (f"page{c[5]}" if c[5] else "contig")
        + f"-splits{c[6] or 'Auto'}"
    ),
)
@pytest.mark.parametrize("dtype", KERNEL_DTYPES, ids=DTYPE_IDS.get)
def test_decode_appends_the_new_token(dtype, case, kernel, monkeypatch):
    """k_new / v_new: the launch stores each sequence's new token at seq_lens - 1 and attends to it, as a write into
    the cache and then a decode would; every other entry of the cache stays as it was. Cases: the Hopper kernel's
    inputs (on a GPU it stores them in a launch of its own before it reads), D 80 with two splits, a one-token cache
    (only the new token), more splits than tiles; the new tokens in fp32, stored in the cache's dtype."""
    if kernel == "triton":
        monkeypatch.setenv("ZOO_DECODE_SM90", "0")
    b, hq, hkv, s, d, page_size, splits = case
    q = torch.randn(b, hq, d, device=DEVICE, dtype=dtype)
    k, v = (torch.randn(b, hkv, s, d, device=DEVICE, dtype=dtype) for _ in range(2))
    k_new, v_new = (torch.randn(b, hkv, d, device=DEVICE) for _ in range(2))
    seq_lens = ragged_lens(b, s)
    if page_size:
        k, v, table = _paged(k, v, page_size)
    want_k, want_v = _appended(k, v, k_new.to(dtype), v_new.to(dtype), seq_lens, table if page_size else None)
    if page_size:
        ref_out, ref_lse = paged_decode_reference(q, want_k, want_v, table, seq_lens, scale=0.1)
        out, lse = paged_grouped_decode(
            q, k, v, table, seq_lens, scale=0.1, num_splits=splits, k_new=k_new, v_new=v_new
        )
    else:
        ref_out, ref_lse = decode_reference(q, want_k, want_v, seq_lens, scale=0.1)
        out, lse = grouped_decode(q, k, v, seq_lens, scale=0.1, num_splits=splits, k_new=k_new, v_new=v_new)
    _check(out, lse, ref_out, ref_lse, dtype, "decode with append")
    assert torch.equal(k, want_k) and torch.equal(v, want_v), "the cache after the append"


def test_decode_appends_through_strided_views():
    """The new tokens as the model hands them over (strided views of one projection) into a cache stored
    (B, S, H_kv, D) and viewed (B, H_kv, S, D), as cache.GroupedCache holds it."""
    dtype = KERNEL_DTYPES[-1]
    b, hq, hkv, s, d = 3, 8, 2, 50, 32
    q = torch.randn(b, hq, d, device=DEVICE, dtype=dtype)
    k, v = (torch.randn(b, s, hkv, d, device=DEVICE, dtype=dtype).transpose(1, 2) for _ in range(2))
    kv = torch.randn(b, 2, hkv, d, device=DEVICE, dtype=dtype)
    k_new, v_new = kv[:, 0], kv[:, 1]
    seq_lens = ragged_lens(b, s)
    want_k, want_v = _appended(k, v, k_new, v_new, seq_lens)
    ref_out, ref_lse = decode_reference(q, want_k, want_v, seq_lens, scale=0.1)
    out, lse = grouped_decode(q, k, v, seq_lens, scale=0.1, num_splits=3, k_new=k_new, v_new=v_new)
    _check(out, lse, ref_out, ref_lse, dtype, "strided append")
    assert torch.equal(k, want_k) and torch.equal(v, want_v)


def test_sm90_eligibility():
    """Which paged inputs the Hopper decode kernel takes (on an sm_90 GPU): fp16/bf16, D_qk == D_v in {64, 128}, no
    RoPE, pools whose slots hold their heads side by side (TMA reads them as (pages, page_size, H_kv * D)).
    Everything else, and every contiguous cache, runs the Triton kernel."""
    from attention_kernels.decode_sm90 import eligible

    def inputs(d=128, dv=None, dtype=torch.bfloat16):
        return (
            torch.zeros(2, 8, d, dtype=dtype),
            torch.zeros(6, 16, 2, d, dtype=dtype),
            torch.zeros(6, 16, 2, dv or d, dtype=dtype),
        )

    assert eligible(*inputs(), None) and eligible(*inputs(64), None)
    assert eligible(*inputs(dtype=torch.float16), None)
    assert not eligible(*inputs(dtype=torch.float32), None)
    assert not eligible(*inputs(96), None) and not eligible(*inputs(128, 64), None)
    q, k, v = inputs()
    assert not eligible(q, k, v, torch.zeros(2, 8, 16, dtype=q.dtype)), "a RoPE term"
    both = torch.zeros(6, 16, 2, 2, 128, dtype=q.dtype)  # K and V interleaved per slot: each pool's heads packed
    assert eligible(q, both[:, :, 0], both[:, :, 1], None)
    spread = torch.zeros(6, 16, 2, 256, dtype=q.dtype)[..., :128]  # heads 256 apart: not one row of H_kv * D
    assert not eligible(q, spread, spread, None)
    odd = torch.zeros(6, 16, 2 * 128 + 1, dtype=q.dtype)[..., :256].unflatten(2, (2, 128))  # slots 514 bytes apart
    assert not eligible(q, odd, odd, None)


# (D, page size, splits, crowded: the ring of a launch with more programs than SMs, `decode_sm90.launch_config`)
SM90_STRUCTURE = [
    (128, 8, 1, False),
    (128, 16, 4, False),
    (128, 64, 2, False),
    (128, 256, 1, False),
    (64, 16, 1, False),
    (64, 128, 4, False),
    (128, 16, 4, True),
    (128, 64, 1, True),
]


@pytest.mark.slow
@pytest.mark.parametrize(
    "d,page_size,splits,crowded",
    SM90_STRUCTURE,
    ids=[f"D{d}-page{p}-splits{n}" + ("-crowded" if c else "") for d, p, n, c in SM90_STRUCTURE],
)
def test_sm90_kernel_structure(d, page_size, splits, crowded):
    """The Hopper paged decode kernel (Gluon, no CPU interpreter; its numerics run in the paged cases above on an
    H100/H200) compiled for sm_90 on any machine, with pages smaller than, equal to and larger than a tile, and
    with the shorter ring of crowded launches: a loader warp (setmaxnreg 40) with TMA loads, one Q K^T and one P V
    per tile (m64nBLOCK_N and m64nD wgmma), 128 registers per thread at launch and shared memory for two programs
    per SM, no spills. With splits (a group of four) the launch combines them itself: one release-acquire ticket
    per program. Compiled as a programmatic dependent launch (WAIT, with the crowded ring here), it waits once
    (griddepcontrol.wait)."""
    import re

    from conftest import compile_gluon_sm90, setmaxnreg_counts, spill_bytes

    from attention_kernels import decode_sm90

    block_n, stages = decode_sm90.CONFIGS[d]
    if crowded:
        stages = decode_sm90.CROWDED_STAGES[d]
    rows = min(page_size, block_n)
    block = [1, rows, d]
    types = dict(
        q_ptr="*bf16",
        k_desc=dict(block=block, dtype="bfloat16"),
        v_desc=dict(block=block, dtype="bfloat16"),
        seq_lens_ptr="*i32",
        table_ptr="*i32",
        out_ptr="*bf16" if splits == 1 else "*fp32",
        lse_ptr="*fp32",
        final_out_ptr="*bf16",
        final_lse_ptr="*fp32",
        counters_ptr="*i32",
        scale_log2="fp32",
    )
    chunk = split_kv.fused_combine_chunk(splits, 4, d, split_kv.FUSED_COMBINE_MIN_ROWS, torch.device("cpu"))
    assert (chunk > 0) == (splits > 1)
    const = dict(
        BLOCK_N=block_n, D=d, STAGES=stages, PAGE_SIZE=page_size, PAGE_ROWS=rows, MERGE_H=4, CHUNK=chunk, WAIT=crowded
    )
    result = compile_gluon_sm90(
        "attention_kernels.decode_sm90",
        "_grouped_decode_sm90_kernel",
        types,
        const,
        options=dict(maxnreg=decode_sm90.MAX_REGS),
    )
    ptx = result["ptx"]
    assert "40" in setmaxnreg_counts(ptx), setmaxnreg_counts(ptx)
    assert "cp.async.bulk.tensor" in ptx, "no TMA load"
    shapes = re.findall(r"wgmma\.mma_async\.sync\.aligned\.(m\d+n\d+k\d+)", ptx)
    assert sorted(shapes) == sorted([f"m64n{block_n}k16"] * (d // 16) + [f"m64n{d}k16"] * (block_n // 16)), shapes
    assert 2 * result["shared"] <= 228 * 1024 - 2048, f"{result['shared']} bytes: two programs per SM must fit"
    assert re.search(r"Used (\d+) registers", result["ptxas"]).group(1) == str(decode_sm90.MAX_REGS)
    spills = spill_bytes(result["ptxas"])
    assert spills and all(a == 0 and b == 0 for a, b in spills), result["ptxas"]
    assert ptx.count("atom.global.gpu.acq_rel.add") == (1 if chunk else 0)
    assert ptx.count("griddepcontrol.wait") == (1 if crowded else 0), "a dependent launch waits once, first"


def test_sm90_crowded_launch_config(monkeypatch):
    """The Hopper paged kernel's ring: CONFIGS up to one program per SM, CROWDED_STAGES (D=128) beyond, and the
    split model's count of programs per SM (shared_bytes) stays that of CONFIGS' ring."""
    from attention_kernels import decode_sm90

    gpu = torch.device("cuda", 0)
    monkeypatch.setattr(decode_sm90, "num_sms", lambda device: 132)
    assert decode_sm90.launch_config(128, 132, gpu) == decode_sm90.CONFIGS[128] == (64, 3)
    assert decode_sm90.launch_config(128, 133, gpu) == (64, decode_sm90.CROWDED_STAGES[128]) == (64, 2)
    assert decode_sm90.launch_config(64, 4096, gpu) == decode_sm90.CONFIGS[64]
    assert decode_sm90.shared_bytes(128, 2) == 3 * 64 * 2 * 128 * 2


CROWDED_CASES = [c for c in SM90_CASES if c[5] and c[4] == 128]  # paged, D=128 (the head dim of CROWDED_STAGES)


@pytest.mark.parametrize(
    "case", CROWDED_CASES, ids=[f"B{c[0]}-page{c[5]}-splits{c[6] or 'Auto'}" for c in CROWDED_CASES]
)
def test_paged_decode_crowded(case, monkeypatch):
    """The paged D=128 cases above with the GPU counted as one SM, so that their launches (six programs or more)
    take the crowded ring on an H100/H200 (elsewhere the same calls run the Triton kernel): NaN past every end,
    outputs and lse against the reference. On an H100/H200 spies check that the Hopper kernel ran, each launch with
    the crowded ring (CROWDED_STAGES)."""
    from attention_kernels import decode_sm90

    monkeypatch.setattr(decode_sm90, "num_sms", lambda device: 1)
    launches, rings = [], []  # per Hopper launch: the call, its (BLOCK_N, STAGES)
    launch, launch_config = decode_sm90.launch, decode_sm90.launch_config
    monkeypatch.setattr(decode_sm90, "launch", lambda *a, **kw: launches.append(1) or launch(*a, **kw))
    monkeypatch.setattr(decode_sm90, "launch_config", lambda *a: rings.append(launch_config(*a)) or rings[-1])
    crowded = (decode_sm90.CONFIGS[128][0], decode_sm90.CROWDED_STAGES[128])
    b, hq, hkv, s, d, page_size, splits = case
    for dtype in KERNEL_DTYPES:
        q = torch.randn(b, hq, d, device=DEVICE, dtype=dtype)
        k, v = (torch.randn(b, hkv, s, d, device=DEVICE, dtype=dtype) for _ in range(2))
        seq_lens = ragged_lens(b, s)
        ref_out, ref_lse = decode_reference(q, k, v, seq_lens, scale=0.1)
        k_pages, v_pages, table = _paged(k, v, page_size)
        k_pages, v_pages = _nan_past_end((k_pages, v_pages), table, seq_lens, page_size)
        launches.clear()
        rings.clear()
        out, lse = paged_grouped_decode(q, k_pages, v_pages, table, seq_lens, scale=0.1, num_splits=splits)
        _check(out, lse, ref_out, ref_lse, dtype, f"crowded paged decode, page {page_size}")
        if decode_sm90.on_hopper(q):
            assert len(launches) == 1 and rings == [crowded], f"{dtype}: {len(launches)} Hopper launches, rings {rings}"


# (B, S, H_kv) -> the split count `ragged_num_splits` must pick for the Hopper paged kernel (D 128, H_q 32, 132
# SMs): from an H200 sweep of every power-of-two split on full-length and ragged batches, the pick that
# is worst off against each batch's best split by the least (benchmarks/RESULTS.md).
MEASURED_PAGED_SPLITS = {(1, 65536, 8): 16, (64, 8192, 8): 2, (8, 32768, 8): 16, (128, 4096, 8): 1, (64, 8192, 1): 4}


@pytest.mark.parametrize("shape", list(MEASURED_PAGED_SPLITS), ids=lambda s: "B{}-S{}-Hkv{}".format(*s))
def test_ragged_num_splits_matches_measured(shape, monkeypatch):
    """The paged Hopper kernel's split model, from shapes only: many splits for few long sequences, some for a
    batch whose ragged tail would otherwise run alone, none once the programs fill the machine."""
    monkeypatch.setattr(decode, "num_sms", lambda device: 132)
    b, s, h_kv = shape
    assert (
        decode.grouped_num_splits(b, 32, h_kv, s, 128, 128, 2, torch.device("cuda"), paged=True, sm90=True)
        == MEASURED_PAGED_SPLITS[shape]
    )


def test_ragged_num_splits_limits():
    """Never more splits than tiles, never past the cap, a power of two; a single sequence's work is spread."""
    for batch, capacity in [(1, 64), (1, 200), (3, 1000), (1, 10**6), (512, 4096)]:
        n = decode.ragged_num_splits(batch, 8, capacity, 64, 64 * 512, 1e-6, batch * 32 * 129 * 4, 264)
        assert n & (n - 1) == 0 and n <= max(1, -(-capacity // 64)) and n <= decode.MAX_SPLITS, (batch, capacity, n)
    assert decode.ragged_num_splits(1, 1, 10**6, 64, 64 * 512, 1e-6, 32 * 129 * 4, 264) == decode.MAX_SPLITS


def test_combine_splits_over_column_blocks():
    """64 splits of an 80-wide output: the combine cuts the columns into two programs (the second one masked past
    column 80), and only the first writes lse. Empty splits (lse = -inf) weigh nothing."""
    b, h, splits, d_v = 2, 3, 64, 80
    part_o = torch.randn(b, h, splits, d_v, device=DEVICE)
    part_lse = 4 * torch.randn(b, h, splits, device=DEVICE)  # log2 units
    part_lse[:, :, 40:] = -float("inf")
    out = torch.full((b, h, d_v), float("nan"), device=DEVICE)
    lse = torch.full((b, h), float("nan"), device=DEVICE)
    decode.combine_splits(part_o, part_lse, out, lse)
    w = torch.softmax(part_lse * math.log(2), dim=-1)  # 2^(lse_s) / sum 2^(lse)
    assert_close(out, (w[..., None] * part_o).sum(2), torch.float32, "combined output")
    assert_close(lse, torch.logsumexp(part_lse * math.log(2), dim=-1), torch.float32, "combined lse")


# (B, S, H_kv, D) -> the fastest split count of every power of two, measured on an H200 (bf16, H_q 32, CUDA graphs,
# cold L2) in the sweep behind auto_num_splits; a spread of regimes: one long sequence, few sequences, MQA, a full
# machine.
MEASURED_BEST_SPLITS = {
    (1, 65536, 1, 128): 128,
    (8, 65536, 1, 128): 16,
    (32, 65536, 1, 128): 4,
    (128, 8192, 1, 64): 2,
    (1, 1024, 8, 64): 8,
    (8, 8192, 8, 128): 2,
    (8, 8192, 32, 128): 1,
    (128, 1024, 8, 128): 1,
    (1, 8192, 32, 64): 8,
    (32, 8192, 1, 64): 8,
}


@pytest.mark.parametrize("shape", list(MEASURED_BEST_SPLITS), ids=lambda s: "B{}-S{}-Hkv{}-D{}".format(*s))
def test_auto_num_splits_matches_measured_best(shape, monkeypatch):
    """On a 132-SM H200 the cost model picks the split count that measured fastest: many for few long sequences,
    one once the programs fill the machine; only shapes enter (no device values)."""
    monkeypatch.setattr(decode, "num_sms", lambda device: 132)
    b, s, h_kv, d = shape
    assert decode.grouped_num_splits(b, 32, h_kv, s, d, d, 2, torch.device("cuda")) == MEASURED_BEST_SPLITS[shape]


@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
def test_tile_config_fits_shared_memory(paged):
    """Every head dim and dtype gets tiles whose pipelined K/V stages fit in one program's shared memory."""
    for d_qk, d_v in [(16, 16), (64, 64), (96, 64), (128, 128), (192, 128), (256, 256), (576, 512)]:
        for itemsize in (2, 4):
            block_n, warps, stages = decode._tile_config(d_qk, d_v, itemsize, paged)
            used = stages * block_n * (triton.next_power_of_2(d_qk) + triton.next_power_of_2(d_v)) * itemsize
            assert stages >= 1 and block_n >= 16 and used <= 200 * 1024, (d_qk, d_v, itemsize, block_n, stages)


def test_tile_config_follows_the_load(monkeypatch):
    """Contiguous launches size their tiles by programs per SM: heads of at most 64 stream through two stages from
    three programs per SM, wider heads take 64-token tiles between one and three, and 64-token tiles through two
    stages from three to four (one wave); paged caches keep theirs."""
    monkeypatch.setattr(decode, "num_sms", lambda device: 132)
    cuda = torch.device("cuda")
    assert decode._load(264, False, cuda) == 2.0 and decode._load(264, True, cuda) == 0.0
    assert decode._tile_config(64, 64, 2, False, load=3.0) == (128, 4, 2)
    assert decode._tile_config(64, 64, 2, False, load=2.9) == decode._tile_config(64, 64, 2, False) == (128, 4, 3)
    assert decode._tile_config(128, 128, 2, False, load=2.0) == (64, 4, 3)
    for load in (3.0, 3.9, 4.0):
        assert decode._tile_config(128, 128, 2, False, load=load) == (64, 4, 2)
    for load in (0.5, 1.0, 4.1, 8.0):
        assert decode._tile_config(128, 128, 2, False, load=load) == (128, 4, 3)
    assert decode._tile_config(64, 64, 2, True, load=8.0) == decode._tile_config(64, 64, 2, True)
    assert decode.programs_per_sm(64, 64, 2, False, load=4.0) > decode.programs_per_sm(64, 64, 2, False)
    assert decode.programs_per_sm(128, 128, 2, False, load=2.0) > decode.programs_per_sm(128, 128, 2, False)
    assert decode.programs_per_sm(128, 128, 2, False, load=3.5) == decode.ONE_WAVE


def test_auto_num_splits_limits():
    """Never more splits than tiles, never past the cap, always a power of two."""
    tile = 64 * 256 * 2
    assert auto_num_splits(programs=1, n_tiles=3, tile_bytes=tile, tile_time=1e-6, partial_bytes=1, slots=264) <= 3
    assert auto_num_splits(programs=1, n_tiles=0, tile_bytes=tile, tile_time=1e-6, partial_bytes=1, slots=264) == 1
    many = auto_num_splits(programs=1, n_tiles=10**6, tile_bytes=tile, tile_time=1e-6, partial_bytes=1, slots=264)
    assert many == decode.MAX_SPLITS
    for n_tiles in (5, 17, 100, 1000):
        n = auto_num_splits(programs=3, n_tiles=n_tiles, tile_bytes=tile, tile_time=1e-6, partial_bytes=64, slots=8)
        assert n & (n - 1) == 0 and n <= n_tiles


def _bad_inputs():
    f = dict(device=DEVICE, dtype=KERNEL_DTYPES[0])
    q, k, v = torch.randn(2, 4, 32, **f), torch.randn(2, 2, 16, 32, **f), torch.randn(2, 2, 16, 32, **f)
    lens = torch.tensor([16, 3], dtype=torch.int32, device=DEVICE)
    pk, pv = torch.randn(6, 8, 2, 32, **f), torch.randn(6, 8, 2, 32, **f)
    table = torch.tensor([[0, 1], [2, 3]], dtype=torch.int32, device=DEVICE)
    other = torch.bfloat16 if f["dtype"] != torch.bfloat16 else torch.float16
    i32 = dict(dtype=torch.int32, device=DEVICE)

    def grouped(**kw):
        args = dict(q=q, k=k, v=v, seq_lens=lens, scale=0.1) | kw
        return lambda: grouped_decode(args.pop("q"), args.pop("k"), args.pop("v"), args.pop("seq_lens"), **args)

    def paged(**kw):
        args = dict(q=q, k_pages=pk, v_pages=pv, block_table=table, seq_lens=lens, scale=0.1) | kw
        return lambda: paged_grouped_decode(
            args.pop("q"),
            args.pop("k_pages"),
            args.pop("v_pages"),
            args.pop("block_table"),
            args.pop("seq_lens"),
            **args,
        )

    return {
        "q-rank": (grouped(q=q[0]), "q"),
        "k-rank": (grouped(k=k[0]), "k"),
        "k-batch": (grouped(k=k[:1], v=v[:1]), "k"),
        "k-headdim": (grouped(k=torch.randn(2, 2, 16, 16, **f)), "k"),
        "v-seq-mismatch": (grouped(v=v[:, :, :8]), "v"),
        "Hq-not-multiple-of-Hkv": (grouped(q=torch.randn(2, 3, 32, **f)), "q"),
        "k-dtype": (grouped(k=k.double()), "k"),
        "v-dtype-mismatch": (grouped(v=v.to(torch.bfloat16 if f["dtype"] != torch.bfloat16 else torch.float16)), "v"),
        "q-int": (grouped(q=q.int()), "q"),
        "seq_lens-int64": (grouped(seq_lens=lens.long()), "seq_lens"),
        "seq_lens-shape": (grouped(seq_lens=lens[:1]), "seq_lens"),
        "seq_lens-zero": (grouped(seq_lens=torch.tensor([16, 0], dtype=torch.int32, device=DEVICE)), "seq_lens"),
        "seq_lens-beyond-cache": (
            grouped(seq_lens=torch.tensor([17, 1], dtype=torch.int32, device=DEVICE)),
            "seq_lens",
        ),
        "headdim-too-small": (grouped(q=q[..., :0], k=k[..., :0], v=v[..., :0]), "q"),
        "headdim-too-large": (
            grouped(
                q=torch.randn(2, 4, 272, **f),
                k=torch.randn(2, 2, 4, 272, **f),
                v=torch.randn(2, 2, 4, 32, **f),
                seq_lens=torch.tensor([4, 4], dtype=torch.int32, device=DEVICE),
            ),
            "q",
        ),
        "num_splits-zero": (grouped(num_splits=0), "num_splits"),
        "num_splits-float": (grouped(num_splits=2.0), "num_splits"),
        "num_splits-huge": (grouped(num_splits=10_000), "num_splits"),
        "rope-only-q": (grouped(q_rope=torch.randn(2, 4, 16, **f)), "k_rope"),
        "rope-shape": (grouped(q_rope=torch.randn(2, 4, 16, **f), k_rope=torch.randn(2, 2, 15, 16, **f)), "k_rope"),
        "device-mismatch": (
            grouped(seq_lens=lens.cpu()) if DEVICE == "cuda" else grouped(k=k.to("meta"), v=v.to("meta")),
            "k" if DEVICE == "cpu" else "seq_lens",
        ),
        "paged-page-size": (
            paged(k_pages=torch.randn(6, 12, 2, 32, **f), v_pages=torch.randn(6, 12, 2, 32, **f)),
            "k_pages",
        ),
        "paged-v-mismatch": (paged(v_pages=pv[:5]), "v_pages"),
        "paged-table-rank": (paged(block_table=table[0]), "block_table"),
        "paged-table-int64": (paged(block_table=table.long()), "block_table"),
        "paged-entry-outside-pool": (
            paged(block_table=torch.tensor([[0, 6], [2, 3]], dtype=torch.int32, device=DEVICE)),
            "block_table",
        ),
        "paged-negative-entry": (
            paged(block_table=torch.tensor([[0, 1], [-1, 3]], dtype=torch.int32, device=DEVICE)),
            "block_table",
        ),
        "paged-table-too-short": (paged(block_table=table[:, :1]), "block_table"),
        "paged-seq_lens-zero": (paged(seq_lens=torch.tensor([0, 3], dtype=torch.int32, device=DEVICE)), "seq_lens"),
        "Hkv-zero": (grouped(k=k[:, :0], v=v[:, :0]), "q"),
        "scale-nan": (grouped(scale=float("nan")), "scale"),
        "scale-none": (grouped(scale=None), "scale"),
        "scale-negative": (grouped(scale=-0.1), "scale"),
        "k_rope-only": (grouped(k_rope=torch.randn(2, 2, 16, 16, **f)), "q_rope"),
        "k_rope-rank": (grouped(q_rope=torch.randn(2, 4, 16, **f), k_rope=torch.randn(2, 16, 16, **f)), "k_rope"),
        "q_rope-dtype": (
            grouped(q_rope=torch.randn(2, 4, 16, device=DEVICE, dtype=other), k_rope=torch.randn(2, 2, 16, 16, **f)),
            "q_rope",
        ),
        "paged-q-rank": (paged(q=q[0]), "q"),
        "paged-k_pages-rank": (paged(k_pages=pk[0]), "k_pages"),
        "paged-k_pages-headdim": (paged(k_pages=pk[..., :16]), "k_pages"),
        "paged-Hq-not-multiple-of-Hkv": (paged(q=torch.randn(2, 3, 32, **f)), "q"),
        "paged-v-dtype-mismatch": (paged(v_pages=pv.to(other)), "v_pages"),
        "paged-headdim-too-small": (paged(q=q[..., :0], k_pages=pk[..., :0], v_pages=pv[..., :0]), "q"),
        "paged-table-batch": (paged(block_table=table[:1]), "block_table"),
        "paged-seq_lens-beyond-table": (paged(seq_lens=torch.tensor([17, 3], **i32)), "block_table"),
        "paged-rope-pool-shape": (
            paged(q_rope=torch.randn(2, 4, 16, **f), k_rope_pages=torch.randn(6, 8, 1, 16, **f)),
            "k_rope_pages",
        ),
        "paged-device-mismatch": (paged(block_table=table.to("meta" if DEVICE == "cpu" else "cpu")), "block_table"),
        "paged-scale-nan": (paged(scale=float("nan")), "scale"),
        "k_new-alone": (grouped(k_new=torch.randn(2, 2, 32, **f)), "v_new"),
        "v_new-alone": (paged(v_new=torch.randn(2, 2, 32, **f)), "k_new"),
        "k_new-shape": (grouped(k_new=torch.randn(2, 4, 32, **f), v_new=torch.randn(2, 2, 32, **f)), "k_new"),
        "v_new-dim": (paged(k_new=torch.randn(2, 2, 32, **f), v_new=torch.randn(2, 2, 16, **f)), "v_new"),
        "k_new-int": (grouped(k_new=torch.ones(2, 2, 32, **i32), v_new=torch.randn(2, 2, 32, **f)), "k_new"),
        "k_new-with-rope": (
            grouped(
                q_rope=torch.randn(2, 4, 16, **f),
                k_rope=torch.randn(2, 2, 16, 16, **f),
                k_new=torch.randn(2, 2, 32, **f),
                v_new=torch.randn(2, 2, 32, **f),
            ),
            "k_new",
        ),
        "k_new-device": (
            grouped(k_new=torch.randn(2, 2, 32, device="meta" if DEVICE == "cpu" else "cpu"), v_new=v[:, :, 0]),
            "k_new",
        ),
    }


BAD = _bad_inputs()


@pytest.mark.parametrize("name", list(BAD))
def test_bad_input_raises(name):
    call, argument = BAD[name]
    with pytest.raises(ValueError, match=rf"^{argument}\b.*got .*valid"):
        call()


def test_empty_cache_or_pool_names_what_is_valid():
    """A cache of 0 tokens or a pool of 0 pages has no valid length or page: the message says so, not "lengths
    from 1 to 0"."""
    q = torch.randn(1, 4, 16, device=DEVICE)
    k = v = torch.randn(1, 2, 0, 16, device=DEVICE)
    lens = torch.ones(1, dtype=torch.int32, device=DEVICE)
    with pytest.raises(ValueError, match=r"seq_lens: got a cache of 0 tokens .*; valid: a cache of at least one"):
        grouped_decode(q, k, v, lens, scale=0.25)
    pool = torch.randn(0, 8, 2, 16, device=DEVICE)
    table = torch.zeros(1, 1, dtype=torch.int32, device=DEVICE)
    with pytest.raises(ValueError, match=r"block_table: got a pool of 0 pages; valid: a pool of at least one page"):
        paged_grouped_decode(q, pool, pool, table, lens, scale=0.25)


def test_strided_seq_lens_and_block_table():
    """seq_lens and block_table as strided views (every other entry of a longer tensor, a transposed table): the
    kernels see the same lengths and pages as the value checks."""
    dtype = KERNEL_DTYPES[0]
    b, hq, hkv, s, d = 3, 4, 2, 40, 32
    q = torch.randn(b, hq, d, device=DEVICE, dtype=dtype)
    k, v = (torch.randn(b, hkv, s, d, device=DEVICE, dtype=dtype) for _ in range(2))
    lens = torch.tensor([40, 1, 1, 1, 23, 40], dtype=torch.int32, device=DEVICE)[::2]  # (40, 1, 23)
    k_pages, v_pages, table = _paged(k, v, 8)
    table_t = table.t().contiguous().t()  # same values, column-major
    assert not (lens.is_contiguous() or table_t.is_contiguous())
    ref_out, ref_lse = decode_reference(q, k, v, lens, scale=0.1)
    out, lse = grouped_decode(q, k, v, lens, scale=0.1, num_splits=2)
    _check(out, lse, ref_out, ref_lse, dtype, "grouped_decode strided seq_lens")
    out, lse = paged_grouped_decode(q, k_pages, v_pages, table_t, lens, scale=0.1, num_splits=2)
    _check(out, lse, ref_out, ref_lse, dtype, "paged_grouped_decode strided seq_lens and table")


def test_unused_table_entries_are_not_checked():
    """Only the pages a sequence uses must lie in the pool: padding entries (-1) past its length are fine."""
    dtype = KERNEL_DTYPES[0]
    q = torch.randn(2, 4, 32, device=DEVICE, dtype=dtype)
    k_pages, v_pages = (torch.randn(6, 8, 2, 32, device=DEVICE, dtype=dtype) for _ in range(2))
    table = torch.tensor([[0, 1, 4], [2, -1, -1]], dtype=torch.int32, device=DEVICE)
    lens = torch.tensor([20, 5], dtype=torch.int32, device=DEVICE)
    out, _ = paged_grouped_decode(q, k_pages, v_pages, table, lens, scale=0.1)
    ref, _ = paged_decode_reference(q, k_pages, v_pages, table.clamp(min=0), lens, scale=0.1)
    assert_close(out, ref, dtype, "padded table")


def test_validate_false_skips_value_checks():
    """validate=False reads no values (no sync): a zero length is the caller's contract and is not caught."""
    dtype = KERNEL_DTYPES[0]
    q, k, v = (
        torch.randn(2, 4, 32, device=DEVICE, dtype=dtype),
        torch.randn(2, 2, 16, 32, device=DEVICE, dtype=dtype),
        torch.randn(2, 2, 16, 32, device=DEVICE, dtype=dtype),
    )
    zero = torch.tensor([16, 0], dtype=torch.int32, device=DEVICE)
    with pytest.raises(ValueError, match="seq_lens"):
        grouped_decode(q, k, v, zero, scale=0.1, num_splits=1)
    grouped_decode(q, k, v, zero, scale=0.1, num_splits=1, validate=False)  # launches; row 1 is undefined


def test_compile_fullgraph():
    """torch.compile traces both ops as custom ops without a graph break (aot_eager: no Inductor codegen), and their
    appending forms as ops that write the caches the caller passed."""
    dtype = KERNEL_DTYPES[-1]
    b, hq, hkv, s, d = 2, 4, 2, 24, 32
    q = torch.randn(b, hq, d, device=DEVICE, dtype=dtype)
    k, v = (torch.randn(b, hkv, s, d, device=DEVICE, dtype=dtype) for _ in range(2))
    k_pages, v_pages, table = _paged(k, v, 8)
    lens = torch.tensor([24, 7], dtype=torch.int32, device=DEVICE)

    def step(q, k, v, k_pages, v_pages, table, lens):
        a, lse_a = grouped_decode(q, k, v, lens, scale=0.2)
        p, lse_p = paged_grouped_decode(q * 1, k_pages, v_pages, table, lens, scale=0.2)
        return a + p, lse_a + lse_p

    torch._dynamo.reset()
    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")
    out, lse = compiled(q, k, v, k_pages, v_pages, table, lens)
    ref_out, ref_lse = decode_reference(q, k, v, lens, scale=0.2)
    assert_close(out, 2 * ref_out, dtype, "compiled out")
    assert_close(lse, 2 * ref_lse, dtype, "compiled lse")

    # The appending ops mutate the caches: traced as such, the writes land in the tensors the caller passed.
    k_new, v_new = (torch.randn(b, hkv, d, device=DEVICE, dtype=dtype) for _ in range(2))
    want_k, want_v = _appended(k, v, k_new, v_new, lens)
    want_kp, want_vp = _appended(k_pages, v_pages, k_new, v_new, lens, table)

    def append(q, k, v, k_pages, v_pages, table, lens, k_new, v_new):
        a, _ = grouped_decode(q, k, v, lens, scale=0.2, k_new=k_new, v_new=v_new)
        p, _ = paged_grouped_decode(q, k_pages, v_pages, table, lens, scale=0.2, k_new=k_new, v_new=v_new)
        return a + p

    compiled = torch.compile(append, fullgraph=True, backend="aot_eager")
    out = compiled(q, k, v, k_pages, v_pages, table, lens, k_new, v_new)
    assert_close(out, 2 * decode_reference(q, want_k, want_v, lens, scale=0.2)[0], dtype, "compiled append")
    for got, want in ((k, want_k), (v, want_v), (k_pages, want_kp), (v_pages, want_vp)):
        assert torch.equal(got, want)


def test_append_ops_pass_opcheck():
    """torch.library.opcheck of the appending ops: their schemas declare the caches they write, the fake kernels
    match the real outputs' metadata, and autograd and functionalization see the mutation."""
    dtype = KERNEL_DTYPES[-1]
    b, hq, hkv, s, d = 2, 4, 2, 24, 32
    q = torch.randn(b, hq, d, device=DEVICE, dtype=dtype)
    k, v = (torch.randn(b, hkv, s, d, device=DEVICE, dtype=dtype) for _ in range(2))
    k_pages, v_pages, table = _paged(k, v, 8)
    lens = torch.tensor([24, 7], dtype=torch.int32, device=DEVICE)
    k_new, v_new = (torch.randn(b, hkv, d, device=DEVICE, dtype=dtype) for _ in range(2))
    torch.library.opcheck(torch.ops.zoo.grouped_decode_append, (q, k, v, lens, 0.2, None, k_new, v_new))
    torch.library.opcheck(
        torch.ops.zoo.paged_grouped_decode_append, (q, k_pages, v_pages, table, lens, 0.2, None, k_new, v_new)
    )


@pytest.mark.parametrize(
    "case",
    [(3, 8, 2, 130, 64, 3), (2, 8, 1, 65, 128, 5), (2, 80, 1, 20, 32, 2), (2, 4, 4, 70, 16, 9)],
    ids=lambda c: "B{}-Hq{}-Hkv{}-S{}-D{}-splits{}".format(*c),
)
def test_fused_combine_matches_separate_combine(case, monkeypatch):
    """With splits, the decode launch merges them itself (`_combine_if_last`: the last program of each sequence
    and head tile): the same output and lse as the separate combine kernel, which then never runs, and every
    ticket counter back at zero for the next launch. Covers a split count that is not a power of two, a head
    tile padded past its group (8 of 16 rows), two head tiles of one group (80 heads), and empty splits. (Batches
    this small merge in the launch on the CPU; on the GPU only from FUSED_COMBINE_MIN_ROWS, lowered here.)"""
    b, hq, hkv, s, d, splits = case
    monkeypatch.setattr(split_kv, "FUSED_COMBINE_MIN_ROWS", 0)
    assert split_kv.fused_combine_chunk(splits, min(hq // hkv, 64), d, b * hq, torch.device(DEVICE)) > 0
    q = torch.randn(b, hq, d, device=DEVICE)
    k = torch.randn(b, hkv, s, d, device=DEVICE)
    v = torch.randn(b, hkv, s, d, device=DEVICE)
    seq_lens = ragged_lens(b, s)
    monkeypatch.setenv("ZOO_FUSED_COMBINE", "0")
    sep_out, sep_lse = grouped_decode(q, k, v, seq_lens, scale=0.3, num_splits=splits)
    monkeypatch.setenv("ZOO_FUSED_COMBINE", "1")

    def no_combine(*args):
        raise AssertionError("the separate combine kernel ran")

    monkeypatch.setattr(decode, "combine_splits", no_combine)
    out, lse = grouped_decode(q, k, v, seq_lens, scale=0.3, num_splits=splits)
    assert_close(out, sep_out, torch.float32, "fused combine out")
    assert_close(lse, sep_lse, torch.float32, "fused combine lse")
    assert not split_kv.split_counters(q.device, 1).any(), "a ticket counter was left non-zero"


def test_fused_combine_chunk_rule(monkeypatch):
    """Splits per load of the fused combine, or 0 (the separate kernel): one split, the switch, a merge of more
    than 16384 fp32 partials (MQA: 32 heads x 128 x 8 splits), chunks of at most 8192 values, and, where the
    separate combine is a dependent launch (`decode.pdl`: sm_90 GPUs), fewer than FUSED_COMBINE_MIN_ROWS rows."""
    cpu, rows = torch.device("cpu"), split_kv.FUSED_COMBINE_MIN_ROWS
    assert split_kv.fused_combine_chunk(1, 4, 128, rows, cpu) == 0
    assert split_kv.fused_combine_chunk(4, 32, 128, rows, cpu) == 2  # 4096 values per split: two splits per load
    assert split_kv.fused_combine_chunk(8, 32, 128, rows, cpu) == 0  # 32768 values: the separate kernel
    assert split_kv.fused_combine_chunk(16, 4, 128, rows, cpu) == 16  # a group of 4: 512 values per split, one load
    assert split_kv.fused_combine_chunk(3, 3, 80, rows, cpu) == 4  # powers of two: 4 heads x 128 columns, 4 per load
    assert split_kv.fused_combine_chunk(2, 16, 512, rows, cpu) == 1  # MLA, 16 heads: one split per load
    assert split_kv.fused_combine_chunk(4, 32, 128, 32, cpu) == 2  # no dependent launch on the CPU: any batch
    monkeypatch.setattr(split_kv, "pdl", lambda device: True)
    assert split_kv.fused_combine_chunk(4, 32, 128, rows - 1, cpu) == 0  # MQA B31: the dependent combine
    assert split_kv.fused_combine_chunk(4, 32, 128, rows, cpu) == 2  # MQA B32: merged in the launch
    monkeypatch.setenv("ZOO_FUSED_COMBINE", "0")
    assert split_kv.fused_combine_chunk(4, 32, 128, rows, cpu) == 0


def test_split_counters_under_graph_capture(monkeypatch):
    """The ticket counters are allocated zeroed outside CUDA graph capture and kept; while a capture runs, a
    launch that needs more counters than exist gets None (and uses the separate combine) instead of memory that
    only a replay would zero; a grown buffer keeps the old one alive for graphs captured with it. On a GPU, a
    fused launch captured in a graph replays correctly between eager launches that use the same counters."""
    monkeypatch.setattr(split_kv, "_COUNTERS", {})
    monkeypatch.setattr(split_kv, "_RETIRED", [])
    device = torch.device(DEVICE)
    first = split_kv.split_counters(device, 10)
    assert first.numel() >= 10 and not first.any()
    monkeypatch.setattr(split_kv, "_capturing", lambda device: True)
    assert split_kv.split_counters(device, 10) is first
    assert split_kv.split_counters(device, first.numel() + 1) is None
    monkeypatch.setattr(split_kv, "_capturing", lambda device: False)
    grown = split_kv.split_counters(device, first.numel() + 1)
    assert grown.numel() > first.numel() and len(split_kv._RETIRED) == 1 and split_kv._RETIRED[0] is first
    if DEVICE == "cuda":  # a real capture: replays of a fused launch, between eager ones, on the same counters
        q = torch.randn(2, 8, 64, device=DEVICE, dtype=torch.bfloat16)
        k = torch.randn(2, 2, 300, 64, device=DEVICE, dtype=torch.bfloat16)
        v = torch.randn_like(k)
        seq_lens = torch.tensor([300, 77], device=DEVICE, dtype=torch.int32)
        monkeypatch.setattr(split_kv, "FUSED_COMBINE_MIN_ROWS", 0)  # a batch this small merges in the launch
        assert split_kv.fused_combine_chunk(4, 4, 64, 2 * 8, q.device) > 0

        def run():
            return grouped_decode(q, k, v, seq_lens, scale=0.125, num_splits=4, validate=False)

        ref_out, ref_lse = decode_reference(q, k, v, seq_lens, scale=0.125)
        run()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out, lse = run()
        for _ in range(3):
            graph.replay()
            torch.cuda.synchronize()
            _check(out, lse, ref_out, ref_lse, torch.bfloat16, "graph replay")
            _check(*run(), ref_out, ref_lse, torch.bfloat16, "eager launch between replays")


@pytest.mark.parametrize("splits", [1, 4], ids=lambda n: f"splits{n}")
def test_decode_as_dependent_launch(splits, monkeypatch):
    """The grouped decode launch is itself a programmatic dependent of the kernel before it where `decode.pdl`
    says so: its programs may start while that kernel runs, and wait (`gdc_wait`) before they read anything. A
    chain of three decodes, each taking the previous one's output as its query (so each reads what the launch
    before it wrote), eager and replayed from a CUDA graph: the reference's outputs, bit for bit those of plain
    launches (ZOO_PDL=0)."""
    dtype = KERNEL_DTYPES[-1]  # bf16 on the GPU, fp16 on the interpreter (which computes bf16 wrong)
    q = torch.randn(3, 8, 64, device=DEVICE, dtype=dtype)
    k = torch.randn(3, 2, 300, 64, device=DEVICE, dtype=dtype)
    v = torch.randn_like(k)
    seq_lens = torch.tensor([300, 77, 1], device=DEVICE, dtype=torch.int32)

    def check(x, out, lse, name):
        _check(out, lse, *decode_reference(x, k, v, seq_lens, scale=0.125), dtype, name)

    check_dependent_chain(
        lambda x: grouped_decode(x, k, v, seq_lens, scale=0.125, num_splits=splits, validate=False),
        q,
        check,
        monkeypatch,
    )


def test_separate_combine_as_dependent_launch(monkeypatch):
    """The separate split combine launches as a programmatic dependent of the decode launch (`decode.pdl`) on
    sm_90 and newer GPUs, never on the CPU or with ZOO_PDL=0. Its programs may then start before the partials are
    stored and wait for them (`gdc_wait`): the outputs, eager and replayed from a CUDA graph, match the reference
    and are bit for bit those of the plain launch."""
    assert not decode.pdl(torch.device("cpu"))
    if DEVICE == "cuda":
        assert decode.pdl(torch.device(DEVICE)) == (torch.cuda.get_device_capability()[0] >= 9)
    monkeypatch.setenv("ZOO_PDL", "0")
    assert not decode.pdl(torch.device(DEVICE))
    monkeypatch.setenv("ZOO_FUSED_COMBINE", "0")  # every split launch takes the separate combine
    dtype = KERNEL_DTYPES[-1]  # bf16 on the GPU, fp16 on the interpreter (which computes bf16 wrong)
    q = torch.randn(3, 8, 64, device=DEVICE, dtype=dtype)
    k = torch.randn(3, 2, 500, 64, device=DEVICE, dtype=dtype)
    v = torch.randn_like(k)
    seq_lens = torch.tensor([500, 77, 1], device=DEVICE, dtype=torch.int32)
    ref_out, ref_lse = decode_reference(q, k, v, seq_lens, scale=0.125)

    def run():
        return grouped_decode(q, k, v, seq_lens, scale=0.125, num_splits=4, validate=False)

    launches = spy_launches(monkeypatch)
    plain = run()
    assert ("_combine_splits_kernel", False) in launches, launches
    monkeypatch.setenv("ZOO_PDL", "1")
    launches.clear()
    dependent = run()
    # the combine launch takes launch_pdl exactly where pdl allows it (sm_90 and newer; never on the CPU)
    assert ("_combine_splits_kernel", decode.pdl(torch.device(DEVICE))) in launches, launches
    _check(*dependent, ref_out, ref_lse, dtype, "dependent combine")
    assert all(torch.equal(a, b) for a, b in zip(plain, dependent))
    if DEVICE == "cuda":
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out, lse = run()
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, plain[0]) and torch.equal(lse, plain[1])


# Per kernel: its pointer arguments' types and its constants besides WAIT. The Triton grouped decode as
# `_launch_triton` sets it for B32 H_q32/8 D=128 (a tile of four heads, two splits merged in the launch) and the
# separate split combine of eight splits.
_TRITON_DECODE_COMPILES = {
    "_grouped_decode_kernel": (
        dict(
            Q="*bf16",
            K="*bf16",
            V="*bf16",
            Q_ROPE="*bf16",
            K_ROPE="*bf16",
            BLOCK_TABLE="*i32",
            SEQ_LENS="*i32",
            OUT="*fp32",
            LSE="*fp32",
            FINAL_OUT="*bf16",
            FINAL_LSE="*fp32",
            COUNTERS="*i32",
            K_NEW="*bf16",
            V_NEW="*bf16",
            scale_log2="fp32",
        ),
        dict(
            GROUP_SIZE=4,
            D_QK=128,
            D_ROPE=0,
            D_V=128,
            BLOCK_H=16,
            BLOCK_N=128,
            BLOCK_DQK=128,
            BLOCK_DR=16,
            BLOCK_DV=128,
            PAGED=False,
            PAGE_SIZE=1,
            NUM_SPLITS=2,
            STATIC_ITERS=0,
            DOT_PRECISION="tf32",
            FUSE_CHUNK=2,
            APPEND=True,  # the new token's fold and store ride on the whole kernel
        ),
    ),
    "_combine_splits_kernel": (
        dict(PARTIAL_O="*fp32", PARTIAL_LSE="*fp32", OUT="*bf16", LSE="*fp32"),
        dict(NUM_SPLITS=8, D_V=128, BLOCK_S=8, BLOCK_DV=128),
    ),
}


@pytest.mark.slow
@pytest.mark.parametrize("wait", [False, True], ids=["plain", "dependent"])
@pytest.mark.parametrize("kernel", list(_TRITON_DECODE_COMPILES))
def test_triton_dependent_launch_compiles(kernel, wait):
    """The Triton decode kernels' WAIT path, which only an sm_90 GPU runs (`decode.pdl` is off under the
    interpreter, which cannot execute gdc_wait; the chain tests above run it on a GPU): compiled for sm_90 on any
    machine, a dependent launch waits exactly once (griddepcontrol.wait), before its first global load or store,
    so nothing is read before the kernel it depends on has stored it; a plain launch never waits."""
    import re

    from conftest import compile_gluon_sm90

    types, const = _TRITON_DECODE_COMPILES[kernel]
    module = "attention_kernels.split_kv" if kernel == "_combine_splits_kernel" else "attention_kernels.decode"
    ptx = compile_gluon_sm90(
        module,
        kernel,
        types,
        dict(const, WAIT=wait),
        options=dict(num_warps=4, num_stages=3),
        gluon=False,
    )["ptx"]
    assert ptx.count("griddepcontrol.wait") == (1 if wait else 0)
    first_access = re.search(r"\b(ld\.global|st\.global|cp\.async|atom\.global|red\.global)", ptx)
    assert first_access, "no global memory access in the PTX"
    if wait:
        assert ptx.index("griddepcontrol.wait") < first_access.start(), "a global access before the wait"
