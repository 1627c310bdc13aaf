"""Train a GPT with MHA, GQA, MQA or MLA attention, from a laptop CPU to several GPUs (nanoGPT's train.py, kept flat).

A tiny run on the CPU (embedded dataset, prepared on first use, no network; a couple of minutes):
    python train.py
The four attention variants, same size and token budget (out-mha .. out-mla; add --wandb_log=True for one wandb
chart), then their table and plots (a variant already trained with the same config is kept, not trained again):
    for v in mha gqa mqa mla; do python train.py configs/$v.py || break; done
    python compare.py
A GPT-2-small-sized GQA model on one GPU, with the Triton kernels and torch.compile:
    python train.py configs/gpt2_small_gqa.py
    python train.py configs/gpt2_small_gqa.py --cuda_graphs=True   # each micro-step replayed from a CUDA graph
Stack a size file and a variant file to compare the KV cache at GPU scale (the size file first: the variant file
appends its name to the size file's out_dir, here out-kv-mla):
    python train.py configs/kv_h200.py configs/mla.py
Override anything (`--key=value` or `--key value`; they apply left to right), resume exactly, fine-tune GPT-2, or
start a new run from a run's model (its best.pt; the model's architecture, this run's data, schedule, block_size):
    python train.py configs/gqa.py --batch_size=32 --max_iters=200
    python train.py configs/gqa.py --init_from=resume    # continues out-gqa/last.pt where it stopped
    python train.py --init_from=gpt2 --dataset=tinystories --learning_rate=3e-5 --block_size=512 --compile=True
    python train.py configs/gqa.py --init_from=out-gqa --out_dir=out-gqa-ft --learning_rate=3e-4
One node with 8 GPUs (DDP over NCCL; `gradient_accumulation_steps` is global and is divided among the ranks):
    torchrun --standalone --nproc_per_node=8 train.py configs/gpt2_small_gqa.py
Two nodes of 8 GPUs (node 0 at 10.0.0.1; every node needs the prepared data; global rank 0 writes out_dir;
NCCL_IB_DISABLE=1 where there is no InfiniBand), on node 0 (and the same with --node_rank=1 on node 1):
    torchrun --nproc_per_node=8 --nnodes=2 --node_rank=0 --master_addr=10.0.0.1 --master_port=29500 \\
        train.py configs/gpt2_small_gqa.py
On CPUs, torchrun runs DDP over gloo; the micro-steps must divide among the ranks, so on a laptop:
    torchrun --standalone --nproc_per_node=2 train.py --gradient_accumulation_steps=2 --out_dir=out-ddp

Every eval appends a line to out_dir/metrics.jsonl (`tokens`: the training tokens so far, counted across resumes
that change the batch; on resume, a last line a crash cut short and the lines after the checkpoint are dropped, so
each iteration keeps one line) and writes out_dir/last.pt (and best.pt when val loss improves) atomically. An
out_dir that already holds this run, finished, with the same config and data directory is kept and the command
succeeds doing nothing (so a loop over the variant files trains only what is missing); one that holds another or
an unfinished run is refused before anything starts, with exit status 2 and what to do (resume it when its last.pt
is readable, pick another out_dir, or --overwrite=True). Ctrl-C (or SIGTERM) finishes the current iteration, saves
last.pt and exits with status 130 (143), so a shell loop over runs stops too, whatever became of stdout
(`| tee log`); a NaN/inf loss stops the run with a message and leaves the last good checkpoint untouched. `seed`
sets the initial weights, the data order and dropout; the eval batches are the same for every seed, so runs that
differ only in seed compare on the same data. The data order depends only on `seed` and the iteration, so
`--init_from=resume` reproduces an uninterrupted run exactly; on resume the model is the checkpoint's, and a model
setting it does not take is named. """

from __future__ import annotations

import json
import math
import os
import random
import signal
import sys
import textwrap
import time
import traceback
from contextlib import contextmanager
from dataclasses import asdict, dataclass, fields

import numpy as np
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from attention_kernels.flash import MAX_HEAD_DIM, MIN_HEAD_DIM
from checkpoint import (
    MODEL_KEYS_NEEDED,
    TRAIN_KEYS,
    CheckpointError,
    clean_state_dict,
    first_line,
    intact_checkpoint_beside,
    load_checkpoint,
    loads_with_keys,
    model_from_checkpoint,
    run_checkpoints,
    save_checkpoint,
)
from configurator import ConfigError, help_text, parse_config, wants_help
from data import DataError, dataset_dir, ensure_dataset
from model import GPT, GPT2_NAMES, Block, GPTConfig
from train_step import PTDTYPES, TrainStep, autocast_context, compile_model
from wandb_run import open_wandb_run

DEFAULTS = dict(
    # I/O
    out_dir="out",
    eval_interval=250,  # every this many iterations: eval, a metrics.jsonl line, last.pt (and best.pt)
    log_interval=10,  # progress line and NaN check (a device sync) every this many iterations
    eval_iters=20,  # batches per split per eval (always the same batches: curves are comparable)
    eval_only=False,  # evaluate the init_from model (resume, a run or checkpoint, GPT-2) once; no training
    init_from="scratch",  # "scratch", "resume" (out_dir/last.pt), a run dir or .pt (its model), a GPT-2 name or HF dir
    overwrite=False,  # a run that does not resume refuses an out_dir holding another run's files, unless True
    seed=1337,  # initial weights, data order and dropout (the eval batches are the same for every seed)
    # wandb (offline automatically without credentials or network)
    wandb_log=False,
    wandb_project="attention-zoo",
    wandb_run_name="",  # "": the attention variant ("gqa-kv2", "mla-r64")
    wandb_group="",  # runs of one comparison share a group (one chart); "": dataset and size ("pydoc-L4-E128-H8-T128")
    # data
    dataset="pydoc",  # data/<dataset>/ (see data/__init__.py); pydoc is embedded and prepared on first use
    data_dir="",  # "" = data/<dataset>
    gradient_accumulation_steps=1,  # micro-steps per iteration, over all ranks together
    batch_size=8,  # sequences per micro-step per process
    block_size=128,
    # model (the fields of model.GPTConfig)
    vocab_size=0,  # 0: the dataset's vocabulary (rounded up to a multiple of 64 when larger than 1024)
    n_layer=4,
    n_head=8,
    n_embd=128,
    dropout=0.0,
    bias=False,
    attention="mha",  # "mha", "gqa", "mqa" or "mla"
    n_kv_head=None,  # K/V heads for gqa (mha: n_head, mqa: 1, mla: n/a)
    kv_lora_rank=0,  # MLA latent width
    q_lora_rank=0,  # MLA query compression (0: none)
    qk_nope_head_dim=0,
    qk_rope_head_dim=0,
    v_head_dim=0,
    pos_embedding="rope",  # "rope" or "learned" (GPT-2)
    rope_theta=10000.0,
    attn_backend="auto",  # "triton" (our kernels), "torch" (reference), "auto": triton on CUDA, torch elsewhere
    # AdamW and the learning-rate schedule (linear warmup, cosine decay to min_lr)
    learning_rate=1e-3,
    max_iters=1500,
    weight_decay=0.1,
    beta1=0.9,
    beta2=0.99,
    grad_clip=1.0,  # 0: off
    decay_lr=True,
    warmup_iters=100,
    lr_decay_iters=0,  # 0: max_iters
    min_lr=1e-4,
    # system
    device="auto",  # "auto" (cuda if available, else cpu), "cpu", "cuda", "cuda:1"
    dtype="auto",  # "auto" (bfloat16 where the GPU has it, else float32), "float32", "bfloat16", "float16"
    compile=False,
    cuda_graphs=False,  # capture the training micro-step in a CUDA graph and replay it (one CUDA process)
    backend="auto",  # DDP backend: "auto" (nccl on CUDA, gloo on CPU), "nccl", "gloo"
)
MODEL_KEYS = [f.name for f in fields(GPTConfig)]
RUN_FILES = ("last.pt", "best.pt", "metrics.jsonl")  # what a run writes into out_dir
EVAL_SEED = 1338  # the eval batches: the same in every run, whatever its seed, so every run is measured alike
# What holds a distributed run's process groups (its DDP model, the stop flag's group), kept until the process ends:
# freeing a gloo group can deadlock (see the end of this file), so a torchrun process leaves by os._exit instead.
UNTIL_EXIT: list = []
INIT_NAMES = ("scratch", "resume", *GPT2_NAMES)  # init_from values that name no file


class NonFiniteLoss(RuntimeError):
    """The loss became NaN or inf: the run stops without writing a checkpoint."""


# ----------------------------------------------------------------------------------------------- setup helpers


@dataclass
class Dist:
    rank: int = 0
    local_rank: int = 0
    world_size: int = 1

    @property
    def master(self) -> bool:
        return self.rank == 0

    @property
    def ddp(self) -> bool:
        return self.world_size > 1


def launched_as_ranks() -> bool:
    """Whether torchrun started this process as one of several ranks (its environment says so)."""
    return "RANK" in os.environ and int(os.environ.get("WORLD_SIZE", "1")) > 1


def setup_distributed(config: dict) -> tuple[Dist, str]:
    """Read torchrun's environment, pick the device and join the process group; return (Dist, device)."""
    device = resolve_device(config["device"])
    if not launched_as_ranks():
        return Dist(), device
    d = Dist(int(os.environ["RANK"]), int(os.environ["LOCAL_RANK"]), int(os.environ["WORLD_SIZE"]))
    if device.startswith("cuda"):
        device = f"cuda:{d.local_rank}"
        torch.cuda.set_device(device)
    backend = config["backend"] if config["backend"] != "auto" else ("nccl" if device.startswith("cuda") else "gloo")
    dist.init_process_group(backend=backend)
    return d, device


def resolve_device(name: str) -> str:
    if name == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise ConfigError(f"device: got {name!r} but no CUDA GPU is visible; valid here: 'cpu' or 'auto'")
    if name.split(":")[0] not in ("cpu", "cuda"):
        mps = " (Apple's MPS is not supported: its batches, float64 sums and autocast would need paths of their own)"
        raise ConfigError(f"device: got {name!r}; valid: 'auto', 'cpu', 'cuda', 'cuda:N'{mps if 'mps' in name else ''}")
    if name.startswith("cuda:") and not (name[5:].isdigit() and int(name[5:]) < torch.cuda.device_count()):
        raise ConfigError(f"device: got {name!r}; valid here: 'cuda:0' .. 'cuda:{torch.cuda.device_count() - 1}'")
    return name


def resolve_dtype(name: str, device: str) -> str:
    if name == "auto":
        return "bfloat16" if device.startswith("cuda") and torch.cuda.is_bf16_supported() else "float32"
    if name not in PTDTYPES:
        raise ConfigError(f"dtype: got {name!r}; valid: 'auto', {', '.join(map(repr, PTDTYPES))}")
    return name


def check_config(config: dict, d: Dist) -> None:
    """Value checks the types alone cannot make, before anything heavy runs."""
    for key in (
        "batch_size",
        "block_size",
        "gradient_accumulation_steps",
        "eval_interval",
        "log_interval",
        "eval_iters",
    ):
        if config[key] < 1:
            raise ConfigError(f"{key}: got {config[key]}; valid: a positive int")
    if config["max_iters"] < 1:  # 0 would only evaluate the starting model, and leave a run dir with no checkpoint
        raise ConfigError(
            f"max_iters: got {config['max_iters']}; valid: an int >= 1 (--eval_only=True evaluates a model "
            "without training it)"
        )
    for key in ("warmup_iters", "lr_decay_iters", "learning_rate", "min_lr", "weight_decay", "grad_clip"):
        if not 0 <= config[key] < math.inf:  # also refuses NaN and inf (1e400 parses as inf)
            raise ConfigError(f"{key}: got {config[key]}; valid: a finite number >= 0")
    if config["decay_lr"] and config["min_lr"] > config["learning_rate"]:  # the "decay" would raise the rate
        raise ConfigError(f"min_lr: got {config['min_lr']}; valid: <= learning_rate ({config['learning_rate']})")
    # torch takes seeds in [-2**63, 2**64 - 1], but a negative one is another name for seed + 2**64 (two seeds
    # recorded for one run), and each rank seeds with seed + rank: non-negative int64s leave room for any rank.
    if not 0 <= config["seed"] <= 2**63 - 1:
        raise ConfigError(f"seed: got {config['seed']}; valid: an int in [0, 2**63 - 1]")
    if not 0 < config["rope_theta"] < math.inf:
        raise ConfigError(f"rope_theta: got {config['rope_theta']}; valid: a finite number > 0")
    for key in ("beta1", "beta2"):
        if not 0 <= config[key] < 1:
            raise ConfigError(f"{key}: got {config[key]}; valid: a number in [0, 1)")
    if config["backend"] not in ("auto", "nccl", "gloo"):
        raise ConfigError(f"backend: got {config['backend']!r}; valid: 'auto', 'nccl', 'gloo'")
    if config["cuda_graphs"] and d.ddp:
        raise ConfigError(
            f"cuda_graphs: got True with {d.world_size} processes; valid: True in a single process "
            "(DDP's gradient all-reduce is not captured here), else False"
        )
    if config["gradient_accumulation_steps"] % d.world_size:
        raise ConfigError(
            f"gradient_accumulation_steps: got {config['gradient_accumulation_steps']}; valid: a "
            f"multiple of the number of processes ({d.world_size}), since it is divided among them"
        )
    init = config["init_from"]
    valid_init = (
        f"valid: 'scratch', 'resume', a run directory (its best.pt, else last.pt) or checkpoint file that train.py "
        f"wrote, {', '.join(GPT2_NAMES)}, or a directory saved by GPT2LMHeadModel.save_pretrained"
    )
    named = init in INIT_NAMES  # a directory of the same name does not count
    if config["eval_only"] and init == "scratch":
        raise ConfigError(
            "eval_only: got True with --init_from=scratch, which would evaluate random weights; valid: "
            "--eval_only=True with --init_from=resume or a checkpoint (a run directory or .pt file, or GPT-2 weights)"
        )
    if not named and not os.path.exists(init):
        raise ConfigError(f"init_from: got {init!r}, which is not a file or directory; {valid_init}")
    if not named and os.path.isdir(init) and not run_checkpoints(init) and not os.path.isfile(f"{init}/config.json"):
        raise ConfigError(
            f"init_from: got {init!r}, a directory with no checkpoint (best.pt, last.pt) and no GPT-2 weights "
            f"(config.json); {valid_init}"
        )
    out_dir = config["out_dir"]
    if not out_dir or (os.path.exists(out_dir) and not os.path.isdir(out_dir)):
        raise ConfigError(
            f"out_dir: got {out_dir!r}{' (a file)' if out_dir else ''}; valid: a directory path (created if missing)"
        )
    if not named:  # recorded in checkpoints and compared across runs: out-gqa/, ./out-gqa and its absolute path agree
        config["init_from"] = init = one_spelling(init)
    source = init_checkpoint_path(init)
    if source is not None and os.path.realpath(os.path.dirname(os.path.abspath(source))) == os.path.realpath(out_dir):
        resume = "--init_from=resume to continue that run, or " if resumable(resume_path(config)) else ""
        raise ConfigError(
            f"init_from: got {init!r}, a checkpoint of the run in this out_dir ({out_dir!r}); valid: "
            f"{resume}another --out_dir for a new run from its model"
        )


def resumable(path: str) -> bool:
    """Whether --init_from=resume could start from this last.pt: it loads, with every key a resume reads. A refusal
    suggests resuming only then."""
    return loads_with_keys(path, TRAIN_KEYS)


def one_spelling(path: str) -> str:
    """The path of a file or directory as a run records it: relative to the working directory when inside it (as
    a user types it), else absolute; symlinks resolved, so each place has one spelling."""
    real = os.path.realpath(path)
    relative = os.path.relpath(real)
    return real if relative == os.pardir or relative.startswith(os.pardir + os.sep) else relative


def init_checkpoint_path(init: str) -> str | None:
    """The checkpoint that init_from names when it is one of train.py's: a file, or a run directory's best.pt
    (else last.pt). None for scratch, resume and GPT-2 (a name, or a directory of save_pretrained)."""
    if init in INIT_NAMES:
        return None
    if os.path.isfile(init):
        return init
    found = run_checkpoints(init) if os.path.isdir(init) else []
    return found[0] if found else None


# Keys that say where or how a run computes and logs, not what it trains: two configs that differ only in these
# describe the same run.
NOT_THE_RUN = (
    "out_dir",
    "init_from",
    "overwrite",
    "wandb_log",
    "wandb_project",
    "wandb_run_name",
    "wandb_group",
    "log_interval",
    "device",
    "compile",
    "cuda_graphs",
    "backend",
    "attn_backend",
)


def check_out_dir(config: dict, d: Dist, device: str) -> tuple[str, int] | None:
    """Before anything starts: None where out_dir is free for this run (or it resumes, or --overwrite=True);
    (message, its iteration) where out_dir holds this very run, finished (the caller keeps it and does nothing); a
    ConfigError naming what to do where it holds another run or an unfinished one. Rank 0 reads out_dir (the only
    rank that writes it) and tells the others."""
    outcome = [("free", None)]
    if d.master:
        try:
            outcome = [("kept", held_run(config, device))]
        except ConfigError as e:
            outcome = [("refused", str(e))]
    if d.ddp:
        dist.broadcast_object_list(outcome, src=0)
    kind, message = outcome[0]
    if kind == "refused":
        raise ConfigError(message)
    return message


def held_run(config: dict, device: str) -> tuple[str, int] | None:
    out_dir = config["out_dir"]
    held = [f for f in RUN_FILES if os.path.exists(os.path.join(out_dir, f))]
    if config["init_from"] == "resume" or not held or config["overwrite"]:
        return None
    elsewhere = "another --out_dir, or --overwrite=True to start over there (its checkpoints and metrics are deleted)"
    valid = f"valid: --init_from=resume to continue it, {elsewhere}"
    try:  # only the config and the iteration are read: mmap leaves the tensors on disk
        saved = torch.load(resume_path(config), map_location="cpu", mmap=True, weights_only=True)
        old, iter_num = dict(saved["config"]), int(saved["iter_num"])
        differ = config_differences(config, old, saved["model_args"], device)
    except Exception as e:  # no last.pt, or one this code cannot read: the generic refusal, with the reason
        reason = f"its last.pt cannot be read: {type(e).__name__}: {first_line(e)}"
        valid = valid if resumable(resume_path(config)) else f"valid: {elsewhere}"  # a resume would fail
        raise ConfigError(f"out_dir: {out_dir!r} already holds a run ({', '.join(held)}); {valid} ({reason})") from None
    if differ:
        raise ConfigError(
            f"out_dir: {out_dir!r} already holds a run ({', '.join(held)}); {valid}. That run differs from this "
            "one in " + ", ".join(f"{k} ({there!r} there, {here!r} here)" for k, (there, here) in differ.items())
        )
    if iter_num < config["max_iters"]:
        raise ConfigError(
            f"out_dir: {out_dir!r} already holds this run (same config), stopped at iteration {iter_num} of "
            f"{config['max_iters']}; valid: --init_from=resume to continue it, or --overwrite=True to start over"
        )
    message = (
        f"{out_dir} already holds this run, finished at iteration {iter_num} (same config): kept; "
        "--overwrite=True trains it again"
    )
    return message, iter_num


def config_differences(config: dict, old: dict, old_model_args: dict, device: str) -> dict:
    """The keys (outside NOT_THE_RUN) where this config, resolved as setup() resolves it, differs from a saved run's
    config: key -> (the saved run's value, this run's). A run started from a model (a checkpoint, GPT-2) has that
    model's architecture whatever the config says, so there the source itself is compared instead. data_dir is
    compared as the directory it selects ("" and data/<dataset> are one place)."""
    mine = dict(config, dtype=resolve_dtype(config["dtype"], device), data_dir=data_location(config))
    old = dict(old, data_dir=data_location(old))
    skip = set(NOT_THE_RUN)
    if config["init_from"] == "scratch":
        try:  # the model fields as the model resolves them (vocab_size 0: the dataset's, which the saved run has)
            mine.update(asdict(model_config(config, old_model_args["vocab_size"])))
        except ConfigError:  # settings that would not build a model: compared as written
            pass
    else:
        skip |= set(MODEL_KEYS) - {"block_size", "dropout"}
    differ = {k: (old.get(k), v) for k, v in mine.items() if k not in skip and old.get(k) != v}
    if old.get("init_from", "scratch") not in ("resume", config["init_from"]):  # a resumed run's source is unknown
        differ["init_from"] = (old.get("init_from", "scratch"), config["init_from"])
    return differ


def data_location(config: dict) -> str:
    """The dataset directory a config trains on (data_dir, else data/<dataset>), spelt as one_spelling spells it, so
    that two spellings of one directory compare equal."""
    return one_spelling(dataset_dir(str(config.get("dataset", "")), str(config.get("data_dir") or "")))


def model_config(config: dict, vocab_size: int) -> GPTConfig:
    """GPTConfig from the train config; vocab 0 means the dataset's (large vocabularies padded to 64 for speed)."""
    args = {k: config[k] for k in MODEL_KEYS if k in config}
    if not args["vocab_size"]:
        args["vocab_size"] = vocab_size if vocab_size <= 1024 else -(-vocab_size // 64) * 64
    if args["vocab_size"] < vocab_size:
        raise ConfigError(f"vocab_size: got {args['vocab_size']}; valid: 0 or at least the dataset's {vocab_size}")
    try:
        return GPTConfig(**args)
    except ValueError as e:  # GPTConfig names the field and its valid values
        raise ConfigError(f"model config: {e}") from None


def check_backend(model: GPT, device: str) -> None:
    """Where the model will run our Triton kernels, their limits as a config error before training starts, not a
    kernel's ValueError at the first step."""
    if model.attn_backend_for(device) != "triton":
        return
    if not device.startswith("cuda") and os.environ.get("TRITON_INTERPRET") != "1":
        raise ConfigError(
            f"attn_backend: got 'triton' on device {device!r}; valid: 'torch' or 'auto' there, or "
            "TRITON_INTERPRET=1 in the environment (Triton's CPU interpreter: slow, what the tests use)"
        )
    cfg = model.config
    for name, dim in (("query/key", cfg.qk_head_dim), ("value", cfg.v_dim)):
        if not MIN_HEAD_DIM <= dim <= MAX_HEAD_DIM:
            raise ConfigError(
                f"attn_backend: {cfg.attn_backend!r} runs the Triton kernels here, which take head dims "
                f"from {MIN_HEAD_DIM} to {MAX_HEAD_DIM}, and this model's {name} head dim is {dim}; "
                "valid: --attn_backend=torch, or a size whose head dims are in that range"
            )


def run_names(config: dict, mc: GPTConfig) -> tuple[str, str]:
    """The wandb group and run name, where the config leaves them empty: the group from the data and the size,
    which the four variant files leave alike (so their runs land on one chart), the name the model's variant, as
    compare.py labels its rows ("gqa-kv4", "mla-r256")."""
    group = config["wandb_group"] or f"{config['dataset']}-{size_name(config)}"
    return group, config["wandb_run_name"] or mc.label


def size_name(config: dict) -> str:
    """The model size as layers, width, heads and context ("L4-E128-H8-T128"): what runs must share to compare."""
    return f"L{config['n_layer']}-E{config['n_embd']}-H{config['n_head']}-T{config['block_size']}"


def tokens_per_iter(config: dict) -> int:
    """Training tokens of one iteration over all ranks (gradient_accumulation_steps is global)."""
    return config["gradient_accumulation_steps"] * config["batch_size"] * config["block_size"]


TRAIN_BYTES_PER_PARAM = 16  # fp32 weights, their gradients and AdamW's two moments


def check_model_fits(mc: GPTConfig, device: str) -> None:
    """A model whose weights alone would not fit is refused before it is built: built, it would take the host's
    memory until the kernel killed the process, with no message. Counted on the meta device (nothing allocated;
    the final norm left out): the host holds its fp32 weights while they are initialized, the device its weights,
    gradients and AdamW states; activations come on top, so this catches sizes off by orders of magnitude, not a
    batch a little large."""
    from generate import available_bytes

    with torch.device("meta"):  # one block, times n_layer: a million layers are not built to be counted
        n = mc.n_layer * sum(p.numel() for p in Block(mc, 0).parameters())
    positions = mc.block_size if mc.pos_embedding == "learned" else 0
    n += (mc.vocab_size + positions) * mc.n_embd  # the (tied) token embedding and the learned positions
    needs = [("the host", torch.device("cpu"), 4 * n)]
    if torch.device(device).type == "cuda":
        needs.append((device, torch.device(device), TRAIN_BYTES_PER_PARAM * n))
    for where, dev, need in needs:
        free = available_bytes(dev)
        if free is not None and need > free:
            raise ConfigError(
                f"model size: got {n:,} parameters (n_layer={mc.n_layer}, n_embd={mc.n_embd}, vocab_size="
                f"{mc.vocab_size}), which need {need / 2**30:,.1f} GiB on {where} before any activation; valid: a "
                f"model that fits its {free / 2**30:,.1f} GiB free (a smaller n_layer or n_embd)"
            )


def build_model(config: dict, vocab_size: int, ckpt: dict | None, source: tuple[str, dict] | None) -> GPT:
    """A fresh model; the resumed run's (ckpt); or, at this run's block_size, another run's (source: its checkpoint's
    path and dict) or OpenAI's GPT-2. A checkpoint's architecture wins over the config."""
    overrides = dict(attn_backend=config["attn_backend"], dropout=config["dropout"])
    if ckpt is not None:
        model = model_from_checkpoint(ckpt, resume_path(config), **overrides)
    elif config["init_from"] == "scratch":
        mc = model_config(config, vocab_size)
        check_model_fits(mc, config["device"])
        model = GPT(mc)
    else:
        if source is not None:
            path, saved = source
            args = saved["model_args"] if isinstance(saved["model_args"], dict) else {}  # damaged: named below
            if args.get("pos_embedding") != "learned":  # RoPE has no table: any block_size goes
                overrides["block_size"] = config["block_size"]
            model = model_from_checkpoint(saved, path, **overrides)
        else:
            try:
                model = GPT.from_pretrained(config["init_from"], overrides)
            except (OSError, ValueError, ImportError) as e:  # no network or transformers, not a GPT-2 directory
                raise ConfigError(f"init_from: {e}") from None
        if config["block_size"] > model.config.block_size:
            raise ConfigError(
                f"block_size: got {config['block_size']}; valid: at most {model.config.block_size}, the learned "
                f"positions of {config['init_from']!r}"
            )
        model.crop_block_size(config["block_size"])
    if model.config.vocab_size < vocab_size:
        raise ConfigError(
            f"dataset: its vocabulary ({vocab_size}) does not fit the model's "
            f"vocab_size={model.config.vocab_size}; use a dataset made with the model's tokenizer"
        )
    config.update({k: v for k, v in asdict(model.config).items() if k in config})  # the config reports the truth
    return model


def get_lr(it: int, config: dict) -> float:
    """Linear warmup for warmup_iters, then cosine decay to min_lr at lr_decay_iters (0: max_iters)."""
    lr, min_lr, warmup = config["learning_rate"], config["min_lr"], config["warmup_iters"]
    if not config["decay_lr"]:
        return lr
    decay_iters = config["lr_decay_iters"] or config["max_iters"]
    if it < warmup:
        return lr * (it + 1) / (warmup + 1)
    if it >= decay_iters:
        return min_lr
    ratio = (it - warmup) / max(1, decay_iters - warmup)
    return min_lr + 0.5 * (1.0 + math.cos(math.pi * ratio)) * (lr - min_lr)


# ----------------------------------------------------------------------------------------------- data


class BatchSampler:
    """Draws each iteration's global batch (A micro-steps x batch_size offsets) from one seeded generator, so the
    data order depends only on (seed, iteration): the saved generator state resumes it exactly, and W ranks see
    the same global batch as one process. Rank r of W takes micro-steps [r A/W, (r+1) A/W)."""

    def __init__(self, n_tokens: int, config: dict, d: Dist):
        self.high = n_tokens - config["block_size"]  # offsets i with i + block_size + 1 <= n_tokens
        self.shape = (config["gradient_accumulation_steps"], config["batch_size"])
        self.local = self.shape[0] // d.world_size
        self.rank = d.rank
        self.generator = torch.Generator().manual_seed(config["seed"])

    def next(self) -> torch.Tensor:
        """Offsets of this rank's micro-steps for the next iteration: (A / W, batch_size)."""
        offsets = torch.randint(self.high, self.shape, generator=self.generator)
        return offsets[self.rank * self.local : (self.rank + 1) * self.local]

    def state_dict(self) -> dict:
        return {"generator": self.generator.get_state()}

    def load_state_dict(self, state: dict) -> None:
        self.generator.set_state(state["generator"])


def get_batch(tokens: np.ndarray, offsets: torch.Tensor, block_size: int, device: str):
    """x, y (B, T) int64: the windows at `offsets` and the same windows shifted by one token. The B windows of T + 1
    tokens are gathered into one buffer, x and y are views of it: on CUDA a pinned host buffer and one non-blocking
    copy, so the host goes on launching work while the copy runs (the pinned block is not reused before its copy
    is done: PyTorch's pinned-memory cache waits for it)."""
    windows = offsets.numpy()[:, None] + np.arange(block_size + 1)  # (B, T + 1) token positions
    pinned = device.startswith("cuda")
    batch = torch.empty(windows.shape, dtype=torch.int64, pin_memory=pinned)
    batch.numpy()[...] = tokens[windows]
    if pinned:
        batch = batch.to(device, non_blocking=True)
    return batch[:, :-1], batch[:, 1:]


def micro_batches(tokens: np.ndarray, offsets: torch.Tensor, block_size: int, device: str):
    """An iteration's (x, y) per micro-step, each drawn when the loop asks for it: after the previous micro-step's
    work is queued on the device, so gathering the next batch and queueing its copy overlaps that work (the
    prefetch of the next batch, without a thread: the host is ahead of the device unless launches bind it)."""
    for row in offsets:
        yield get_batch(tokens, row, block_size, device)


@torch.no_grad()
def estimate_loss(model, data, config: dict, d: Dist, ctx, device: str) -> dict[str, float]:
    """Mean loss over the same eval_iters batches of each split every time and in every run, sharded across ranks."""
    model.eval()
    losses = {}
    for i, (split, tokens) in enumerate((("train", data.train), ("val", data.val))):
        g = torch.Generator().manual_seed(EVAL_SEED + i)
        offsets = torch.randint(
            len(tokens) - config["block_size"], (config["eval_iters"], config["batch_size"]), generator=g
        )
        total = torch.zeros(2, dtype=torch.float64, device=device)  # (sum of batch losses, number of batches)
        for row in offsets[d.rank :: d.world_size]:
            x, y = get_batch(tokens, row, config["block_size"], device)
            with ctx:
                _, loss = model(x, y)
            total += torch.stack([loss.double(), torch.ones((), dtype=torch.float64, device=device)])
        if d.ddp:
            dist.all_reduce(total)
        losses[split] = (total[0] / total[1]).item()
    model.train()
    return losses


# ----------------------------------------------------------------------------------------------- state


def rng_states() -> dict:
    np_state = np.random.get_state()
    return {
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
        "numpy": [np_state[0], torch.from_numpy(np_state[1].astype(np.int64)), *np_state[2:]],
        "python": random.getstate(),
    }


def set_rng_states(states: dict) -> None:
    torch.set_rng_state(states["torch"])
    if torch.cuda.is_available() and len(states["cuda"]) == torch.cuda.device_count():
        torch.cuda.set_rng_state_all(states["cuda"])
    name, keys, *rest = states["numpy"]
    np.random.set_state((name, keys.numpy().astype(np.uint32), *rest))
    random.setstate(states["python"])


def gather_rng_states(d: Dist) -> list[dict]:
    """Every rank's RNG states (dropout differs per rank), gathered for rank 0 to save."""
    if not d.ddp:
        return [rng_states()]
    states = [None] * d.world_size
    dist.all_gather_object(states, rng_states())
    return states


def describe_tokenizer(tok) -> str:
    """A tokenizer's meta in a few words, for messages: its kind, encoding and vocabulary size."""
    if not isinstance(tok, dict):
        return repr(tok)
    name = tok.get("encoding") if tok.get("kind") == "tiktoken" else tok.get("kind")
    return f"{name} tokens, vocabulary {tok.get('vocab_size')}"


def resume_path(config: dict) -> str:
    return os.path.join(config["out_dir"], "last.pt")


def load_resume_checkpoint(config: dict) -> dict:
    """out_dir/last.pt, its changes of batch or data named. A damaged one names the intact checkpoint beside it (a
    resume cannot take best.pt, so as the start of a new run)."""
    path = resume_path(config)
    try:
        ckpt = load_checkpoint(path, map_location="cpu", required_keys=TRAIN_KEYS)
    except CheckpointError as e:
        other = intact_checkpoint_beside(path, MODEL_KEYS_NEEDED)
        if other is None:
            raise
        raise CheckpointError(
            f"{e}; valid: a new run from the intact checkpoint beside it, --init_from={other} with another --out_dir"
        ) from None
    old = ckpt["config"] if isinstance(ckpt["config"], dict) else {}
    changes = [(k, old.get(k), config[k]) for k in ("batch_size", "gradient_accumulation_steps", "seed", "dataset")]
    changes.append(("data_dir", data_location(old), data_location(config)))  # the directory, however spelt
    changed = [(k, there, here) for k, there, here in changes if there != here]
    if changed:  # allowed (e.g. a larger batch for the rest of the run), but then it is no longer the same run
        say(
            f"resume: {', '.join(f'{k} {there!r} -> {here!r}' for k, there, here in changed)} changed since the "
            "checkpoint; the run will not match an uninterrupted one"
        )
    return ckpt


def tokens_trained(ckpt: dict, iter_num: int, config: dict) -> int:
    """The training tokens of a checkpoint's iterations: its running count ("tokens"); a checkpoint without that key
    counts its iterations at its own config's tokens per iteration, else (no batch keys there) at this config's."""
    if "tokens" in ckpt:
        return int(ckpt["tokens"])
    try:
        return iter_num * tokens_per_iter(ckpt["config"])
    except (KeyError, TypeError):  # a config without the batch keys
        return iter_num * tokens_per_iter(config)


def run_origin(config: dict, ckpt: dict | None) -> str:
    """init_from as the run's checkpoints record it: a resume continues the run its checkpoint began, so the
    origin of that run, never "resume" (compare.py and the kept-run check read it)."""
    if ckpt is None:
        return config["init_from"]
    return ckpt["config"].get("init_from", "scratch") if isinstance(ckpt["config"], dict) else "scratch"


def load_init_checkpoint(config: dict) -> tuple[str, dict] | None:
    """(path, checkpoint) of the run whose model --init_from names (a new run starts from it), else None. A damaged
    best.pt names the last.pt beside it rather than silently starting from another model."""
    path = init_checkpoint_path(config["init_from"])
    if path is None:
        return None
    try:
        return path, load_checkpoint(path, map_location="cpu", required_keys=MODEL_KEYS_NEEDED)
    except CheckpointError as e:
        other = intact_checkpoint_beside(path, MODEL_KEYS_NEEDED)
        if other is None:
            raise
        raise CheckpointError(f"{e}; valid: the other checkpoint beside it, --init_from={other}") from None


def note_ignored_model_args(config: dict, ckpt: dict, vocab_size: int, taken: tuple[str, ...], why: str) -> None:
    """The model is the checkpoint's (only the `taken` fields follow this run's config): say which of this run's
    model settings it does not take, so an override is never dropped in silence."""
    try:
        wanted = asdict(model_config(config, vocab_size))
    except ConfigError:  # settings that would not even build a model: compare them as written
        wanted = {k: config[k] for k in MODEL_KEYS if k in config}
    saved = ckpt["model_args"] if isinstance(ckpt["model_args"], dict) else {}
    differ = [k for k in saved if k not in taken and k in wanted and wanted[k] != saved[k]]
    if differ:
        say(
            f"{why}: the model is the checkpoint's; not taken from this run's config: "
            + ", ".join(f"{k}={wanted[k]!r} (checkpoint: {saved[k]!r})" for k in differ)
        )


# ----------------------------------------------------------------------------------------------- logging


def say(*args, **kwargs) -> None:
    """print, flushed, that never raises: when stdout's reader has gone (`python train.py ... | tee log` after Ctrl-C
    closes the pipe), stdout is pointed at /dev/null, so this and every later print succeed and the run goes on to
    save its checkpoint."""
    try:
        print(*args, **kwargs, flush=True)
    except OSError:  # BrokenPipeError, or EIO from a terminal that has gone
        try:
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, sys.stdout.fileno())
            os.close(devnull)
        except (OSError, ValueError):  # a stdout without a file descriptor (a test's capture): nothing to repoint
            pass


def print_setup(config: dict, model: GPT, d: Dist) -> None:
    """The resolved config, the model and the batch, as the run will use them."""
    text = ", ".join(f"{k}={v!r}" for k, v in config.items())
    say("config: " + textwrap.fill(text, width=118, subsequent_indent="  "))
    mc = model.config
    if mc.attention == "mla":  # what MLA caches: one latent and one shared RoPE key per token and layer
        heads = f"{mc.n_head} heads, latent cache {mc.kv_lora_rank} + {mc.qk_rope_head_dim} per token and layer"
    else:
        heads = f"{plural(mc.n_head, 'head')} / {plural(mc.n_kv_head, 'KV head')}"
    kv_bytes = model.kv_cache_bytes_per_token(PTDTYPES[config["dtype"]])
    say(
        f"model: {mc.attention}, {plural(mc.n_layer, 'layer')}, {heads}, {mc.n_embd} wide, "
        f"{model.num_params() / 1e6:.2f}M params, KV cache {kv_bytes:,} bytes/token in {config['dtype']}, "
        f"attention via {model.attn_backend_for(config['device'])}"
    )
    accum, batch, block = config["gradient_accumulation_steps"], config["batch_size"], config["block_size"]
    say(
        f"tokens per iteration: {tokens_per_iter(config):,} ({plural(accum, 'micro-step')} x {batch} sequences x "
        f"{block} tokens, over {plural(d.world_size, 'process', 'processes')}); device {config['device']}, "
        f"{config['dtype']}"
    )


def plural(n: int, one: str, many: str | None = None) -> str:
    return f"{n} {one if n == 1 else many or one + 's'}"


def run_facts(config: dict, model: GPT, iter_num: int, tokens: int) -> dict:
    """What every metrics line carries besides the numbers of the moment, so that compare.py builds its table from a
    run directory alone (for a line without them compare.py falls back to the checkpoint). iter_num and tokens:
    where the run starts (a resume), so that the token budget counts what came before at its own batch."""
    mc = model.config
    mla = mc.attention == "mla"
    return dict(
        params=model.num_params(),
        kv_cache_bytes_per_token=model.kv_cache_bytes_per_token(PTDTYPES[config["dtype"]]),
        kv_cache_dtype=config["dtype"],
        attention=mc.attention,
        n_kv_head=None if mla else mc.n_kv_head,  # MLA caches a latent, not K/V heads
        kv_lora_rank=mc.kv_lora_rank if mla else 0,
        dataset=config["dataset"],
        seed=config["seed"],
        size=size_name(config),
        token_budget=tokens + max(0, config["max_iters"] - iter_num) * tokens_per_iter(config),
    )


def peak_memory_bytes(device: str) -> int | None:
    """The most memory the run's tensors have held on the GPU so far (PyTorch's allocator); None off CUDA."""
    return torch.cuda.max_memory_allocated(device) if device.startswith("cuda") else None


# The numbers logged to wandb over the run, by their names here (metrics.jsonl's, and running_loss for the progress
# line's) and the names wandb charts them under; each is charted against `tokens` (training tokens seen), so runs
# with different batch sizes line up on one x-axis.
WANDB_SERIES = {
    "train_loss": "train/loss",
    "val_loss": "val/loss",
    "running_loss": "train/running_loss",
    "lr": "lr",
    "tokens_per_sec": "tokens_per_sec",
    "mfu": "mfu",
    "peak_memory_bytes": "peak_memory_bytes",
}


def init_wandb(config: dict, model: GPT, facts: dict):
    """A wandb run in config's project and group; offline (never blocking) without credentials or network. The run's
    facts (params, KV bytes/token and its dtype, ...) go into its config and summary."""
    try:
        import wandb
    except ImportError:
        say("wandb: not installed (pip install wandb); metrics go to metrics.jsonl only")
        return None
    summary = {**config, **facts, "n_kv_head": model.config.n_kv_head}  # the config keeps the model's own value
    kwargs = dict(
        project=config["wandb_project"],
        group=config["wandb_group"],
        name=config["wandb_run_name"],
        config=summary,
        dir=os.environ.get("WANDB_DIR") or config["out_dir"],
    )  # each run's files beside its checkpoints
    run = open_wandb_run(wandb, kwargs, "metrics go to metrics.jsonl only", log=say)
    if run is not None:
        run.define_metric("tokens")
        for name in WANDB_SERIES.values():
            run.define_metric(name, step_metric="tokens")
        run.summary.update(facts)
    return run


def log_wandb(run, numbers: dict, step: int) -> None:
    """`tokens` and the WANDB_SERIES in numbers, under their wandb names, at step (run None: wandb is off). Other keys
    (iter, time, the run's facts) are left out, and so is a None (no MFU or peak memory off CUDA): not charted as 0."""
    if run is not None:
        names = {"tokens": "tokens", **WANDB_SERIES}
        run.log({name: numbers[k] for k, name in names.items() if numbers.get(k) is not None}, step=step)


def metrics_for_resume(path: str, iter_num: int) -> set[int]:
    """Before a resume from iteration iter_num appends to metrics.jsonl, the file says no more than the checkpoint:
    a last line cut short (a run killed while writing it) is dropped, and so are the lines after iter_num (a run that
    died between an eval's line and its checkpoint), which the resumed run writes again. Each drop is one line on
    stderr. Returns the iterations the file keeps, so an eval of the resumed checkpoint is not appended twice."""
    try:
        with open(path, "rb") as f:
            text = f.read()
    except FileNotFoundError:
        return set()
    kept, iters, later, partial = [], set(), 0, None
    lines = text.split(b"\n")  # the last is b"" when the file ends with its newline
    for i, line in enumerate(lines):
        if not line:
            continue
        try:
            record = json.loads(line)
        except ValueError:  # JSONDecodeError, UnicodeDecodeError
            record = None
        if not isinstance(record, dict):
            if i == len(lines) - 1:  # the last line, without its newline: cut short
                partial = line.decode("utf-8", errors="replace")
            else:  # a line no run of ours wrote: kept as it is
                kept.append(line + b"\n")
            continue
        it = record.get("iter")
        if isinstance(it, int) and it > iter_num:
            later += 1
            continue
        kept.append(line + b"\n")
        if isinstance(it, int):
            iters.add(it)
    if b"".join(kept) != text:  # a line dropped or a last newline missing: written whole, then renamed into place
        tmp = path + ".tmp"
        with open(tmp, "wb") as f:
            f.write(b"".join(kept))
        os.replace(tmp, path)
    if partial is not None:
        shown = partial if len(partial) <= 40 else partial[:40] + "..."
        sys.stderr.write(
            f"note: {path}: its last line was cut short (a run killed while writing it): {shown!r}; dropped before "
            "appending\n"
        )
    if later:
        sys.stderr.write(
            f"note: {path}: {later} line(s) after iteration {iter_num} (written after the checkpoint the run resumes "
            "from) dropped; the resumed run writes them again\n"
        )
    return iters


def log_eval(config: dict, run, record: dict) -> None:
    """One JSON line in out_dir/metrics.jsonl (always) and its numbers on wandb (if on; the run's facts are in its
    summary already)."""
    with open(os.path.join(config["out_dir"], "metrics.jsonl"), "a", encoding="utf-8") as f:
        f.write(json.dumps(record) + "\n")
    log_wandb(run, record, step=record["iter"])


def format_progress(
    it: int, config: dict, loss: float, lr: float, dt: float, tok_s: float, mfu, peak_bytes: int | None
) -> str:
    """The progress line: loss, learning rate, time per iteration, throughput, MFU and (on CUDA) peak memory."""
    mfu_text = f"{100 * mfu:.1f}%" if mfu is not None else "n/a"
    peak = f" | peak mem {peak_bytes / 2**30:.2f} GiB" if peak_bytes is not None else ""
    return (
        f"iter {it}/{config['max_iters']} | loss {loss:.4f} | lr {lr:.2e} | {1000 * dt:.1f} ms/iter | "
        f"{tok_s:,.0f} tok/s | mfu {mfu_text}{peak}"
    )


@contextmanager
def stop_on_signal():
    """Ctrl-C / SIGTERM set a flag that the loop checks between iterations (a second Ctrl-C interrupts at once)."""
    requested = {"stop": False}
    previous = {}

    def handler(signum, frame):
        if requested["stop"] and signum == signal.SIGINT:
            raise KeyboardInterrupt
        requested["stop"] = True
        requested["signal"] = signum
        # No print here: a print can raise (BrokenPipeError after `| tee` died of the same Ctrl-C, or a reentrant
        # call into the stdout buffer the loop was writing), and an exception from a handler would lose the save.
        # One unbuffered write to stderr, which reaches the terminal even when stdout is piped, errors ignored.
        notice = f"\n{signal.Signals(signum).name}: stopping after this iteration (Ctrl-C again to abort at once)\n"
        try:
            os.write(2, notice.encode())
        except OSError:
            pass

    for sig in (signal.SIGINT, signal.SIGTERM):
        previous[sig] = signal.signal(sig, handler)
    try:
        yield requested
    finally:
        for sig, h in previous.items():
            signal.signal(sig, h)


def should_stop(requested: dict, d: Dist, group) -> bool:
    """All ranks must stop at the same iteration: the flag is all-reduced (on CPU, gloo: no GPU sync)."""
    if not d.ddp:
        return requested["stop"]
    flag = torch.tensor([int(requested["stop"])])
    dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
    return bool(flag.item())


# ----------------------------------------------------------------------------------------------- main


@dataclass
class Setup:
    """Everything the loop needs, built by `setup` (the loop itself stays flat and visible in `train`)."""

    data: object  # data.TokenData
    raw_model: GPT  # not DDP-wrapped (its blocks compiled in place when compile=True): eval, checkpoints, MFU
    optimizer: torch.optim.Optimizer
    scaler: torch.amp.GradScaler
    sampler: BatchSampler
    ctx: object  # autocast context (or nullcontext for float32)
    step: TrainStep  # one optimizer step over the global batch, through raw_model (DDP-wrapped when distributed)
    iter_num: int
    tokens: int  # training tokens of the iter_num iterations (over every resume)
    best_val_loss: float
    resumed: bool
    origin: str  # how the run began: scratch, a GPT-2 name, or the run or checkpoint it started from
    facts: dict  # run_facts: what every metrics line carries besides the numbers of the moment
    stop_group: object  # process group of the stop flag (gloo), None = the default group
    run: object  # wandb run or None
    logged_iters: set  # the iterations metrics.jsonl has lines for when a resume starts (on the master)


def main(argv: list[str] | None = None) -> dict:
    """Parse the config, join the process group if torchrun started us, set up, train; returns the final state."""
    config = parse_config(DEFAULTS, sys.argv[1:] if argv is None else argv)
    d, device = setup_distributed(config)
    finished = False
    try:
        check_config(config, d)
        kept = check_out_dir(config, d, device)  # before anything is printed or started
        if kept is not None:
            if d.master:
                say(kept[0])
            finished = True
            return dict(iter_num=kept[1], losses={}, best_val_loss=None, interrupted=None, kept=True)
        with stop_on_signal() as stop_requested:
            s = setup(config, d, device)
            try:
                result = train(config, d, device, s, stop_requested)
                finished = True
                return result
            finally:
                if s.run is not None:  # marked failed when an exception (NaN loss, ...) is on its way out
                    s.run.finish(exit_code=0 if sys.exc_info()[0] is None else 1)
    finally:
        if d.ddp:
            # Every rank finished (a stop request is agreed on by all): leave together. Without the barrier a rank
            # that tears its gloo pairs down first can make its peer's gloo thread abort the process
            # ("terminate called without an active exception") after a run that completed. On an error the peers
            # may be gone, so no barrier there.
            if finished:
                dist.barrier()
            dist.destroy_process_group()


def setup(config: dict, d: Dist, device: str) -> Setup:
    """Data, model, optimizer and loggers; a resumed run's state restored. check_config has run."""
    config["device"], config["dtype"] = device, resolve_dtype(config["dtype"], device)
    device_type = "cuda" if device.startswith("cuda") else "cpu"
    if config["cuda_graphs"] and device_type != "cuda":
        raise ConfigError(f"cuda_graphs: got True on device {device!r}; valid: True on a CUDA device, else False")
    torch.manual_seed(config["seed"] + d.rank)
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = True
    ctx = autocast_context(config["dtype"], device_type)
    if device_type == "cpu" and config["dtype"] == "float16" and d.master:
        say("note: dtype float16 on the CPU: its float16 matmuls are slow, a step takes several times float32's")

    data = ensure_dataset(config["dataset"], config["data_dir"])
    for split, tokens in (("train", data.train), ("val", data.val)):
        if len(tokens) <= config["block_size"] + 1:
            raise ConfigError(
                f"block_size: got {config['block_size']}, but the {split} split has only "
                f"{len(tokens)} tokens (a block and its next-token target need block_size + 2); "
                f"valid: at most {len(tokens) - 2}"
            )
    ckpt = load_resume_checkpoint(config) if config["init_from"] == "resume" else None
    source = load_init_checkpoint(config)  # a new run from another run's model
    for saved in (ckpt, source[1] if source else None):
        if saved and saved["tokenizer"] != data.meta["tokenizer"]:
            theirs = saved["config"].get("dataset") if isinstance(saved["config"], dict) else None
            here, there = describe_tokenizer(data.meta["tokenizer"]), describe_tokenizer(saved["tokenizer"])
            there += " with other symbols" if there == here else ""
            raise ConfigError(
                f"dataset: {config['dataset']!r} is tokenized differently from the checkpoint's data (here {here}; "
                f"the checkpoint's {there}{f', dataset {theirs!r}' if theirs else ''}); valid: a dataset prepared "
                "with the checkpoint's tokenizer"
            )
    if d.master and ckpt is not None:
        note_ignored_model_args(config, ckpt, data.vocab_size, ("attn_backend", "dropout"), "resume")
    if d.master and source is not None:
        taken = ("attn_backend", "dropout", "block_size")
        note_ignored_model_args(config, source[1], data.vocab_size, taken, "init_from")
    raw_model = build_model(config, data.vocab_size, ckpt, source).to(device)
    # from the final values: a resume's model, MLA's dims derived from the width
    config["wandb_group"], config["wandb_run_name"] = run_names(config, raw_model.config)
    check_backend(raw_model, device)
    optimizer = raw_model.configure_optimizers(
        config["weight_decay"], config["learning_rate"], (config["beta1"], config["beta2"]), device_type
    )
    scaler = torch.amp.GradScaler(device_type, enabled=config["dtype"] == "float16")
    sampler = BatchSampler(len(data.train), config, d)
    iter_num, best_val_loss, tokens_seen = 0, float("inf"), 0
    if ckpt is not None:
        try:
            impl = [{k: g[k] for k in ("fused", "foreach") if k in g} for g in optimizer.param_groups]
            optimizer.load_state_dict(ckpt["optimizer"])
            for group, flags in zip(optimizer.param_groups, impl):  # this device's AdamW (fused on CUDA)
                group.update(flags)
            scaler.load_state_dict(ckpt["scaler"])
            sampler.load_state_dict(ckpt["data_state"])
            iter_num, best_val_loss = int(ckpt["iter_num"]), float(ckpt["best_val_loss"])
            tokens_seen = tokens_trained(ckpt, iter_num, config)
            if len(ckpt["rng"]) == d.world_size:
                set_rng_states(ckpt["rng"][d.rank])
        except (TypeError, ValueError, RuntimeError, KeyError, IndexError) as e:
            raise CheckpointError(
                f"checkpoint {resume_path(config)!r}: its training state (optimizer, scaler, "
                f"sampler, RNG) does not fit this model ({type(e).__name__}: {first_line(e)})"
            ) from None
        if len(ckpt["rng"]) != d.world_size and d.master:
            say(
                f"resume: the checkpoint has RNG states of {len(ckpt['rng'])} processes, this run has "
                f"{d.world_size}; RNGs stay seeded (only dropout is affected)"
            )
    if config["compile"]:
        compile_model(raw_model)  # in place, region by region
    train_model = DDP(raw_model, device_ids=[d.local_rank] if device_type == "cuda" else None) if d.ddp else raw_model
    stop_group = dist.new_group(backend="gloo") if d.ddp and dist.get_backend() != "gloo" else None
    if d.ddp:
        UNTIL_EXIT.extend([train_model, stop_group])
    step = TrainStep(
        train_model,
        optimizer,
        scaler,
        dtype=config["dtype"],
        accum_steps=config["gradient_accumulation_steps"] // d.world_size,
        grad_clip=config["grad_clip"],
        cuda_graphs=config["cuda_graphs"],
    )
    facts = run_facts(config, raw_model, iter_num, tokens_seen)
    run, logged = None, set()
    if d.master:
        try:
            os.makedirs(config["out_dir"], exist_ok=True)
        except OSError as e:
            raise ConfigError(
                f"out_dir: cannot create {config['out_dir']!r} ({e.strerror}); valid: a writable directory path"
            ) from None
        if config["init_from"] != "resume" and config["overwrite"]:  # a new run: none of the old one's files
            for name in RUN_FILES:
                if os.path.exists(os.path.join(config["out_dir"], name)):
                    os.remove(os.path.join(config["out_dir"], name))
        print_setup(config, raw_model, d)
        if ckpt is not None:
            say(f"resumed from iteration {iter_num} ({resume_path(config)})")
            logged = metrics_for_resume(os.path.join(config["out_dir"], "metrics.jsonl"), iter_num)
        if source is not None:
            say(f"init_from: the model of {source[0]} (its iteration {source[1].get('iter_num', '?')}); a new run")
        run = init_wandb(config, raw_model, facts) if config["wandb_log"] else None
    return Setup(
        data,
        raw_model,
        optimizer,
        scaler,
        sampler,
        ctx,
        step,
        iter_num,
        tokens_seen,
        best_val_loss,
        ckpt is not None,
        run_origin(config, ckpt),
        facts,
        stop_group,
        run,
        logged,
    )


def train(config: dict, d: Dist, device: str, s: Setup, stop_requested: dict) -> dict:
    """The training loop. Invariant at the top of each pass: iter_num iterations are complete, and the sampler,
    optimizer and RNG states are exactly those after them (what a checkpoint written there holds)."""
    data, raw_model, optimizer, scaler, sampler = s.data, s.raw_model, s.optimizer, s.scaler, s.sampler
    iter_num, best_val_loss, start_iter, tokens = s.iter_num, s.best_val_loss, s.iter_num, s.tokens
    saved_config = dict(config, init_from=s.origin)  # what checkpoints record
    local_accum = config["gradient_accumulation_steps"] // d.world_size
    iter_tokens = tokens_per_iter(config)
    window_loss, window_iters = torch.zeros((), device=device), 0  # summed on the device: no sync until a log
    t_window, tok_s, mfu, losses = time.perf_counter(), None, None, {}
    interrupted = None  # the signal that stopped the run early
    if s.resumed and iter_num >= config["max_iters"] and not config["eval_only"]:  # no eval line appended twice
        if d.master:
            say(
                f"resume: the run already finished at iteration {iter_num} (max_iters={config['max_iters']}); "
                "nothing to do: raise --max_iters to train on"
            )
        return dict(iter_num=iter_num, losses=losses, best_val_loss=best_val_loss, interrupted=None)
    while True:
        lr = get_lr(iter_num, config)
        for group in optimizer.param_groups:
            group["lr"] = lr

        # Eval, metrics and checkpoints (not at the iteration a resumed run starts from: that one is on disk).
        final = iter_num >= config["max_iters"] or config["eval_only"]
        if (iter_num % config["eval_interval"] == 0 and (iter_num > start_iter or not s.resumed)) or final:
            check_window(window_loss, window_iters, iter_num, d)  # never checkpoint a model whose loss went NaN
            losses = estimate_loss(raw_model, data, config, d, s.ctx, device)
            if not all(math.isfinite(v) for v in losses.values()):
                raise NonFiniteLoss(f"eval loss at iteration {iter_num} is {losses}; the last checkpoint is kept")
            rng = gather_rng_states(d)
            if d.master:
                say(f"eval {iter_num}: train loss {losses['train']:.4f}, val loss {losses['val']:.4f}")
                record = dict(
                    iter=iter_num,
                    tokens=tokens,
                    train_loss=losses["train"],
                    val_loss=losses["val"],
                    lr=lr,
                    tokens_per_sec=tok_s,
                    mfu=mfu,
                    peak_memory_bytes=peak_memory_bytes(device),
                    time=time.time(),
                )
                if iter_num in s.logged_iters:  # eval_only on the checkpoint a resume starts from
                    say(f"eval {iter_num}: metrics.jsonl has this iteration's line already; not appended again")
                else:
                    log_eval(config, s.run, dict(record, **s.facts))
                if iter_num > start_iter:
                    state = training_state(
                        raw_model,
                        optimizer,
                        scaler,
                        sampler,
                        saved_config,
                        iter_num,
                        min(best_val_loss, losses["val"]),
                        rng,
                        data.meta,
                        tokens,
                    )
                    save_checkpoint(resume_path(config), state)
                    if losses["val"] < best_val_loss:
                        save_checkpoint(os.path.join(config["out_dir"], "best.pt"), state)
            best_val_loss = min(best_val_loss, losses["val"])
            t_window = time.perf_counter()  # eval time is not training throughput
        if final:
            break
        if should_stop(stop_requested, d, s.stop_group):
            check_window(window_loss, window_iters, iter_num, d)
            save_interrupted(
                raw_model, optimizer, scaler, sampler, saved_config, iter_num, best_val_loss, data, tokens, d
            )
            interrupted = stop_requested.get("signal", signal.SIGINT)  # another rank's signal: as Ctrl-C
            break

        # One optimizer step over the global batch (train_step.TrainStep): local_accum micro-steps on each rank,
        # DDP all-reducing the gradients on the last one, then the clip and AdamW.
        loss_iter = s.step(micro_batches(data.train, sampler.next(), config["block_size"], device))
        iter_num += 1
        tokens += iter_tokens  # a running count: a resume may change the tokens per iteration
        window_loss += loss_iter
        window_iters += 1

        if iter_num % config["log_interval"] == 0:
            loss_mean = check_window(window_loss, window_iters, iter_num, d)  # syncs the device
            dt = (time.perf_counter() - t_window) / window_iters
            tok_s = iter_tokens / dt
            mfu = raw_model.estimate_mfu(config["batch_size"] * local_accum, dt)
            peak = peak_memory_bytes(device)
            if d.master:
                say(format_progress(iter_num, config, loss_mean, lr, dt, tok_s, mfu, peak))
                running = dict(
                    tokens=tokens, running_loss=loss_mean, lr=lr, tokens_per_sec=tok_s, mfu=mfu, peak_memory_bytes=peak
                )
                log_wandb(s.run, running, step=iter_num)
            window_loss.zero_()
            window_iters, t_window = 0, time.perf_counter()

    if s.run is not None:
        s.run.summary["best_val_loss"] = best_val_loss
    if d.master and interrupted is None and not config["eval_only"]:  # eval_only saves nothing: its eval line says all
        say_where_it_went(config["out_dir"], iter_num, best_val_loss)
    return dict(iter_num=iter_num, losses=losses, best_val_loss=best_val_loss, interrupted=interrupted)


def say_where_it_went(out_dir: str, iter_num: int, best_val_loss: float) -> None:
    """The end of a run: where its checkpoints are and what to run next."""
    last, best = os.path.join(out_dir, "last.pt"), os.path.join(out_dir, "best.pt")
    saved = f"saved: {last} (iteration {iter_num})"
    if os.path.exists(best):
        saved += f" and {best} (val loss {best_val_loss:.4f})"
    say(saved)
    here = not os.path.relpath(os.path.abspath(out_dir)).startswith("..")  # compare.py alone reads the runs here
    runs = "`python compare.py` compares the runs here" if here else f"`python compare.py {out_dir}` tabulates it"
    say(f"next: `python sample.py --out_dir={out_dir}` generates from it, {runs}")


def check_window(window_loss: torch.Tensor, window_iters: int, iter_num: int, d: Dist) -> float:
    """Mean train loss over the iterations since the last check (all ranks); NonFiniteLoss if any was NaN/inf."""
    if window_iters == 0:
        return float("nan")
    total = window_loss.detach().clone().double()
    if d.ddp:
        dist.all_reduce(total)
    mean = total.item() / (window_iters * d.world_size)
    if not math.isfinite(mean):
        raise NonFiniteLoss(f"train loss became {mean} in iterations {iter_num - window_iters + 1}..{iter_num}")
    return mean


def save_interrupted(raw_model, optimizer, scaler, sampler, config, iter_num, best_val_loss, data, tokens, d: Dist):
    """On Ctrl-C / SIGTERM: last.pt of the last completed iteration."""
    rng = gather_rng_states(d)
    if d.master:
        path = resume_path(config)
        state = training_state(
            raw_model, optimizer, scaler, sampler, config, iter_num, best_val_loss, rng, data.meta, tokens
        )
        save_checkpoint(path, state)
        say(f"interrupted: saved {path} at iteration {iter_num}; continue with --init_from=resume")


def training_state(
    raw_model, optimizer, scaler, sampler, config, iter_num, best_val_loss, rng, meta, tokens: int
) -> dict:
    """The checkpoint dict (keys: checkpoint.TRAIN_KEYS, and tokens)."""
    return dict(
        model=clean_state_dict(raw_model.state_dict()),
        model_args=asdict(raw_model.config),
        config=config,
        iter_num=iter_num,
        best_val_loss=best_val_loss,
        optimizer=optimizer.state_dict(),
        scaler=scaler.state_dict(),
        rng=rng,
        data_state=sampler.state_dict(),
        tokenizer=meta["tokenizer"],
        tokens=tokens,
    )


def cli() -> int:
    """The command line: its exit status (2: a usage error, 1: a failure with its message, 130 / 143: stopped by
    Ctrl-C / SIGTERM after saving)."""
    if wants_help(sys.argv[1:], DEFAULTS):
        print(help_text(__doc__, DEFAULTS, __file__))
        return 0
    try:
        result = main()
    except ConfigError as e:  # a usage error: status 2, as argparse's, so that `... || break` in a loop stops
        sys.stderr.write(f"error: {e}\n")
        return 2
    except (DataError, CheckpointError, NonFiniteLoss) as e:  # a message, not a traceback
        sys.stderr.write(f"error: {e}\n")
        return 1
    return 128 + int(result["interrupted"]) if result["interrupted"] else 0  # saved, but a script stops too


if __name__ == "__main__":
    if not launched_as_ranks():
        sys.exit(cli())
    # Under torchrun: main() has synced the ranks (or one failed) and closed the process groups, and every file is
    # written. What holds the groups (UNTIL_EXIT) is never freed: a gloo group's destructor joins its worker threads
    # while holding the GIL (pytorch/pytorch#56297), and a worker that is still releasing a finished collective's
    # tensors waits for that GIL: a deadlock, seen as an occasional hang at the end of runs on a loaded CPU.
    try:
        code = cli()
    except BaseException:  # what Python would print before exiting with 1
        traceback.print_exc()
        code = 1
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a reader that has gone: nothing left to lose
            pass
    os._exit(code)
