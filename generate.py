"""The generation engine: prompts in, new tokens out, through a KV cache (cache.py) or none.

    from generate import generate
    out, stats = generate(model, prompts, "paged", max_new_tokens=100, temperature=0.8, top_k=200)
    stats.summary()["decode_tokens_per_s"]

A scheduler admits waiting prompts into cache rows (and pages) as they free up, a batch of them at a time
(`admit_batch`): more prompts than `max_batch` run through a queue (continuous batching). Admitted prompts are
prefilled eagerly through the flash kernel, prompts of different lengths together in one forward, right-padded
to the longest (`_prefill_groups`); then every active sequence decodes one token per step, in one of three
engines:

- eager: the model's forward through a cache view of the active rows, the next tokens read back every step.
- static: one decode step over static device buffers: each row's input token, write position (the cache's
  `next_pos`), tokens still allowed and liveness live on the device and are advanced in place by the step itself;
  sampling (greedy, temperature, top-k, top-p) runs on the device; the batch is padded up to a bucket (1, 2, 4, 8,
  then steps of 16 up to max_batch) whose padding rows write only to free rows or the paged cache's scratch page.
  The host reads the sampled tokens back every `sync_every` steps (or as soon as a row must end so a waiting
  prompt can take it), not every token. The same function runs on the CPU, where the tests check it.
- graphs: the static step captured once per bucket in a CUDA graph (one memory pool for all of them, captured at
  the start, reported on stderr) and replayed: a step is one graph launch, with no Python or kernel launches.

"auto" is graphs on a CUDA device and eager elsewhere.
"""

from __future__ import annotations

import functools
import numbers
import sys
import time
from collections import deque
from dataclasses import dataclass, field

import torch

from cache import PAGED_KINDS, CacheFullError, cdiv, make_cache, pool_pages
from train_step import PTDTYPES as DTYPES  # the dtypes by name, as train.py's and sample.py's --dtype take them

ENGINES = ("auto", "eager", "static", "graphs")


# ---------------------------------------------------------------------------------------------- choices


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


def resolve_engine(engine: str, kind: str, device) -> str:
    """auto -> graphs on a CUDA device, eager elsewhere (and without a cache)."""
    if engine not in ENGINES:
        raise ValueError(f"engine: got {engine!r}; valid: {', '.join(ENGINES)}")
    cuda = torch.device(device).type == "cuda"
    if engine == "auto":
        return "graphs" if cuda and kind != "none" else "eager"
    if engine != "eager" and kind == "none":
        raise ValueError(f"engine: got {engine!r} with cache 'none'; valid: eager (or auto) without a cache")
    if engine == "graphs" and not cuda:
        raise ValueError(f"engine: got 'graphs' on {device}; valid: eager or static (CUDA graphs need a CUDA device)")
    return engine


def compile_model(model):
    """torch.compile the decode step of `model`, in place, region by region: the embedding (`GPT.embed`), every
    block around its cache call, and the final norm with the output projection (`GPT.logits_and_loss`). Inductor
    fuses the norms, projections, residual adds and MLP around each cache call (RoPE is our kernel either way), and
    the cache call itself runs as it is (cache.py keeps it out of the graphs). One compile serves every layer, batch
    size and cache view, and the CUDA graphs of the graphs engine replay the fused kernels. The model is marked
    `decode_compiled`, which compiles the static step's bookkeeping too (`StaticDecoder`). Prefill stays eager (see
    _DecodeCompiled). The compiling happens in the first calls, inside generate: its seconds are kept out of the
    prefill, decode and capture times and said on stderr (`_report_compile`)."""
    # layer_idx is an int attribute of each block that reaches the cache call: left specialized, every layer would
    # compile a graph of its own and a 12-layer model would pass dynamo's recompile limit.
    torch._dynamo.config.allow_unspec_int_on_nn_module = True
    for block in model.transformer.h:
        block.forward = _DecodeCompiled(block.forward)
    model.embed = _DecodeCompiled(model.embed)
    model.logits_and_loss = _DecodeCompiled(model.logits_and_loss)
    model.decode_compiled = True
    return model


# Coordinate-descent tuning, as gpt-fast sets it: Inductor tunes its kernels' block sizes, and at batch 1 on the
# PyTorch attention backend it writes each projection (a one-row matmul, model.linear) as a reduction fused with its
# neighbours instead of a cuBLAS GEMM. (On the Triton backend a batch-1 step runs its projections through
# attention_kernels.decode_linear, `GPT.fused_rows`, and Inductor fuses what lies between them.)
DECODE_INDUCTOR_OPTIONS = {"coordinate_descent_tuning": True}


class _DecodeCompiled:
    """A region of the forward, compiled for one new token per sequence and eager for prefill. A prefill compiled
    for symbolic lengths took twice the eager one's host time (docs/kernel-notes.md, "The decode step end to
    end"): its time goes to launches either way, and the compiled regions add guards and a cache lookup each. The
    region's first argument is (B, T, ...)."""

    def __init__(self, forward):
        self.eager, self.compiled = forward, _Compiled(forward, dynamic=True, options=DECODE_INDUCTOR_OPTIONS)

    def __call__(self, x, *args):
        return (self.compiled if x.shape[1] == 1 else self.eager)(x, *args)


@dataclass
class _CompileClock:
    """Seconds spent in the calls of compiled functions that compiled (a first call, or a recompile for a new
    shape or guard), and the graphs they compiled: such a call compiles on the host inside whatever prefill or
    decode step makes it, so `_Timer` leaves its seconds out and generate reports them (`_report_compile`)."""

    seconds: float = 0.0
    graphs: int = 0


COMPILING = _CompileClock()


class _Compiled:
    """torch.compile(fn, **options), whose calls that compile are timed on COMPILING (dynamo's count of graphs
    rose during the call; the call's one run of the new graph counts with it, a small part of it)."""

    def __init__(self, fn, **options):
        from torch._dynamo.utils import counters  # dynamo's own tallies (torch._dynamo.reset clears, not replaces)

        self.fn, self.counters = torch.compile(fn, **options), counters

    def __call__(self, *args):
        graphs, t0 = self.counters["stats"]["unique_graphs"], time.perf_counter()
        out = self.fn(*args)
        new = self.counters["stats"]["unique_graphs"] - graphs
        if new > 0:
            COMPILING.seconds += time.perf_counter() - t0
            COMPILING.graphs += new
        return out


def per_prompt(max_new_tokens, n: int) -> list[int]:
    """max_new_tokens as one int per prompt (an int applies to all)."""
    values = [max_new_tokens] * n if not isinstance(max_new_tokens, (list, tuple)) else list(max_new_tokens)
    if len(values) != n or any(not _is_int(m) or m < 1 for m in values):
        raise ValueError(f"max_new_tokens: got {max_new_tokens!r}; valid: an int >= 1, or one per prompt ({n})")
    return values


def check_length(config, prompt_lens: list[int], max_new_tokens, allow_past_block_size: bool, prefix: str = ""):
    """Positions run up to prompt + max_new_tokens - 2 (the last sampled token is never fed back). `prefix` goes
    before each option's name in the message ("--" for a command line); without it, the message names generate's
    keyword and sample.py's flag both."""
    if not prompt_lens:
        raise ValueError("prompts: got none; valid: at least one prompt")
    max_new = per_prompt(max_new_tokens, len(prompt_lens))
    if min(prompt_lens) < 1:
        raise ValueError(f"{prefix}start: got an empty prompt; valid: at least one token")
    allow = f"{prefix}allow_past_block_size=True" + ("" if prefix else " (sample.py: --allow_past_block_size=True)")
    if max(prompt_lens) > config.block_size and (config.pos_embedding == "learned" or not allow_past_block_size):
        rope = "" if config.pos_embedding == "learned" else f", or {allow} for this RoPE model"
        raise ValueError(
            f"prompt: got {max(prompt_lens)} tokens, longer than the model's block_size={config.block_size}; "
            f"valid: at most {config.block_size} tokens (shorten the prompt){rope}"
        )
    longest = max(n + m - 1 for n, m in zip(prompt_lens, max_new))
    if longest <= config.block_size:
        return
    n, m = max((n + m - 1, n, m) for n, m in zip(prompt_lens, max_new))[1:]
    how = f"prompt of {n} tokens + max_new_tokens={m} - 1 = {longest} tokens"
    if config.pos_embedding == "learned":
        raise ValueError(
            f"{how}; valid: at most block_size={config.block_size} for learned position embeddings "
            f"(shorten the prompt or lower {prefix}max_new_tokens)"
        )
    if not allow_past_block_size:
        raise ValueError(
            f"{how} > block_size={config.block_size}; this RoPE model may go past what it was trained "
            f"on with {allow}, or lower {prefix}max_new_tokens"
        )


def _a(value) -> str:
    """'a list', 'an int': the type of a value as a message names it."""
    name = type(value).__name__
    return f"{'an' if name[0].lower() in 'aeiou' else 'a'} {name}"


def check_prompts(prompts, vocab_size: int) -> list[list[int]]:
    """The prompts as lists of Python ints, each a token id in [0, vocab_size): a list (or tuple) of non-empty lists
    of ints. Checked on the host, where they are (no device sync): an id out of range would otherwise be an
    IndexError of the embedding on a CPU and a device-side assert that kills the process on a GPU."""
    valid = "a list of token-id lists (one per prompt)"
    if not isinstance(prompts, (list, tuple)):
        hint = ": a (B, T) tensor's .tolist()" if isinstance(prompts, torch.Tensor) else ""
        raise TypeError(f"prompts: got {_a(prompts)}; valid: {valid}{hint}")
    if not prompts:
        raise ValueError(f"prompts: got none; valid: {valid}, at least one")
    checked = []
    for i, prompt in enumerate(prompts):
        if not isinstance(prompt, (list, tuple)):
            flat = " ([[1, 2, 3]] for one prompt)" if isinstance(prompt, numbers.Integral) else ""
            raise TypeError(f"prompts[{i}]: got {_a(prompt)}; valid: a list of token ids{flat}")
        if not prompt:
            raise ValueError(f"prompts[{i}]: got an empty list; valid: at least one token id")
        if all(type(t) is int for t in prompt) and 0 <= min(prompt) and max(prompt) < vocab_size:
            checked.append(list(prompt))  # the common case at C speed: 256 prompts of 512 tokens in milliseconds
            continue
        for j, token in enumerate(prompt):
            check_token(f"prompts[{i}][{j}]", token, vocab_size)
        checked.append([int(t) for t in prompt])  # numpy ints too; a list, which the engines extend
    return checked


def cache_dtype(dtype, model_dtype: torch.dtype) -> torch.dtype:
    """The cache's dtype: None (the model's), a floating-point torch.dtype, or its name as sample.py's --dtype
    takes it."""
    if dtype is None:
        return model_dtype
    if isinstance(dtype, str) and dtype in DTYPES:
        return DTYPES[dtype]
    if isinstance(dtype, torch.dtype) and dtype.is_floating_point:
        return dtype
    raise (ValueError if isinstance(dtype, (str, torch.dtype)) else TypeError)(
        f"dtype: got {dtype!r}; valid: None (the model's), a floating-point torch.dtype, or {', '.join(DTYPES)}"
    )


def check_token(name: str, token, vocab_size: int, valid: str = "an int token id"):
    """One token id: an int (numpy's too, not a bool) in [0, vocab_size); TypeError or ValueError naming it."""
    if not isinstance(token, numbers.Integral) or isinstance(token, bool):
        raise TypeError(f"{name}: got {token!r} ({_a(token)}); valid: {valid} in [0, {vocab_size})")
    if not 0 <= token < vocab_size:
        raise ValueError(f"{name}: got {token}; valid: {valid} in [0, {vocab_size})")


def check_eot(eot_token, vocab_size: int):
    if eot_token is not None:
        check_token("eot_token", eot_token, vocab_size, "None or an int token id")


def check_pool_options(kind: str, num_pages, wait_for_pages: bool, prefix: str = ""):
    """num_pages and wait_for_pages act on a paged cache only: given with another cache, they would be ignored in
    silence. Their defaults (None or 0, False) mean "not given", so the message names only what was set; `prefix`
    ("--" for a command line) as check_sampling's."""
    if kind in PAGED_KINDS:
        return
    given = [(f"{prefix}num_pages", num_pages)] if num_pages not in (None, 0) else []
    if wait_for_pages:
        given.append((f"{prefix}wait_for_pages", True))
    if given:
        cache, paged = (
            (f"{prefix}cache={kind}", f"{prefix}cache=paged") if prefix else (f"cache {kind!r}", "cache 'paged'")
        )
        raise ValueError(
            f"{' and '.join(f'{name}={value!r}' for name, value in given)}: given with {cache}, which has no page "
            f"pool; valid: {paged}, or no {' and no '.join(name for name, _ in given)}"
        )


# --------------------------------------------------------------------------------------------- sampling


def check_sampling(temperature: float, top_k: int | None, top_p: float | None, prefix: str = ""):
    """temperature >= 0 (0: greedy), top_k >= 0 (0 or None: off), top_p in (0, 1] (1 or None: off). `prefix`
    goes before each name in the message ("--" for a command line). A temperature or top_p that is not a number is a
    TypeError; a top_k that is not an int (a bool included) is a ValueError, as a negative one is."""
    if not _is_number(temperature):
        raise TypeError(f"{prefix}temperature: got {temperature!r}; valid: a number >= 0 (0 = greedy)")
    if not temperature >= 0:  # also refuses NaN
        raise ValueError(f"{prefix}temperature: got {temperature!r}; valid: a number >= 0 (0 = greedy)")
    if top_k is not None and (not _is_int(top_k) or top_k < 0):
        raise ValueError(f"{prefix}top_k: got {top_k!r}; valid: an int >= 0 (0 = off)")
    if top_p is not None and not _is_number(top_p):
        raise TypeError(f"{prefix}top_p: got {top_p!r}; valid: a number in (0, 1] (1 = off)")
    if top_p is not None and not 0 < top_p <= 1:
        raise ValueError(f"{prefix}top_p: got {top_p!r}; valid: a number in (0, 1] (1 = off)")


def _is_number(value) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def sample_next(
    logits: torch.Tensor,
    temperature: float = 0.0,
    top_k: int | None = None,
    top_p: float | None = None,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """logits (B, V) -> next tokens (B,) on the logits' device, with no host sync (a CUDA graph captures it).
    temperature 0 is greedy (argmax); top_k / top_p filter before sampling.

    Sampling is the exponential race: with E_i ~ Exp(1) independent, argmax_i p_i / E_i is token i with
    probability p_i (the Gumbel-max trick written with exponentials), so one random kernel and an argmax replace
    torch.multinomial. The noise comes from `generator` (a CUDA graph registers it, so every replay draws anew)."""
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
    probs = logits.softmax(dim=-1)
    # An exponential draw of exactly 0 would make 0 / 0 = NaN for a filtered token: clamp it to the smallest normal.
    race = torch.empty_like(probs).exponential_(generator=generator).clamp_min_(torch.finfo(torch.float32).tiny)
    return (probs / race).argmax(dim=-1)


# ------------------------------------------------------------------------------------------- generation


@dataclass
class GenerationStats:
    prefill_tokens: int = 0
    prefill_s: float = 0.0
    prefill_forwards: int = 0  # prefill forwards (each of one or more prompts: `_prefill_groups`)
    decode_tokens: int = 0
    decode_s: float = 0.0
    decode_steps: int = 0
    cache_bytes_allocated: int = 0
    cache_bytes_peak: int = 0
    cache_bytes_per_token: int = 0
    # engine; static and graphs engines: buckets, reads, steps_per_bucket; graphs only: capture_s;
    # a compiled model: compile_s, compiled_graphs
    extra: dict = field(default_factory=dict)

    def summary(self) -> dict:
        return {
            "prefill_tokens_per_s": self.prefill_tokens / max(self.prefill_s, 1e-9),
            "decode_tokens_per_s": self.decode_tokens / max(self.decode_s, 1e-9),
            "prefill_tokens": self.prefill_tokens,
            "prefill_forwards": self.prefill_forwards,
            "decode_tokens": self.decode_tokens,
            "decode_steps": self.decode_steps,
            "cache_bytes_allocated": self.cache_bytes_allocated,
            "cache_bytes_peak": self.cache_bytes_peak,
            "cache_bytes_per_token": self.cache_bytes_per_token,
            **self.extra,
        }


class _Timer:
    """The seconds of a prefill or decode region, less what compiling took inside it (COMPILING), so that a first
    call of the compiled step never reads as a slow prefill or decode."""

    def __init__(self, device):
        self.cuda = torch.device(device).type == "cuda"

    def __enter__(self):
        if self.cuda:
            torch.cuda.synchronize()
        self.t0, self.compiling = time.perf_counter(), COMPILING.seconds
        return self

    def __exit__(self, *exc):
        if self.cuda:
            torch.cuda.synchronize()
        self.seconds = time.perf_counter() - self.t0 - (COMPILING.seconds - self.compiling)


class _Sequences:
    """Host bookkeeping of a generation: each prompt's new tokens and whether it is done."""

    def __init__(self, prompts, max_new: list[int], eot_token, on_token):
        self.prompts, self.max_new, self.eot, self.on_token = prompts, max_new, eot_token, on_token
        self.out: list[list[int]] = [[] for _ in prompts]

    def emit(self, i: int, token: int) -> bool:
        """Record token for sequence i; True when the sequence is finished."""
        if self.eot is not None and token == self.eot:
            return True
        self.out[i].append(token)
        if self.on_token is not None:
            self.on_token(i, token)
        return len(self.out[i]) >= self.max_new[i]

    def last(self, i: int) -> int:
        return self.out[i][-1]

    def remaining(self, i: int) -> int:
        return self.max_new[i] - len(self.out[i])

    def cached(self, i: int) -> int:
        """Tokens of sequence i in the cache: the prompt and every new token but the last (not fed back yet)."""
        return len(self.prompts[i]) + len(self.out[i]) - 1


@torch.no_grad()
def generate(
    model,
    prompts: list[list[int]],
    cache_kind: str = "auto",
    *,
    max_new_tokens: int | list[int],
    temperature: float = 0.0,
    top_k: int | None = None,
    top_p: float | None = None,
    eot_token: int | None = None,
    generator: torch.Generator | None = None,
    page_size: int = 16,
    num_pages: int | None = None,
    wait_for_pages: bool = False,
    max_batch: int | None = None,
    admit_batch: int | None = None,
    allow_past_block_size: bool = False,
    dtype: torch.dtype | str | None = None,
    engine: str = "auto",
    sync_every: int = 16,
    on_token=None,
    on_logits=None,
):
    """Generate up to max_new_tokens (an int, or one per prompt) after each prompt; returns (new tokens per prompt,
    GenerationStats). prompts: a list of token-id lists, each id in [0, vocab_size) (`check_prompts`).

    cache_kind: as resolve_cache_kind takes it ("none" recomputes the full context every step). engine: one of
    ENGINES (the module docstring). max_batch caps the rows decoded together (default: all prompts; the others wait
    in a queue); with wait_for_pages a paged cache admits prompts only as pages free up. admit_batch: with prompts
    waiting, how many rows must free before they are admitted, so that they prefill together rather than one per
    freed row (default a quarter of the rows, at least 1; 1 admits at once; see _Scheduler). sync_every: decode steps
    between reads of the sampled tokens in the static and graphs engines (a finished row is noticed, and a waiting
    prompt admitted, at the next read). on_token(i, tok) sees every emitted token, in order per sequence
    (streaming; the static engines deliver them at each read); on_logits(i, logits (V,)) sees the logits each new
    token of sequence i was sampled from (the tests compare them with the full forward; it makes the static engines
    read back every step). dtype: the cache's, None for the model's, or a name (DTYPES). num_pages and
    wait_for_pages take a paged cache only. Every argument is checked before anything runs.
    """
    config = model.config
    prompts = check_prompts(prompts, config.vocab_size)
    kind = resolve_cache_kind(config, cache_kind)
    check_sampling(temperature, top_k, top_p)
    check_eot(eot_token, config.vocab_size)
    check_pool_options(kind, num_pages, wait_for_pages)
    dtype = cache_dtype(dtype, next(model.parameters()).dtype)
    if max_batch is not None and (not _is_int(max_batch) or max_batch < 1):
        raise ValueError(f"max_batch: got {max_batch!r}; valid: None (all prompts together) or an int >= 1")
    if admit_batch is not None and (not _is_int(admit_batch) or admit_batch < 1):
        raise ValueError(f"admit_batch: got {admit_batch!r}; valid: None (a quarter of the rows) or an int >= 1")
    if not _is_int(sync_every) or sync_every < 1:
        raise ValueError(f"sync_every: got {sync_every!r}; valid: an int >= 1")
    check_length(config, [len(p) for p in prompts], max_new_tokens, allow_past_block_size)
    max_new = per_prompt(max_new_tokens, len(prompts))
    device = next(model.parameters()).device
    engine = resolve_engine(engine, kind, device)
    seqs = _Sequences(prompts, max_new, eot_token, on_token)
    stats = GenerationStats(extra={"engine": engine})
    compiled_before = (COMPILING.seconds, COMPILING.graphs)
    if temperature == 0 and getattr(model, "decode_compiled", False):
        pick = _compiled_greedy()
    else:
        pick = lambda logits: sample_next(logits, temperature, top_k, top_p, generator)  # noqa: E731
    if kind == "none":
        _generate_uncached(model, seqs, pick, on_logits, stats)
        _report_compile(model, stats, compiled_before)
        return seqs.out, stats
    rows = min(len(prompts), max_batch or len(prompts))
    max_len = max(len(p) + m - 1 for p, m in zip(prompts, max_new))
    if kind in PAGED_KINDS and num_pages:
        _check_pages(prompts, max_new, page_size, num_pages, wait_for_pages, rows)
    _check_fits(model, kind, rows, max_len, page_size, num_pages, engine != "eager", dtype, device)
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
        static=engine != "eager",
    )
    mem = cache.memory()
    stats.cache_bytes_allocated, stats.cache_bytes_per_token = mem["bytes_allocated"], mem["bytes_per_token"]
    sched = _Scheduler(cache, seqs, wait_for_pages, admit_batch or default_admit_batch(rows))
    if engine == "eager":
        _generate_eager(model, sched, pick, on_logits, stats)
    else:
        decoder = StaticDecoder(model, cache, pick, eot_token, sync_every, keep_logits=on_logits is not None)
        if engine == "graphs":
            decoder.capture(generator)
            stats.extra["capture_s"] = decoder.capture_s
        stats.extra["buckets"] = decoder.buckets
        _generate_static(model, sched, decoder, pick, on_logits, stats)
    _report_compile(model, stats, compiled_before)
    return seqs.out, stats


def _report_compile(model, stats: GenerationStats, before: tuple[float, int]):
    """A compiled model's compile time in this generation, in the stats and on stderr as the capture's is: those
    seconds are in neither the prefill's nor the decode's tokens/s (`_Timer`), nor in the capture's time."""
    if not getattr(model, "decode_compiled", False):
        return
    seconds, graphs = COMPILING.seconds - before[0], COMPILING.graphs - before[1]
    stats.extra.update(compile_s=seconds, compiled_graphs=graphs)
    if graphs:
        print(
            f"torch.compile: compiled the decode step ({graphs} graph{'s' * (graphs > 1)}) in {seconds:.2f} s, "
            "outside the prefill and decode tokens/s",
            file=sys.stderr,
        )


def default_admit_batch(rows: int) -> int:
    """Rows freed before waiting prompts are admitted, by default: a quarter of the rows, at least 1."""
    return max(1, rows // 4)


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
    """Which prompt goes into which cache row, and when. Waiting prompts are admitted once `admit_batch` rows are
    free (or as many as prompts wait, or when nothing runs): at this repository's model sizes a prefill of a few
    prompts is bound by its launches, and so is a decode step of a few rows more or less, so admitting prompts in
    batches prefills them together at the cost of a few rows idle for a few steps (docs/kernel-notes.md). Without
    `wait_for_pages` a row is all a prompt needs (a pool too small raises CacheFullError). With it (paged caches) a
    prompt is admitted only when the free pages cover its whole life (prompt + max_new_tokens - 1 tokens) on top of
    what the running sequences may still claim, so a running sequence never meets an empty pool. `pack` keeps the
    running sequences in rows 0 .. n-1, so that a decode step over the first rows covers them."""

    def __init__(self, cache, seqs: _Sequences, wait_for_pages: bool, admit_batch: int = 1):
        self.cache, self.seqs, self.admit_batch = cache, seqs, admit_batch
        self.wait_for_pages = wait_for_pages and cache.store.paged
        self.waiting = deque(range(len(seqs.prompts)))
        self.active: dict[int, int] = {}  # cache row -> sequence id

    def pages_for_life(self, i: int) -> int:
        return cdiv(len(self.seqs.prompts[i]) + self.seqs.max_new[i] - 1, self.cache.store.page_size)

    def free_rows(self) -> list[int]:
        return [r for r in range(self.cache.store.batch_size) if r not in self.active]

    def rows_wanted(self) -> int:
        """Free rows that admit the waiting prompts while others run: `admit_batch`, or as many as prompts wait."""
        return min(self.admit_batch, len(self.waiting))

    def rows_to_free(self) -> int:
        """How many more rows must free before waiting prompts are admitted (at least 1: the next to finish may
        free the pages a prompt waits for)."""
        return max(1, self.rows_wanted() - len(self.free_rows()))

    def admit(self) -> list[tuple[int, int]]:
        """(row, sequence) pairs admitted now, lowest free rows first."""
        free_rows = self.free_rows()
        if self.active and len(free_rows) < self.rows_wanted():
            return []
        admitted = []
        while self.waiting and free_rows:
            i = self.waiting[0]
            if self.wait_for_pages:
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
        for r in rows:
            del self.active[r]
            self.cache.release(r)

    def pack(self) -> list[tuple[int, int]]:
        """Move the sequences above row n-1 (n running) into the free rows below it, fewest moves first: a
        contiguous cache copies each moved sequence once, a paged one moves a table row. Returns (src, dst)."""
        n = len(self.active)
        holes = [r for r in range(n) if r not in self.active]
        movers = sorted(r for r in self.active if r >= n)
        moves = list(zip(movers, holes))
        self.cache.move_rows(moves)
        for src, dst in moves:
            self.active[dst] = self.active.pop(src)
        return moves


def _prefill(model, sched: _Scheduler, admitted, pick, on_logits, stats, device) -> list[tuple[int, int]]:
    """Prefill admitted prompts (eager, through the flash kernel) in as few forwards as `_prefill_groups` allows:
    a group's shorter prompts are padded on the right to its longest. Causal attention keeps the padding out of
    every real token's output, each prompt's next token comes from its own last position, and `trim` then drops the
    padding from the cache. Returns the (row, sequence) pairs still running after their first token."""
    seqs, cache = sched.seqs, sched.cache
    done, running = [], []
    for group in _prefill_groups(cache, seqs.prompts, admitted):
        rows = [r for r, _ in group]
        lens = [len(seqs.prompts[i]) for _, i in group]
        longest = lens[0]
        with _Timer(device) as t:
            # token 0 pads: any id will do, nothing real attends to it
            idx = torch.tensor([seqs.prompts[i] + [0] * (longest - n) for (_, i), n in zip(group, lens)], device=device)
            last = torch.tensor(lens, device=device) - 1
            logits = model(idx, cache=cache.view(rows), last=last)[0][:, 0].float()
            tokens = pick(logits).tolist()
        for r, n in zip(rows, lens):
            if n < longest:
                cache.trim(r, n)
        stats.prefill_tokens += sum(lens)
        stats.prefill_s += t.seconds
        stats.prefill_forwards += 1
        for j, (r, i) in enumerate(group):
            if on_logits is not None:
                on_logits(i, logits[j])
            (done if seqs.emit(i, tokens[j]) else running).append((r, i))
    sched.finish([r for r, _ in done])
    return running


def _prefill_groups(cache, prompts, admitted) -> list[list[tuple[int, int]]]:
    """The admitted (row, sequence) pairs in prefill forwards, longest prompt first in each. A prompt joins the
    current forward while the padding stays at most the real tokens (a forward is at most half padding: an eager
    prefill of a few prompts is bound by its launches, not by the padded work) and, in a paged cache, while the
    free pages cover every row of the forward at its longest length (they come back at `trim`)."""
    store = cache.store
    free = store.allocator.num_free if store.paged else None  # None: no pages to count
    groups: list[list[tuple[int, int]]] = []
    tokens = 0
    for r, i in sorted(admitted, key=lambda pair: -len(prompts[pair[1]])):
        n = len(prompts[i])
        if groups:
            group = groups[-1]
            longest = len(prompts[group[0][1]])
            rows = len(group) + 1
            if rows * longest <= 2 * (tokens + n) and (free is None or rows * cdiv(longest, store.page_size) <= free):
                group.append((r, i))
                tokens += n
                continue
            if free is not None:  # what the finished forward keeps after its trim
                free -= sum(cdiv(len(prompts[j]), store.page_size) for _, j in group)
        groups.append([(r, i)])
        tokens = n
    return groups


def _admit(model, sched: _Scheduler, pick, on_logits, stats, device) -> list[tuple[int, int]]:
    """Admit and prefill what fits; returns the running newcomers (their rows before `pack`)."""
    admitted = sched.admit()
    if not admitted and not sched.active:
        raise CacheFullError("no prompt can be admitted into an empty cache; raise --num_pages")
    running = _prefill(model, sched, admitted, pick, on_logits, stats, device)
    _note_cache_peak(stats, sched.cache)
    return running


def _note_cache_peak(stats: GenerationStats, cache):
    """The cache's bytes in use into the peak, taken wherever they may have grown: after a prefill, after an eager
    decode step, and in the static engines once a run's pages are given (its steps take no more)."""
    stats.cache_bytes_peak = max(stats.cache_bytes_peak, cache.memory()["bytes_in_use"])


def _generate_eager(model, sched: _Scheduler, pick, on_logits, stats: GenerationStats):
    """One forward per decode step through a view of the running rows; the next tokens read back every step."""
    cache, seqs = sched.cache, sched.seqs
    device = next(model.parameters()).device
    while sched.waiting or sched.active:
        _admit(model, sched, pick, on_logits, stats, device)
        sched.pack()  # the running rows are 0 .. n-1: the view's caches are slices, not gathered copies
        if not sched.active:
            continue
        rows = sorted(sched.active)
        with _Timer(device) as t:
            idx = torch.tensor([[seqs.last(sched.active[r])] for r in rows], device=device)
            logits = model(idx, cache=cache.view(rows))[0][:, -1].float()
            tokens = pick(logits).tolist()
        stats.decode_tokens += len(rows)
        stats.decode_s += t.seconds
        stats.decode_steps += 1
        _note_cache_peak(stats, cache)
        done = []
        for j, r in enumerate(rows):
            if on_logits is not None:
                on_logits(sched.active[r], logits[j])
            if seqs.emit(sched.active[r], tokens[j]):
                done.append(r)
        sched.finish(done)


# ------------------------------------------------------------------------------------ static decode steps


def batch_buckets(rows: int) -> list[int]:
    """Batch sizes that get a decode step of their own: 1, 2, 4, 8, then steps of 16, up to `rows` (the last)."""
    return [b for b in (1, 2, 4, 8) if b < rows] + list(range(16, rows, 16)) + [rows]


class StaticDecoder:
    """The decode step over static device buffers, for rows 0 .. b-1 of a cache made with static=True, b a bucket.

    Per row on the device: `tokens` (the input of the next step), `remaining` (tokens it may still emit), `live`;
    the cache's `next_pos` (where the row's next token is written). One step runs the model over a static cache
    view, samples on the device, and advances all of these in place: a live row that emits end-of-text or its last
    allowed token stops being live, and a row that is not live writes at position 0 of its own row (free, or
    finished and not yet released) or the scratch page, so padding never touches a live sequence. The sampled
    tokens go into `history` (step, row) at the device counter `step_index`; the host reads them after a run of
    steps and replays the same end-of-text / length rule to know what each row emitted (`_generate_static`).
    With `capture`, each bucket's step is a CUDA graph; without, the same function runs eagerly (the CPU tests)."""

    def __init__(self, model, cache, pick, eot_token: int | None, sync_every: int, keep_logits: bool):
        self.model, self.cache, self.pick, self.eot = model, cache, pick, eot_token
        rows, device = cache.store.batch_size, cache.store.device
        self.buckets = batch_buckets(rows)
        self.views = {b: cache.static_view(b) for b in self.buckets}  # made before capture: they copy row ids in
        self.tokens = torch.zeros(rows, dtype=torch.int64, device=device)
        self.remaining = torch.zeros(rows, dtype=torch.int64, device=device)
        self.live = torch.zeros(rows, dtype=torch.bool, device=device)
        self.history = torch.zeros(sync_every, rows, dtype=torch.int64, device=device)
        self.step_index = torch.zeros(1, dtype=torch.int64, device=device)
        vocab = model.config.vocab_size
        self.logits = torch.zeros(rows, vocab, dtype=torch.float32, device=device) if keep_logits else None
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.capture_s = 0.0
        # A dozen small ops a step, one or two kernels once compiled (with the model: generate.compile_model).
        self.advance = _compiled_advance() if getattr(model, "decode_compiled", False) else advance_rows

    def bucket(self, n: int) -> int:
        return next(b for b in self.buckets if b >= n)

    def step(self, b: int):
        """One decode step of rows 0 .. b-1 (device work only: this is what a graph captures)."""
        logits = self.model(self.tokens[:b, None], cache=self.views[b])[0][:, -1]  # (b, V)
        if self.logits is not None:
            self.logits[:b].copy_(logits)
        new = self.pick(logits)  # (b,); greedy takes the argmax of the model's dtype, the same as of its float
        rows = (self.tokens[:b], self.remaining[:b], self.live[:b], self.cache.next_pos[:b], self.history[:, :b])
        self.advance(new, *rows, self.step_index, self.eot)

    def run(self, b: int, steps: int):
        """`steps` decode steps of bucket b, queued without a host sync."""
        self.step_index.zero_()
        for _ in range(steps):
            if self.graphs:
                self.graphs[b].replay()
            else:
                self.step(b)

    def start(self, rows: list[int], tokens: list[int], remaining: list[int], positions: list[int]):
        """Rows that just prefilled: their first token, what they may still emit and their next write position,
        in one copy to the device."""
        if not rows:
            return
        device = self.tokens.device
        rows_t, tok, rem, pos = torch.tensor([rows, tokens, remaining, positions], dtype=torch.int64).to(device)
        self.tokens[rows_t], self.remaining[rows_t], self.live[rows_t] = tok, rem, True
        self.cache.next_pos[rows_t] = pos

    def move(self, moves: list[tuple[int, int]]):
        """The row state follows the sequences that `_Scheduler.pack` moved (the cache moved its own)."""
        if not moves:
            return
        src, dst = torch.tensor(moves, dtype=torch.int64).t().to(self.tokens.device)
        for buf in (self.tokens, self.remaining, self.live):
            buf[dst] = buf[src]
        self.live[src] = False

    def capture(self, generator: torch.Generator | None = None):
        """One CUDA graph per bucket, the largest first so that the smaller ones reuse its memory in the shared
        pool. Each is warmed up once (kernel compiles and tuning, the kernels' persistent buffers) on a side
        stream before its capture; nothing is live yet, so those runs write only to free rows and scratch."""
        if self.live.any():
            raise RuntimeError("capture: rows are live; valid: capture before any prompt is admitted")
        t0, compiling = time.perf_counter(), COMPILING.seconds  # a compiled step compiles in its warm-up here
        pool, stream = torch.cuda.graph_pool_handle(), torch.cuda.Stream()
        for b in reversed(self.buckets):
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                self.step_index.zero_()
                self.step(b)
            torch.cuda.current_stream().wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            if generator is not None and generator.device.type == "cuda":
                graph.register_generator_state(generator)  # each replay advances its offset, as an eager draw does
            with torch.cuda.graph(graph, pool=pool, stream=stream):
                self.step(b)
            self.graphs[b] = graph
        torch.cuda.synchronize()
        self.capture_s = time.perf_counter() - t0 - (COMPILING.seconds - compiling)
        kind = type(self.cache).__name__
        print(
            f"cuda graphs: captured the decode step for {len(self.buckets)} batch sizes "
            f"({', '.join(map(str, self.buckets))}) over the {kind} in {self.capture_s:.2f} s",
            file=sys.stderr,
        )


def advance_rows(new, tokens, remaining, live, next_pos, history, step_index, eot: int | None):
    """The bookkeeping of a static decode step over its rows, in place (StaticDecoder's docstring): a live row
    spends one token of `remaining` and stops at zero or at end-of-text; a row that stops writes at position 0 from
    now on; the sampled tokens `new` become the next inputs and go into `history` at `step_index`."""
    remaining -= live.long()
    still = live & (remaining > 0)
    if eot is not None:
        still &= new != eot
    next_pos.copy_((next_pos + 1) * still)
    live.copy_(still)
    tokens.copy_(new)
    history.index_copy_(0, step_index, new[None])
    step_index += 1


@functools.cache
def _compiled_greedy():
    """Greedy sampling of a compiled model: Inductor splits the argmax over the vocabulary across many programs,
    where ATen's reduction of one row of logits runs in one block (benchmarks/RESULTS.md, "Generation")."""
    return _Compiled(lambda logits: logits.argmax(dim=-1), dynamic=True)


@functools.cache
def _compiled_advance():
    """advance_rows compiled once per process: every decoder and batch size shares its graph."""
    return _Compiled(advance_rows, dynamic=True)


def _generate_static(model, sched: _Scheduler, decoder: StaticDecoder, pick, on_logits, stats: GenerationStats):
    """Runs of decode steps between host reads: admit and prefill, pack, give every running row the pages of the
    run, queue the steps, read their tokens back once, then emit and finish on the host."""
    cache, seqs = sched.cache, sched.seqs
    device = next(model.parameters()).device
    most = decoder.history.shape[0] if on_logits is None else 1
    stats.extra.update(reads=0, steps_per_bucket={})  # host reads of the sampled tokens; steps run per bucket
    while sched.waiting or sched.active:
        running = _admit(model, sched, pick, on_logits, stats, device)
        decoder.start(
            [r for r, _ in running],
            [seqs.last(i) for _, i in running],
            [seqs.remaining(i) for _, i in running],
            [len(seqs.prompts[i]) for _, i in running],
        )
        decoder.move(sched.pack())
        if not sched.active:
            continue
        rows = sorted(sched.active)  # 0 .. n-1
        left = [seqs.remaining(sched.active[r]) for r in rows]
        steps = min(most, max(left))
        if sched.waiting:  # the run ends when enough rows reach their length for the waiting prompts' admission
            steps = min(steps, sorted(left)[min(sched.rows_to_free(), len(left)) - 1])
        cache.ensure_capacity(rows, [seqs.cached(sched.active[r]) + min(steps, m) for r, m in zip(rows, left)])
        _note_cache_peak(stats, cache)
        bucket = decoder.bucket(len(rows))
        with _Timer(device) as t:
            decoder.run(bucket, steps)
            history = decoder.history[:steps, : len(rows)].tolist()  # the one sync of the run
        stats.decode_s += t.seconds
        stats.decode_steps += steps
        stats.extra["reads"] += 1
        stats.extra["steps_per_bucket"][bucket] = stats.extra["steps_per_bucket"].get(bucket, 0) + steps
        logits = decoder.logits[: len(rows)].clone() if on_logits is not None else None  # the buffer is reused
        done = []
        for j, r in enumerate(rows):
            i = sched.active[r]
            for k in range(steps):
                if on_logits is not None:
                    on_logits(i, logits[j])
                stats.decode_tokens += 1
                if seqs.emit(i, history[k][j]):
                    done.append(r)
                    break
            else:
                cache.set_len(r, seqs.cached(i))
        sched.finish(done)


# ---------------------------------------------------------------------------------------------- memory


def _check_fits(model, kind: str, rows: int, max_len: int, page_size: int, num_pages, static: bool, dtype, device):
    """The cache's bytes against the memory its device has available, so that a size that cannot fit is refused
    at start with the numbers, not a failed allocation (or the process killed by the OS) after the prompt. A
    static engine's paged pool has one page more, the scratch page its padding rows write to."""
    per_token = model.kv_cache_bytes_per_token(dtype)
    if kind in PAGED_KINDS:
        tokens = (pool_pages(rows, max_len, page_size, num_pages or None) + static) * page_size
    else:
        tokens = rows * max_len
    need, free = per_token * tokens, available_bytes(device)
    if free is not None and need > free:
        raise ValueError(
            f"cache: {need / 2**30:.1f} GiB ({rows} sequences of up to {max_len} tokens at "
            f"{per_token} bytes a token), but {free / 2**30:.1f} GiB is available on {device}; valid: "
            "fewer samples or new tokens, or a paged cache with a smaller --num_pages"
        )


def available_bytes(device: torch.device) -> int | None:
    """Free GPU memory, or the host's MemAvailable (Linux); None where it cannot be read."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    try:
        with open("/proc/meminfo") as f:
            kib = next(int(line.split()[1]) for line in f if line.startswith("MemAvailable:"))
        return kib * 1024
    except (OSError, StopIteration, ValueError, IndexError):
        return None


def pages_needed(prompt_lens: list[int], max_new_tokens, page_size: int, wait: bool, rows: int):
    """(pages a pool must hold so that generation cannot run out partway, pages of the longest sequence): one
    sequence at full length when waiting for pages, else the `rows` largest together."""
    max_new = per_prompt(max_new_tokens, len(prompt_lens))
    per_sample = sorted((cdiv(n + m - 1, page_size) for n, m in zip(prompt_lens, max_new)), reverse=True)
    return (per_sample[0] if wait else sum(per_sample[:rows])), per_sample[0]


def _check_pages(prompts, max_new_tokens, page_size: int, num_pages: int, wait: bool, rows: int):
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
