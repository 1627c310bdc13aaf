"""Compare training runs of the attention variants: one table, two plots, and optionally a wandb summary run.

    python compare.py out-mha out-gqa out-mqa out-mla      # these run directories (train.py's out_dir)
    python compare.py                                      # every directory here holding best.pt or last.pt
    python compare.py --format=markdown --plot=docs/compare.png
    python compare.py --decode=False --format=csv > runs.csv   # from the files alone, no model is run
    python compare.py --wandb_log=True                     # the table and plots into the runs' wandb group

The four designs at one size and token budget (train.py's defaults: a few CPU minutes each), then the table:
    for v in mha gqa mqa mla; do python train.py configs/$v.py || break; done
    python compare.py
The four designs over 3 seeds on one GPU (twelve runs, one after another), then one row per design:
    for s in 0 1 2; do for v in mha gqa mqa mla; do
        python train.py configs/$v.py --seed=$s --out_dir=out-$v-s$s || break 2
    done; done
    python compare.py out-*-s*

Run it from the repo root (as train.py and sample.py are; the run directories are found from the current folder).
Each run directory needs metrics.jsonl (a line per eval) and a checkpoint (best.pt, else last.pt). The table has a
row per run, from those files:
    attention         mha, gqa-kv<n_kv_head>, mqa, or mla-r<kv_lora_rank>
    params            model.num_params() (without a learned position table)
    tokens            training tokens seen at the last eval
    best / final val  the lowest val loss over the evals, and the last one
    KV B/token        KV-cache bytes one token costs over all layers, at the dtype the run trained in (named), as
                      model.GPT.kv_cache_bytes_per_token computes it and this script checks against the formula
                      (B = bytes a number: 2 for bfloat16 and float16, 4 for float32; head_dim = n_embd / n_head):
                          MHA  2 * n_layer * n_head * head_dim * B             (K and V of every head)
                          GQA  2 * n_layer * n_kv_head * head_dim * B
                          MQA  2 * n_layer * 1 * head_dim * B
                          MLA  n_layer * (kv_lora_rank + qk_rope_head_dim) * B  (the latent and the shared RoPE key)
    KV formula        that product with the run's numbers
    train tok/s, MFU  medians over the eval lines of metrics.jsonl (each holds the latest logged window); MFU is
                      n/a for a run trained on a CPU (no known peak)
    train peak GiB    the most GPU memory the run's tensors held while training (PyTorch's allocator; the largest
                      peak_memory_bytes of metrics.jsonl); n/a for a run trained on a CPU
    decode tok/s      greedy decode of a fixed 16-token prompt plus --decode_tokens new tokens at batch 1 and at
                      --decode_batch, through generate.generate and the model's natural cache, after a warm-up run
                      of the same size. On a GPU the checkpoint runs our Triton kernels at the run's training dtype;
                      on a CPU the plain PyTorch attention (attn_backend=torch) in float32, and the table says so.
Runs that differ only in seed (same attention, dataset, size, token budget, start and every other training setting)
share one row: each number is the mean ± the sample standard deviation over them, and n counts them. Rows that
differ in dataset, size, token budget, training dtype, device or start (train.py's init_from: a run fine-tuned from
another's model), or runs that stopped before their token budget, are marked with * and a line under the table
says what differs.

The plots (compare.png, `--plot`; needs matplotlib: pip install -e ".[plot]") are val loss against training tokens
for every run on one chart, and best val loss against KV-cache bytes per token (the Pareto view: lower left is
better). Progress and notes go to standard error, the table alone to standard output. Exit status: 2 for a bad
option or value, 1 for runs that cannot be read, 130 on Ctrl-C (as train.py's).
"""

from __future__ import annotations

import csv
import io
import json
import math
import os
import statistics
import sys
from collections import Counter
from dataclasses import dataclass, field

import torch

from checkpoint import CheckpointError, first_line, load_checkpoint, model_from_checkpoint, run_checkpoints
from configurator import ConfigError, help_text, parse_config, wants_help
from model import ATTENTIONS
from train_step import PTDTYPES

DEFAULTS = dict(
    # output
    format="table",  # table (aligned plain text) | markdown | csv | json
    plot="compare.png",  # the plots' PNG file; "" = no plots (they need matplotlib: pip install -e ".[plot]")
    # decode speed, measured on each run's checkpoint
    decode=True,  # False: the table from the files alone, no model is run
    decode_batch=16,  # the larger batch, beside batch 1
    decode_tokens=32,  # new tokens per sequence (greedy) after the 16-token prompt
    device="auto",  # auto (cuda if available, else cpu) | cpu | cuda | cuda:N
    # wandb
    wandb_log=False,  # the table and plots as a summary run (job_type "compare") in the runs' project and group
    wandb_project="",  # "": the runs' project
    wandb_group="",  # "": the runs' group
)

FORMATS = ("table", "markdown", "csv", "json")
PROMPT_LEN = 16
# Settings that do not change what a run learns (where it ran and wrote, how often it printed): runs equal in
# everything else but the seed share a row. init_from counts: a run started from another run's model is another
# experiment (checkpoints record where a resumed run began, not "resume").
NOT_THE_EXPERIMENT = {
    "seed",
    "out_dir",
    "data_dir",
    "overwrite",
    "eval_only",
    "log_interval",
    "device",
    "backend",
    "compile",
    "cuda_graphs",
    "attn_backend",
    "wandb_log",
    "wandb_project",
    "wandb_run_name",
    "wandb_group",
}
# (field, name in the note): a row whose value differs from the others' is marked.
COMPARED = (
    ("dataset", "dataset"),
    ("size", "size"),
    ("token_budget", "token budget"),
    ("kv_dtype", "training dtype"),
    ("trained_on", "trained on"),
    ("init_from", "started from"),
)


class CompareError(ValueError):
    """A run directory that cannot be compared (missing, no checkpoint or metrics, corrupt) or a bad option."""


def note(message: str) -> None:
    print(message, file=sys.stderr)


# --------------------------------------------------------------------------------------------- arguments


def split_argv(argv: list[str]) -> tuple[list[str], list[str]]:
    """(run directories, config overrides): existing directories are runs; `--key=value`, `--key value` and a bool
    `--key` alone are options (parse_config reads them)."""
    dirs, overrides = [], []
    i = 0
    while i < len(argv):
        arg = argv[i]
        i += 1
        if arg.startswith("--"):
            overrides.append(arg)
            key = arg[2:]
            takes_next = key in DEFAULTS and "=" not in arg and i < len(argv) and not argv[i].startswith("--")
            if takes_next and (not isinstance(DEFAULTS[key], bool) or argv[i] in ("True", "False")):
                overrides.append(argv[i])
                i += 1
        elif os.path.isdir(arg):
            dirs.append(arg)
        else:
            what = "a file, not a directory" if os.path.exists(arg) else "no such directory"
            raise CompareError(
                f"{arg!r}: {what}; valid: run directories (train.py's out_dir, holding metrics.jsonl and best.pt "
                f"or last.pt{_found_here()}) and options --key=value ({', '.join(DEFAULTS)})"
            )
    return dirs, overrides


def check_options(cfg: dict) -> str:
    """Every option that needs no run, checked before anything is loaded; returns the decode device."""
    if cfg["format"] not in FORMATS:
        raise ConfigError(f"--format: got {cfg['format']!r}; valid: {', '.join(FORMATS)}")
    if cfg["decode_batch"] < 2:
        raise ConfigError(f"--decode_batch: got {cfg['decode_batch']}; valid: an int >= 2 (batch 1 is always run)")
    if cfg["decode_tokens"] < 2:
        raise ConfigError(
            f"--decode_tokens: got {cfg['decode_tokens']}; valid: an int >= 2 (the first new token comes from the "
            "prefill, the others are the decode steps timed)"
        )
    name = cfg["device"]
    if name == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    cuda = name == "cuda" or (name.startswith("cuda:") and name[5:].isdigit())
    if name != "cpu" and not cuda:
        raise ConfigError(f"--device: got {name!r}; valid: auto, cpu, cuda, cuda:N")
    if cuda and not (torch.cuda.is_available() and int(name[5:] or 0) < torch.cuda.device_count()):
        raise ConfigError(f"--device: got {name!r}, but {torch.cuda.device_count()} CUDA GPUs are visible; valid: cpu")
    return name


# ----------------------------------------------------------------------------------------------- one run


@dataclass
class Run:
    """One run directory, read: what its table row, plots and decode measurement need."""

    directory: str
    model: torch.nn.Module  # on the CPU, float32, attention backend for the decode device
    config: dict  # the checkpoint's train config
    attention: str
    params: int
    tokens: int
    val_loss_best: float
    val_loss_final: float
    kv_bytes_per_token: int
    kv_dtype: str
    kv_formula: str
    train_tokens_per_s: float | None
    mfu: float | None
    train_peak_bytes: int | None
    dataset: str
    seed: int | None
    size: str
    token_budget: int
    trained_on: str
    init_from: str  # scratch, a GPT-2 name, or the run or checkpoint it started from
    curve: list[tuple[int, float]]  # (tokens seen, val loss) per eval
    decode: dict[int, float] = field(default_factory=dict)  # batch -> decode tokens/s

    @property
    def name(self) -> str:
        return os.path.basename(os.path.normpath(self.directory)) or self.directory


def load_run(directory: str, attn_backend: str = "torch") -> Run:
    """Read a run directory (checkpoint and metrics.jsonl); CompareError naming it when it cannot be compared."""
    ckpt, model = _read_checkpoint(directory, attn_backend)
    lines = _read_metrics(directory)
    cfg, last = ckpt["config"], lines[-1]
    try:
        tokens_per_iter = cfg["gradient_accumulation_steps"] * cfg["batch_size"] * cfg["block_size"]
        curve = [(int(line.get("tokens", line["iter"] * tokens_per_iter)), float(line["val_loss"])) for line in lines]
        kv_dtype = last.get("kv_cache_dtype", cfg["dtype"])
        token_budget = int(last.get("token_budget", cfg["max_iters"] * tokens_per_iter))
        dataset = last.get("dataset", cfg["dataset"])
    except (KeyError, TypeError, ValueError) as e:
        raise CompareError(
            f"run directory {directory!r}: its metrics.jsonl and checkpoint config lack what the table needs "
            f"({type(e).__name__}: {first_line(e)}); valid: a run directory written by train.py"
        ) from None
    if kv_dtype not in PTDTYPES:
        raise CompareError(
            f"run directory {directory!r}: training dtype {kv_dtype!r}; valid: {', '.join(PTDTYPES)} (train.py saves "
            "the dtype it resolved)"
        )
    kv_bytes = model.kv_cache_bytes_per_token(PTDTYPES[kv_dtype])
    formula_bytes, formula = kv_formula(model.config, PTDTYPES[kv_dtype])
    if kv_bytes != formula_bytes:
        raise CompareError(
            f"run directory {directory!r}: model.py gives {kv_bytes} KV-cache bytes per token, the formula "
            f"{formula} gives {formula_bytes}; one of them is wrong for attention={model.config.attention!r}"
        )
    mc = model.config
    losses = [loss for _, loss in curve]
    return Run(
        directory=directory,
        model=model,
        config=cfg,
        attention=mc.label,
        params=int(last.get("params", model.num_params())),
        tokens=curve[-1][0],
        val_loss_best=min(losses),
        val_loss_final=losses[-1],
        kv_bytes_per_token=kv_bytes,
        kv_dtype=kv_dtype,
        kv_formula=formula,
        train_tokens_per_s=_median(line.get("tokens_per_sec") for line in lines),
        mfu=_median(line.get("mfu") for line in lines),
        train_peak_bytes=_largest(line.get("peak_memory_bytes") for line in lines),
        dataset=dataset,
        seed=last.get("seed", cfg.get("seed")),
        size=last.get("size", f"L{mc.n_layer}-E{mc.n_embd}-H{mc.n_head}-T{mc.block_size}"),
        token_budget=token_budget,
        trained_on=str(cfg.get("device", "?")).split(":")[0],
        init_from=str(cfg.get("init_from", "scratch")),
        curve=curve,
    )


def _read_checkpoint(directory: str, attn_backend: str):
    """(checkpoint, model) of best.pt, else last.pt; a damaged best.pt beside a good last.pt is noted."""
    present = run_checkpoints(directory)
    if not present:
        raise CompareError(
            f"run directory {directory!r}: no checkpoint (best.pt or last.pt); valid: a directory train.py wrote"
            f"{_found_here()}"
        )
    errors = []
    for path in present:
        try:
            ckpt = load_checkpoint(path, map_location="cpu", required_keys=("model", "model_args", "config"))
            model = model_from_checkpoint(ckpt, path, attn_backend=attn_backend, dropout=0.0)
        except CheckpointError as e:
            errors.append(str(e))
            continue
        if errors:
            note(f"note: {errors[0]}; using {path}")
        return ckpt, model.eval()
    raise CompareError(f"run directory {directory!r}: {'; and '.join(errors)}")


def _read_metrics(directory: str) -> list[dict]:
    """The eval lines of metrics.jsonl. A last line cut short (a run killed mid-write) is skipped with a note."""
    path = os.path.join(directory, "metrics.jsonl")
    if not os.path.isfile(path):
        raise CompareError(
            f"run directory {directory!r}: no metrics.jsonl (train.py appends a line at every eval, the first at "
            "iteration 0); valid: a directory train.py wrote"
        )
    with open(path, encoding="utf-8", errors="replace") as f:
        text = f.read()
    raw = text.splitlines()
    lines = []
    for number, line in enumerate(raw, 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
            if not isinstance(record, dict) or not isinstance(record.get("val_loss"), (int, float)):
                raise ValueError("no val_loss number")
            if not isinstance(record.get("iter"), int) and "tokens" not in record:
                raise ValueError("no iter or tokens")
        except ValueError as e:
            if number == len(raw) and not text.endswith("\n") and lines:
                note(f"note: {path}: its last line is incomplete (a run killed while writing it); skipped")
                break
            raise CompareError(
                f"{path}: line {number} is not an eval record ({first_line(e)}); valid: the JSON lines train.py "
                "writes (iter, val_loss, ...)"
            ) from None
        lines.append(record)
    if not lines:
        raise CompareError(f"{path}: no eval lines yet (the first is written at iteration 0)")
    return lines


def _numbers(values) -> list[float]:
    return [v for v in values if isinstance(v, (int, float)) and math.isfinite(v)]


def _median(values) -> float | None:
    values = _numbers(values)
    return statistics.median(values) if values else None


def _largest(values) -> float | None:
    # a resumed run starts the allocator's peak again, so the run's peak is the largest of its lines'
    values = _numbers(values)
    return max(values) if values else None


def kv_formula(config, dtype: torch.dtype) -> tuple[int, str]:
    """(bytes, the product written out): the KV-cache bytes per token that the module docstring's formulas give."""
    size = torch.empty((), dtype=dtype).element_size()
    L = config.n_layer
    if config.attention == "mla":
        r, rope = config.kv_lora_rank, config.qk_rope_head_dim
        return L * (r + rope) * size, f"{L}*({r}+{rope})*{size}"
    kv = {"mha": config.n_head, "mqa": 1}.get(config.attention, config.n_kv_head)
    head_dim = config.n_embd // config.n_head
    return 2 * L * kv * head_dim * size, f"2*{L}*{kv}*{head_dim}*{size}"


def discover() -> list[str]:
    """The directories directly under the current one that hold a checkpoint, sorted."""
    try:
        names = sorted(os.listdir("."))
    except OSError:
        return []
    return [d for d in names if not d.startswith(".") and os.path.isdir(d) and run_checkpoints(d)]


def _found_here() -> str:
    found = discover()
    if found:
        return "; here: " + ", ".join(found)
    return "; none here: train one with python train.py configs/gqa.py"


# -------------------------------------------------------------------------------------------- decode speed


def decode_backend(device: str) -> str:
    """The attention of the decode measurement: our Triton kernels on a GPU, the plain PyTorch path on a CPU (the
    kernels' CPU interpreter would time numpy, not the design)."""
    return "triton" if device.startswith("cuda") else "torch"


def decode_dtype(device: str, run: Run) -> torch.dtype:
    """The run's training dtype on a GPU; float32 on a CPU (where bfloat16 matmuls are emulated and slow)."""
    return PTDTYPES[run.kv_dtype] if device.startswith("cuda") else torch.float32


def check_decode_length(runs: list[Run], decode_tokens: int) -> None:
    """The prompt and the new tokens must fit every run's block size (generate refuses more)."""
    for run in runs:
        block = run.model.config.block_size
        if PROMPT_LEN + decode_tokens - 1 > block:
            raise ConfigError(
                f"--decode_tokens: got {decode_tokens}; {run.name} has block_size {block}, so with the "
                f"{PROMPT_LEN}-token prompt valid: 2 .. {block - PROMPT_LEN + 1}"
            )


def measure_decode(run: Run, batches: tuple[int, ...], decode_tokens: int, device: str) -> dict[int, float]:
    """Decode tokens/s of the run's checkpoint at each batch size: greedy, a fixed prompt, the model's natural
    cache; a warm-up run of the same size first (kernel compiles and autotuning, allocator growth)."""
    from generate import generate

    model = run.model.to(device, decode_dtype(device, run))
    vocab = model.config.vocab_size
    prompt = [(7 * i + 1) % vocab for i in range(PROMPT_LEN)]
    result = {}
    try:
        for batch in batches:
            prompts = [prompt] * batch
            for _ in range(2):  # the first is the warm-up
                _, stats = generate(model, prompts, "auto", max_new_tokens=decode_tokens, temperature=0.0)
            result[batch] = stats.summary()["decode_tokens_per_s"]
    finally:
        run.model = model.to("cpu", torch.float32)
        if device.startswith("cuda"):
            torch.cuda.empty_cache()
    return result


# ------------------------------------------------------------------------------------------------ rows


@dataclass
class Row:
    """A table row: one run, or runs that differ only in seed (their numbers as mean and spread)."""

    runs: list[Run]
    label: str
    flags: list[str] = field(default_factory=list)

    @property
    def first(self) -> Run:
        """The first run: what all of them share (attention, size, KV bytes, ...) is read from it."""
        return self.runs[0]

    def values(self, key) -> list:
        return [_get(run, key) for run in self.runs]

    def mean(self, key) -> float | None:
        values = self.values(key)
        if any(v is None for v in values):
            return None
        return values[0] if len(values) == 1 else statistics.fmean(values)

    def std(self, key) -> float | None:
        """The sample standard deviation over the runs (None for one run)."""
        values = self.values(key)
        if len(values) < 2 or any(v is None for v in values):
            return None
        return statistics.stdev(values)


def _get(run: Run, key: str):
    if key.startswith("decode_b"):
        return run.decode.get(int(key[len("decode_b") :]))
    return getattr(run, key)


def group_rows(runs: list[Run]) -> list[Row]:
    """One row per set of runs that differ only in seed, in the order of each set's first run. Runs that do not
    differ at all (the same seed too: a rerun, another code version) keep rows of their own."""
    groups: list[tuple[str, list[Run]]] = []
    for run in runs:
        key = repr(
            (
                sorted((k, repr(v)) for k, v in run.config.items() if k not in NOT_THE_EXPERIMENT),
                run.attention,
                run.size,
                run.dataset,
                run.token_budget,
                run.kv_dtype,
            )
        )
        group = next((g for k, g in groups if k == key and run.seed not in {r.seed for r in g}), None)
        if group is None:
            groups.append((key, [run]))
        else:
            group.append(run)
    return [Row(members, _group_label([r.name for r in members])) for _, members in groups]


def _group_label(names: list[str]) -> str:
    """out-mha-s0, out-mha-s1 -> out-mha-s{0,1}; a single name as it is."""
    if len(names) == 1:
        return names[0]
    prefix = os.path.commonprefix(names)
    return f"{prefix}{{{','.join(n[len(prefix) :] for n in names)}}}"


def flag_rows(rows: list[Row]) -> None:
    """Mark each row whose dataset, size, token budget, dtype, device or start differs from the others', or whose runs
    stopped before their token budget (Row.flags: what differs, in words)."""
    for key, name in COMPARED:
        values = [getattr(row.first, key) for row in rows]
        common, count = Counter(values).most_common(1)[0]
        if count > len(rows) / 2:
            who = "most runs have"
        else:  # no majority: the rows that differ from the first
            common, who = values[0], "the first row has"
        for row, value in zip(rows, values):
            if value != common:
                row.flags.append(f"{name} {_show(key, value)} where {who} {_show(key, common)}")
    for row in rows:
        short = [run for run in row.runs if run.tokens < run.token_budget]
        if short:
            row.flags.append(
                f"stopped at {_tokens(short[0].tokens)} of its {_tokens(short[0].token_budget)}-token budget "
                "(interrupted or still training)"
            )


def _show(key: str, value) -> str:
    return _tokens(value) if key == "token_budget" else str(value)


# ----------------------------------------------------------------------------------------------- output


def columns(batch: int) -> list[tuple[str, str]]:
    """(key, header) of the table's columns."""
    return [
        ("label", "run"),
        ("n", "n"),
        ("attention", "attention"),
        ("params", "params"),
        ("tokens", "tokens"),
        ("val_loss_best", "best val"),
        ("val_loss_final", "final val"),
        ("kv_bytes_per_token", "KV B/token"),
        ("kv_formula", "KV formula"),
        ("train_tokens_per_s", "train tok/s"),
        ("mfu", "MFU"),
        ("train_peak_bytes", "train peak GiB"),
        ("decode_b1", "decode tok/s b1"),
        (f"decode_b{batch}", f"decode tok/s b{batch}"),
    ]


STATS = ("tokens", "val_loss_best", "val_loss_final", "train_tokens_per_s", "mfu", "train_peak_bytes")


def cell(row: Row, key: str) -> str:
    """A row's value as the text table shows it (mean ± std for a group of seeds)."""
    if key == "label":
        return row.label + ("*" if row.flags else "")
    if key == "n":
        return str(len(row.runs))
    if key == "params":
        return _millions(row.first.params)
    if key == "kv_bytes_per_token":
        return f"{row.first.kv_bytes_per_token:,} ({row.first.kv_dtype})"
    if key in ("attention", "kv_formula"):
        return getattr(row.first, key)
    show = {
        "tokens": _tokens,
        "val_loss_best": lambda v: f"{v:.4f}",
        "val_loss_final": lambda v: f"{v:.4f}",
        "mfu": lambda v: f"{100 * v:.1f}%",
        "train_peak_bytes": lambda v: f"{v / 2**30:.2f}",
    }.get(key, lambda v: f"{v:,.0f}")
    mean, std = row.mean(key), row.std(key)
    if mean is None:
        return "n/a" if key in ("mfu", "train_peak_bytes") else "-"
    if std is None or (key == "tokens" and std == 0):
        return show(mean)
    return f"{show(mean)} ± {show(std)}"


def _millions(n: float) -> str:
    return f"{n / 1e6:.2f}M"


def _tokens(n: float) -> str:
    return f"{n / 1e6:.2f}M" if n >= 1e5 else f"{n:,.0f}"


def records(rows: list[Row], batch: int) -> list[dict]:
    """Rows as plain numbers (csv, json, wandb): mean and sample std (None for a single run) of each measurement."""
    out = []
    for row in rows:
        rec = dict(
            run=row.label,
            runs=[run.directory for run in row.runs],
            n=len(row.runs),
            seeds=[run.seed for run in row.runs],
            attention=row.first.attention,
            params=row.first.params,
            kv_bytes_per_token=row.first.kv_bytes_per_token,
            kv_dtype=row.first.kv_dtype,
            kv_formula=row.first.kv_formula,
            dataset=row.first.dataset,
            size=row.first.size,
            token_budget=row.first.token_budget,
            trained_on=row.first.trained_on,
        )
        for key in (*STATS, "decode_b1", f"decode_b{batch}"):
            name = key.replace("decode_b", "decode_tokens_per_s_b")
            rec[name], rec[f"{name}_std"] = row.mean(key), row.std(key)
        rec["flags"] = row.flags
        out.append(rec)
    return out


def footer(rows: list[Row], cfg: dict, device: str) -> list[str]:
    lines = [
        "KV B/token: KV-cache bytes per token over all layers at the run's training dtype; KV formula: "
        "2*n_layer*n_kv_head*head_dim*bytes (MHA/GQA/MQA), n_layer*(kv_lora_rank+qk_rope_head_dim)*bytes (MLA)",
        "train tok/s, MFU: medians over the eval lines of metrics.jsonl (MFU n/a: trained on a CPU); train peak "
        "GiB: the most GPU memory the run's tensors held while training (n/a: trained on a CPU)",
    ]
    if cfg["decode"]:
        where = (
            f"on {device} through our Triton kernels (generate's default engine: CUDA graphs) at each run's "
            "training dtype"
            if device.startswith("cuda")
            else f"on {device} with the plain PyTorch attention (attn_backend=torch) in float32, not our GPU kernels"
        )
        lines.append(
            f"decode tok/s: greedy, a {PROMPT_LEN}-token prompt + {cfg['decode_tokens']} new tokens at batch 1 and "
            f"{cfg['decode_batch']}, after a warm-up, {where}"
        )
    else:
        lines.append("decode tok/s: not measured (--decode=False)")
    if any(len(row.runs) > 1 for row in rows):
        lines.append("n > 1: runs that differ only in seed; mean ± sample standard deviation over them")
    lines += [f"* {row.label}: {'; '.join(row.flags)}" for row in rows if row.flags]
    return lines


def render(rows: list[Row], cfg: dict, device: str) -> str:
    """The table in --format, with its notes (table, markdown) or without them (csv; json carries them)."""
    batch = cfg["decode_batch"]
    cols = columns(batch)
    if cfg["format"] == "json":
        notes = footer(rows, cfg, device)
        return json.dumps(dict(rows=records(rows, batch), notes=notes), indent=2)
    if cfg["format"] == "csv":
        recs = records(rows, batch)
        buf = io.StringIO()
        writer = csv.DictWriter(buf, fieldnames=list(recs[0]), lineterminator="\n")
        writer.writeheader()
        for rec in recs:
            writer.writerow({k: " ".join(map(str, v)) if isinstance(v, list) else v for k, v in rec.items()})
        return buf.getvalue().rstrip("\n")
    cells = [[cell(row, key) for key, _ in cols] for row in rows]
    headers = [header for _, header in cols]
    left = {"label", "attention", "kv_formula"}
    notes = footer(rows, cfg, device)
    if cfg["format"] == "markdown":  # `*` is emphasis there, even inside a word: formulas as code, marks escaped
        formula = [key for key, _ in cols].index("kv_formula")
        cells = [[f"`{v}`" if i == formula else v.replace("*", "\\*") for i, v in enumerate(r)] for r in cells]
        align = ["---" if key in left else "---:" for key, _ in cols]
        lines = ["| " + " | ".join(r) + " |" for r in (headers, align, *cells)]
        return "\n".join(lines + [""] + ["- " + n.replace("*", "\\*") for n in notes])
    widths = [max(len(r[i]) for r in (headers, *cells)) for i in range(len(cols))]

    def line(values):
        return "  ".join(
            v.ljust(w) if key in left else v.rjust(w) for v, w, (key, _) in zip(values, widths, cols)
        ).rstrip()

    return "\n".join([line(headers), "  ".join("-" * w for w in widths), *map(line, cells), "", *notes])


def plot(rows: list[Row], path: str) -> bool:
    """Val loss against tokens for every run, and best val loss against KV-cache bytes per token, into `path`
    (PNG). False, with a note saying how to get plots, where matplotlib is not installed."""
    try:
        from matplotlib.figure import Figure  # no pyplot: no global backend state
        from matplotlib.ticker import FuncFormatter
    except ImportError:
        note('plot: matplotlib is not installed, so no plots; pip install -e ".[plot]" (or matplotlib) for them')
        return False
    fig = Figure(figsize=(11, 4.2), layout="constrained")
    curves, pareto = fig.subplots(1, 2)
    colors = [f"C{i % 10}" for i in range(len(rows))]
    for row, color in zip(rows, colors):
        for i, run in enumerate(row.runs):
            tokens, losses = zip(*run.curve)
            label = f"{row.label} ({row.first.attention})" if i == 0 else None
            curves.plot(tokens, losses, color=color, alpha=1.0 if len(row.runs) == 1 else 0.6, lw=1.4, label=label)
        std = row.std("val_loss_best")
        pareto.errorbar(
            row.first.kv_bytes_per_token, row.mean("val_loss_best"), yerr=std, fmt="o", color=color, capsize=3, ms=7
        )
        at = (row.first.kv_bytes_per_token, row.mean("val_loss_best"))
        pareto.annotate(row.first.attention, at, textcoords="offset points", xytext=(6, 4), fontsize=9, color=color)
    curves.set(xlabel="training tokens", ylabel="val loss", title="val loss during training")
    curves.grid(alpha=0.3)
    curves.legend(fontsize=8)
    dtypes = sorted({row.first.kv_dtype for row in rows})
    pareto.set_xscale("log", base=2)
    pareto.xaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
    pareto.set(
        xlabel=f"KV-cache bytes per token ({', '.join(dtypes)})",
        ylabel="best val loss" + (" (mean ± std over seeds)" if any(len(r.runs) > 1 for r in rows) else ""),
        title="quality against KV cache (lower left is better)",
    )
    pareto.grid(alpha=0.3, which="both")
    pareto.margins(x=0.15, y=0.15)
    directory = os.path.dirname(os.path.abspath(path))
    try:
        os.makedirs(directory, exist_ok=True)
        fig.savefig(path, dpi=90)
    except (OSError, ValueError) as e:  # an unwritable place, or a name whose extension is no image format
        raise CompareError(f"--plot: cannot write {path!r} ({first_line(e)}); valid: a writable .png path, or ''")
    return True


def log_wandb(rows: list[Row], cfg: dict, device: str, plot_path: str | None) -> None:
    """The table (wandb.Table) and the plots (wandb.Image) as one run of job_type "compare" in the runs' project and
    group; offline (never blocking) without credentials or network, as train.py's runs."""
    try:
        import wandb
    except ImportError:
        note("wandb_log: wandb is not installed (pip install wandb); skipped")
        return
    from wandb_run import open_wandb_run

    runs = [run for row in rows for run in row.runs]

    def common(key: str, given: str, fallback: str) -> str:
        if given:
            return given
        values = Counter(run.config.get(key) or fallback for run in runs)
        if len(values) > 1:
            note(
                f"wandb_log: the runs are in several {key.split('_')[1]}s ({', '.join(values)}); using the most common"
            )
        return values.most_common(1)[0][0]

    recs = records(rows, cfg["decode_batch"])
    kwargs = dict(
        project=common("wandb_project", cfg["wandb_project"], "attention-zoo"),
        group=common("wandb_group", cfg["wandb_group"], "compare"),
        name="compare",
        job_type="compare",
        config=dict(cfg, runs=[run.directory for run in runs], decode_device=device),
        dir=os.environ.get("WANDB_DIR") or ".",
    )
    run = open_wandb_run(wandb, kwargs, "the comparison is not logged", log=note)
    if run is None:
        return
    names = list(recs[0])
    data = [[json.dumps(v) if isinstance(v, list) else v for v in rec.values()] for rec in recs]
    logged = {"comparison": wandb.Table(columns=names, data=data)}
    if plot_path:
        logged["plots"] = wandb.Image(plot_path)
    run.log(logged)
    run.finish()


# ------------------------------------------------------------------------------------------------- main


def load_runs(dirs: list[str], attn_backend: str) -> list[Run]:
    """The runs named, or with none every run directory here (those that cannot be read skipped with a note)."""
    if dirs:  # a run named twice (out-gqa and ./out-gqa/) is one row, not two
        unique: dict[str, str] = {}
        for d in dirs:
            unique.setdefault(os.path.realpath(d), d)
        return [load_run(d, attn_backend) for d in unique.values()]
    runs = []
    for d in discover():
        try:
            runs.append(load_run(d, attn_backend))
        except CompareError as e:
            note(f"skipped {d}: {e}")
    if not runs:
        raise CompareError(
            "no run directories here (directories holding metrics.jsonl and best.pt or last.pt); train some first: "
            "for v in mha gqa mqa mla; do python train.py configs/$v.py || break; done"
        )
    order = {a: i for i, a in enumerate(ATTENTIONS)}  # discovered runs: model.py's order of the variants, then names
    return sorted(runs, key=lambda r: (order.get(r.model.config.attention, len(order)), r.name))


def main(argv: list[str]) -> dict:
    """Read the runs, measure decode speed, print the table, write the plots (and the wandb run); returns
    {"rows": the records, "text": what was printed, "plot": the PNG's path or None}."""
    dirs, overrides = split_argv(argv)
    cfg = parse_config(DEFAULTS, overrides)
    device = check_options(cfg)
    runs = load_runs(dirs, decode_backend(device))
    if cfg["decode"]:
        check_decode_length(runs, cfg["decode_tokens"])
        batches = (1, cfg["decode_batch"])
        for run in runs:
            note(f"decode: {run.name} ({run.attention}) at batch {' and '.join(map(str, batches))} on {device}")
            run.decode = measure_decode(run, batches, cfg["decode_tokens"], device)
    rows = group_rows(runs)
    flag_rows(rows)
    text = render(rows, cfg, device)
    print(text)
    if cfg["format"] == "csv":
        for line in footer(rows, cfg, device):
            note(line)
    plot_path = cfg["plot"] if cfg["plot"] and plot(rows, cfg["plot"]) else None
    if plot_path:
        note(f"plots: {plot_path}")
    if cfg["wandb_log"]:
        log_wandb(rows, cfg, device, plot_path)
    return dict(rows=records(rows, cfg["decode_batch"]), text=text, plot=plot_path)


if __name__ == "__main__":
    if wants_help(sys.argv[1:], DEFAULTS):
        print(help_text(__doc__, DEFAULTS, __file__, config_files=False))
        sys.exit(0)
    try:
        main(sys.argv[1:])
    except ConfigError as e:  # a usage error: 2, as train.py's and argparse's
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    except (CompareError, CheckpointError) as e:  # a message, not a traceback
        raise SystemExit(f"error: {e}") from None
    except KeyboardInterrupt:  # the runs are only read; 130, as a shell loop expects
        print("\nstopped (Ctrl-C)", file=sys.stderr)
        sys.exit(130)
