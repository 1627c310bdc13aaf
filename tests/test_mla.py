"""mla_decode and paged_mla_decode against attention_kernels.reference on the CPU (interpreter, fp32/fp16) and the GPU
(fp16/bf16): DeepSeek's 512 + 64 latent at small S, other latent widths and head counts (masked heads, two head
tiles), ragged lengths including 1, explicit/automatic splits, shuffled page tables at page sizes 8-256, the
absorbed kernel against the unabsorbed math (per-head K/V materialized), non-contiguous inputs, bad inputs and
torch.compile; and mla_decode_inputs, the decode step's query absorption, RoPE, latent norm and cache write, the same
ways."""

import pytest
import torch
from conftest import (
    DEVICE,
    DTYPE_IDS,
    KERNEL_DTYPES,
    TOLERANCES,
    assert_close,
    check_dependent_chain,
    compile_gluon_sm90,
    ragged_lens,
    setmaxnreg_counts,
    spill_bytes,
)

import model as gpt
from attention_kernels import mla_decode, mla_decode_inputs, paged_mla_decode
from attention_kernels.mla import _inputs_op as _mla_inputs_op
from attention_kernels.mla import input_columns
from attention_kernels.reference import (
    absorb_query,
    mla_decode_inputs_reference,
    mla_decode_reference,
    mla_unabsorbed_reference,
    paged_mla_decode_reference,
    unabsorb_output,
)


@pytest.fixture(autouse=True)
def _poison(poison_decode_outputs):
    """Every output and partial of the decode kernels starts as NaN (conftest.poison_decode_outputs)."""


def _inputs(b, h, s, d_c, d_r, dtype):
    # Latent entries of size ~0.3 keep the 512-wide scores O(1) at scale 1/sqrt(d_c + d_r), as in a trained model.
    q_abs = torch.randn(b, h, d_c, device=DEVICE, dtype=dtype)
    q_rope = torch.randn(b, h, d_r, device=DEVICE, dtype=dtype)
    c_kv = (0.3 * torch.randn(b, s, d_c, device=DEVICE)).to(dtype)
    k_rope = torch.randn(b, s, d_r, device=DEVICE, dtype=dtype)
    return q_abs, q_rope, c_kv, k_rope, (d_c + d_r) ** -0.5


def _check(out, lse, ref_out, ref_lse, dtype, name):
    assert out.dtype == dtype and lse.dtype == torch.float32
    assert_close(out, ref_out, dtype, f"{name} out")
    assert_close(lse, ref_lse, dtype, f"{name} lse")


# (B, H, S_max, D_c, D_r, explicit splits): 512 + 64 at 7, 16, 24, 40, 64 and 128 heads, 5 heads (masked rows) and
# non-powers of 2. On an H100/H200 the 512 + 64 cases run the Gluon kernels (attention_kernels/mla_sm90.py; 7, 16 and 24
# heads the narrow one, in tiles of 16 or 32 heads; 40 heads a zero-padded 64-head tile): a sequence shorter than
# one 64-token block, ragged last blocks, several blocks per split, empty splits.
CASES = [
    (2, 16, 33, 512, 64, 3),
    (3, 7, 130, 512, 64, 2),
    (2, 24, 100, 512, 64, 2),
    (1, 40, 70, 512, 64, 2),
    (1, 128, 20, 512, 64, 1),
    (3, 64, 300, 512, 64, 3),
    (3, 5, 70, 80, 16, 7),
    (2, 20, 40, 96, 48, 2),
]


@pytest.mark.parametrize("auto", [True, False], ids=["splitsAuto", "splitsFixed"])
@pytest.mark.parametrize("case", CASES, ids=[f"B{b}-H{h}-S{s}-Dc{c}-Dr{r}" for b, h, s, c, r, _ in CASES])
@pytest.mark.parametrize("dtype", KERNEL_DTYPES, ids=DTYPE_IDS.get)
def test_mla_decode_matches_reference(dtype, case, auto):
    b, h, s, d_c, d_r, splits = case
    q_abs, q_rope, c_kv, k_rope, scale = _inputs(b, h, s, d_c, d_r, dtype)
    seq_lens = ragged_lens(b, s)
    # NaN in every row past a sequence's end: a kernel that reads one and gives it zero weight returns NaN.
    past_end = torch.arange(s, device=DEVICE)[None, :, None] >= seq_lens[:, None, None]
    out, lse = mla_decode(
        q_abs,
        q_rope,
        c_kv.masked_fill(past_end, float("nan")),
        k_rope.masked_fill(past_end, float("nan")),
        seq_lens,
        scale=scale,
        num_splits=None if auto else splits,
    )
    ref_out, ref_lse = mla_decode_reference(q_abs, q_rope, c_kv, k_rope, seq_lens, scale=scale)
    _check(out, lse, ref_out, ref_lse, dtype, "mla_decode")


@pytest.mark.parametrize("dtype", KERNEL_DTYPES, ids=DTYPE_IDS.get)
def test_absorbed_kernel_matches_unabsorbed_mla(dtype):
    """Per-head K = c_kv W_UK[h]^T and V = c_kv W_UV[h]^T materialized (fp32) against the absorbed kernel path."""
    b, h, s, d_c, d_r, d_nope, d_v = 2, 16, 24, 512, 64, 32, 32
    q_nope = torch.randn(b, h, d_nope, device=DEVICE, dtype=dtype)
    q_rope = torch.randn(b, h, d_r, device=DEVICE, dtype=dtype)
    c_kv = (0.3 * torch.randn(b, s, d_c, device=DEVICE)).to(dtype)
    k_rope = torch.randn(b, s, d_r, device=DEVICE, dtype=dtype)
    w_uk = (d_c**-0.5 * torch.randn(h, d_nope, d_c, device=DEVICE)).to(dtype)
    w_uv = (d_c**-0.5 * torch.randn(h, d_v, d_c, device=DEVICE)).to(dtype)
    scale = (d_nope + d_r) ** -0.5
    q_abs = absorb_query(q_nope, w_uk).to(dtype)  # what the model feeds the kernel: the absorbed query in its dtype
    seq_lens = torch.full((b,), s, dtype=torch.int32, device=DEVICE)
    latent, _ = mla_decode(q_abs, q_rope, c_kv, k_rope, seq_lens, scale=scale, num_splits=2)
    out = unabsorb_output(latent, w_uv)
    ref = mla_unabsorbed_reference(q_nope, q_rope, c_kv, k_rope, w_uk, w_uv, scale=scale)
    # Rounding the absorbed query and the latent output to the input dtype adds one rounding each on top of the
    # kernel's own; the up-projection sums 512 such errors with random signs (~sqrt(512) * 2^-8 * |w| ~ 1e-2 for
    # bf16), so the budget is twice the dtype's kernel tolerance.
    tol = TOLERANCES[dtype]
    err = (out - ref).abs()
    bound = 2 * tol["atol"] + 2 * tol["rtol"] * ref.abs()
    assert not torch.isnan(out).any()
    assert bool((err <= bound).all()), f"absorbed vs unabsorbed ({dtype}): max err {err.max():.3e}"


def _paged_latent(c_kv, k_rope, page_size, extra_pages=2):
    b, s, _ = c_kv.shape
    max_pages = -(-s // page_size)
    num_pages = b * max_pages + extra_pages
    table = torch.randperm(num_pages, device=DEVICE)[: b * max_pages].reshape(b, max_pages).to(torch.int32)
    pools = []
    for x in (c_kv, k_rope):
        pool = torch.randn(num_pages, page_size, x.shape[-1], device=DEVICE, dtype=x.dtype)  # unused pages: noise
        pool[table.long()] = torch.nn.functional.pad(x, (0, 0, 0, max_pages * page_size - s)).reshape(
            b, max_pages, page_size, -1
        )
        pools.append(pool)
    return pools[0], pools[1], table


def _poison_past_end(c_pages, r_pages, table, seq_lens):
    """Copies of the pools with NaN in every row no sequence uses: unused pages, and each sequence's rows past its
    length. A kernel that reads such a row and gives it zero weight still returns NaN (0 * NaN)."""
    page_size = c_pages.shape[1]
    used = torch.zeros(c_pages.shape[:2], dtype=torch.bool, device=DEVICE)
    for b, n in enumerate(seq_lens.tolist()):
        pos = torch.arange(n, device=DEVICE)
        used[table[b, pos // page_size].long(), pos % page_size] = True
    return [p.masked_fill(~used[..., None], float("nan")) for p in (c_pages, r_pages)]


# (B, H, S_max, D_c, D_r, D_v, splits, paged): one row (a program per row and 16 value columns) and 17 or 20 rows
# (16 a program, as one MMA in fp16/bf16, the last block masked); one split (the decode's final latent passes
# through), several, and the automatic count; DeepSeek's 512 + 64 (on an H100/H200 the Gluon kernels: 16 heads the
# narrow one, 64 and 128 the 64-head tile) and widths that are not powers of two.
UP_CASES = [
    (1, 12, 70, 256, 32, 64, None, False),
    (1, 16, 130, 512, 64, 128, 4, False),
    (3, 5, 40, 80, 16, 24, 1, False),
    (17, 4, 33, 64, 16, 48, 3, False),
    (20, 16, 70, 512, 64, 64, None, True),
    (2, 7, 60, 96, 32, 40, 2, True),
    (2, 128, 70, 512, 64, 32, 2, False),
    (1, 64, 40, 512, 64, 64, 1, True),
]


@pytest.mark.parametrize(
    "case",
    UP_CASES,
    ids=[f"B{c[0]}-H{c[1]}-Dc{c[3]}-Dv{c[5]}-s{c[6]}-{'paged' if c[7] else 'contiguous'}" for c in UP_CASES],
)
@pytest.mark.parametrize("dtype", KERNEL_DTYPES, ids=DTYPE_IDS.get)
def test_mla_decode_applies_w_uv(dtype, case):
    """With w_uv the decode returns the heads' values latent W_UV[h]^T, the up-projection applied as the splits are
    combined, and the same lse as without it. W_UV is a strided view of one (H, D_n + D_v, D_c) weight, as a model's
    kv_b_proj holds it, in fp32 beside fp16/bf16 activations (autocast) and in the activations' dtype."""
    b, h, s, d_c, d_r, d_v, splits, paged = case
    q_abs, q_rope, c_kv, k_rope, scale = _inputs(b, h, s, d_c, d_r, dtype)
    kv_b = d_c**-0.5 * torch.randn(h, 16 + d_v, d_c, device=DEVICE)
    w_uv = kv_b[:, 16:]
    seq_lens = ragged_lens(b, s)
    latent, ref_lse = mla_decode_reference(q_abs, q_rope, c_kv, k_rope, seq_lens, scale=scale)
    if paged:
        c_pages, r_pages, table = _paged_latent(c_kv, k_rope, 16)
        c_pages, r_pages = _poison_past_end(c_pages, r_pages, table, seq_lens)
        call = lambda **kw: paged_mla_decode(q_abs, q_rope, c_pages, r_pages, table, seq_lens, **kw)  # noqa: E731
    else:
        past_end = torch.arange(s, device=DEVICE)[None, :, None] >= seq_lens[:, None, None]
        c_nan, r_nan = c_kv.masked_fill(past_end, float("nan")), k_rope.masked_fill(past_end, float("nan"))
        call = lambda **kw: mla_decode(q_abs, q_rope, c_nan, r_nan, seq_lens, **kw)  # noqa: E731
    plain_out, plain_lse = call(scale=scale, num_splits=splits)
    for w in (w_uv, w_uv.to(dtype)):
        out, lse = call(scale=scale, num_splits=splits, w_uv=w)
        assert out.shape == (b, h, d_v)
        # The one-row programs keep the latent in fp32 for the product, the MMA rounds it and W_UV to the output's
        # half dtype (as a matmul under autocast would): over D_c terms of random sign that adds ~sqrt(D_c) * 2^-9 *
        # |latent| * |w|, a few 1e-4 for bf16, well inside the kernel's own tolerance.
        _check(out, lse, unabsorb_output(latent, w), ref_lse, dtype, f"w_uv {w.dtype}")
        assert torch.equal(lse, plain_lse), "the lse does not depend on w_uv"
        assert_close(out, unabsorb_output(plain_out, w), dtype, "the plain latent, up-projected")


# On an H100/H200 paged 512 + 64 caches run the Gluon kernels (attention_kernels/mla_sm90.py), whose loader copies
# 64 // page_size pages per 64-token block below 64 and a 64-row slice of larger pages: 5 or 16 heads the narrow
# kernel in a tile of 16 heads, 32 heads in a tile of 32, 128 heads two 64-head tiles. "wide" runs 16 heads in a
# zero-padded 64-head tile (ZOO_MLA_NARROW=0), "triton" turns both off (ZOO_MLA_SM90=0): the Triton kernel
# on the GPU (on the CPU every case runs it). On an H100/H200 a spy checks which program ran: its heads per program.
PAGED_HEADS = [(5, "default"), (16, "default"), (16, "wide"), (16, "triton"), (32, "default"), (128, "default")]


@pytest.mark.parametrize("heads,kernel", PAGED_HEADS, ids=[f"H{h}-{k}" for h, k in PAGED_HEADS])
@pytest.mark.parametrize("page_size", [8, 16, 64, 256], ids=lambda p: f"page{p}")
@pytest.mark.parametrize("dtype", KERNEL_DTYPES, ids=DTYPE_IDS.get)
def test_paged_mla_decode_matches_reference(dtype, page_size, heads, kernel, monkeypatch):
    if kernel == "triton":
        monkeypatch.setenv("ZOO_MLA_SM90", "0")
    if kernel == "wide":
        monkeypatch.setenv("ZOO_MLA_NARROW", "0")
    from attention_kernels import mla

    tiles = []  # heads per program of each Hopper launch
    hopper = mla.mla_sm90
    if hopper is not None:
        launch = hopper.launch
        monkeypatch.setattr(hopper, "launch", lambda *a, **kw: tiles.append(kw["heads"]) or launch(*a, **kw))
    b, h, s, d_c, d_r = 3, heads, 70 if page_size < 256 else 260, 512, 64
    q_abs, q_rope, c_kv, k_rope, scale = _inputs(b, h, s, d_c, d_r, dtype)
    c_pages, r_pages, table = _paged_latent(c_kv, k_rope, page_size)
    seq_lens = ragged_lens(b, s)
    ref_out2, _ = paged_mla_decode_reference(q_abs, q_rope, c_pages, r_pages, table, seq_lens, scale=scale)
    c_poisoned, r_poisoned = _poison_past_end(c_pages, r_pages, table, seq_lens)
    out, lse = paged_mla_decode(
        q_abs,
        q_rope,
        c_poisoned,
        r_poisoned,
        table,
        seq_lens,
        scale=scale,
        num_splits=None if page_size in (16, 256) else 3,
    )
    ref_out, ref_lse = mla_decode_reference(q_abs, q_rope, c_kv, k_rope, seq_lens, scale=scale)
    _check(out, lse, ref_out, ref_lse, dtype, "paged_mla_decode")
    assert_close(out, ref_out2, dtype, "paged_mla_decode vs paged reference")
    if hopper is not None and hopper.on_hopper(q_abs):  # the narrow program (16 or 32 heads), the 64-head tile, none
        tile = 16 if h <= 16 else 32 if h <= 32 else 64
        assert tiles == {"default": [tile], "wide": [64], "triton": []}[kernel], f"Hopper launches' tiles: {tiles}"


@pytest.mark.parametrize("dtype", KERNEL_DTYPES, ids=DTYPE_IDS.get)
def test_mla_decode_non_contiguous(dtype):
    """The natural layout in a model: q_absorbed/q_rope slices of one (B, H, D_c + D_r) tensor and c_kv/k_rope
    slices of one (B, S, D_c + D_r) cache; the paged pools likewise slices of one page pool."""
    b, h, s, d_c, d_r = 2, 16, 40, 128, 32
    q = torch.randn(b, h, d_c + d_r, device=DEVICE, dtype=dtype)
    cache = (0.5 * torch.randn(b, s, d_c + d_r, device=DEVICE)).to(dtype)
    q_abs, q_rope, c_kv, k_rope = q[..., :d_c], q[..., d_c:], cache[..., :d_c], cache[..., d_c:]
    assert not (q_abs.is_contiguous() or c_kv.is_contiguous())
    seq_lens = ragged_lens(b, s)
    out, lse = mla_decode(q_abs, q_rope, c_kv, k_rope, seq_lens, scale=0.08, num_splits=2)
    ref_out, ref_lse = mla_decode_reference(q_abs, q_rope, c_kv, k_rope, seq_lens, scale=0.08)
    _check(out, lse, ref_out, ref_lse, dtype, "mla_decode non-contiguous")
    pool, _, table = _paged_latent(cache, cache[..., :1], 16)
    out, lse = paged_mla_decode(q_abs, q_rope, pool[..., :d_c], pool[..., d_c:], table, seq_lens, scale=0.08)
    _check(out, lse, ref_out, ref_lse, dtype, "paged_mla_decode non-contiguous")


def _bad_inputs():
    f = dict(device=DEVICE, dtype=KERNEL_DTYPES[0])
    qa, qr = torch.randn(2, 4, 64, **f), torch.randn(2, 4, 16, **f)
    ckv, kr = torch.randn(2, 16, 64, **f), torch.randn(2, 16, 16, **f)
    lens = torch.tensor([16, 3], dtype=torch.int32, device=DEVICE)
    cp, rp = torch.randn(6, 8, 64, **f), torch.randn(6, 8, 16, **f)
    table = torch.tensor([[0, 1], [2, 3]], dtype=torch.int32, device=DEVICE)

    def dense(**kw):
        a = dict(q_absorbed=qa, q_rope=qr, c_kv=ckv, k_rope=kr, seq_lens=lens, num_splits=None, scale=0.1) | kw
        return lambda: mla_decode(
            a["q_absorbed"],
            a["q_rope"],
            a["c_kv"],
            a["k_rope"],
            a["seq_lens"],
            scale=a["scale"],
            num_splits=a["num_splits"],
            w_uv=a.get("w_uv"),
        )

    def paged(**kw):
        a = (
            dict(q_absorbed=qa, q_rope=qr, c_kv_pages=cp, k_rope_pages=rp, block_table=table, seq_lens=lens, scale=0.1)
            | kw
        )
        return lambda: paged_mla_decode(
            a["q_absorbed"],
            a["q_rope"],
            a["c_kv_pages"],
            a["k_rope_pages"],
            a["block_table"],
            a["seq_lens"],
            scale=a["scale"],
            w_uv=a.get("w_uv"),
        )

    other = torch.bfloat16 if f["dtype"] != torch.bfloat16 else torch.float16
    return {
        "q_absorbed-rank": (dense(q_absorbed=qa[0]), "q_absorbed"),
        "q_rope-heads": (dense(q_rope=qr[:, :3]), "q_rope"),
        "c_kv-rank": (dense(c_kv=ckv[0]), "c_kv"),
        "c_kv-batch": (dense(c_kv=ckv[:1], k_rope=kr[:1]), "c_kv"),
        "c_kv-latent-dim": (dense(c_kv=torch.randn(2, 16, 32, **f)), "c_kv"),
        "k_rope-rows": (dense(k_rope=kr[:, :8]), "k_rope"),
        "latent-dim-too-large": (
            dense(q_absorbed=torch.randn(2, 4, 576, **f), c_kv=torch.randn(2, 16, 576, **f)),
            "q_absorbed",
        ),
        "rope-dim-too-large": (
            dense(q_rope=torch.randn(2, 4, 144, **f), k_rope=torch.randn(2, 16, 144, **f)),
            "q_rope",
        ),
        "c_kv-dtype": (dense(c_kv=ckv.to(other)), "c_kv"),
        "q_absorbed-int": (dense(q_absorbed=qa.int()), "q_absorbed"),
        "seq_lens-int64": (dense(seq_lens=lens.long()), "seq_lens"),
        "seq_lens-zero": (dense(seq_lens=torch.tensor([0, 3], dtype=torch.int32, device=DEVICE)), "seq_lens"),
        "seq_lens-beyond-cache": (dense(seq_lens=torch.tensor([17, 3], dtype=torch.int32, device=DEVICE)), "seq_lens"),
        "num_splits-negative": (dense(num_splits=-1), "num_splits"),
        "device-mismatch": (
            dense(c_kv=ckv.to("meta"), k_rope=kr.to("meta")) if DEVICE == "cpu" else dense(seq_lens=lens.cpu()),
            "c_kv" if DEVICE == "cpu" else "seq_lens",
        ),
        "paged-page-size": (
            paged(c_kv_pages=torch.randn(6, 4, 64, **f), k_rope_pages=torch.randn(6, 4, 16, **f)),
            "c_kv_pages",
        ),
        "paged-rope-pool-mismatch": (paged(k_rope_pages=rp[:5]), "k_rope_pages"),
        "paged-table-int64": (paged(block_table=table.long()), "block_table"),
        "paged-entry-outside-pool": (
            paged(block_table=torch.tensor([[0, 9], [2, 3]], dtype=torch.int32, device=DEVICE)),
            "block_table",
        ),
        "paged-table-too-short": (paged(block_table=table[:, :1]), "block_table"),
        "latent-dim-too-small": (dense(q_absorbed=qa[..., :0], c_kv=ckv[..., :0]), "q_absorbed"),
        "q_rope-dtype": (dense(q_rope=qr.to(other)), "q_rope"),
        "k_rope-rank": (dense(k_rope=kr[0]), "k_rope"),
        "scale-nan": (dense(scale=float("nan")), "scale"),
        "scale-zero": (dense(scale=0.0), "scale"),
        "paged-q_absorbed-rank": (paged(q_absorbed=qa[0]), "q_absorbed"),
        "paged-c_kv_pages-rank": (paged(c_kv_pages=cp[0]), "c_kv_pages"),
        "paged-latent-dim": (paged(c_kv_pages=cp[..., :32]), "c_kv_pages"),
        "paged-c_kv_pages-dtype": (paged(c_kv_pages=cp.to(other)), "c_kv_pages"),
        "paged-table-rank": (paged(block_table=table[0]), "block_table"),
        "paged-table-batch": (paged(block_table=table[:1]), "block_table"),
        "paged-negative-entry": (
            paged(block_table=torch.tensor([[0, 1], [-1, 3]], dtype=torch.int32, device=DEVICE)),
            "block_table",
        ),
        "paged-seq_lens-zero": (paged(seq_lens=torch.tensor([16, 0], dtype=torch.int32, device=DEVICE)), "seq_lens"),
        "paged-seq_lens-beyond-table": (
            paged(seq_lens=torch.tensor([17, 3], dtype=torch.int32, device=DEVICE)),
            "block_table",
        ),
        "paged-device-mismatch": (paged(block_table=table.to("meta" if DEVICE == "cpu" else "cpu")), "block_table"),
        "paged-scale-none": (paged(scale=None), "scale"),
        "w_uv-rank": (dense(w_uv=torch.randn(4, 64, **f)), "w_uv"),
        "w_uv-heads": (dense(w_uv=torch.randn(3, 32, 64, **f)), "w_uv"),
        "w_uv-latent-dim": (dense(w_uv=torch.randn(4, 32, 48, **f)), "w_uv"),
        "w_uv-value-dim-too-large": (dense(w_uv=torch.randn(4, 513, 64, **f)), "w_uv"),
        "w_uv-int": (dense(w_uv=torch.ones(4, 32, 64, dtype=torch.int32, device=DEVICE)), "w_uv"),
        "w_uv-device": (dense(w_uv=torch.randn(4, 32, 64, dtype=f["dtype"], device="meta")), "w_uv"),
        "paged-w_uv-heads": (paged(w_uv=torch.randn(5, 32, 64, **f)), "w_uv"),
    }


BAD = _bad_inputs()


@pytest.mark.parametrize("name", list(BAD))
def test_bad_input_raises(name):
    call, argument = BAD[name]
    with pytest.raises(ValueError, match=rf"^{argument}\b.*got .*valid"):
        call()


def test_strided_seq_lens():
    """seq_lens a strided view (every other entry of a longer tensor), block_table column-major: the kernels see
    the lengths and pages the value checks saw."""
    dtype = KERNEL_DTYPES[0]
    q_abs, q_rope, c_kv, k_rope, scale = _inputs(3, 4, 24, 64, 16, dtype)
    lens = torch.tensor([24, 1, 1, 1, 9, 24], dtype=torch.int32, device=DEVICE)[::2]  # (24, 1, 9)
    c_pages, r_pages, table = _paged_latent(c_kv, k_rope, 8)
    table_t = table.t().contiguous().t()
    assert not (lens.is_contiguous() or table_t.is_contiguous())
    ref_out, ref_lse = mla_decode_reference(q_abs, q_rope, c_kv, k_rope, lens, scale=scale)
    out, lse = mla_decode(q_abs, q_rope, c_kv, k_rope, lens, scale=scale, num_splits=2)
    _check(out, lse, ref_out, ref_lse, dtype, "mla_decode strided seq_lens")
    out, lse = paged_mla_decode(q_abs, q_rope, c_pages, r_pages, table_t, lens, scale=scale, num_splits=2)
    _check(out, lse, ref_out, ref_lse, dtype, "paged_mla_decode strided seq_lens and table")


def test_compile_fullgraph():
    """torch.compile traces both MLA ops as custom ops without a graph break (aot_eager backend)."""
    dtype = KERNEL_DTYPES[-1]
    b, h, s, d_c, d_r = 2, 16, 24, 64, 16
    q_abs, q_rope, c_kv, k_rope, scale = _inputs(b, h, s, d_c, d_r, dtype)
    c_pages, r_pages, table = _paged_latent(c_kv, k_rope, 8)
    lens = torch.tensor([24, 5], dtype=torch.int32, device=DEVICE)

    w_uv = d_c**-0.5 * torch.randn(h, 32, d_c, device=DEVICE)

    def step(q_abs, q_rope, c_kv, k_rope, c_pages, r_pages, table, lens):
        a, lse_a = mla_decode(q_abs, q_rope, c_kv, k_rope, lens, scale=scale)
        p, lse_p = paged_mla_decode(q_abs, q_rope, c_pages, r_pages, table, lens, scale=scale)
        values = paged_mla_decode(q_abs, q_rope, c_pages, r_pages, table, lens, scale=scale, w_uv=w_uv)[0]
        values = values + mla_decode(q_abs, q_rope, c_kv, k_rope, lens, scale=scale, w_uv=w_uv)[0]
        return a.float() + p.float(), lse_a + lse_p, values

    torch._dynamo.reset()
    out, lse, values = torch.compile(step, fullgraph=True, backend="aot_eager")(
        q_abs, q_rope, c_kv, k_rope, c_pages, r_pages, table, lens
    )
    ref_out, ref_lse = mla_decode_reference(q_abs, q_rope, c_kv, k_rope, lens, scale=scale)
    assert_close(out, 2 * ref_out, dtype, "compiled out")
    assert_close(lse, 2 * ref_lse, dtype, "compiled lse")
    assert values.shape == (b, h, 32)
    assert_close(values, 2 * unabsorb_output(ref_out, w_uv), dtype, "compiled values")


@pytest.mark.slow
@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
def test_128_head_tile_computes_each_score_once(paged):
    """The 64-head tile compiled for sm_90 (`conftest.compile_gluon_sm90`, no GPU needed): its eight warps must
    not both compute the same 64 x 64 scores. Triton lays out a dot that feeds another dot with every warp along M,
    which at M = 64 makes two warpgroups duplicate one tile (mla._cut_chain). Every tensor-core layout of the
    kernel must split its warps 4 x 2 (warpgroups side by side along N), never 8 x 1, and the kernel must fit the
    227 KB of shared memory an H100/H200 block may use."""
    import re

    from attention_kernels import mla

    cfg = mla._mla_config(128, 512)
    assert cfg["BLOCK_H"] == 64 and cfg["num_warps"] == 8, cfg
    # A 64-head tile's partials are merged by the separate combine (decode.fused_combine_chunk).
    assert mla.fused_combine_chunk(2, 64, 512, 1 << 20, torch.device("cpu")) == 0
    const = dict(
        H=128,
        D_C=512,
        D_R=64,
        BLOCK_H=cfg["BLOCK_H"],
        BLOCK_N=cfg["BLOCK_N"],
        BLOCK_DC=512,
        BLOCK_DR=64,
        PAGED=paged,
        PAGE_SIZE=64 if paged else 1,
        NUM_SPLITS=2,
        STATIC_ITERS=0,
        EVICT="",
        DOT_PRECISION="tf32",
        FUSE_CHUNK=0,
    )
    types = dict(
        QA="*bf16",
        QR="*bf16",
        CKV="*bf16",
        KR="*bf16",
        BLOCK_TABLE="*i32",
        SEQ_LENS="*i32",
        OUT="*fp32",
        LSE="*fp32",
        FINAL_OUT="*bf16",
        FINAL_LSE="*fp32",
        COUNTERS="*i32",
        scale_log2="fp32",
    )
    result = compile_gluon_sm90(
        "attention_kernels.mla",
        "_mla_decode_kernel",
        types,
        const,
        gluon=False,
        options=dict(num_warps=cfg["num_warps"], num_stages=cfg["num_stages"]),
    )
    layouts = re.findall(r"nvidia_mma<\{versionMajor = 3[^}]*warpsPerCTA = \[(\d+), (\d+)\]", result["ttgir"])
    assert layouts, "no Hopper tensor-core (wgmma) layout in the compiled kernel"
    assert all(w == ("4", "2") for w in layouts), f"warp grids {layouts}: a score tile is computed twice"
    assert result["shared"] <= 232448, f"{result['shared']} bytes of shared memory"


def _compile_sm90(splits: int, page_size: int, heads: int) -> dict:
    """The Hopper MLA kernel with a tile of `heads` compiled for sm_90 (`conftest.compile_gluon_sm90`), as an sm_90
    GPU launches it: the narrow program as a programmatic dependent launch (WAIT, `mla_sm90.launch`)."""
    from attention_kernels import mla_sm90

    half, n, rope = mla_sm90.HALF_COLUMNS, mla_sm90.BLOCK_N, mla_sm90.ROPE_DIM
    rows = min(page_size, n) if page_size else n
    types = dict(
        qc_desc=dict(block=[1, heads, half], dtype="bfloat16"),
        qr_desc=dict(block=[1, heads, rope], dtype="bfloat16"),
        c_desc=dict(block=[1, rows, half], dtype="bfloat16"),
        r_desc=dict(block=[1, rows, rope], dtype="bfloat16"),
        seq_lens_ptr="*i32",
        table_ptr="*i32",
        out_ptr="*bf16" if splits == 1 else "*fp32",
        lse_ptr="*fp32",
        num_heads="i32",
        scale_log2="fp32",
    )
    const = dict(
        BLOCK_N=n,
        STAGES=mla_sm90.STAGES,
        NUM_SPLITS=splits,
        PAGED=page_size > 0,
        PAGE_SIZE=max(page_size, 1),
        PAGE_ROWS=rows,
        WAIT=heads < mla_sm90.HEADS_PER_PROGRAM,
    )
    return compile_gluon_sm90("attention_kernels.mla_sm90", "_mla_decode_sm90_kernel", types, const)


# (splits, page_size): contiguous (page 0), and paged with several pages per 64-token block, one, or a slice of one.
SM90_STRUCTURE = [(1, 0), (4, 0), (1, 8), (4, 16), (1, 64), (4, 256)]


@pytest.mark.slow
@pytest.mark.parametrize(
    "splits,page_size",
    SM90_STRUCTURE,
    ids=[f"splits{s}-" + (f"page{p}" if p else "contiguous") for s, p in SM90_STRUCTURE],
)
def test_sm90_kernel_structure(splits, page_size):
    """The Hopper MLA kernel (Gluon, no CPU interpreter; its numerics run in the 64- and 128-head cases above on an
    H100/H200) compiled for sm_90 on any machine: a loader warp that gives its registers to two consumer
    warpgroups (setmaxnreg 40 / 240), TMA loads, the scores of each block computed once (576 / 16 = 36 m64n64k16
    wgmma, by consumer 0 only) and P times each latent half once per consumer (2 x 4 m64n256k16), within the 227 KB
    of shared memory, no serialized wgmma and no register spills when contiguous, and no wait for the kernel before
    (it is not a dependent launch). Paged, ptxas spills one or two
    registers (8-16 bytes stored; two at 8-token pages): the SASS (cuobjdump) shows the stores in the prologue and
    the loads and stores in the softmax consumer's setup, outside every loop, so they run once per program."""
    import re

    from attention_kernels import mla_sm90

    result = _compile_sm90(splits, page_size, mla_sm90.HEADS_PER_PROGRAM)
    ptx = result["ptx"]
    regs = setmaxnreg_counts(ptx)
    assert {"40", "240"} <= regs, f"warp roles' register counts {sorted(regs)}"
    assert "cp.async.bulk.tensor" in ptx, "no TMA load"
    shapes = re.findall(r"wgmma\.mma_async\.sync\.aligned\.(m\d+n\d+k\d+)", ptx)
    assert shapes.count("m64n64k16") == 36 and shapes.count("m64n256k16") == 8, sorted(set(shapes))
    assert result["shared"] <= 232448, f"{result['shared']} bytes of shared memory"
    spills = spill_bytes(result["ptxas"])
    allowed = 16 if page_size else 0
    assert spills and all(a <= allowed and b <= allowed for a, b in spills), result["ptxas"]
    assert "serialized" not in result["ptxas"], result["ptxas"]
    assert "griddepcontrol.wait" not in ptx


@pytest.mark.slow
@pytest.mark.parametrize(
    "splits,page_size,heads",
    [(1, 0, 16), (4, 16, 16), (2, 0, 32)],
    ids=["splits1-contiguous-H16", "splits4-page16-H16", "splits2-contiguous-H32"],
)
def test_sm90_narrow_kernel_structure(splits, page_size, heads):
    """The narrow Hopper MLA kernel (a tile of 16 or 32 heads as the wgmma's N; its numerics run in the 5-, 7-, 16-
    and 24-head cases above on an H100/H200) compiled for sm_90: a loader warp (setmaxnreg 40) and one consumer
    warpgroup, TMA loads, per 64-token block the transposed scores once (576 / 16 = 36 m64nNk16 wgmma, operands
    K-major) and the two latent halves of the transposed output (2 x 4 row tiles x 4 token steps = 32 m64nNk16,
    the latent tile read M-major and P^T N-major: transpose flags 1, 1), within the 227 KB of shared memory, no
    serialized wgmma, no spills, one griddepcontrol.wait (the dependent launch)."""
    import re

    result = _compile_sm90(splits, page_size, heads)
    ptx = result["ptx"]
    assert "40" in setmaxnreg_counts(ptx), f"warp roles' register counts {sorted(setmaxnreg_counts(ptx))}"
    assert "cp.async.bulk.tensor" in ptx, "no TMA load"
    mmas = re.findall(r"wgmma\.mma_async\.sync\.aligned\.(m\d+n\d+k\d+)\.[^;]*, (\d), (\d);", ptx)
    assert sorted(set(shape for shape, _, _ in mmas)) == [f"m64n{heads}k16"], mmas
    transposed = [(a, b) for _, a, b in mmas]
    assert transposed.count(("0", "0")) == 36 and transposed.count(("1", "1")) == 32, transposed
    assert result["shared"] <= 232448, f"{result['shared']} bytes of shared memory"
    spills = spill_bytes(result["ptxas"])
    assert spills and all(a == 0 and b == 0 for a, b in spills), result["ptxas"]
    assert "serialized" not in result["ptxas"], result["ptxas"]
    assert ptx.count("griddepcontrol.wait") == 1


def test_sm90_eligibility():
    """Which inputs the Hopper MLA kernels take (on an sm_90 GPU): fp16/bf16, 512 + 64, up to 64 heads or a multiple
    of 64, TMA-readable strides (the model's slices of one (B, H, 576) tensor are); everything else
    runs the Triton kernel."""
    from attention_kernels.mla_sm90 import eligible

    def inputs(h=128, d_c=512, d_r=64, dtype=torch.bfloat16):
        return (
            torch.zeros(2, h, d_c, dtype=dtype),
            torch.zeros(2, h, d_r, dtype=dtype),
            torch.zeros(2, 40, d_c, dtype=dtype),
            torch.zeros(2, 40, d_r, dtype=dtype),
        )

    assert eligible(*inputs()) and eligible(*inputs(h=64)) and eligible(*inputs(dtype=torch.float16))
    # Up to 32 heads: the narrow kernel; 33-63 one zero-padded 64-head tile; contiguous or paged alike.
    for h in (1, 5, 16, 17, 32, 40, 63):
        assert eligible(*inputs(h=h)) and eligible(*inputs(h=h), paged=True), h
    assert not eligible(*inputs(h=96)) and not eligible(*inputs(h=96), paged=True)
    assert eligible(*inputs(h=128), paged=True)
    assert not eligible(*inputs(dtype=torch.float32))
    assert not eligible(*inputs(d_c=256)) and not eligible(*inputs(d_r=32))
    q = torch.zeros(2, 128, 576, dtype=torch.bfloat16)
    cache = torch.zeros(2, 40, 576, dtype=torch.bfloat16)
    assert eligible(q[..., :512], q[..., 512:], cache[..., :512], cache[..., 512:])
    odd = torch.zeros(2, 40, 577, dtype=torch.bfloat16)
    assert not eligible(q[..., :512], q[..., 512:], odd[..., :512], cache[..., 512:]), "unaligned row stride"


DEPENDENT = [(16, 1, False), (16, 4, False), (24, 2, False), (64, 2, False), (16, 1, True), (16, 4, True)]


@pytest.mark.parametrize("h,splits,up", DEPENDENT, ids=[f"H{h}-splits{s}" + "-w_uv" * u for h, s, u in DEPENDENT])
def test_mla_decode_as_dependent_launch(h, splits, up, monkeypatch):
    """The narrow Hopper MLA program (up to 32 heads, on an H100/H200) launches as a programmatic dependent of the
    kernel before it where `decode.pdl` says so: its programs wait for that kernel before they read anything (the
    64-head tile and the Triton kernel launch plainly). So does the combine that applies W_UV, which reads W_UV
    before it waits. A chain of three decodes, each taking the previous one's output (the latent, or the values of
    a square W_UV) as its absorbed query, eager and replayed from a CUDA graph: the reference's outputs, bit for
    bit those of plain launches (ZOO_PDL=0)."""
    dtype = KERNEL_DTYPES[-1]  # bf16 on the GPU, fp16 on the interpreter (which computes bf16 wrong)
    # The interpreter has no dependent launches to test; there a 64-wide latent keeps W_UV's chain quick.
    d_c = 64 if up and DEVICE == "cpu" else 512
    q_abs, q_rope, c_kv, k_rope, scale = _inputs(2, h, 200, d_c, 64, dtype)
    lens = torch.tensor([200, 61], device=DEVICE, dtype=torch.int32)
    w_uv = (d_c**-0.5 * torch.randn(h, d_c, d_c, device=DEVICE)).to(dtype) if up else None

    def check(x, out, lse, name):
        latent, ref_lse = mla_decode_reference(x, q_rope, c_kv, k_rope, lens, scale=scale)
        _check(out, lse, latent if w_uv is None else unabsorb_output(latent, w_uv), ref_lse, dtype, name)

    check_dependent_chain(
        lambda x: mla_decode(x, q_rope, c_kv, k_rope, lens, scale=scale, num_splits=splits, w_uv=w_uv, validate=False),
        q_abs,
        check,
        monkeypatch,
    )


# ------------------------------------------------------------------------------------------------------------
# mla_decode_inputs: a decode step's absorbed query, RoPE parts, latent norm and cache write
# ------------------------------------------------------------------------------------------------------------

INPUT_SHAPES = {  # B, H, D_n, D_r, D_c
    "one row": (1, 3, 16, 8, 32),
    "two row blocks": (19, 2, 24, 6, 40),  # 16 rows a program; D_n, D_r / 2 and D_c not powers of two
    "gpt2-small": (2, 12, 64, 32, 256),  # the model bench_generate decodes: four column blocks a head
    "wide head": (3, 2, 128, 8, 100),  # fp32 takes 32 columns a program here (`input_columns`), fp16 64
}


def _step_inputs(B, H, D_n, D_r, D_c, dtype, together: bool, cache_dtype=None):
    """together: q and kv as column slices of one projection's output (MLA without query compression); else two
    tensors. w_uk is a view of the model's (H, D_n + D_v, D_c) up-projection, as `_up_weights` gives it. The cache
    (7 rows or pages of 11 slots) starts random, so a write to the wrong place or a missing one shows."""
    if together:
        proj = torch.randn(B, H * (D_n + D_r) + D_c + D_r, device=DEVICE, dtype=dtype)
        q, kv = proj.split([H * (D_n + D_r), D_c + D_r], dim=-1)
        q = q.view(B, H, D_n + D_r)
    else:
        q = torch.randn(B, H, D_n + D_r, device=DEVICE, dtype=dtype)
        kv = torch.randn(B, D_c + D_r, device=DEVICE, dtype=dtype)
    w_uk = (torch.randn(H, D_n + 5, D_c, device=DEVICE) / D_n**0.5).to(dtype)[:, :D_n]
    positions = 5 + 3 * torch.arange(B, device=DEVICE)[:, None]  # (B, 1): each row's next position
    cos, sin = (t[:, 0] for t in gpt.rope_cos_sin(positions, D_r, 10000.0))
    norm_weight = (1 + 0.1 * torch.randn(D_c, device=DEVICE)).to(dtype)
    P, S = max(7, B), 11
    c_cache = torch.randn(P, S, D_c, device=DEVICE, dtype=cache_dtype or dtype)
    r_cache = torch.randn(P, S, D_r, device=DEVICE, dtype=cache_dtype or dtype)
    where = torch.randperm(P * S, device=DEVICE)[:B]  # distinct (page, slot) per row
    return dict(
        q=q,
        kv=kv,
        cos=cos,
        sin=sin,
        norm_weight=norm_weight,
        eps=1e-6,
        w_uk=w_uk,
        c_cache=c_cache,
        r_cache=r_cache,
        pages=where // S,
        slots=where % S,
    )


def _check_step(args, got, dtype):
    """got (q_absorbed, q_rope) and the cache against the reference; every other cache entry unchanged."""
    q, w_uk = args["q"], args["w_uk"]
    B, H, _ = q.shape
    before_c, before_r = args["c_cache_before"], args["r_cache_before"]
    ref = mla_decode_inputs_reference(q, args["kv"], args["cos"], args["sin"], args["norm_weight"], args["eps"], w_uk)
    q_abs, q_rope = got
    assert q_abs.shape == (B, H, w_uk.shape[2]) and q_abs.dtype == q.dtype
    assert q_rope.shape == (B, H, q.shape[2] - w_uk.shape[1]) and q_rope.dtype == q.dtype
    assert_close(q_abs, ref[0], dtype, "q_absorbed")
    assert_close(q_rope, ref[1], dtype, "q_rope")
    pages, slots = args["pages"], args["slots"]
    c_cache, r_cache = args["c_cache"], args["r_cache"]
    assert_close(c_cache[pages, slots], ref[2], dtype, "the cached latent")
    assert_close(r_cache[pages, slots], ref[3], dtype, "the cached RoPE key")
    untouched = torch.ones(c_cache.shape[:2], dtype=torch.bool, device=DEVICE)
    untouched[pages, slots] = False
    assert torch.equal(c_cache[untouched], before_c[untouched]) and torch.equal(r_cache[untouched], before_r[untouched])


def _run_step(args):
    args["c_cache_before"], args["r_cache_before"] = args["c_cache"].clone(), args["r_cache"].clone()
    keys = ("q", "kv", "cos", "sin", "norm_weight", "eps", "w_uk", "c_cache", "r_cache", "pages", "slots")
    return mla_decode_inputs(*(args[k] for k in keys))


@pytest.mark.parametrize("dtype", KERNEL_DTYPES, ids=DTYPE_IDS.get)
@pytest.mark.parametrize("together", [True, False], ids=["one projection", "two projections"])
@pytest.mark.parametrize("shape", list(INPUT_SHAPES), ids=str)
def test_mla_decode_inputs_matches_the_math(shape, together, dtype):
    args = _step_inputs(*INPUT_SHAPES[shape], dtype, together)
    _check_step(args, _run_step(args), dtype)


def test_mla_decode_inputs_other_dtypes_with_shared_angles():
    """An fp32 cache and fp32 weights (W_UK, the norm's gain) under a half-precision model, as autocast decodes with
    fp32 weights: the cache stores the values as a copy would. int32 page and slot ids and one row of angles for
    every row (a (1, D_r/2) broadcast) work as well."""
    dtype = KERNEL_DTYPES[-1]  # fp16 on the CPU, bf16 on the GPU
    args = _step_inputs(*INPUT_SHAPES["two row blocks"], dtype, True, cache_dtype=torch.float32)
    args["w_uk"], args["norm_weight"] = args["w_uk"].float(), args["norm_weight"].float()
    args["cos"], args["sin"] = args["cos"][:1], args["sin"][:1]
    args["pages"], args["slots"] = args["pages"].int(), args["slots"].int()
    got = _run_step(args)
    assert args["c_cache"].dtype == torch.float32 and args["r_cache"].dtype == torch.float32
    args["cos"], args["sin"] = (t.expand(args["q"].shape[0], -1) for t in (args["cos"], args["sin"]))
    _check_step(args, got, dtype)


def test_mla_decode_inputs_equals_the_models_eager_math():
    """What MLA's decode runs without it: the per-head einsum with W_UK, apply_rope on the query heads' RoPE parts
    and the key, RMSNorm, and the cache's write."""
    B, H, D_n, D_r, D_c = INPUT_SHAPES["two row blocks"]
    args = _step_inputs(B, H, D_n, D_r, D_c, torch.float32, together=True)
    norm = gpt.RMSNorm(D_c).to(DEVICE)
    norm.weight.data.copy_(args["norm_weight"])
    args["norm_weight"], args["eps"] = norm.weight, norm.eps
    q, kv, cos, sin = args["q"], args["kv"], args["cos"], args["sin"]
    with torch.no_grad():
        q_abs, q_rope = _run_step(args)
        want_c = norm(kv[:, :D_c])
    assert_close(q_abs, torch.einsum("bhn,hnc->bhc", q[..., :D_n], args["w_uk"]), torch.float32, "q_absorbed")
    assert_close(q_rope, gpt.apply_rope(q[..., D_n:], cos[:, None], sin[:, None]), torch.float32, "q_rope")
    pages, slots = args["pages"], args["slots"]
    assert_close(args["c_cache"][pages, slots], want_c, torch.float32, "c_kv")
    want_k = gpt.apply_rope(kv[:, None, D_c:], cos[:, None], sin[:, None])[:, 0]
    assert_close(args["r_cache"][pages, slots], want_k, torch.float32, "k_rope")


def test_mla_decode_inputs_compiles_to_its_op():
    """Under torch.compile(fullgraph=True) it traces as the zoo::mla_decode_inputs op and writes the cache as the
    eager call does; opcheck checks the op's registrations (its declared mutation of both caches included)."""
    args = _step_inputs(*INPUT_SHAPES["one row"], torch.float32, together=True)
    keys = ("q", "kv", "cos", "sin", "norm_weight", "eps", "w_uk", "c_cache", "r_cache", "pages", "slots")
    eager = _run_step(args)
    eager_cache = args["c_cache"].clone(), args["r_cache"].clone()
    args["c_cache"].copy_(args["c_cache_before"])
    args["r_cache"].copy_(args["r_cache_before"])
    compiled = torch.compile(mla_decode_inputs, fullgraph=True, backend="aot_eager")
    for g, e in zip(compiled(*(args[k] for k in keys), validate=False), eager):
        assert torch.equal(g, e)
    assert torch.equal(args["c_cache"], eager_cache[0]) and torch.equal(args["r_cache"], eager_cache[1])
    torch.library.opcheck(_mla_inputs_op, tuple(args[k] for k in keys))


def test_mla_decode_inputs_bad_inputs_fail_clearly():
    B, H, D_n, D_r, D_c = 2, 3, 16, 8, 32
    args = _step_inputs(B, H, D_n, D_r, D_c, torch.float32, together=False)
    q, kv, w_uk, c_cache = args["q"], args["kv"], args["w_uk"], args["c_cache"]
    cases = [
        (dict(q=q[0]), "q: got shape (3, 24); valid: a 3-d tensor (B, H, D_n + D_r)"),
        (dict(kv=kv[:, :20]), "kv: got shape (2, 20); valid: (B=2, D_c + D_r=40)"),
        (dict(w_uk=w_uk[:2]), "w_uk: got shape (2, 16, 32); valid: (H=3, D_n, D_c)"),
        (dict(w_uk=w_uk.int()), "w_uk: got dtype torch.int32"),
        (dict(q=q[..., :23], kv=kv[:, :39]), "q: got last dim 23 with D_n=16; valid: D_n + D_r with an even D_r"),
        (dict(kv=kv.half()), "kv: got dtype torch.float16; valid: the dtype of q, torch.float32"),
        (dict(w_uk=w_uk.mT.contiguous().mT), "w_uk: got strides"),
        (dict(c_cache=c_cache[..., :31]), "c_cache: got shape (7, 11, 31); valid: (P, S, D_c=32)"),
        (dict(r_cache=args["r_cache"][:, :10]), "r_cache: got shape (7, 10, 8); valid: (7, 11, 8)"),
        (dict(c_cache=c_cache.int()), "c_cache: got dtype torch.int32"),
        (
            dict(pages=args["pages"][:1]),
            "pages: got torch.int64 shape (1,); valid: an int32 or int64 tensor of shape (B=2,)",
        ),
        (dict(slots=args["slots"].float()), "slots: got torch.float32 shape (2,)"),
        (dict(slots=args["slots"] + 11), "slots: got values in"),
        (dict(pages=-args["pages"] - 1), "pages: got values in"),
        (dict(cos=args["cos"][:, :3]), "cos: got shape (2, 3); valid: (2 or 1, D_r/2=4)"),
        (dict(norm_weight=args["norm_weight"][:31]), "norm_weight: got shape (31,); valid: (D_c=32,)"),
        (dict(eps=0.0), "eps: got 0.0; valid: a finite float > 0"),
    ]
    for change, message in cases:
        call = {k: v for k, v in args.items() if not k.endswith("_before")} | change
        with pytest.raises(ValueError) as err:
            mla_decode_inputs(**call)
        assert message in str(err.value), (change, str(err.value))


@pytest.mark.slow
@pytest.mark.parametrize(
    "dims, dtype",
    [((12, 64, 256, 32), "bf16"), ((128, 128, 512, 64), "bf16"), ((16, 256, 512, 64), "fp32")],
    ids=["gpt2-small-bf16", "deepseek-bf16", "widest-fp32"],
)
def test_mla_decode_inputs_compiles_for_sm90_without_spills(dims, dtype):
    """The kernel as the GPT-2-small MLA decodes with it (12 heads, D_n 64, a 256-wide latent, a 32-dim RoPE key),
    at DeepSeek-V2's 128 heads of 128 + 64 with a 512-wide latent, and at the widest head and latent the op takes in
    fp32 (exact fp32 dots), compiled for sm_90 on any machine: the compiler accepts what the interpreter ran, and
    ptxas spills nothing."""
    H, d_n, d_c, d_r = dims
    t = f"*{dtype}"
    pointers = dict(Q=t, KV=t, COS="*fp32", SIN="*fp32", NORM_W=t, W_UK=t, Q_ABS=t, Q_ROPE=t, C_CACHE=t, R_CACHE=t)
    pointers |= dict(PAGES="*i64", SLOTS="*i64", B="i32", eps="fp32")
    columns = input_columns(d_n, 4 if dtype == "fp32" else 2)
    const = dict(H=H, D_N=d_n, D_C=d_c, HALF=d_r // 2, BLOCK_B=16, BLOCK_N=d_n, BLOCK_C=columns, BLOCK_LATENT=d_c)
    const |= dict(BLOCK_HALF=d_r // 2, DOT_PRECISION="ieee" if dtype == "fp32" else "tf32")
    result = compile_gluon_sm90("attention_kernels.mla", "_inputs_kernel", pointers, const, gluon=False)
    assert spill_bytes(result["ptxas"]) == [(0, 0)], result["ptxas"]


# (batch, splits, D_c, D_v, activations, W_UV): the GPT-2-small MLA at one row and 64, DeepSeek's 512-wide latent
# and 128 values a head at 16 rows (the MMA) with fp32 weights under autocast and with many splits, and fp32.
UP_COMPILES = [
    (1, 8, 256, 64, "bf16", "bf16"),
    (64, 2, 256, 64, "bf16", "bf16"),
    (16, 1, 512, 128, "bf16", "fp32"),
    (16, 128, 512, 128, "bf16", "fp32"),
    (1, 64, 512, 128, "bf16", "fp32"),
    (64, 4, 512, 128, "fp32", "fp32"),
]


@pytest.mark.slow
@pytest.mark.parametrize("case", UP_COMPILES, ids=["-".join(map(str, c)) for c in UP_COMPILES])
def test_combine_up_compiles_for_sm90_without_spills(case):
    """The split combine that applies W_UV, with the constants the launch picks (`up_config`), compiled for sm_90
    on any machine: ptxas spills nothing, and as a dependent launch the wait reaches the PTX."""
    from attention_kernels.mla import up_config

    batch, splits, d_c, d_v, act, weights = case
    dtype = torch.float32 if act == "fp32" else torch.bfloat16
    part = "*fp32" if splits > 1 else f"*{act}"
    pointers = dict(PART_O=part, PART_LSE="*fp32", W_UV=f"*{weights}", OUT=f"*{act}", LSE="*fp32", B="i32")
    cfg = up_config(batch, splits, d_c, d_v, dtype)
    options = dict(num_warps=cfg.pop("num_warps"))
    result = compile_gluon_sm90(
        "attention_kernels.mla", "_combine_up_kernel", pointers, cfg | dict(WAIT=True), options, gluon=False
    )
    assert spill_bytes(result["ptxas"]) == [(0, 0)], result["ptxas"]
    assert "griddepcontrol.wait" in result["ptx"], "WAIT did not reach the PTX"
