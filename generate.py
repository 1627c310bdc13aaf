"""The generation engine: prompts in, new tokens out, through a KV cache (cache.py) or none.

    from generate import generate
    out, stats = generate(model, prompts, "paged", max_new_tokens=100, temperature=0.8, top_k=200)
    stats.summary()["decode_tokens_per_s"]

Prefill runs the model over each admitted prompt (the flash kernel); decode runs one token per step for every
active sequence. A scheduler admits waiting prompts into free cache rows (and pages) as soon as they free up.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

import torch

from cache import CacheFullError, make_cache


def resolve_cache_kind(config, requested: str) -> str:
    """The cache kind for a model: auto -> grouped / mla; paged on an MLA model -> paged_mla. A kind that cannot
    hold this model's attention raises ValueError with the valid choices."""
    mla = config.attention == "mla"
    valid = ("auto", "mla", "paged", "paged_mla", "none") if mla else ("auto", "grouped", "paged", "none")
    if requested not in valid:
        raise ValueError(
            f"--cache: got {requested!r} for a model with attention={config.attention!r}; valid: {', '.join(valid)}"
        )
    if requested == "auto":
        return "mla" if mla else "grouped"
    return "paged_mla" if mla and requested == "paged" else requested


def check_length(config, prompt_lens: list[int], max_new_tokens: int, allow_past_block_size: bool):
    """Positions run up to prompt + max_new_tokens - 2 (the last sampled token is never fed back)."""
    if not prompt_lens:
        raise ValueError("prompts: got none; valid: at least one prompt")
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens: got {max_new_tokens}; valid: an int >= 1")
    if min(prompt_lens) < 1:
        raise ValueError("start: got an empty prompt; valid: at least one token")
    longest = max(prompt_lens) + max_new_tokens - 1
    if longest <= config.block_size:
        return
    how = f"prompt of {max(prompt_lens)} tokens + max_new_tokens={max_new_tokens} - 1 = {longest} tokens"
    if config.pos_embedding == "learned":
        raise ValueError(
            f"{how}; valid: at most block_size={config.block_size} for learned position embeddings "
            "(shorten the prompt or lower --max_new_tokens)"
        )
    if not allow_past_block_size:
        raise ValueError(
            f"{how} > block_size={config.block_size}; this RoPE model may go past what it was trained "
            "on with --allow_past_block_size=True, or lower --max_new_tokens"
        )


# --------------------------------------------------------------------------------------------- sampling


def check_sampling(temperature: float, top_k: int | None, top_p: float | None):
    """temperature >= 0 (0: greedy), top_k >= 0 (0 or None: off), top_p in (0, 1] (1 or None: off)."""
    if not temperature >= 0:  # also refuses NaN
        raise ValueError(f"temperature: got {temperature!r}; valid: a number >= 0 (0 = greedy)")
    if top_k is not None and (not isinstance(top_k, int) or isinstance(top_k, bool) or top_k < 0):
        raise ValueError(f"top_k: got {top_k!r}; valid: an int >= 0 (0 = off)")
    if top_p is not None and not 0 < top_p <= 1:
        raise ValueError(f"top_p: got {top_p!r}; valid: a number in (0, 1] (1 = off)")


def sample_next(
    logits: torch.Tensor,
    temperature: float = 0.0,
    top_k: int | None = None,
    top_p: float | None = None,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """logits (B, V) -> next tokens (B,). temperature 0 is greedy (argmax); top_k / top_p filter before sampling."""
    if temperature == 0:
        return logits.argmax(dim=-1)
    logits = logits.float()
    # The row's max subtracted first: a tiny temperature then sends the others to -inf, never the max to +inf
    # (inf - inf would be NaN in the softmax). The same distribution otherwise.
    logits = (logits - logits.max(dim=-1, keepdim=True).values) / temperature
    if top_k:
        kth = torch.topk(logits, min(top_k, logits.shape[-1]), dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p is not None and top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        cum = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
        drop = cum - sorted_logits.softmax(dim=-1) > top_p  # keep the smallest prefix whose mass reaches top_p
        logits = logits.scatter(-1, order, sorted_logits.masked_fill(drop, float("-inf")))
    return torch.multinomial(logits.softmax(dim=-1), 1, generator=generator)[:, 0]


# ------------------------------------------------------------------------------------------- generation


@dataclass
class GenerationStats:
    prefill_tokens: int = 0
    prefill_s: float = 0.0
    decode_tokens: int = 0
    decode_s: float = 0.0
    decode_steps: int = 0
    cache_bytes_allocated: int = 0
    cache_bytes_peak: int = 0
    cache_bytes_per_token: int = 0
    extra: dict = field(default_factory=dict)

    def summary(self) -> dict:
        return {
            "prefill_tokens_per_s": self.prefill_tokens / max(self.prefill_s, 1e-9),
            "decode_tokens_per_s": self.decode_tokens / max(self.decode_s, 1e-9),
            "prefill_tokens": self.prefill_tokens,
            "decode_tokens": self.decode_tokens,
            "decode_steps": self.decode_steps,
            "cache_bytes_allocated": self.cache_bytes_allocated,
            "cache_bytes_peak": self.cache_bytes_peak,
            "cache_bytes_per_token": self.cache_bytes_per_token,
        }


class _Timer:
    def __init__(self, device):
        self.cuda = torch.device(device).type == "cuda"

    def __enter__(self):
        if self.cuda:
            torch.cuda.synchronize()
        self.t0 = time.perf_counter()
        return self

    def __exit__(self, *exc):
        if self.cuda:
            torch.cuda.synchronize()
        self.seconds = time.perf_counter() - self.t0


class _Sequences:
    """Host bookkeeping of a generation: each prompt's new tokens and whether it is done."""

    def __init__(self, prompts, max_new_tokens, eot_token, on_token):
        self.prompts, self.max_new, self.eot, self.on_token = prompts, max_new_tokens, eot_token, on_token
        self.out: list[list[int]] = [[] for _ in prompts]

    def emit(self, i: int, token: int) -> bool:
        """Record token for sequence i; True when the sequence is finished."""
        if self.eot is not None and token == self.eot:
            return True
        self.out[i].append(token)
        if self.on_token is not None:
            self.on_token(i, token)
        return len(self.out[i]) >= self.max_new

    def last(self, i: int) -> int:
        return self.out[i][-1]


@torch.no_grad()
def generate(
    model,
    prompts: list[list[int]],
    cache_kind: str = "auto",
    *,
    max_new_tokens: int,
    temperature: float = 0.0,
    top_k: int | None = None,
    top_p: float | None = None,
    eot_token: int | None = None,
    generator: torch.Generator | None = None,
    page_size: int = 16,
    num_pages: int | None = None,
    wait_for_pages: bool = False,
    max_batch: int | None = None,
    allow_past_block_size: bool = False,
    dtype: torch.dtype | None = None,
    on_token=None,
    on_logits=None,
):
    """Generate up to max_new_tokens after each prompt; returns (new tokens per prompt, GenerationStats).

    cache_kind: as resolve_cache_kind takes it ("none" recomputes the full context every step). on_token(i, tok)
    sees every emitted token as it comes (streaming); on_logits(i, logits (V,)) sees the logits each new token of
    sequence i was sampled from (the tests compare them with the full forward). max_batch caps the rows decoded
    together (default: all prompts); with wait_for_pages a paged cache admits prompts only as pages free up.
    """
    config = model.config
    kind = resolve_cache_kind(config, cache_kind)
    check_sampling(temperature, top_k, top_p)
    if max_batch is not None and (not isinstance(max_batch, int) or isinstance(max_batch, bool) or max_batch < 1):
        raise ValueError(f"max_batch: got {max_batch!r}; valid: None (all prompts together) or an int >= 1")
    check_length(config, [len(p) for p in prompts], max_new_tokens, allow_past_block_size)
    seqs = _Sequences(prompts, max_new_tokens, eot_token, on_token)
    stats = GenerationStats()
    pick = lambda logits: sample_next(logits, temperature, top_k, top_p, generator)  # noqa: E731
    if kind == "none":
        _generate_uncached(model, seqs, pick, on_logits, stats)
    else:
        device = next(model.parameters()).device
        rows = min(len(prompts), max_batch or len(prompts))
        max_len = max(len(p) for p in prompts) + max_new_tokens - 1
        if kind in ("paged", "paged_mla") and num_pages:
            _check_pages(prompts, max_new_tokens, page_size, num_pages, wait_for_pages, rows)
        dtype = dtype or next(model.parameters()).dtype
        _check_fits(model, kind, rows, max_len, page_size, num_pages, dtype, device)
        cache = make_cache(
            kind,
            config,
            rows,
            max_len,
            device=device,
            dtype=dtype,
            backend=model.attn_backend_for(device),
            page_size=page_size,
            num_pages=num_pages or None,
        )
        _generate_cached(model, cache, seqs, pick, on_logits, stats, wait_for_pages)
    return seqs.out, stats


def _generate_uncached(model, seqs: _Sequences, pick, on_logits, stats: GenerationStats):
    """The reference: every step runs the full forward over each unfinished sequence's whole context."""
    device = next(model.parameters()).device
    live = list(range(len(seqs.prompts)))
    first = True
    while live:
        with _Timer(device) as t:
            finished = []
            for i in live:
                idx = torch.tensor([seqs.prompts[i] + seqs.out[i]], device=device)
                logits = model(idx)[0][:, -1].float()
                if on_logits is not None:
                    on_logits(i, logits[0])
                if seqs.emit(i, int(pick(logits)[0])):
                    finished.append(i)
        n = sum(len(seqs.prompts[i]) for i in live) if first else len(live)
        if first:
            stats.prefill_tokens, stats.prefill_s = n, t.seconds
        else:
            stats.decode_tokens, stats.decode_s, stats.decode_steps = (
                stats.decode_tokens + n,
                stats.decode_s + t.seconds,
                stats.decode_steps + 1,
            )
        live = [i for i in live if i not in finished]
        first = False


class _Scheduler:
    """Which prompt goes into which cache row, and when. Without waiting every prompt is admitted as soon as a row
    is free (a pool too small raises CacheFullError). With waiting (paged caches) a prompt is admitted only when
    the free pages cover its whole life (prompt + max_new_tokens - 1 tokens) on top of what the running sequences
    may still claim, so a running sequence never meets an empty pool."""

    def __init__(self, cache, seqs: _Sequences, wait: bool):
        self.cache, self.seqs = cache, seqs
        self.wait = wait and cache.store.paged
        self.waiting = deque(range(len(seqs.prompts)))
        self.active: dict[int, int] = {}  # cache row -> sequence id

    def pages_for_life(self, i: int) -> int:
        ps = self.cache.store.page_size
        return -(-(len(self.seqs.prompts[i]) + self.seqs.max_new - 1) // ps)

    def admit(self) -> list[tuple[int, int]]:
        """(row, sequence) pairs admitted now, lowest free rows first."""
        free_rows = [r for r in range(self.cache.store.batch_size) if r not in self.active]
        admitted = []
        while self.waiting and free_rows:
            i = self.waiting[0]
            if self.wait:
                store = self.cache.store
                claimed = sum(self.pages_for_life(s) - len(store.pages[r]) for r, s in self.active.items())
                if self.pages_for_life(i) > store.allocator.num_pages:
                    raise CacheFullError(
                        f"prompt {i} needs {self.pages_for_life(i)} pages for its full length, more "
                        f"than the whole pool of {store.allocator.num_pages}; raise --num_pages"
                    )
                if store.allocator.num_free - claimed < self.pages_for_life(i):
                    break
            self.waiting.popleft()
            r = free_rows.pop(0)
            self.active[r] = i
            admitted.append((r, i))
        return admitted

    def finish(self, rows: list[int]):
        """Release finished rows; a contiguous cache then moves the survivors down so decode views stay slices."""
        for r in rows:
            del self.active[r]
            self.cache.release(r)
        if rows and not self.cache.store.paged and self.active:
            old = sorted(self.active)
            new = self.cache.compact(old)
            self.active = {n: self.active[o] for o, n in zip(old, new)}


def _generate_cached(model, cache, seqs: _Sequences, pick, on_logits, stats: GenerationStats, wait: bool):
    device = next(model.parameters()).device
    sched = _Scheduler(cache, seqs, wait)
    mem = cache.memory()
    stats.cache_bytes_allocated, stats.cache_bytes_per_token = mem["bytes_allocated"], mem["bytes_per_token"]
    while sched.waiting or sched.active:
        admitted = sched.admit()
        if not admitted and not sched.active:
            raise CacheFullError("no prompt can be admitted into an empty cache; raise --num_pages")
        _prefill(model, cache, seqs, sched, admitted, pick, on_logits, stats, device)
        stats.cache_bytes_peak = max(stats.cache_bytes_peak, cache.memory()["bytes_in_use"])
        if not sched.active:
            continue
        rows = sorted(sched.active)
        with _Timer(device) as t:
            idx = torch.tensor([[seqs.last(sched.active[r])] for r in rows], device=device)
            logits = model(idx, cache=cache.view(rows))[0][:, -1].float()
            tokens = pick(logits).tolist()
        stats.decode_tokens, stats.decode_s, stats.decode_steps = (
            stats.decode_tokens + len(rows),
            stats.decode_s + t.seconds,
            stats.decode_steps + 1,
        )
        stats.cache_bytes_peak = max(stats.cache_bytes_peak, cache.memory()["bytes_in_use"])
        done = []
        for j, r in enumerate(rows):
            if on_logits is not None:
                on_logits(sched.active[r], logits[j])
            if seqs.emit(sched.active[r], tokens[j]):
                done.append(r)
        sched.finish(done)


def _prefill(model, cache, seqs, sched, admitted, pick, on_logits, stats, device):
    """Prefill admitted prompts; prompts of one length go together through one view, others one at a time."""
    by_len: dict[int, list[tuple[int, int]]] = {}
    for r, i in admitted:
        by_len.setdefault(len(seqs.prompts[i]), []).append((r, i))
    done = []
    for group in by_len.values():
        with _Timer(device) as t:
            idx = torch.tensor([seqs.prompts[i] for _, i in group], device=device)
            logits = model(idx, cache=cache.view([r for r, _ in group]))[0][:, -1].float()
            tokens = pick(logits).tolist()
        stats.prefill_tokens += idx.numel()
        stats.prefill_s += t.seconds
        for j, (r, i) in enumerate(group):
            if on_logits is not None:
                on_logits(i, logits[j])
            if seqs.emit(i, tokens[j]):
                done.append(r)
    sched.finish(done)


def _check_fits(model, kind: str, rows: int, max_len: int, page_size: int, num_pages, dtype, device):
    """The cache's bytes against the memory its device has available, so that a size that cannot fit is refused
    at start with the numbers, not a failed allocation (or the process killed by the OS) after the prompt."""
    per_token = model.kv_cache_bytes_per_token(dtype)
    if kind in ("paged", "paged_mla"):
        tokens = (num_pages or rows * -(-max_len // page_size)) * page_size
    else:
        tokens = rows * max_len
    need, free = per_token * tokens, _available_bytes(device)
    if free is not None and need > free:
        raise ValueError(
            f"cache: {need / 2**30:.1f} GiB ({rows} sequences of up to {max_len} tokens at "
            f"{per_token} bytes a token), but {free / 2**30:.1f} GiB is available on {device}; valid: "
            "fewer samples or new tokens, or a paged cache with a smaller --num_pages"
        )


def _available_bytes(device: torch.device) -> int | None:
    """Free GPU memory, or the host's MemAvailable (Linux); None where it cannot be read."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    try:
        with open("/proc/meminfo") as f:
            kib = next(int(line.split()[1]) for line in f if line.startswith("MemAvailable:"))
        return kib * 1024
    except (OSError, StopIteration, ValueError, IndexError):
        return None


def pages_needed(prompt_lens: list[int], max_new_tokens: int, page_size: int, wait: bool, rows: int):
    """(pages a pool must hold so that generation cannot run out partway, pages of the longest sequence): one
    sequence at full length when waiting for pages, else the `rows` largest together."""
    per_sample = sorted((-(-(n + max_new_tokens - 1) // page_size) for n in prompt_lens), reverse=True)
    return (per_sample[0] if wait else sum(per_sample[:rows])), per_sample[0]


def _check_pages(prompts, max_new_tokens: int, page_size: int, num_pages: int, wait: bool, rows: int):
    """A pool that cannot hold what must be resident at once would run out partway through, after tokens were
    generated (`pages_needed`)."""
    need, longest = pages_needed([len(p) for p in prompts], max_new_tokens, page_size, wait, rows)
    if num_pages < need:
        who = "the longest sequence" if wait else f"{rows} sequences at once"
        raise ValueError(
            f"num_pages: got {num_pages}; the pool must hold {need} pages of {page_size} tokens for "
            f"{who} at full length; valid: None (enough for all) or >= {need}"
            + ("" if wait else f", or wait_for_pages=True with >= {longest}")
        )
