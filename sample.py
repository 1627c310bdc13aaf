"""Sample from a trained model (or GPT-2): the command line over generate.py's engine. Prefill with the flash kernel,
then one token per step through the grouped, paged or MLA decode kernels, replayed from CUDA graphs on a GPU.

    python sample.py                                                     # the newest checkpoint here (named)
    python sample.py --out_dir=out-gqa                                   # the checkpoint's natural cache
    python sample.py --cache paged --num_samples=4 --max_new_tokens=200  # `--key value` works as `--key=value`
    python sample.py --out_dir=out-gqa --cache=paged --num_samples=8 --max_new_tokens=500
    python sample.py --out_dir=out-mla --cache=none                      # the reference: recompute everything
    python sample.py --out_dir=out-gqa/last.pt                           # a checkpoint file (best.pt is the default)
    python sample.py --out_dir=out-gqa --compile=True                    # the blocks compiled, then graphed
    python sample.py --init_from=gpt2 --start="FILE:prompt.txt" --temperature=0 > out.txt
    python train.py --max_iters=50 --eval_interval=50 --out_dir=out-try  # a model to try, in a minute on a CPU
    python sample.py --out_dir=out-try --device=cpu --max_new_tokens=50  # CPU: plain PyTorch attention

Which checkpoint: --out_dir (or --init_from) takes a run directory (its best.pt, else last.pt) or a checkpoint
file; without either, the run directory here with the most recently written checkpoint, named on stderr. Both given
must name the same checkpoint (two different ones are a usage error).

--cache: auto (grouped for MHA/GQA/MQA, mla for MLA), grouped, paged, mla, none. On an MLA model "paged" means the
paged latent cache (paged_mla, also accepted by name); grouped on an MLA model and mla on a GQA model are refused
at start with the valid choices. "none" recomputes the whole context each step with no cache.

The prompts (`--start`, one per sample) decode together as one batch; a sequence that emits the end-of-text
token or reaches --max_new_tokens finishes and gives its cache rows (its pages) back while the others go on. With
a paged cache, --num_pages limits the pool (0: enough for every sample at full length); a pool that cannot hold
every sample at full length fails at start, unless --wait_for_pages=True, which admits prompts only as pages free
up (each admitted sequence is guaranteed pages for its full length, so nothing is ever evicted). --num_pages and
--wait_for_pages with a contiguous cache, and any option out of its range, fail at start with the valid values.

Speed: on a GPU each decode step is replayed from a CUDA graph captured at the start for the batch sizes it may
take (stderr says which and how long the capture took), with sampling on the GPU and the tokens read back every
few steps; --cuda_graphs=False runs the eager loop instead (a forward and a read-back per step), and on a CPU the
eager loop is the only one (--cuda_graphs=True there is an error). On a GPU at batch 1 every projection runs as one
kernel with the norm before it and the GELU or residual add after it (attention_kernels.decode_linear), and at any
batch RoPE runs as one kernel a layer (rope_qkv; for MLA mla_decode_inputs, which also applies W_UK to the query,
normalizes the latent and writes it into the cache), compiled or not.
--compile=True compiles every block with torch.compile around its cache call for the decode steps
(generate.compile_model: norms, projections, residual adds and MLP fused; prefill stays eager; either loop, the
graphs then replay the fused kernels; the capture waits for it). It pays most where small kernels remain between
the projections, at batches above 1 (benchmarks/RESULTS.md has the numbers; GQA at batch 1 gains 7%), and over long
generations: a short run spends more on the compile than it saves. The compiling happens in the first steps; stderr
says how long it took, and the prefill and decode tokens/s leave it out.

Standard output gets the samples alone (the first one streamed as it is generated, then the others, separated by
a line of dashes), so `> out.txt` captures just the text; progress and statistics (prefill and decode tokens/s,
cache memory) go to standard error, and to the checkpoint's wandb project with --wandb_log=True. Ctrl-C (or
SIGTERM) stops the generation and prints every sample as far as it got (exit status 130, or 143 for SIGTERM). A
reader that closes standard output (`| head`) ends the run quietly (exit status 141, as a Unix tool's).

Exit status: 0, 2 for a usage error (a bad option or value, named with the valid ones), 1 for a failure with its
message (a checkpoint that does not load, a page pool that runs dry, GPT-2 offline or without transformers),
130 after Ctrl-C, 143 after SIGTERM, 141 when standard output's reader has gone.

Past block_size: a model with learned positions cannot go there, so prompt + max_new_tokens beyond block_size is
an error at start. A RoPE model goes on, with a one-line warning on stderr (positions beyond what it was trained
on, whose quality is the user's risk; --allow_past_block_size=False makes it an error). A prompt longer than
block_size has a message of its own. Nothing is ever cropped silently.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
from contextlib import contextmanager

import torch

from cache import PAGED_KINDS, CacheFullError, check_page_size
from checkpoint import (
    MODEL_KEYS_NEEDED,
    CheckpointError,
    intact_checkpoint_beside,
    load_checkpoint,
    model_from_checkpoint,
    run_checkpoints,
)
from configurator import ConfigError
from generate import (
    DTYPES,
    available_bytes,
    check_length,
    check_pool_options,
    check_sampling,
    compile_model,
    generate,
    pages_needed,
    resolve_cache_kind,
)

DEFAULTS = dict(
    init_from="resume",  # "resume" (--out_dir), a run directory or checkpoint file, or gpt2 / gpt2-medium / ...
    # --out_dir: a run directory (best.pt, else last.pt) or a checkpoint file; '': the newest checkpoint's run here
    out_dir="",
    cache="auto",  # auto | grouped | paged | mla | paged_mla | none
    start="\n",  # the prompt, or FILE:path to read it from a file
    num_samples=1,
    max_new_tokens=100,  # past block_size: see --allow_past_block_size
    temperature=0.8,  # 0 = greedy
    top_k=200,  # 0 = off
    top_p=1.0,  # 1.0 = off
    seed=1337,
    page_size=16,
    num_pages=0,  # 0 = enough for every sample at full length
    wait_for_pages=False,
    allow_past_block_size=True,  # a RoPE model goes past block_size with a warning (False: an error)
    device="auto",  # auto (cuda where this torch sees a GPU, else cpu) | cpu | cuda | cuda:N
    dtype="auto",  # auto (bfloat16 on a GPU that has it, else float32) | float32 | bfloat16 | float16
    # speed ("Speed" above): decode steps replayed from CUDA graphs on a GPU (False: the eager loop; a CPU has none),
    # and --compile=True for torch.compile of every block around its cache call (with or without the graphs)
    cuda_graphs=True,
    compile=False,
    wandb_log=False,
)

CACHE_CHOICES = ("auto", "grouped", "paged", "mla", "paged_mla", "none")
# What torch.Generator.manual_seed takes (a uint64; a negative seed wraps around): past it, an OverflowError that
# does not say which option.
SEEDS = (-(2**63), 2**64 - 1)


# ---------------------------------------------------------------------------------------------- choices


def check_options(cfg: dict):
    """Every option that needs no model, checked before anything is loaded or printed."""
    if cfg["cache"] not in CACHE_CHOICES:
        raise ValueError(f"--cache: got {cfg['cache']!r}; valid: {', '.join(CACHE_CHOICES)}")
    for key in ("num_samples", "max_new_tokens"):
        if cfg[key] < 1:
            raise ValueError(f"--{key}: got {cfg[key]}; valid: an int >= 1")
    check_host_memory(cfg["num_samples"], cfg["max_new_tokens"])
    check_sampling(cfg["temperature"], cfg["top_k"], cfg["top_p"], prefix="--")
    check_page_size(cfg["page_size"])
    if cfg["num_pages"] < 0:
        raise ValueError(f"--num_pages: got {cfg['num_pages']}; valid: 0 (enough for every sample) or an int >= 1")
    check_device(cfg["device"])
    resolve_dtype(cfg["dtype"], resolve_device(cfg["device"]))
    if not SEEDS[0] <= cfg["seed"] <= SEEDS[1]:
        raise ValueError(f"--seed: got {cfg['seed']}; valid: an int in [-2**63, 2**64 - 1]")


HOST_BYTES_PER_TOKEN = 40  # a generated token on the host: a Python int (28 bytes) and its list slot (8), rounded up


def check_host_memory(num_samples: int, max_new_tokens: int):
    """Every sample's tokens stay on the host until the end (to print them): so many samples that those alone
    exceed the host's available memory (with any cache, --cache=none too) are refused at start, not killed by the
    OS partway."""
    need, free = num_samples * max_new_tokens * HOST_BYTES_PER_TOKEN, available_bytes(torch.device("cpu"))
    if free is not None and need > free:
        raise ValueError(
            f"--num_samples={num_samples} x --max_new_tokens={max_new_tokens}: the samples' tokens "
            f"need {need / 2**30:.1f} GiB of host memory ({HOST_BYTES_PER_TOKEN} bytes a token), but "
            f"{free / 2**30:.1f} GiB is available; valid: fewer samples or new tokens"
        )


def check_device(name: str):
    if name == "auto":
        return
    try:
        device = torch.device(name)
    except RuntimeError:
        device = None
    if device is None or device.type not in ("cpu", "cuda"):
        raise ValueError(f"--device: got {name!r}; valid: cpu, cuda, cuda:N, or auto")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"--device: got {name!r} but this torch sees no CUDA device; valid: cpu or auto")
    if device.type == "cuda" and (device.index or 0) >= torch.cuda.device_count():
        raise ValueError(f"--device: got {name!r}; valid: cpu, cuda:0 .. cuda:{torch.cuda.device_count() - 1}")


def resolve_device(name: str) -> str:
    """--device=auto: cuda where this torch sees a GPU, else cpu; any other (checked) name as it is."""
    if name == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return name


def check_pool(kind: str, prompt_len: int, cfg: dict):
    """--num_pages and --wait_for_pages act on a paged cache only. A pool too small for one sample at full length,
    or (without waiting) for all the samples at once, could not finish: both fail here, at start."""
    check_pool_options(kind, cfg["num_pages"], cfg["wait_for_pages"], "--")
    if kind not in PAGED_KINDS or not cfg["num_pages"]:
        return
    tokens = prompt_len + cfg["max_new_tokens"] - 1
    need, per_sample = pages_needed(
        [prompt_len] * cfg["num_samples"],
        cfg["max_new_tokens"],
        cfg["page_size"],
        cfg["wait_for_pages"],
        cfg["num_samples"],
    )
    if cfg["num_pages"] < need:
        who = "one sample" if cfg["wait_for_pages"] else f"{cfg['num_samples']} samples at once"
        wait = "" if cfg["wait_for_pages"] else f", or --wait_for_pages=True with >= {per_sample}"
        raise ValueError(
            f"--num_pages: got {cfg['num_pages']}; the pool must hold {need} pages of {cfg['page_size']} "
            f"tokens for {who} at full length ({tokens} tokens each); valid: 0 (enough for all), "
            f">= {need}{wait}"
        )


# ----------------------------------------------------------------------------------------------- the CLI


@contextmanager
def usage_errors():
    """A ValueError from checking the command line's options (a bad value, or one this model or folder cannot take)
    is a usage error: ConfigError, exit status 2 (`cli`), as train.py's."""
    try:
        yield
    except ValueError as e:
        raise ConfigError(str(e)) from None


def load_model(cfg: dict, out_dir_given: bool = True):
    """(model, tokenizer meta, checkpoint config, checkpoint path or None) from --init_from: resume (--out_dir, or
    without it the newest checkpoint here), a run directory or checkpoint file, or gpt2*."""
    from model import GPT, GPT2_NAMES

    if out_dir_given and cfg["init_from"] != "resume":
        with usage_errors():
            check_one_source(cfg["out_dir"], cfg["init_from"])
    if cfg["init_from"] in GPT2_NAMES:
        from data import tiktoken_meta

        return GPT.from_pretrained(cfg["init_from"]), tiktoken_meta("gpt2"), {}, None
    with usage_errors():
        path = checkpoint_path(cfg, out_dir_given)
    ckpt, model = _load(path, "--out_dir" if cfg["init_from"] == "resume" else "--init_from")
    print(f"loaded {path} (iter {ckpt.get('iter_num', '?')})", file=sys.stderr)
    return model, ckpt["tokenizer"], ckpt.get("config", {}), path


def check_one_source(out_dir: str, init_from: str):
    """--out_dir and --init_from both name what to sample (init_from is not an override of out_dir): given both,
    they must name the same checkpoint, else which one was meant is the user's to say."""
    from model import GPT2_NAMES

    def resolved(target: str) -> str:
        found = run_checkpoints(target) if os.path.isdir(target) else []
        return os.path.realpath(found[0] if found else target)

    if init_from in GPT2_NAMES or resolved(out_dir) != resolved(init_from):
        raise ValueError(
            f"--init_from: got {init_from!r} with --out_dir={out_dir!r}, which names another model; valid: one of "
            "the two (each takes a run directory or a checkpoint file, --init_from a GPT-2 name too), or both naming "
            "the same checkpoint"
        )


def checkpoint_path(cfg: dict, out_dir_given: bool) -> str:
    """The checkpoint file that --init_from / --out_dir name (a directory: its best.pt, else last.pt); with neither
    given, the run directory here whose checkpoint was written last, said on stderr."""
    from model import GPT2_NAMES

    if cfg["init_from"] == "resume" and not out_dir_given:
        found = _checkpoint_dirs()
        if not found:
            raise ValueError(
                "no checkpoint here (no directory under the current one holds best.pt or last.pt); train one "
                "first: python train.py configs/gqa.py (it writes out-gqa/), or sample GPT-2 with --init_from=gpt2"
            )
        newest = max(found, key=lambda d: max(_mtimes(d)))
        others = [d for d in found if d != newest]
        also = f"; also here: {', '.join(others)}" if others else ""
        print(f"no --out_dir given: sampling from {newest}, the newest checkpoint here{also}", file=sys.stderr)
        return _in_directory(newest, "--out_dir")
    option = "--out_dir" if cfg["init_from"] == "resume" else "--init_from"
    target = cfg["out_dir"] if cfg["init_from"] == "resume" else cfg["init_from"]
    if os.path.isfile(target):
        return target
    if os.path.isdir(target):
        return _in_directory(target, option)
    raise ValueError(
        f"{option}: got {target!r}, which is not a directory or a checkpoint file; valid: a run directory holding "
        f"best.pt or last.pt, a checkpoint file, "
        + ("or no --out_dir (the newest checkpoint here)" if option == "--out_dir" else "")
        + (f"'resume' (--out_dir), or {', '.join(GPT2_NAMES)}" if option == "--init_from" else "")
        + f"; here: {_as_options(_checkpoint_dirs())}"
    )


def _in_directory(directory: str, option: str) -> str:
    found = run_checkpoints(directory)
    if found:
        return found[0]
    raise ValueError(
        f"{option}: no checkpoint in {directory!r} (best.pt or last.pt; train.py writes them to its out_dir); "
        f"valid: {_as_options(_checkpoint_dirs())}"
    )


def _load(path: str, option: str):
    """(checkpoint, model) of a checkpoint file; a file that does not load names the other checkpoint beside it,
    when that one loads."""
    try:
        ckpt = load_checkpoint(path, map_location="cpu", required_keys=MODEL_KEYS_NEEDED)
        return ckpt, model_from_checkpoint(ckpt, path)
    except CheckpointError as e:
        other = intact_checkpoint_beside(path, MODEL_KEYS_NEEDED)
        if other is None:
            raise
        raise CheckpointError(f"{e}; valid: the other checkpoint beside it, {option}={other}") from None


def _mtimes(directory: str) -> list[float]:
    return [os.path.getmtime(p) for p in run_checkpoints(directory)]


def _checkpoint_dirs() -> list[str]:
    """The directories under the current one that hold a checkpoint."""
    return sorted(d for d in os.listdir(".") if os.path.isdir(d) and _mtimes(d))


def _as_options(found: list[str]) -> str:
    if not found:
        return (
            "a directory train.py has written (e.g. python train.py configs/gqa.py, then --out_dir=out-gqa), or "
            "--init_from=gpt2"
        )
    return ", ".join(f"--out_dir={d}" for d in found)


def read_start(start: str) -> str:
    if not start.startswith("FILE:"):
        return start
    try:
        with open(start[5:], encoding="utf-8") as f:
            return f.read()
    except (OSError, UnicodeDecodeError) as e:
        why = e.strerror if isinstance(e, OSError) else "not UTF-8 text"
        raise ValueError(
            f"--start: got {start!r}, which cannot be read ({why}); valid: the prompt text, "
            "or FILE:path of a readable UTF-8 file"
        ) from None


def encode_start(tokenizer, start: str) -> list[int]:
    """--start's text as token ids. A character-level model knows only the characters of its training text: one
    outside them names --start and the characters it knows (in ranges), not the tokenizer's `text`."""
    from data import CharTokenizer

    text = read_start(start)
    if isinstance(tokenizer, CharTokenizer):
        missing = list(dict.fromkeys(c for c in text if c not in tokenizer.stoi))
        if missing:
            shown = ", ".join(map(repr, missing[:5])) + (f" and {len(missing) - 5} more" if len(missing) > 5 else "")
            whose = f"whose character {shown} is" if len(missing) == 1 else f"whose characters {shown} are"
            raise ValueError(
                f"--start: got {_short(start)}, {whose} not in this character-level model's vocabulary; valid: text "
                f"in the {len(tokenizer.chars)} characters of its training text: {_char_ranges(tokenizer.chars)}"
            )
    return tokenizer.encode(text)


def _short(text: str, most: int = 40) -> str:
    return repr(text) if len(text) <= most else repr(text[:most]) + f"... ({len(text)} characters)"


def _char_ranges(chars: str, most: int = 40) -> str:
    """Sorted characters as runs ('a'..'z' for three or more in a row), the first `most` runs of them."""
    runs: list[list[str]] = []
    for c in sorted(chars):
        if runs and ord(c) == ord(runs[-1][-1]) + 1:
            runs[-1].append(c)
        else:
            runs.append([c])
    parts = [f"{r[0]!r}..{r[-1]!r}" if len(r) > 2 else ", ".join(map(repr, r)) for r in runs]
    more = f", ... ({len(parts) - most} more runs)" if len(parts) > most else ""
    return ", ".join(parts[:most]) + more


def resolve_dtype(name: str, device: str) -> torch.dtype:
    if name == "auto":
        cuda = torch.device(device).type == "cuda"
        return torch.bfloat16 if cuda and torch.cuda.is_bf16_supported() else torch.float32
    if name not in DTYPES:
        raise ValueError(f"--dtype: got {name!r}; valid: auto, {', '.join(DTYPES)}")
    return DTYPES[name]


class _Streamer:
    """Writes sample 0's text to stdout as it grows (decoding the whole list keeps multi-byte BPE pieces whole), and
    keeps every sample's tokens so far, which an interrupted run prints."""

    def __init__(self, tokenizer, out=None):
        self.tok, self.out, self.shown = tokenizer, out or sys.stdout, 0
        self.so_far: dict[int, list[int]] = {0: []}

    def __call__(self, i: int, token: int):
        self.so_far.setdefault(i, []).append(token)
        if i != 0:
            return
        text = self.tok.decode(self.so_far[0])
        if text.endswith("\ufffd"):  # an incomplete UTF-8 sequence: wait for the rest of it
            return
        self.out.write(text[self.shown :])
        self.out.flush()
        self.shown = len(text)

    def flush(self):
        text = self.tok.decode(self.so_far[0])
        self.out.write(text[self.shown :])
        self.shown = len(text)


def main(argv: list[str]) -> dict:
    from configurator import parse_config
    from data import get_tokenizer

    cfg = parse_config(DEFAULTS, argv)
    given = parse_config({**DEFAULTS, "out_dir": None, "cuda_graphs": None}, argv)  # None: left at the default
    with usage_errors():
        check_options(cfg)
        cfg["device"] = resolve_device(cfg["device"])
        engine = resolve_engine(cfg, explicit=given["cuda_graphs"] is not None)
    torch.manual_seed(cfg["seed"])
    dtype = resolve_dtype(cfg["dtype"], cfg["device"])
    model, meta, train_cfg, path = load_model(cfg, out_dir_given=given["out_dir"] is not None)
    model.eval().to(cfg["device"], dtype)
    tokenizer = get_tokenizer(meta)
    with usage_errors():  # the options against this model: its caches, its block_size, its tokenizer
        kind = resolve_cache_kind(model.config, cfg["cache"])
        start_ids = encode_start(tokenizer, cfg["start"])
        check_length(model.config, [len(start_ids)], cfg["max_new_tokens"], cfg["allow_past_block_size"], "--")
        check_pool(kind, len(start_ids), cfg)
    warn_past_block_size(model.config, len(start_ids), cfg["max_new_tokens"])
    if cfg["compile"]:
        compile_model(model)
    prompts = [start_ids] * cfg["num_samples"]
    generator = torch.Generator(device=cfg["device"]).manual_seed(cfg["seed"])
    stream = _Streamer(tokenizer)
    sys.stdout.write(tokenizer.decode(start_ids))
    engine = "eager" if kind == "none" else engine
    print(
        f"sampling {cfg['num_samples']} x {cfg['max_new_tokens']} tokens, cache={kind}, "
        f"attention={model.config.attention}, backend={model.attn_backend_for(cfg['device'])}, dtype={dtype}, "
        f"decode={'CUDA graphs' if engine == 'graphs' else 'eager loop'}{', compiled' if cfg['compile'] else ''}",
        file=sys.stderr,
    )
    try:
        outputs, stats = generate(
            model,
            prompts,
            kind,
            max_new_tokens=cfg["max_new_tokens"],
            temperature=cfg["temperature"],
            top_k=cfg["top_k"] or None,
            top_p=cfg["top_p"],
            eot_token=tokenizer.eot_token,
            generator=generator,
            page_size=cfg["page_size"],
            num_pages=cfg["num_pages"] or None,
            wait_for_pages=cfg["wait_for_pages"],
            allow_past_block_size=cfg["allow_past_block_size"],
            dtype=dtype,
            engine=engine,
            on_token=stream,
        )
    except KeyboardInterrupt as e:  # Ctrl-C or SIGTERM: the samples as far as they got, then the exit in cli
        write_samples(stream, tokenizer, start_ids, [stream.so_far.get(i, []) for i in range(len(prompts))])
        print(
            f"{'terminated (SIGTERM)' if isinstance(e, Terminated) else 'interrupted'}: the samples stop where "
            f"generation was ({sum(map(len, stream.so_far.values())):,} new tokens in all)",
            file=sys.stderr,
        )
        raise
    write_samples(stream, tokenizer, start_ids, outputs)
    dtype_name = str(dtype).removeprefix("torch.")
    summary = {"cache": kind, "attention": model.config.attention, "dtype": dtype_name, **stats.summary()}
    report(summary)
    if cfg["wandb_log"]:
        log_wandb(summary, train_cfg, cfg, path)
    return summary


def write_samples(stream: _Streamer, tokenizer, start_ids: list[int], outputs: list[list[int]]):
    """The rest of sample 0 (streamed so far), then every other sample after a line of dashes."""
    stream.flush()
    for out in outputs[1:]:
        sys.stdout.write("\n---------------\n" + tokenizer.decode(start_ids + out))
    sys.stdout.write("\n")
    sys.stdout.flush()


def resolve_engine(cfg: dict, explicit: bool) -> str:
    """--cuda_graphs: on by default on a CUDA device; a CPU has none, so only an explicit True fails there."""
    cuda = torch.device(cfg["device"]).type == "cuda"
    if cfg["cuda_graphs"] and not cuda and explicit:
        raise ValueError(
            f"--cuda_graphs: got True with --device={cfg['device']}; valid: False on a CPU (CUDA graphs need a "
            "CUDA device), or --device=cuda"
        )
    return "graphs" if cuda and cfg["cuda_graphs"] else "eager"


def warn_past_block_size(config, prompt_len: int, max_new_tokens: int):
    """One line on stderr where a RoPE model is asked for positions past its block_size (check_length has refused
    what cannot run)."""
    last, limit = prompt_len + max_new_tokens - 1, config.block_size
    if last <= limit:
        return
    what = (
        f"the prompt alone ({prompt_len} tokens) is longer than block_size={limit}"
        if prompt_len > limit
        else f"prompt {prompt_len} + max_new_tokens {max_new_tokens} - 1 = {last} tokens > block_size={limit}"
    )
    print(f"warning: {what}: this RoPE model goes past the positions it was trained on", file=sys.stderr)


def report(summary: dict):
    mib = 1024**2
    print(
        f"prefill: {summary['prefill_tokens']} tokens, {summary['prefill_tokens_per_s']:.1f} tokens/s | "
        f"decode: {summary['decode_tokens']} tokens in {summary['decode_steps']} steps, "
        f"{summary['decode_tokens_per_s']:.1f} tokens/s",
        file=sys.stderr,
    )
    if summary["cache"] != "none":
        print(
            f"cache {summary['cache']}: {summary['cache_bytes_allocated'] / mib:.2f} MiB allocated, "
            f"peak {summary['cache_bytes_peak'] / mib:.2f} MiB in use, "
            f"{summary['cache_bytes_per_token']} bytes/token ({summary['dtype']})",
            file=sys.stderr,
        )


def log_wandb(summary: dict, train_cfg: dict, cfg: dict, path: str | None):
    """Log the decode statistics into the checkpoint's wandb project and group, so the variants compare on
    decoding too. Offline (never blocking) without credentials or network, as train.py does."""
    try:
        import wandb
    except ImportError:
        print("wandb_log: wandb is not installed (pip install wandb); skipped", file=sys.stderr)
        return
    from wandb_run import open_wandb_run

    run_name = train_cfg.get("wandb_run_name") or summary["attention"]
    # The run's files go beside the checkpoint's training run (GPT-2 from the hub: here), so that
    # `wandb sync out-*/wandb/offline-run-*` uploads both.
    checkpoint_dir = os.path.dirname(path) if path else "."
    kwargs = dict(
        project=train_cfg.get("wandb_project") or "attention-zoo",
        group=train_cfg.get("wandb_group") or None,
        job_type="sample",
        name=f"{run_name}-sample-{summary['cache']}",
        config={**cfg, "train": train_cfg},
        dir=os.environ.get("WANDB_DIR") or checkpoint_dir or ".",
    )
    run = open_wandb_run(wandb, kwargs, "the numbers above are not logged", log=lambda m: print(m, file=sys.stderr))
    if run is None:
        return
    numbers = {f"sample/{k}": v for k, v in summary.items() if isinstance(v, (int, float))}
    run.log(numbers)
    run.summary.update(numbers)
    run.finish()


class Terminated(KeyboardInterrupt):
    """SIGTERM, raised where Python raises KeyboardInterrupt for Ctrl-C, so that it ends a run as Ctrl-C does."""


@contextmanager
def sigterm_as_interrupt():
    """SIGTERM (`timeout`, `kill`, a job scheduler) stops sampling as Ctrl-C does: the samples so far are printed
    (train.py's stop_on_signal takes both signals alike too). Without it, Python dies of the signal, printing none."""
    if threading.current_thread() is not threading.main_thread():  # signal.signal works in the main thread only
        yield
        return

    def handler(signum, frame):
        raise Terminated

    previous = signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def _stdout_to_devnull():
    """Point stdout's file descriptor at devnull (Python's docs, "Note on SIGPIPE"): the buffered text left in
    sys.stdout then goes nowhere at exit instead of failing again with a second BrokenPipeError."""
    try:
        fd = sys.stdout.fileno()
    except (AttributeError, OSError, ValueError):  # not a file (a test's capture): nothing flushes at exit
        return
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, fd)
    os.close(devnull)


def cli(argv: list[str]) -> int:
    """The command line: its exit status (2: a usage error, 1: a failure with its message, 130: Ctrl-C, 143:
    SIGTERM, 141: stdout's reader gone)."""
    from configurator import help_text, wants_help

    if wants_help(argv, DEFAULTS):
        print(help_text(__doc__, DEFAULTS, __file__))
        return 0
    try:
        with sigterm_as_interrupt():
            main(argv)
    except BrokenPipeError:
        # `sample.py | head`: the reader took what it wanted. 141 (128 + SIGPIPE) is what a Unix tool killed by
        # SIGPIPE returns (`yes | head`), so PIPESTATUS and `set -o pipefail` see sample.py as they see any such
        # tool; 0 would claim every sample was written. No message: the reader closing is not an error to report.
        _stdout_to_devnull()
        return 128 + signal.SIGPIPE
    except ConfigError as e:  # a bad option or value: 2, as train.py's and argparse's, so `... || break` stops a loop
        print(f"error: {e}", file=sys.stderr)
        return 2
    except (ValueError, CacheFullError, OSError, ImportError) as e:  # a checkpoint, a pool, GPT-2 offline or absent
        print(f"error: {e}", file=sys.stderr)
        return 1
    except Terminated:  # main printed the samples so far; 143 = 128 + SIGTERM, what dying of the signal would give
        return 128 + signal.SIGTERM
    except KeyboardInterrupt:  # main printed the samples so far; 130, as a shell loop expects of Ctrl-C
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(cli(sys.argv[1:]))
