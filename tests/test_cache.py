"""The KV caches on their own (no model): the block allocator's invariants under random use, exhaustion, the
paged bookkeeping against a shadow copy of every sequence, and each cache's decode (torch reference and Triton
kernels) against the reference attention over the same tokens, through ragged lengths, release and reuse."""

import random
from types import SimpleNamespace

import pytest
import torch
from conftest import DEVICE, KERNEL_DTYPES, assert_close

import attention_kernels
from attention_kernels import reference
from cache import BlockAllocator, CacheFullError, make_cache
from model import rope_cos_sin

GQA = SimpleNamespace(attention="gqa", n_layer=2, n_head=4, n_kv_head=2, n_embd=64)  # head_dim 16
MLA = SimpleNamespace(attention="mla", n_layer=2, n_head=4, kv_lora_rank=32, qk_rope_head_dim=8)


# ----------------------------------------------------------------------------------------------- allocator


def test_allocator_random_sequences_keep_invariants():
    rng = random.Random(0)
    alloc = BlockAllocator(37)
    owned: dict[int, list[int]] = {}  # sequence id -> its pages
    ever_freed, reused = set(), 0
    for step in range(2000):
        if owned and rng.random() < 0.4:
            seq = rng.choice(list(owned))
            pages = owned.pop(seq)
            alloc.free(pages)
            ever_freed.update(pages)
        else:
            n = rng.randint(0, 6)
            if alloc.can_allocate(n):
                pages = alloc.allocate(n)
                reused += len(set(pages) & ever_freed)
                owned[step] = pages
            else:
                before = (alloc.num_free, alloc.num_used)
                with pytest.raises(CacheFullError):
                    alloc.allocate(n)
                assert (alloc.num_free, alloc.num_used) == before, "a failed allocate changed the pool"
        alloc.check()
        held = [p for ps in owned.values() for p in ps]
        assert len(held) == len(set(held)), f"step {step}: a page is owned by two sequences"
        assert len(held) == alloc.num_used and alloc.num_free + len(held) == 37, f"step {step}: leak"
    assert reused > 0, "freed pages were never handed out again"


def test_allocator_exhaustion_message_and_bad_free():
    alloc = BlockAllocator(4)
    pages = alloc.allocate(3)
    with pytest.raises(CacheFullError, match=r"asked for 2 pages, 1 free of 4 .*--num_pages.*batch"):
        alloc.allocate(2)
    assert alloc.num_free == 1
    with pytest.raises(ValueError, match="pages: got"):
        alloc.free([pages[0], pages[0]])
    alloc.free([pages[0]])
    with pytest.raises(ValueError, match="not owned"):
        alloc.free([pages[0]])
    assert alloc.allocate(1) == [pages[0]], "the freed page is the next one handed out"
    with pytest.raises(ValueError, match="num_pages"):
        BlockAllocator(0)
    alloc.check()


# ----------------------------------------------------------------------------------- paged bookkeeping


def _paged_consistency(cache, shadow):
    store = cache.store
    store.allocator.check()
    held = [p for ps in store.pages for p in ps]
    assert len(held) == len(set(held)), "a page belongs to two sequences"
    assert len(held) == store.allocator.num_used, "pages leaked"
    table = store.block_table.cpu()
    for r, toks in enumerate(shadow):
        assert store.lens[r] == len(toks)
        assert len(store.pages[r]) == -(-len(toks) // store.page_size)
        assert table[r, : len(store.pages[r])].tolist() == store.pages[r]
        if toks:
            k_all, _ = _read(cache, r)
            torch.testing.assert_close(k_all, torch.stack(toks, 1), rtol=0, atol=0)


def _read(cache, r):
    view = cache.view([r])
    n = cache.store.lens[r]
    k = view.store.prefix(view.k[0], view.rows, view._rows_t, n).transpose(1, 2)
    return k[0], None


def test_paged_random_grow_release_matches_shadow():
    """Random growth (batch-1 prefill of 1..12 tokens) and release of 5 sequences over a pool too small for all
    of them: every sequence reads back exactly what was written, whatever was freed and reused around it."""
    rng = random.Random(1)
    cache = make_cache("paged", GQA, 5, 40, device=DEVICE, page_size=8, num_pages=9)
    shadow = [[] for _ in range(5)]  # row -> list of (H_kv, D) tokens of layer 0's K
    full = 0
    for _ in range(300):
        r = rng.randrange(5)
        if shadow[r] and rng.random() < 0.25:
            cache.release(r)
            shadow[r] = []
        else:
            T = rng.randint(1, 12)
            if len(shadow[r]) + T > 40:
                continue
            view = cache.view([r])
            k = torch.randn(1, 2, T, 16, device=DEVICE)
            try:
                view.reserve(T)
            except CacheFullError:
                full += 1
                _paged_consistency(cache, shadow)  # nothing changed
                continue
            view.append(0, k, k)
            shadow[r] += list(k[0].unbind(1))
        _paged_consistency(cache, shadow)
    assert full > 0, "the test never exhausted the pool"


@pytest.mark.parametrize("kind", ["grouped", "paged"])
def test_trim_drops_the_padding_of_a_prefill_and_gives_its_pages_back(kind):
    """A right-padded prefill writes 20 tokens where the prompt has 9: trim keeps the 9 (a paged cache frees the
    pages past them), and the next tokens land right after them. A length past the row's tokens is refused."""
    cache = make_cache(kind, GQA, 2, 40, device=DEVICE, **({"page_size": 8} if kind == "paged" else {}))
    k = torch.randn(1, 2, 20, 16, device=DEVICE)
    view = cache.view([1])
    view.reserve(20)
    view.append(0, k, k)
    cache.trim(1, 9)
    assert cache.store.lens == [0, 9]
    if kind == "paged":
        assert len(cache.store.pages[1]) == 2 and cache.store.allocator.num_used == 2
        cache.store.allocator.check()
    more = torch.randn(1, 2, 3, 16, device=DEVICE)
    view = cache.view([1])
    view.reserve(3)
    view.append(0, more, more)
    k_all, _ = _read(cache, 1)
    torch.testing.assert_close(k_all, torch.cat([k[0, :, :9], more[0]], 1), rtol=0, atol=0)
    with pytest.raises(ValueError, match=r"length: got 13 for row 1; valid: 0 .. 12"):
        cache.trim(1, 13)
    with pytest.raises(ValueError, match=r"row: got 2"):
        cache.trim(2, 0)


def test_paged_exhaustion_raises_and_leaves_others_intact():
    cache = make_cache("paged", GQA, 3, 64, device=DEVICE, page_size=8, num_pages=6)
    data = {}
    for r, n in ((0, 20), (1, 16)):  # 3 + 2 pages
        view = cache.view([r])
        view.reserve(n)
        data[r] = torch.randn(1, 2, n, 16, device=DEVICE)
        view.append(0, data[r], data[r])
    before = ([list(p) for p in cache.store.pages], list(cache.store.lens), cache.store.block_table.clone())
    # rows 0 and 1 each need one more page for 5 more tokens: 2 pages asked, 1 free -> nothing allocated at all
    with pytest.raises(CacheFullError, match=r"asked for 2 pages, 1 free of 6"):
        cache.view([0, 1]).reserve(5)
    with pytest.raises(CacheFullError, match="--num_pages"):
        cache.view([2]).reserve(16)
    assert ([list(p) for p in cache.store.pages], list(cache.store.lens)) == before[:2]
    assert torch.equal(cache.store.block_table, before[2])
    for r in data:
        torch.testing.assert_close(_read(cache, r)[0], data[r][0], rtol=0, atol=0)
    cache.release(0)  # a finished sequence makes room: the waiting prompt now fits
    cache.view([2]).reserve(16)
    assert cache.store.allocator.num_free == 2


# ----------------------------------------------------------------------- decode against the reference


def _backends():
    yield pytest.param("torch", torch.float32, id="torch-fp32")
    for dt in KERNEL_DTYPES:
        yield pytest.param("triton", dt, id=f"triton-{str(dt).split('.')[-1]}")


class _Shadow:
    """Every token written, per row and layer, kept apart from the cache: the reference reads it."""

    def __init__(self, rows, n_layer):
        self.tok = {(r, layer): [] for r in range(rows) for layer in range(n_layer)}

    def add(self, rows, layer, *xs):  # xs: (n, T, ...) each
        for i, r in enumerate(rows):
            self.tok[r, layer].append(tuple(x[i] for x in xs))

    def stacked(self, r, layer, j):
        return torch.cat([t[j] for t in self.tok[r, layer]], 0)  # (S, ...)

    def clear(self, r):
        for key in self.tok:
            if key[0] == r:
                self.tok[key] = []


def _raw_latent_step(n, positions, dtype):
    """attend_latent_inputs' arguments after the scale for n rows at their positions (n, 1): the query heads (4 of
    16 + 8), the token's latent and RoPE key (32 + 8) before their norm and rotation, the angles, the norm and W_UK."""
    q = torch.randn(n, 4, 16 + 8, device=DEVICE, dtype=dtype)
    kv = torch.randn(n, 32 + 8, device=DEVICE, dtype=dtype)
    cos, sin = (t[:, 0] for t in rope_cos_sin(positions, 8, 10000.0))
    norm_weight = (1 + 0.1 * torch.randn(32, device=DEVICE)).to(dtype)
    w_uk = (torch.randn(4, 16, 32, device=DEVICE) / 4).to(dtype)
    return q, kv, cos, sin, norm_weight, 1e-6, w_uk


def _step(cache, shadow, rows, T, dtype, check, view=None, checked=None):
    """Grow `rows` of the cache by T tokens in every layer and check what the cache returns (for the rows of
    `checked`, default all; `view`: a view of `rows` to go through, default cache.view(rows))."""
    view = cache.view(rows) if view is None else view
    checked = rows if checked is None else checked
    pos = view.reserve(T)
    n = len(rows)
    mla = hasattr(cache, "c")
    for layer in range(cache.n_layer):
        if mla:
            c, kr = torch.randn(n, T, 32, device=DEVICE, dtype=dtype), torch.randn(n, T, 8, device=DEVICE, dtype=dtype)
            if T > 1:
                shadow.add(rows, layer, c, kr)
                c_all, r_all = view.append_latent(layer, c, kr)
                check(c_all[0], shadow.stacked(rows[0], layer, 0), "append_latent c_kv")
                check(r_all[0], shadow.stacked(rows[0], layer, 1), "append_latent k_rope")
                continue
            if layer % 2:  # the step's raw projections: the cache normalizes, rotates and writes them itself
                raw = _raw_latent_step(n, pos, dtype)
                qa, qr, c, kr = (t[:, :, None] for t in reference.mla_decode_inputs_reference(*raw))
                c, kr = c.transpose(1, 2).to(dtype), kr.transpose(1, 2).to(dtype)  # (n, 1, D): as the cache holds
                shadow.add(rows, layer, c, kr)
                out = view.attend_latent_inputs(layer, *raw, 0.2)[:, :, None]
                name = "attend_latent_inputs"
            else:
                shadow.add(rows, layer, c, kr)
                qa, qr = (
                    torch.randn(n, 4, 1, 32, device=DEVICE, dtype=dtype),
                    torch.randn(n, 4, 1, 8, device=DEVICE, dtype=dtype),
                )
                out = view.attend_latent(layer, qa, qr, c[:, :, :], kr, 0.2)
                name = "attend_latent"
            for i, r in ((i, r) for i, r in enumerate(rows) if r in checked):
                cs, rs = shadow.stacked(r, layer, 0), shadow.stacked(r, layer, 1)  # (S, D_c), (S, D_r)
                ref, _ = reference.mla_decode_reference(
                    qa[i : i + 1, :, 0],
                    qr[i : i + 1, :, 0],
                    cs[None],
                    rs[None],
                    torch.tensor([cs.shape[0]], device=DEVICE),
                    scale=0.2,
                )
                check(out[i : i + 1, :, 0], ref, f"{name} row {r} layer {layer}")
        else:
            k, v = (
                torch.randn(n, 2, T, 16, device=DEVICE, dtype=dtype),
                torch.randn(n, 2, T, 16, device=DEVICE, dtype=dtype),
            )
            shadow.add(rows, layer, k.transpose(1, 2), v.transpose(1, 2))
            if T > 1:
                k_all, v_all = view.append(layer, k, v)
                check(k_all[0].transpose(0, 1), shadow.stacked(rows[0], layer, 0), "append k")
                check(v_all[0].transpose(0, 1), shadow.stacked(rows[0], layer, 1), "append v")
                continue
            q = torch.randn(n, 4, 1, 16, device=DEVICE, dtype=dtype)
            y = view.attend(layer, q, k, v, 0.25)
            for i, r in ((i, r) for i, r in enumerate(rows) if r in checked):
                ks, vs = shadow.stacked(r, layer, 0), shadow.stacked(r, layer, 1)  # (S, H_kv, D)
                n_tok = torch.tensor([ks.shape[0]], device=DEVICE)
                ref, _ = reference.decode_reference(
                    q[i : i + 1, :, 0], ks.transpose(0, 1)[None], vs.transpose(0, 1)[None], n_tok, scale=0.25
                )
                check(y[i : i + 1, :, 0], ref, f"attend row {r} layer {layer}")
    return pos


@pytest.mark.parametrize("backend,dtype", list(_backends()))
@pytest.mark.parametrize("kind", ["grouped", "paged", "mla", "paged_mla"])
def test_decode_matches_reference_through_ragged_release_and_reuse(kind, backend, dtype):
    """Ragged prefill (rows of 7, 1 and 15 tokens, one at a time), decode steps over the ragged batch, a finished
    row released, the last row's sequence moved into it (move_rows, as the engine packs), decode over the rows
    kept, a new prompt in the freed last row (the released pages reused), then decode over all again."""
    config = MLA if kind.endswith("mla") else GQA
    cache = make_cache(kind, config, 3, 24, device=DEVICE, dtype=dtype, backend=backend, page_size=8)
    shadow = _Shadow(3, config.n_layer)

    def check(got, ref, name):
        assert_close(got, ref, dtype, f"{kind} {backend} {name}")

    for r, n in enumerate((7, 1, 15)):  # rows 0 and 2 cross into a new page during the first decode steps
        pos = _step(cache, shadow, [r], n, dtype, check)
        assert pos.tolist() == [list(range(n))]
    pos = _step(cache, shadow, [0, 1, 2], 1, dtype, check)
    assert pos.tolist() == [[7], [1], [15]]
    cache.release(1)
    shadow.clear(1)
    cache.move_rows([(2, 1)])  # as the engine packs: the survivor moves down into the hole, a decode view a slice
    assert cache.lens == [8, 16, 0]
    shadow.tok = {((1 if r == 2 else r), layer): t for (r, layer), t in shadow.tok.items() if r != 1}
    shadow.tok.update({(2, layer): [] for layer in range(config.n_layer)})
    rows, free_row = [0, 1], 2
    _step(cache, shadow, rows, 1, dtype, check)
    _step(cache, shadow, [free_row], 6, dtype, check)  # a new prompt in the freed row (paged: freed pages)
    all_rows = sorted(rows + [free_row])
    pos = _step(cache, shadow, all_rows, 1, dtype, check)
    assert sorted(p[0] for p in pos.tolist()) == sorted([9, 17, 6])
    if cache.store.paged:
        cache.store.allocator.check()


@pytest.mark.parametrize("kind", ["grouped", "paged"])
def test_decode_step_writes_inside_the_decode_launch(kind, monkeypatch):
    """With the Triton backend a decode step's new K/V reach the cache inside the decode kernel (grouped_decode's
    k_new), with no write_tokens launch, wherever the kernel reads the cache's own buffer: a grouped view of
    consecutive rows, any paged view. A grouped view of scattered rows decodes from a gathered copy, so there the
    write keeps its launch. Either way the outputs and every buffer equal the torch backend's."""
    dtype = KERNEL_DTYPES[0]
    writes = []
    write_tokens = attention_kernels.write_tokens
    monkeypatch.setattr(attention_kernels, "write_tokens", lambda *a, **kw: writes.append(1) or write_tokens(*a, **kw))
    caches = {
        b: make_cache(kind, GQA, 3, 24, device=DEVICE, dtype=dtype, backend=b, page_size=8) for b in ("torch", "triton")
    }
    for r, n in enumerate((5, 9, 3)):  # ragged prefills, one row at a time
        kv = [(torch.randn(1, 2, n, 16, device=DEVICE, dtype=dtype),) * 2 for _ in range(GQA.n_layer)]
        for cache in caches.values():
            view = cache.view([r])
            view.reserve(n)
            for layer in range(GQA.n_layer):
                view.append(layer, *kv[layer])
    for rows in ([0, 1, 2], [1, 2], [0, 2]):
        q, k, v = (torch.randn(len(rows), h, 1, 16, device=DEVICE, dtype=dtype) for h in (4, 2, 2))
        out = {}
        for backend, cache in caches.items():
            writes.clear()
            view = cache.view(rows)
            view.reserve(1)
            out[backend] = [view.attend(layer, q, k, v, 0.25) for layer in range(GQA.n_layer)]
        scattered = kind == "grouped" and rows == [0, 2]
        assert len(writes) == (GQA.n_layer if scattered else 0), (rows, writes)
        for got, want in zip(out["triton"], out["torch"]):
            assert_close(got, want, dtype, f"{kind} rows {rows}")
        for got, want in zip(caches["triton"].store.buffers, caches["torch"].store.buffers):
            assert torch.equal(got, want), f"{kind} rows {rows}: the caches differ"


# ----------------------------------------------------------------------------------------- static decode


def _snapshot(cache):
    return [b.clone() for b in cache.store.buffers]


@pytest.mark.parametrize("backend,dtype", list(_backends()))
@pytest.mark.parametrize("kind", ["grouped", "paged", "mla", "paged_mla"])
def test_static_view_decodes_live_rows_and_pads_into_free_storage(kind, backend, dtype):
    """A static step over 4 rows of which 2 hold sequences (7 and 12 tokens): reserve(1) reads the write positions
    from next_pos (the live rows' lengths, 0 for the padding rows), the live rows decode against the reference over
    their tokens and the new one, and the padding rows write only to their own free rows (contiguous) or the scratch
    page (paged), never into a page of a live row, and take no pages."""
    config = MLA if kind.endswith("mla") else GQA
    paged = dict(page_size=8, num_pages=5) if kind.startswith("paged") else {}
    cache = make_cache(kind, config, 4, 24, device=DEVICE, dtype=dtype, backend=backend, static=True, **paged)
    shadow = _Shadow(4, config.n_layer)

    def check(got, ref, name):
        assert_close(got, ref, dtype, f"{kind} {backend} {name}")

    for r, n in ((0, 7), (1, 12)):
        _step(cache, shadow, [r], n, dtype, check)
    if cache.store.paged:
        cache.ensure_capacity([0, 1], [8, 13])  # row 1 crosses into its second page: allocated now, not in the step
        used = cache.store.allocator.num_used
        owned = {p for r in (0, 1) for p in cache.store.pages[r]}
    cache.next_pos[:2] = torch.tensor([7, 12], device=DEVICE)
    before = _snapshot(cache)
    positions = _step(cache, shadow, [0, 1, 2, 3], 1, dtype, check, view=cache.static_view(4), checked=[0, 1])
    assert positions.tolist() == [[7], [12], [0], [0]]
    # Where each live row's new token goes: (page, slot) when paged (row 1's position 12 is slot 4 of its second
    # page), else (row, position).
    if cache.store.paged:
        new_slots = {0: (cache.store.pages[0][0], 7), 1: (cache.store.pages[1][1], 4)}
    else:
        new_slots = {0: (0, 7), 1: (1, 12)}
    for j, (b0, b1) in enumerate(zip(before, _snapshot(cache))):
        changed = (b0 != b1).reshape(b0.shape[0], b0.shape[1], -1).any(-1)  # (rows or pages, positions or slots)
        changed_at = {tuple(x) for x in changed.nonzero().tolist()}
        if cache.store.paged:  # (pages, page_size): only the live rows' new slots and the scratch page's slot 0
            assert changed_at <= set(new_slots.values()) | {(cache.store.scratch, 0)}
            assert not {p for p, _ in changed_at} - owned - {cache.store.scratch}
        else:  # (rows, positions): the live rows' new positions and position 0 of the padding rows
            assert changed_at <= set(new_slots.values()) | {(2, 0), (3, 0)}
        # Buffers are every layer's first half (K, or the latent), then every layer's second (V, or the RoPE key):
        # each live row's new slot now holds the step's token, the shadow's last one of that row and layer.
        layer, half = j % config.n_layer, j // config.n_layer
        for r, slot in new_slots.items():
            assert slot in changed_at, f"row {r}'s new token was not stored in buffer {j}"
            check(b1[slot], shadow.tok[r, layer][-1][half][-1], f"row {r}'s stored token in buffer {j}")
    if cache.store.paged:
        assert cache.store.allocator.num_used == used, "a padding row took a page"
        cache.store.allocator.check()


def test_move_rows_packs_sequences_and_keeps_their_tokens():
    """move_rows carries a sequence to a free row: its tokens (a contiguous cache copies them), length, pages and
    next_pos; the source row is free afterwards and a paged one points its first entry at the scratch page."""
    for kind in ("grouped", "paged"):
        paged = dict(page_size=8) if kind == "paged" else {}
        cache = make_cache(kind, GQA, 3, 20, device=DEVICE, static=True, **paged)
        data = torch.randn(1, 2, 11, 16, device=DEVICE)
        view = cache.view([2])
        view.reserve(11)
        view.append(0, data, data)
        cache.next_pos[2] = 11
        cache.move_rows([(2, 0)])
        assert cache.store.lens == [11, 0, 0] and cache.next_pos.tolist() == [11, 0, 0]
        torch.testing.assert_close(_read(cache, 0)[0], data[0], rtol=0, atol=0)
        if kind == "paged":
            assert cache.store.pages[2] == [] and len(cache.store.pages[0]) == 2
            assert int(cache.store.block_table[2, 0]) == cache.store.scratch
        with pytest.raises(ValueError, match=r"dst: got row 0, which holds a sequence; valid: a free row"):
            cache.move_rows([(1, 0)])


def test_static_view_needs_a_static_cache():
    with pytest.raises(ValueError, match=r"static_view: this paged cache has no scratch page; valid: .*static=True"):
        make_cache("paged", GQA, 2, 16, device=DEVICE, page_size=8).static_view(2)
    cache = make_cache("grouped", GQA, 2, 16, device=DEVICE, static=True)
    with pytest.raises(ValueError, match=r"batch: got 3; valid: an int in \[1, 2\]"):
        cache.static_view(3)
    with pytest.raises(ValueError, match=r"T: got 2 for a static view; valid: 1"):
        cache.static_view(2).reserve(2)


# ------------------------------------------------------------------------------ factory, memory, bad input


def test_factory_rejects_combinations_that_cannot_work():
    with pytest.raises(ValueError, match=r"'mla'.*attention='gqa'.*valid: grouped, paged"):
        make_cache("mla", GQA, 1, 8, device="cpu")
    with pytest.raises(ValueError, match=r"'grouped'.*attention='mla'.*valid: mla, paged_mla"):
        make_cache("grouped", MLA, 1, 8, device="cpu")
    with pytest.raises(ValueError, match="max_len"):
        make_cache("grouped", GQA, 1, 0, device="cpu")
    with pytest.raises(ValueError, match="page_size"):
        make_cache("paged", GQA, 1, 8, device="cpu", page_size=12)
    with pytest.raises(ValueError, match="page_size"):
        make_cache("paged", GQA, 1, 8, device="cpu", page_size=4)
    with pytest.raises(ValueError, match="backend"):
        make_cache("grouped", GQA, 1, 8, device="cpu", backend="cuda")


def test_memory_report():
    bf16 = torch.bfloat16
    grouped = make_cache("grouped", GQA, 3, 40, device="cpu", dtype=bf16)
    per_token = 2 * GQA.n_layer * GQA.n_kv_head * 16 * 2  # K and V, KV heads only, 2 bytes
    grouped.view([0]).reserve(7)
    assert grouped.memory() == {
        "bytes_allocated": 3 * 40 * per_token,
        "bytes_in_use": 7 * per_token,
        "bytes_per_token": per_token,
    }
    paged = make_cache("paged", GQA, 3, 40, device="cpu", dtype=bf16, page_size=8, num_pages=9)
    paged.view([0]).reserve(9)  # two pages held
    assert paged.memory() == {
        "bytes_allocated": 9 * 8 * per_token,
        "bytes_in_use": 16 * per_token,
        "bytes_per_token": per_token,
    }
    latent = MLA.n_layer * (32 + 8) * 2  # c_kv and the shared RoPE key only, 2 bytes
    mla = make_cache("mla", MLA, 2, 16, device="cpu", dtype=bf16)
    mla.view([1]).reserve(5)
    assert mla.memory() == {"bytes_allocated": 2 * 16 * latent, "bytes_in_use": 5 * latent, "bytes_per_token": latent}
    paged_mla = make_cache("paged_mla", MLA, 2, 16, device="cpu", dtype=bf16, page_size=8)
    paged_mla.view([0, 1]).reserve(3)  # one page each
    assert paged_mla.memory() == {
        "bytes_allocated": 2 * 2 * 8 * latent,  # 2 pages per row by default
        "bytes_in_use": 2 * 8 * latent,
        "bytes_per_token": latent,
    }


def test_bad_use_raises():
    cache = make_cache("grouped", GQA, 2, 8, device="cpu")
    with pytest.raises(ValueError, match=r"T: got 9 new tokens .*at most"):
        cache.reserve(9)
    with pytest.raises(RuntimeError, match="reserve"):
        cache.append(0, torch.zeros(2, 2, 1, 16), torch.zeros(2, 2, 1, 16))
    cache.view([0]).reserve(3)
    view = cache.view([0, 1])
    view.reserve(2)
    with pytest.raises(ValueError, match="prefill: sequence lengths"):
        view.append(0, torch.zeros(2, 2, 2, 16), torch.zeros(2, 2, 2, 16))
    with pytest.raises(ValueError, match="rows: got"):
        cache.view([0, 0])
    with pytest.raises(ValueError, match="layer: got 2"):
        view.append(2, torch.zeros(2, 2, 2, 16), torch.zeros(2, 2, 2, 16))
    with pytest.raises(ValueError, match="k: got shape"):
        view.append(0, torch.zeros(2, 2, 3, 16), torch.zeros(2, 2, 3, 16))


@pytest.mark.parametrize("kind", ["grouped", "paged"])
def test_bad_rows_steps_and_dtypes_change_nothing(kind):
    """A negative or fractional step, a row out of range (a negative one would free the last row's pages through
    Python's indexing), or a cache dtype that would round K and V are refused, and the lengths and pages stay."""
    paged = dict(page_size=8, num_pages=6) if kind == "paged" else {}
    cache = make_cache(kind, GQA, 2, 20, device="cpu", **paged)
    cache.reserve(8)
    free = cache.store.allocator.num_free if kind == "paged" else None
    for T in (-1, 2.5, True):
        with pytest.raises(ValueError, match=r"T: got .*; valid: an int >= 0"):
            cache.reserve(T)
    for row in (-1, 2, 1.0):
        with pytest.raises(ValueError, match=r"row: got .*; valid: a row in \[0, 2\)"):
            cache.release(row)
    with pytest.raises(ValueError, match=r"src: got -1; valid: a row in \[0, 2\)"):
        cache.move_rows([(-1, 0)])
    with pytest.raises(ValueError, match=r"dst: got 5; valid: a row in \[0, 2\)"):
        cache.move_rows([(1, 5)])
    assert cache.lens == [8, 8]
    if kind == "paged":
        assert cache.store.allocator.num_free == free
    with pytest.raises(ValueError, match=r"dtype: got torch.int32; valid: torch.float32, torch.bfloat16"):
        make_cache(kind, GQA, 2, 20, device="cpu", dtype=torch.int32, **paged)


def test_model_refuses_a_cache_it_cannot_use_before_it_grows():
    """GPT.forward checks the cache (made for this model, this batch, positions within learned ones) before
    cache.reserve: a refused step leaves the lengths as they were."""
    from model import GPT, GPTConfig

    torch.manual_seed(0)
    model = GPT(
        GPTConfig(
            n_layer=2, n_head=4, n_embd=64, vocab_size=32, block_size=16, pos_embedding="learned", attn_backend="torch"
        )
    ).eval()
    other = make_cache("grouped", GQA, 1, 16, device="cpu")  # 2 KV heads: made for a GQA model
    with pytest.raises(ValueError, match=r"cache: made for .*'n_kv_head': 2.*valid: a cache for this model"):
        model(torch.zeros(1, 3, dtype=torch.long), cache=other)
    mla = make_cache("mla", MLA, 1, 16, device="cpu")
    with pytest.raises(ValueError, match=r"cache: made for \{'kind': 'latent'"):
        model(torch.zeros(1, 3, dtype=torch.long), cache=mla)
    cache = make_cache("grouped", model.config, 1, 32, device="cpu")
    with pytest.raises(ValueError, match=r"idx: got a batch of 2; valid: the cache's 1 sequences"):
        model(torch.zeros(2, 3, dtype=torch.long), cache=cache)
    with torch.no_grad():
        model(torch.zeros(1, 16, dtype=torch.long), cache=cache)
        with pytest.raises(ValueError, match=r"cache: position 16 reached; valid: positions < block_size=16"):
            model(torch.zeros(1, 1, dtype=torch.long), cache=cache)
    assert other.lens == [0] and mla.lens == [0] and cache.lens == [16]
