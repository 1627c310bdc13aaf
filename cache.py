"""KV caches for generation: grouped (contiguous), paged, and the MLA latent caches, contiguous and paged.

The model calls only the protocol below (see model.py); the cache keeps every piece of bookkeeping.

    positions = cache.reserve(T)                          # (B, T) absolute positions of the T new tokens
    k_all, v_all = cache.append(layer, k, v)              # prefill: (B, H_kv, S, D_*) every cached token
    y = cache.attend(layer, q, k, v, scale)               # decode: (B, H_q, 1, D_v)
    c_all, r_all = cache.append_latent(layer, c_kv, k_rope)                     # MLA prefill
    o = cache.attend_latent(layer, q_absorbed, q_rope, c_kv, k_rope, scale)     # MLA decode: (B, H, 1, D_c)
    o = cache.attend_latent_inputs(layer, q, kv, cos, sin, norm_weight, eps, w_uk, scale)  # MLA decode: (B, H, D_c)

A cache holds `batch_size` rows, one sequence each. `cache.view(rows)` is the same cache seen through some of
its rows (a batch-1 view prefills one prompt of a ragged batch; a view of the active rows decodes them while
the finished ones are gone). Views share storage and bookkeeping with their cache; `reserve` grows only the
view's rows, and `append`/`attend` act on the rows and positions of the view's last `reserve`.

Layouts (the letters of attention_kernels/reference.py):
    grouped      K (B, H_kv, S_max, D_qk), V (B, H_kv, S_max, D_v) per layer: only the KV heads are stored
    paged        K pool (num_pages, page_size, H_kv, D_qk), V pool (num_pages, page_size, H_kv, D_v) per layer,
                 one BlockAllocator and one block table (B, max_pages) int32 shared by all layers
    mla          c_kv (B, S_max, D_c), k_rope (B, S_max, D_r) per layer: the latent and the shared RoPE key only
    paged_mla    c_kv pool (num_pages, page_size, D_c), k_rope pool (num_pages, page_size, D_r) per layer,
                 the same allocator and table machinery as `paged` (PagedRows)

The host owns the lengths and the block tables (plain Python lists); the device gets small index tensors once
per `reserve`, so decoding needs no device-to-host sync and the kernels run with validate=False. A decode step's
new tokens reach the cache inside a launch the step has anyway: the decode kernel's (`grouped_decode`'s k_new,
wherever it reads the cache's own buffer) or MLA's input kernel (`attend_latent_inputs`); prefill and the rest go
through `attention_kernels.write_tokens`.

Static decode (a cache made with `static=True`, for a decode step that a CUDA graph replays): `static_view(b)` is
rows 0 .. b-1, and its `reserve(1)` does no host work at all: each row's write position is read from the device
tensor `next_pos` (B,), which the caller advances in place (generate.py does it inside the captured step), and the
decode reads every row's whole capacity (S_max, or the whole block table) with the lengths next_pos + 1, so
nothing in the step depends on a host value that changes between replays. A row that is not decoding keeps
next_pos = 0 and writes its token at position 0 of its own (finished or free) row; in a paged cache a free row's
first table entry points at a scratch page that belongs to no sequence. The host works around a run of steps:
before it, `ensure_capacity` gives rows the pages of all its steps; after it, `set_len` records what the steps
wrote and `move_rows` packs the live sequences into rows 0 .. n-1 (so a smaller step covers them).

Under torch.compile (generate.compile_model) the five methods a block calls (append, attend, append_latent,
attend_latent, attend_latent_inputs) run outside the compiled graphs (`torch.compiler.disable`): a compiled block
breaks its graph at the cache call, so the host bookkeeping (rows, lengths, the static flag) never becomes guards
that would recompile the blocks for every view and batch size.
"""

from __future__ import annotations

import torch

import attention_kernels
from attention_kernels import reference

PAGED_KINDS = ("paged", "paged_mla")  # the kinds with a page pool


class CacheFullError(RuntimeError):
    """The page pool cannot hold what was asked. Raised before anything changes."""


class BlockAllocator:
    """A free list of page ids 0 .. num_pages - 1.

    Invariants (`check()` asserts them): every page is either free or owned, never both and never twice;
    num_free + len(owned) == num_pages. `allocate` is all-or-nothing: on exhaustion it raises CacheFullError and
    changes nothing. Freed pages go on top of the free list, so they are the next ones handed out.
    """

    def __init__(self, num_pages: int):
        if not isinstance(num_pages, int) or num_pages < 1:
            raise ValueError(f"num_pages: got {num_pages!r}; valid: an int >= 1")
        self.num_pages = num_pages
        self._free = list(range(num_pages - 1, -1, -1))  # a stack: pop() hands out the lowest id first
        self._owned: set[int] = set()

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return len(self._owned)

    def can_allocate(self, n: int) -> bool:
        return n <= len(self._free)

    def allocate(self, n: int) -> list[int]:
        if not isinstance(n, int) or n < 0:
            raise ValueError(f"n: got {n!r}; valid: an int >= 0")
        if not self.can_allocate(n):
            raise CacheFullError(
                f"KV cache page pool exhausted: asked for {n} pages, {self.num_free} free of {self.num_pages} "
                f"in the pool. Raise --num_pages or lower the batch (--num_samples / batch size)."
            )
        pages = [self._free.pop() for _ in range(n)]
        self._owned.update(pages)
        return pages

    def free(self, pages: list[int]):
        pages = list(pages)
        not_owned = [p for p in pages if p not in self._owned]
        if not_owned or len(set(pages)) != len(pages):
            raise ValueError(
                f"pages: got {pages} (not owned or repeated: {not_owned or 'repeated'}); "
                f"valid: distinct pages currently allocated"
            )
        self._owned.difference_update(pages)
        self._free.extend(reversed(pages))

    def check(self):
        free = set(self._free)
        assert len(free) == len(self._free), "a page is on the free list twice"
        assert not (free & self._owned), f"pages both free and owned: {sorted(free & self._owned)}"
        assert free | self._owned == set(range(self.num_pages)), "a page is neither free nor owned (leak)"


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def pool_pages(batch_size: int, max_len: int, page_size: int, num_pages: int | None = None) -> int:
    """The pages of a paged cache's pool: num_pages, or by default every row's max_len (a scratch page apart)."""
    return batch_size * cdiv(max_len, page_size) if num_pages is None else num_pages


def _consecutive(rows: list[int]) -> bool:
    """Are the rows a range (r0, r0 + 1, ...)? Then a slice of the storage is a view of them, not a gathered copy."""
    return rows == list(range(rows[0], rows[0] + len(rows)))


def check_page_size(page_size) -> None:
    """The paged decode kernels take pages of a power of two from 8 to 256 tokens."""
    if not isinstance(page_size, int) or not 8 <= page_size <= 256 or page_size & (page_size - 1):
        raise ValueError(f"page_size: got {page_size!r}; valid: a power of two from 8 to 256 (the paged kernels')")


class _Step:
    """Where the tokens of the last `reserve` go: rows (n,), positions (n, T), seq_lens (n,) int32 (each row's
    length with the new tokens, what the decode reads), and for a paged cache the page ids and in-page offsets of
    every new token (n, T). All on the device."""

    def __init__(self, rows_t, positions, seq_lens, pages=None, offsets=None):
        self.rows_t, self.positions, self.seq_lens = rows_t, positions, seq_lens
        self.pages, self.offsets = pages, offsets


class _Rows:
    """What both per-row token storages keep: each row's length on the host (row r holds its sequence's tokens
    0 .. lens[r] - 1), the buffers every layer writes, and `next_pos` for static decode. A subclass says where a
    row's tokens live (`new_buffer`, `step`, `where`, `prefix`) and, by `_make_room`, how a row gets room for them."""

    paged: bool

    def __init__(self, batch_size: int, max_len: int, device, dtype, capacity: int):
        self.batch_size, self.max_len, self.device, self.dtype = batch_size, max_len, device, dtype
        self.capacity = capacity  # the tokens a static decode step may read in each row
        self.lens = [0] * batch_size
        self.buffers: list[torch.Tensor] = []  # token-major views or pools, for memory accounting and `move`
        self.next_pos = torch.zeros(batch_size, dtype=torch.int64, device=device)  # static decode: see the top

    def grow(self, rows: list[int], T: int):
        for r in rows:
            if self.lens[r] + T > self.max_len:
                raise ValueError(
                    f"T: got {T} new tokens for row {r} holding {self.lens[r]}; valid: at most "
                    f"max_len - {self.lens[r]} = {self.max_len - self.lens[r]} (the cache's max_len)"
                )
        self._make_room(rows, [self.lens[r] + T for r in rows])
        for r in rows:
            self.lens[r] += T

    def ensure_capacity(self, rows: list[int], lengths: list[int]):
        """Room ahead for static decode steps: row r can then hold lengths[i] tokens (raises as grow does)."""
        for r, n in zip(rows, lengths):
            if n > self.max_len:
                raise ValueError(f"lengths: got {n} tokens for row {r}; valid: at most max_len={self.max_len}")
        self._make_room(rows, lengths)

    def _make_room(self, rows: list[int], lengths: list[int]):
        """Room for each row to hold `lengths` tokens, all or nothing: a contiguous row has max_len from the start."""

    def move(self, src: int, dst: int):
        self.lens[dst], self.lens[src] = self.lens[src], 0

    def release(self, row: int):
        self.lens[row] = 0

    def trim(self, row: int, length: int):
        self.lens[row] = length


class ContiguousRows(_Rows):
    """Per-row token storage (B, S_max, ...). Buffers are handled through token-major views (B, S_max, *feat); a
    (H, D) feature is stored head-major, (B, H, S_max, D), as the grouped decode kernel reads it."""

    paged = False

    def __init__(self, batch_size: int, max_len: int, device, dtype):
        super().__init__(batch_size, max_len, device, dtype, capacity=max_len)

    def new_buffer(self, feat: tuple[int, ...]) -> torch.Tensor:
        if len(feat) == 2:  # (H, D): head-major storage, token-major view
            buf = torch.zeros(self.batch_size, feat[0], self.max_len, feat[1], device=self.device, dtype=self.dtype)
            buf = buf.transpose(1, 2)
        else:
            buf = torch.zeros(self.batch_size, self.max_len, *feat, device=self.device, dtype=self.dtype)
        self.buffers.append(buf)
        return buf

    def step(self, rows_t, starts_t, T) -> _Step:
        positions = starts_t[:, None] + torch.arange(T, device=self.device)
        return _Step(rows_t, positions, (starts_t + T).int())

    def static_step(self, rows_t) -> _Step:
        """Rows 0 .. b-1, one token each at next_pos: device tensors only (graph-safe)."""
        pos = self.next_pos[: rows_t.shape[0]]
        return _Step(rows_t, pos[:, None], (pos + 1).int())

    def move(self, src: int, dst: int):
        for buf in self.buffers:
            buf[dst, : self.lens[src]] = buf[src, : self.lens[src]]
        super().move(src, dst)

    def where(self, step: _Step) -> tuple[torch.Tensor, torch.Tensor]:
        """(row, position) of every new token, (n, T) each: buf[where] = x scatters x (n, T, *feat) into the
        token-major buf (B, S_max, *feat), prefill (same start) and ragged decode alike."""
        return step.rows_t[:, None].expand_as(step.positions), step.positions

    def prefix(self, buf, rows: list[int], rows_t, length: int):
        """(n, length, *feat): the first `length` tokens of these rows (a view when the rows are a range)."""
        if _consecutive(rows):
            return buf[rows[0] : rows[0] + len(rows), :length]
        return buf[rows_t, :length]

    def decode_appends(self, rows: list[int]) -> bool:
        """Can the decode kernel store the new tokens (`grouped_decode`'s k_new)? Into a view of the buffer, yes;
        into the copy that `prefix` gathers for scattered rows, no."""
        return _consecutive(rows)

    def tokens_held(self) -> int:
        return sum(self.lens)


class PagedRows(_Rows):
    """Per-row token storage in pages: pools (num_pages, page_size, *feat) shared by every row and one
    BlockAllocator and block table shared by every buffer (every layer, K and V alike).

    Invariants: row r owns at least ceil(lens[r] / page_size) pages (exactly that many, unless
    `ensure_capacity` gave it pages ahead), listed in order in pages[r], and block_table[r, i] == pages[r][i] for
    those; entries past them are stale and never read. A row's pages are owned by no other row (the allocator
    guarantees it). `grow` allocates all the pages it needs at once, before anything is written, so exhaustion
    leaves every sequence intact. With a scratch page (static decode), it is page `num_pages` of every pool, never
    handed out, and the first table entry of every row without pages points at it.
    """

    paged = True

    def __init__(
        self, batch_size: int, max_len: int, device, dtype, page_size: int, num_pages: int | None, scratch=False
    ):
        check_page_size(page_size)
        self.page_size = page_size
        self.max_pages = cdiv(max_len, page_size)
        self.allocator = BlockAllocator(pool_pages(batch_size, max_len, page_size, num_pages))
        self.scratch = self.allocator.num_pages if scratch else None
        self.pages: list[list[int]] = [[] for _ in range(batch_size)]
        self.block_table = torch.full((batch_size, self.max_pages), self.scratch or 0, dtype=torch.int32, device=device)
        super().__init__(batch_size, max_len, device, dtype, capacity=self.max_pages * page_size)

    def new_buffer(self, feat: tuple[int, ...]) -> torch.Tensor:
        pages = self.allocator.num_pages + (self.scratch is not None)
        pool = torch.zeros(pages, self.page_size, *feat, device=self.device, dtype=self.dtype)
        self.buffers.append(pool)
        return pool

    def _make_room(self, rows: list[int], lengths: list[int]):
        """Pages so that each row holds `lengths` tokens: all or nothing, one host-to-device copy."""
        fresh = self.allocator.allocate(
            sum(max(0, cdiv(n, self.page_size) - len(self.pages[r])) for r, n in zip(rows, lengths))
        )
        entries = []
        for r, n in zip(rows, lengths):
            for _ in range(cdiv(n, self.page_size) - len(self.pages[r])):
                entries.append((r, len(self.pages[r]), fresh[len(entries)]))
                self.pages[r].append(entries[-1][2])
        if entries:
            idx = torch.tensor(entries, dtype=torch.int64).t().to(self.device)
            self.block_table[idx[0], idx[1]] = idx[2].int()

    def step(self, rows_t, starts_t, T) -> _Step:
        positions = starts_t[:, None] + torch.arange(T, device=self.device)
        pages = self.block_table[rows_t[:, None], positions // self.page_size].long()
        return _Step(rows_t, positions, (starts_t + T).int(), pages, positions % self.page_size)

    def static_step(self, rows_t) -> _Step:
        """Rows 0 .. b-1, one token each at next_pos, its page looked up on the device (graph-safe)."""
        b = rows_t.shape[0]
        pos = self.next_pos[:b, None]  # (b, 1)
        pages = self.block_table[:b].gather(1, pos // self.page_size).long()
        return _Step(rows_t, pos, (pos[:, 0] + 1).int(), pages, pos % self.page_size)

    def move(self, src: int, dst: int):
        """Row src's sequence into the free row dst: only the table row moves, the pages stay."""
        n = len(self.pages[src])
        self.block_table[dst, :n] = self.block_table[src, :n]
        self.pages[dst], self.pages[src] = self.pages[src], []
        super().move(src, dst)
        self._to_scratch(src)

    def where(self, step: _Step) -> tuple[torch.Tensor, torch.Tensor]:
        """(page, slot) of every new token, (n, T) each: pool[where] = x scatters x (n, T, *feat) into the pool
        (num_pages, page_size, *feat)."""
        return step.pages, step.offsets

    def decode_appends(self, rows: list[int]) -> bool:
        """The paged decode kernel stores the new tokens through the same table it reads: any rows."""
        return True

    def table(self, rows: list[int], rows_t) -> torch.Tensor:
        if _consecutive(rows):
            return self.block_table[rows[0] : rows[0] + len(rows)]
        return self.block_table.index_select(0, rows_t)

    def prefix(self, pool, rows: list[int], rows_t, length: int):
        """(n, length, *feat): the first `length` tokens of these rows, gathered from their pages (a copy)."""
        n_pages = cdiv(length, self.page_size)
        table = self.table(rows, rows_t)[:, :n_pages].long()
        x = pool[table]  # (n, n_pages, page_size, *feat)
        return x.reshape(len(rows), n_pages * self.page_size, *pool.shape[2:])[:, :length]

    def release(self, row: int):
        self.allocator.free(self.pages[row])
        self.pages[row] = []
        super().release(row)
        self._to_scratch(row)

    def trim(self, row: int, length: int):
        """Keep the first `length` tokens of row and give back the pages past them."""
        keep = cdiv(length, self.page_size)
        self.allocator.free(self.pages[row][keep:])
        del self.pages[row][keep:]
        super().trim(row, length)
        if keep == 0:
            self._to_scratch(row)

    def _to_scratch(self, row: int):
        """A row left without pages points its first table entry at the scratch page (if any), so that a padding
        row of a static step writes there, not into a page handed out again."""
        if self.scratch is not None:
            self.block_table[row, 0] = self.scratch

    def tokens_held(self) -> int:
        return self.allocator.num_used * self.page_size

    def gather(self, pool, rows_t, b: int):
        """Static decode with the torch backend: every row's whole capacity, gathered from the table (b, S, ...)."""
        return self.prefix(pool, list(range(b)), rows_t, self.capacity)


class _Cache:
    """What every cache shares: the rows it covers, reserve/view/release, and the memory report."""

    def __init__(self, store, n_layer: int, backend: str):
        if backend not in ("triton", "torch"):
            raise ValueError(f"backend: got {backend!r}; valid: 'triton' or 'torch'")
        self.store, self.n_layer, self.backend = store, n_layer, backend
        self._set_rows(list(range(store.batch_size)))
        self._step: _Step | None = None
        self._static = False

    def _set_rows(self, rows: list[int]):
        self.rows = rows
        self._rows_t = torch.tensor(rows, dtype=torch.int64, device=self.store.device)

    @property
    def batch_size(self) -> int:
        return len(self.rows)

    @property
    def lens(self) -> list[int]:
        return [self.store.lens[r] for r in self.rows]

    def view(self, rows: list[int]) -> "_Cache":
        rows = [int(r) for r in rows]
        if not rows or len(set(rows)) != len(rows) or not all(0 <= r < self.store.batch_size for r in rows):
            raise ValueError(f"rows: got {rows}; valid: distinct rows in [0, {self.store.batch_size})")
        v = object.__new__(type(self))
        v.__dict__.update(self.__dict__)
        v._set_rows(rows)
        v._step = None
        v._static = False
        return v

    def static_view(self, batch: int) -> "_Cache":
        """Rows 0 .. batch-1 for a static decode step (see the top of this file): reserve(1) reads next_pos."""
        if getattr(self.store, "scratch", 0) is None:
            raise ValueError("static_view: this paged cache has no scratch page; valid: make_cache(..., static=True)")
        if not isinstance(batch, int) or not 1 <= batch <= self.store.batch_size:
            raise ValueError(f"batch: got {batch!r}; valid: an int in [1, {self.store.batch_size}]")
        v = self.view(list(range(batch)))
        v._static = True
        return v

    @property
    def next_pos(self) -> torch.Tensor:
        """(B,) int64 on the device: where each row's next static decode token goes (0 for a row not decoding)."""
        return self.store.next_pos

    def reserve(self, T: int) -> torch.Tensor:
        """Grow every sequence of this view by T tokens; returns their positions (B, T) on the device."""
        if not isinstance(T, int) or isinstance(T, bool) or T < 0:
            raise ValueError(f"T: got {T!r}; valid: an int >= 0 (the new tokens of each sequence)")
        if self._static:
            if T != 1:
                raise ValueError(f"T: got {T} for a static view; valid: 1 (static views decode one token)")
            self._step = self.store.static_step(self._rows_t)
            return self._step.positions
        starts = self.lens
        self.store.grow(self.rows, T)  # raises (CacheFullError / ValueError) before anything changes
        starts_t = torch.tensor(starts, dtype=torch.int64).to(self.store.device)
        self._step = self.store.step(self._rows_t, starts_t, T)
        return self._step.positions

    def release(self, row: int):
        """A finished sequence gives its storage back (its pages, for a paged cache)."""
        self._check_row(row, "row")
        self.store.release(row)
        self.store.next_pos[row] = 0

    def trim(self, row: int, length: int):
        """Shorten row's sequence to its first `length` tokens: the padding of a right-padded prefill goes (a paged
        cache gives back the pages past them) and the next token is written at `length`."""
        self._check_row(row, "row")
        if not isinstance(length, int) or isinstance(length, bool) or not 0 <= length <= self.store.lens[row]:
            raise ValueError(f"length: got {length!r} for row {row}; valid: 0 .. {self.store.lens[row]} (its tokens)")
        self.store.trim(row, length)

    def move_rows(self, moves: list[tuple[int, int]]):
        """Move the sequence of row src into the free row dst, for each (src, dst): its tokens (a contiguous cache
        copies them; a paged one moves its table row), length and next_pos. src is free afterwards."""
        for src, dst in moves:
            self._check_row(src, "src")
            self._check_row(dst, "dst")
            if self.store.lens[dst] or (self.store.paged and self.store.pages[dst]):
                raise ValueError(f"dst: got row {dst}, which holds a sequence; valid: a free row")
            self.store.move(src, dst)
        if moves:
            idx = torch.tensor(moves, dtype=torch.int64).t().to(self.store.device)
            self.store.next_pos[idx[1]] = self.store.next_pos[idx[0]]
            self.store.next_pos[idx[0]] = 0

    def ensure_capacity(self, rows: list[int], lengths: list[int]):
        """Room for row rows[i] to hold lengths[i] tokens before static steps write them (pages, for a paged
        cache: all or nothing, CacheFullError when the pool cannot)."""
        self.store.ensure_capacity(rows, lengths)

    def set_len(self, row: int, length: int):
        """The host learns that static steps left `length` tokens in `row` (within the capacity ensured)."""
        self._check_row(row, "row")
        if self.store.paged and cdiv(length, self.store.page_size) > len(self.store.pages[row]):
            raise ValueError(f"length: got {length} for row {row}; valid: at most the pages it holds")
        if length > self.store.max_len:
            raise ValueError(f"length: got {length} for row {row}; valid: at most max_len={self.store.max_len}")
        self.store.lens[row] = length

    def check_model(self, config):
        """Refuse to serve a model of GPTConfig `config` whose K/V (or latent) this cache was not made for."""
        want = layout_for(config)
        if self.layout != want:
            raise ValueError(
                f"cache: made for {self.layout}; valid: a cache for this model, {want} "
                "(cache.make_cache with this model's config)"
            )

    def _check_row(self, row, name: str):
        """A row of the store, as an int: a negative one would pick a row from the end (and free its pages)."""
        if not isinstance(row, int) or isinstance(row, bool) or not 0 <= row < self.store.batch_size:
            raise ValueError(f"{name}: got {row!r}; valid: a row in [0, {self.store.batch_size})")

    def _new_tokens(self, x: torch.Tensor, layer: int, name: str):
        if self._step is None:
            raise RuntimeError(f"{name}: call reserve(T) before writing layer {layer}")
        if not 0 <= layer < self.n_layer:
            raise ValueError(f"layer: got {layer}; valid: 0 .. {self.n_layer - 1}")
        if x.shape[0] != self.batch_size or x.shape[1] != self._step.positions.shape[1]:
            raise ValueError(
                f"{name}: got shape {tuple(x.shape)}; valid: (B={self.batch_size}, "
                f"T={self._step.positions.shape[1]}, ...) matching the last reserve"
            )

    def _store_pair(self, a_buf, b_buf, a, b):
        """The new tokens' two halves (n, T, H, D_*) into their buffers at the last reserve's places: one kernel
        launch with the Triton backend (a decode step's launches are its time), two index_puts with torch."""
        where = self.store.where(self._step)
        if self.backend == "triton":
            attention_kernels.write_tokens(a_buf, b_buf, a, b, *where, validate=False)
        else:
            a_buf[where] = a.to(self.store.dtype)
            b_buf[where] = b.to(self.store.dtype)

    def _prefill_length(self) -> int:
        lens = self.lens
        if len(set(lens)) != 1:
            raise ValueError(
                f"prefill: sequence lengths {lens} differ; valid: prefill ragged prompts one at a time "
                f"through view([row]), or right-padded to one length and then trim(row, length)"
            )
        return lens[0]

    def memory(self) -> dict[str, int]:
        """bytes_allocated: every buffer; bytes_in_use: the tokens held (whole pages for a paged cache);
        bytes_per_token: one token of one sequence across all layers."""
        if not hasattr(self, "_sizes"):  # the buffers never change: their sizes are counted once (a decode loop asks)
            per_token = sum(b[0, 0].numel() * b.element_size() for b in self.store.buffers)
            self._sizes = per_token, sum(b.numel() * b.element_size() for b in self.store.buffers)
        per_token, allocated = self._sizes
        in_use = self.store.tokens_held() * per_token
        return {"bytes_allocated": allocated, "bytes_in_use": in_use, "bytes_per_token": per_token}


class _KVCache(_Cache):
    """MHA/GQA/MQA content: K and V of the KV heads only, per layer."""

    def __init__(self, store, n_layer, n_kv_head, d_qk, d_v, backend):
        super().__init__(store, n_layer, backend)
        self.layout = dict(kind="K/V", n_layer=n_layer, n_kv_head=n_kv_head, d_qk=d_qk, d_v=d_v)  # as layout_for
        self.k = [store.new_buffer((n_kv_head, d_qk)) for _ in range(n_layer)]  # token-major views / pools
        self.v = [store.new_buffer((n_kv_head, d_v)) for _ in range(n_layer)]

    @torch.compiler.disable
    def append(self, layer: int, k: torch.Tensor, v: torch.Tensor):
        """Prefill: k (B, H_kv, T, D_qk), v (B, H_kv, T, D_v) -> every cached token (B, H_kv, S, D_*)."""
        self._write(layer, k, v)
        S = self._prefill_length()
        k_all = self.store.prefix(self.k[layer], self.rows, self._rows_t, S)
        v_all = self.store.prefix(self.v[layer], self.rows, self._rows_t, S)
        return k_all.transpose(1, 2).to(k.dtype), v_all.transpose(1, 2).to(v.dtype)

    def _write(self, layer, k, v):
        k_t, v_t = k.transpose(1, 2), v.transpose(1, 2)  # (B, T, H_kv, D)
        self._new_tokens(k_t, layer, "k")
        self._new_tokens(v_t, layer, "v")
        self._store_pair(self.k[layer], self.v[layer], k_t, v_t)

    @torch.compiler.disable
    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float):
        """Decode: q (B, H_q, 1, D_qk), k/v (B, H_kv, 1, D) -> y (B, H_q, 1, D_v) over every cached token. With
        the Triton backend the decode kernel writes k and v into the cache itself (its k_new, v_new)."""
        for name, x, layout in (
            ("q", q, "(B, H_q, 1, D_qk)"),
            ("k", k, "(B, H_kv, 1, D_qk)"),
            ("v", v, "(B, H_kv, 1, D_v)"),
        ):
            if x.shape[2] != 1:
                raise ValueError(f"{name}: got shape {tuple(x.shape)}; valid: {layout} (decode is one token)")
        if self.backend == "triton" and self.store.decode_appends(self.rows):
            self._new_tokens(k.transpose(1, 2), layer, "k")
            self._new_tokens(v.transpose(1, 2), layer, "v")
            new = (k[:, :, 0], v[:, :, 0])
        else:
            self._write(layer, k, v)
            new = None
        return self._decode(layer, q[:, :, 0].to(self.store.dtype), scale, new).to(q.dtype)[:, :, None]


class GroupedCache(_KVCache):
    def __init__(self, batch_size, max_len, n_layer, n_kv_head, d_qk, d_v, *, device, dtype, backend):
        super().__init__(ContiguousRows(batch_size, max_len, device, dtype), n_layer, n_kv_head, d_qk, d_v, backend)

    def _decode(self, layer, q, scale, new=None):
        # The kernel only reads up to each row's length; narrowing S saves the reference work. A static step reads
        # the whole capacity, because max(lens) is a host value that changes between replays.
        n = self.store.capacity if self._static else max(self.lens)
        k = self.store.prefix(self.k[layer], self.rows, self._rows_t, n).transpose(1, 2)  # (B, H_kv, n, D)
        v = self.store.prefix(self.v[layer], self.rows, self._rows_t, n).transpose(1, 2)
        if self.backend == "torch":
            return reference.decode_reference(q, k, v, self._step.seq_lens, scale=scale)[0]
        k_new, v_new = new or (None, None)
        return attention_kernels.grouped_decode(
            q, k, v, self._step.seq_lens, scale=scale, k_new=k_new, v_new=v_new, validate=False
        )[0]


class PagedCache(_KVCache):
    def __init__(
        self,
        batch_size,
        max_len,
        n_layer,
        n_kv_head,
        d_qk,
        d_v,
        *,
        device,
        dtype,
        backend,
        page_size=16,
        num_pages=None,
        static=False,
    ):
        store = PagedRows(batch_size, max_len, device, dtype, page_size, num_pages, scratch=static)
        super().__init__(store, n_layer, n_kv_head, d_qk, d_v, backend)

    def _decode(self, layer, q, scale, new=None):
        table = self.store.table(self.rows, self._rows_t)
        if self.backend == "torch" and self._static:  # the reference reads max(seq_lens) on the host
            k = self.store.gather(self.k[layer], self._rows_t, self.batch_size).transpose(1, 2)
            v = self.store.gather(self.v[layer], self._rows_t, self.batch_size).transpose(1, 2)
            return reference.decode_reference(q, k, v, self._step.seq_lens, scale=scale)[0]
        if self.backend == "torch":
            return reference.paged_decode_reference(
                q, self.k[layer], self.v[layer], table, self._step.seq_lens, scale=scale
            )[0]
        k_new, v_new = new or (None, None)
        return attention_kernels.paged_grouped_decode(
            q,
            self.k[layer],
            self.v[layer],
            table,
            self._step.seq_lens,
            scale=scale,
            k_new=k_new,
            v_new=v_new,
            validate=False,
        )[0]


class _LatentCache(_Cache):
    """MLA content: the normalized latent c_kv and the RoPE key shared by all heads, per layer."""

    def __init__(self, store, n_layer, d_c, d_r, backend):
        super().__init__(store, n_layer, backend)
        self.layout = dict(kind="latent", n_layer=n_layer, d_c=d_c, d_r=d_r)  # as layout_for
        self.c = [store.new_buffer((d_c,)) for _ in range(n_layer)]
        self.r = [store.new_buffer((d_r,)) for _ in range(n_layer)]

    def _write(self, layer, c_kv, k_rope):
        self._new_tokens(c_kv, layer, "c_kv")
        self._new_tokens(k_rope, layer, "k_rope")
        # a latent token has no head axis: the write kernel takes it as one head
        self._store_pair(self.c[layer][:, :, None], self.r[layer][:, :, None], c_kv[:, :, None], k_rope[:, :, None])

    @torch.compiler.disable
    def append_latent(self, layer: int, c_kv: torch.Tensor, k_rope: torch.Tensor):
        """Prefill: c_kv (B, T, D_c), k_rope (B, T, D_r) -> (B, S, D_c), (B, S, D_r) every cached token."""
        self._write(layer, c_kv, k_rope)
        S = self._prefill_length()
        return (
            self.store.prefix(self.c[layer], self.rows, self._rows_t, S).to(c_kv.dtype),
            self.store.prefix(self.r[layer], self.rows, self._rows_t, S).to(k_rope.dtype),
        )

    @torch.compiler.disable
    def attend_latent(self, layer, q_absorbed, q_rope, c_kv, k_rope, scale: float):
        """Decode: q_absorbed (B, H, 1, D_c), q_rope (B, H, 1, D_r), c_kv (B, 1, D_c), k_rope (B, 1, D_r)
        -> latent out (B, H, 1, D_c); the caller applies the value up-projection."""
        if q_absorbed.shape[2] != 1:
            raise ValueError(f"q_absorbed: got shape {tuple(q_absorbed.shape)}; valid: (B, H, 1, D_c)")
        self._write(layer, c_kv, k_rope)
        dt = self.store.dtype
        out = self._decode(layer, q_absorbed[:, :, 0].to(dt), q_rope[:, :, 0].to(dt), scale)
        return out.to(q_absorbed.dtype)[:, :, None]

    @torch.compiler.disable
    def attend_latent_inputs(self, layer, q, kv, cos, sin, norm_weight, eps: float, w_uk, scale: float):
        """Decode from the step's projections as they come: q (B, H, D_n + D_r) the query heads, kv (B, D_c + D_r)
        the token's latent and RoPE key before their norm and rotation, cos / sin (B or 1, D_r/2) the token's angles,
        w_uk (H, D_n, D_c) -> latent out (B, H, D_c). With the Triton backend one launch
        (`attention_kernels.mla_decode_inputs`) absorbs W_UK into the query, rotates the RoPE parts, normalizes the
        latent and writes the token into the cache, which `attend_latent` needs three launches for."""
        self._new_tokens(kv[:, None], layer, "kv")
        dt = self.store.dtype
        if self.backend == "torch":
            q_abs, q_rope, c_kv, k_rope = reference.mla_decode_inputs_reference(q, kv, cos, sin, norm_weight, eps, w_uk)
            self._write(layer, c_kv[:, None], k_rope[:, None])
        else:
            pages, slots = self.store.where(self._step)  # (B, 1) each
            q_abs, q_rope = attention_kernels.mla_decode_inputs(
                q,
                kv,
                cos,
                sin,
                norm_weight,
                eps,
                w_uk,
                self.c[layer],
                self.r[layer],
                pages[:, 0],
                slots[:, 0],
                validate=False,
            )
        return self._decode(layer, q_abs.to(dt), q_rope.to(dt), scale).to(q.dtype)


class MLACache(_LatentCache):
    def __init__(self, batch_size, max_len, n_layer, d_c, d_r, *, device, dtype, backend):
        super().__init__(ContiguousRows(batch_size, max_len, device, dtype), n_layer, d_c, d_r, backend)

    def _decode(self, layer, q_abs, q_rope, scale):
        n = self.store.capacity if self._static else max(self.lens)
        c = self.store.prefix(self.c[layer], self.rows, self._rows_t, n)
        r = self.store.prefix(self.r[layer], self.rows, self._rows_t, n)
        if self.backend == "torch":
            return reference.mla_decode_reference(q_abs, q_rope, c, r, self._step.seq_lens, scale=scale)[0]
        return attention_kernels.mla_decode(q_abs, q_rope, c, r, self._step.seq_lens, scale=scale, validate=False)[0]


class PagedMLACache(_LatentCache):
    def __init__(
        self,
        batch_size,
        max_len,
        n_layer,
        d_c,
        d_r,
        *,
        device,
        dtype,
        backend,
        page_size=16,
        num_pages=None,
        static=False,
    ):
        store = PagedRows(batch_size, max_len, device, dtype, page_size, num_pages, scratch=static)
        super().__init__(store, n_layer, d_c, d_r, backend)

    def _decode(self, layer, q_abs, q_rope, scale):
        table = self.store.table(self.rows, self._rows_t)
        if self.backend == "torch" and self._static:  # the reference reads max(seq_lens) on the host
            c = self.store.gather(self.c[layer], self._rows_t, self.batch_size)
            r = self.store.gather(self.r[layer], self._rows_t, self.batch_size)
            return reference.mla_decode_reference(q_abs, q_rope, c, r, self._step.seq_lens, scale=scale)[0]
        if self.backend == "torch":
            return reference.paged_mla_decode_reference(
                q_abs, q_rope, self.c[layer], self.r[layer], table, self._step.seq_lens, scale=scale
            )[0]
        return attention_kernels.paged_mla_decode(
            q_abs, q_rope, self.c[layer], self.r[layer], table, self._step.seq_lens, scale=scale, validate=False
        )[0]


def layout_for(config) -> dict:
    """What a cache for a model of GPTConfig `config` holds per token and layer (a cache's `layout`; after `kind`,
    its values are the cache classes' dimension arguments, in order)."""
    if config.attention == "mla":
        return dict(kind="latent", n_layer=config.n_layer, d_c=config.kv_lora_rank, d_r=config.qk_rope_head_dim)
    head_dim = config.n_embd // config.n_head
    return dict(kind="K/V", n_layer=config.n_layer, n_kv_head=config.n_kv_head, d_qk=head_dim, d_v=head_dim)


def valid_cache_kinds(config) -> tuple[str, ...]:
    return ("mla", "paged_mla") if config.attention == "mla" else ("grouped", "paged")


def make_cache(
    kind: str,
    config,
    batch_size: int,
    max_len: int,
    *,
    device,
    dtype=torch.float32,
    backend: str = "torch",
    page_size: int = 16,
    num_pages: int | None = None,
    static: bool = False,
) -> _Cache:
    """Build the cache `kind` for a model of GPTConfig `config`: grouped/paged for MHA/GQA/MQA, mla/paged_mla
    for MLA. Any other combination raises ValueError listing the kinds valid for that model. static=True makes it
    ready for static decode steps (`static_view`; a paged pool gets its scratch page)."""
    valid = valid_cache_kinds(config)
    if kind not in valid:
        raise ValueError(
            f"cache kind: got {kind!r} for a model with attention={config.attention!r}; valid: {', '.join(valid)}"
        )
    for name, value in (("batch_size", batch_size), ("max_len", max_len)):
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{name}: got {value!r}; valid: an int >= 1")
    if dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(
            f"dtype: got {dtype}; valid: torch.float32, torch.bfloat16 or torch.float16 (a cache of "
            "another type would round K and V to it)"
        )
    common = dict(device=device, dtype=dtype, backend=backend)
    paged = dict(page_size=page_size, num_pages=num_pages, static=static)
    dims = [v for k, v in layout_for(config).items() if k != "kind"]
    if config.attention == "mla":
        if kind == "mla":
            return MLACache(batch_size, max_len, *dims, **common)
        return PagedMLACache(batch_size, max_len, *dims, **common, **paged)
    if kind == "grouped":
        return GroupedCache(batch_size, max_len, *dims, **common)
    return PagedCache(batch_size, max_len, *dims, **common, **paged)
