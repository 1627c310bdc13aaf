"""Sample from a trained model (or GPT-2) through a KV cache: prefill with the flash kernel, then one token per step
through the grouped, paged or MLA decode kernels.

    python sample.py --out_dir=out-gqa                                   # the checkpoint's natural cache
    python sample.py --out_dir=out-gqa --cache=paged --num_samples=8 --max_new_tokens=500
    python sample.py --out_dir=out-mla --cache=none                      # the reference: recompute everything
    python sample.py --init_from=gpt2 --start="FILE:prompt.txt" --temperature=0 > out.txt
    python sample.py --out_dir=out-tiny --device=cpu --max_new_tokens=50  # CPU: plain PyTorch attention
    python sample.py --out_dir out-gqa --cache paged                     # `--key value` works as `--key=value`

--cache: auto (grouped for MHA/GQA/MQA, mla for MLA), grouped, paged, mla, none. On an MLA model "paged" means the
paged latent cache (paged_mla, also accepted by name); grouped on an MLA model and mla on a GQA model are refused
at start with the valid choices. "none" recomputes the whole context each step with no cache.

The prompts (`--start`, one per sample) decode together as one batch; a sequence that emits the end-of-text
token or reaches --max_new_tokens finishes and gives its cache rows (its pages) back while the others go on. With
a paged cache, --num_pages limits the pool (0: enough for every sample at full length); a pool that cannot hold
every sample at full length fails at start, unless --wait_for_pages=True, which admits prompts only as pages free
up (each admitted sequence is guaranteed pages for its full length, so nothing is ever evicted). --num_pages and
--wait_for_pages with a contiguous cache, and any option out of its range, fail at start with the valid values.

Standard output gets the samples alone (the first one streamed as it is generated, then the others, separated by
a line of dashes), so `> out.txt` captures just the text; progress and statistics (prefill and decode tokens/s,
cache memory) go to standard error, and to the checkpoint's wandb project with --wandb_log=True.

Past block_size: a model with learned positions cannot go there, so prompt + max_new_tokens beyond block_size is
an error at start. A RoPE model may go on when asked (--allow_past_block_size=True: positions beyond what it was
trained on, whose quality is the user's risk); otherwise that is an error too. Nothing is ever cropped silently.
"""

from __future__ import annotations

import os
import sys

import torch

from cache import CacheFullError, check_page_size
from generate import (
    _available_bytes,
    check_length,
    check_sampling,
    generate,
    pages_needed,
    resolve_cache_kind,
)

DEFAULTS = dict(
    init_from="resume",  # "resume" (the checkpoint in out_dir), a checkpoint directory, or gpt2 / gpt2-medium / ...
    out_dir="out",
    cache="auto",  # auto | grouped | paged | mla | paged_mla | none
    start="\n",  # the prompt, or FILE:path to read it from a file
    num_samples=1,
    max_new_tokens=100,  # prompt + max_new_tokens - 1 must fit in block_size (see --allow_past_block_size)
    temperature=0.8,  # 0 = greedy
    top_k=200,  # 0 = off
    top_p=1.0,  # 1.0 = off
    seed=1337,
    page_size=16,
    num_pages=0,  # 0 = enough for every sample at full length
    wait_for_pages=False,
    allow_past_block_size=False,
    device="cuda" if torch.cuda.is_available() else "cpu",
    dtype="auto",  # auto (bfloat16 on a GPU that has it, else float32) | float32 | bfloat16 | float16
    compile=False,
    wandb_log=False,
)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
CACHE_CHOICES = ("auto", "grouped", "paged", "mla", "paged_mla", "none")


# ---------------------------------------------------------------------------------------------- choices


def check_options(cfg: dict):
    """Every option that needs no model, checked before anything is loaded or printed."""
    if cfg["cache"] not in CACHE_CHOICES:
        raise ValueError(f"--cache: got {cfg['cache']!r}; valid: {', '.join(CACHE_CHOICES)}")
    for key in ("num_samples", "max_new_tokens"):
        if cfg[key] < 1:
            raise ValueError(f"--{key}: got {cfg[key]}; valid: an int >= 1")
    check_host_memory(cfg["num_samples"], cfg["max_new_tokens"])
    check_sampling(cfg["temperature"], cfg["top_k"], cfg["top_p"])
    check_page_size(cfg["page_size"])
    if cfg["num_pages"] < 0:
        raise ValueError(f"--num_pages: got {cfg['num_pages']}; valid: 0 (enough for every sample) or an int >= 1")
    check_device(cfg["device"])
    resolve_dtype(cfg["dtype"], cfg["device"])


HOST_BYTES_PER_TOKEN = 40  # a generated token on the host: a Python int (28 bytes) and its list slot (8), rounded up


def check_host_memory(num_samples: int, max_new_tokens: int):
    """Every sample's tokens stay on the host until the end (to print them): so many samples that those alone
    exceed the host's available memory (with any cache, --cache=none too) are refused at start, not killed by the
    OS partway."""
    need, free = num_samples * max_new_tokens * HOST_BYTES_PER_TOKEN, _available_bytes(torch.device("cpu"))
    if free is not None and need > free:
        raise ValueError(
            f"--num_samples={num_samples} x --max_new_tokens={max_new_tokens}: the samples' tokens "
            f"need {need / 2**30:.1f} GiB of host memory ({HOST_BYTES_PER_TOKEN} bytes a token), but "
            f"{free / 2**30:.1f} GiB is available; valid: fewer samples or new tokens"
        )


def check_device(name: str):
    try:
        device = torch.device(name)
    except RuntimeError:
        device = None
    if device is None or device.type not in ("cpu", "cuda"):
        raise ValueError(f"--device: got {name!r}; valid: cpu, cuda, cuda:N")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"--device: got {name!r} but this torch sees no CUDA device; valid: cpu")
    if device.type == "cuda" and (device.index or 0) >= torch.cuda.device_count():
        raise ValueError(f"--device: got {name!r}; valid: cpu, cuda:0 .. cuda:{torch.cuda.device_count() - 1}")


def check_pool(kind: str, prompt_len: int, cfg: dict):
    """--num_pages and --wait_for_pages act on a paged cache only. A pool too small for one sample at full length,
    or (without waiting) for all the samples at once, could not finish: both fail here, at start."""
    if kind not in ("paged", "paged_mla"):
        if cfg["num_pages"] or cfg["wait_for_pages"]:
            raise ValueError(
                f"--num_pages={cfg['num_pages']} / --wait_for_pages={cfg['wait_for_pages']}: given with "
                f"--cache={kind}, which has no page pool; valid: --cache=paged, or 0 / False"
            )
        return
    if not cfg["num_pages"]:
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


def load_model(cfg: dict):
    """(model, tokenizer meta, checkpoint config) from --init_from: resume (out_dir), a directory, or gpt2*."""
    from model import GPT, GPT2_NAMES

    if cfg["init_from"] in GPT2_NAMES:
        from data import tiktoken_meta

        return GPT.from_pretrained(cfg["init_from"]), tiktoken_meta("gpt2"), {}
    from checkpoint import load_checkpoint, model_from_checkpoint

    directory = cfg["out_dir"] if cfg["init_from"] == "resume" else cfg["init_from"]
    if cfg["init_from"] != "resume" and not os.path.isdir(directory):
        raise ValueError(
            f"--init_from: got {cfg['init_from']!r}, which is not a directory; valid: 'resume' (the "
            "checkpoint in --out_dir), a directory holding best.pt or last.pt, or "
            f"{', '.join(GPT2_NAMES)}"
        )
    path = os.path.join(directory, "best.pt")
    if not os.path.isfile(path):
        path = os.path.join(directory, "last.pt")
    if not os.path.isfile(path):
        option = "--out_dir" if cfg["init_from"] == "resume" else "--init_from"
        raise ValueError(
            f"{option}: no checkpoint in {directory!r} (best.pt or last.pt; train.py writes them to its "
            f"out_dir); valid: {_checkpoint_dirs()}"
        )
    ckpt = load_checkpoint(path, map_location="cpu", required_keys=("model", "model_args", "tokenizer"))
    model = model_from_checkpoint(ckpt, path)
    print(f"loaded {path} (iter {ckpt.get('iter_num', '?')})", file=sys.stderr)
    return model, ckpt["tokenizer"], ckpt.get("config", {})


def _checkpoint_dirs() -> str:
    """The directories under the current one that hold a checkpoint, as --out_dir values, or what to do instead."""
    found = sorted(
        d
        for d in os.listdir(".")
        if os.path.isdir(d) and any(os.path.isfile(os.path.join(d, name)) for name in ("best.pt", "last.pt"))
    )
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


def resolve_dtype(name: str, device: str) -> torch.dtype:
    if name == "auto":
        cuda = torch.device(device).type == "cuda"
        return torch.bfloat16 if cuda and torch.cuda.is_bf16_supported() else torch.float32
    if name not in DTYPES:
        raise ValueError(f"--dtype: got {name!r}; valid: auto, {', '.join(DTYPES)}")
    return DTYPES[name]


class _Streamer:
    """Writes sample 0's text to stdout as it grows (decoding the whole list keeps multi-byte BPE pieces whole)."""

    def __init__(self, tokenizer, out=None):
        self.tok, self.out, self.ids, self.shown = tokenizer, out or sys.stdout, [], 0

    def __call__(self, i: int, token: int):
        if i != 0:
            return
        self.ids.append(token)
        text = self.tok.decode(self.ids)
        if text.endswith("\ufffd"):  # an incomplete UTF-8 sequence: wait for the rest of it
            return
        self.out.write(text[self.shown :])
        self.out.flush()
        self.shown = len(text)

    def flush(self):
        text = self.tok.decode(self.ids)
        self.out.write(text[self.shown :])
        self.shown = len(text)


def main(argv: list[str]) -> dict:
    from configurator import parse_config
    from data import get_tokenizer

    cfg = parse_config(DEFAULTS, argv)
    check_options(cfg)
    torch.manual_seed(cfg["seed"])
    dtype = resolve_dtype(cfg["dtype"], cfg["device"])
    model, meta, train_cfg = load_model(cfg)
    model.eval().to(cfg["device"], dtype)
    kind = resolve_cache_kind(model.config, cfg["cache"])  # fails at start with the valid choices
    if cfg["compile"]:
        model = _compiled(model)
    tokenizer = get_tokenizer(meta)
    start_ids = tokenizer.encode(read_start(cfg["start"]))
    prompts = [start_ids] * cfg["num_samples"]
    check_length(model.config, [len(start_ids)], cfg["max_new_tokens"], cfg["allow_past_block_size"])
    check_pool(kind, len(start_ids), cfg)
    generator = torch.Generator(device=cfg["device"]).manual_seed(cfg["seed"])
    stream = _Streamer(tokenizer)
    sys.stdout.write(tokenizer.decode(start_ids))
    print(
        f"sampling {cfg['num_samples']} x {cfg['max_new_tokens']} tokens, cache={kind}, "
        f"attention={model.config.attention}, backend={model.attn_backend_for(cfg['device'])}, dtype={dtype}",
        file=sys.stderr,
    )
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
        on_token=stream,
    )
    stream.flush()
    for out in outputs[1:]:
        sys.stdout.write("\n---------------\n" + tokenizer.decode(start_ids + out))
    sys.stdout.write("\n")
    sys.stdout.flush()
    summary = {"cache": kind, "attention": model.config.attention, **stats.summary()}
    report(summary)
    if cfg["wandb_log"]:
        log_wandb(summary, train_cfg, cfg)
    return summary


def _compiled(model):
    """torch.compile the per-layer blocks: the cache calls inside attention run eagerly (graph breaks), the
    projections, norms and MLP between them are compiled."""
    for block in model.transformer.h:
        block.mlp = torch.compile(block.mlp, dynamic=True)
    return model


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
            f"{summary['cache_bytes_per_token']} bytes/token",
            file=sys.stderr,
        )


def log_wandb(summary: dict, train_cfg: dict, cfg: dict):
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
    checkpoint_dir = cfg["out_dir"] if cfg["init_from"] == "resume" else cfg["init_from"]
    kwargs = dict(
        project=train_cfg.get("wandb_project") or "attention-zoo",
        group=train_cfg.get("wandb_group") or None,
        job_type="sample",
        name=f"{run_name}-sample-{summary['cache']}",
        config={**cfg, "train": train_cfg},
        dir=os.environ.get("WANDB_DIR") or (checkpoint_dir if os.path.isdir(checkpoint_dir) else "."),
    )
    run = open_wandb_run(wandb, kwargs, "the numbers above are not logged", log=lambda m: print(m, file=sys.stderr))
    if run is None:
        return
    numbers = {f"sample/{k}": v for k, v in summary.items() if isinstance(v, (int, float))}
    run.log(numbers)
    run.summary.update(numbers)
    run.finish()


if __name__ == "__main__":
    from configurator import help_text, wants_help

    if wants_help(sys.argv[1:], DEFAULTS):
        print(help_text(__doc__, DEFAULTS, __file__))
        sys.exit(0)
    try:
        main(sys.argv[1:])
    except (ValueError, CacheFullError, OSError) as e:  # bad options, lengths, checkpoints, pools, GPT-2 offline
        raise SystemExit(f"error: {e}") from None
