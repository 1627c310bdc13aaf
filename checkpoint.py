"""Checkpoints that a crash can never corrupt, and that load anywhere.

`save_checkpoint` writes to a temporary file in the target's directory, fsyncs it and renames it over the target
(`os.replace` is atomic on POSIX and Windows), so a reader sees the old file or the new one, never half of one.
`load_checkpoint` maps tensors to `map_location` (a GPU checkpoint loads on a CPU machine) and turns a missing,
truncated or corrupt file (the archive's CRCs are checked: torch.load does not) into a `CheckpointError` that says
which file and what is wrong with it. A save that was killed leaves a hidden temporary file; the next save of the
same checkpoint removes it.

Training checkpoints (`out_dir/last.pt`, `out_dir/best.pt`) are dicts with the keys of `TRAIN_KEYS` (and `tokens`,
the training tokens seen so far over every resume, which checkpoints from before it was kept lack); their contents
are plain tensors, numbers, strings and containers, so they load with `torch.load(weights_only=True)`.
"""

from __future__ import annotations

import glob
import os
import tempfile
import zipfile

import torch

TRAIN_KEYS = (
    "model",  # state_dict, no `_orig_mod.` / `module.` prefixes
    "model_args",  # GPTConfig as a dict
    "config",  # the resolved train config
    "iter_num",  # completed iterations
    "best_val_loss",
    "optimizer",
    "scaler",  # GradScaler state (empty unless fp16)
    "rng",  # torch / cuda / numpy / python RNG states
    "data_state",  # the batch sampler's generator state
    "tokenizer",  # the dataset's meta dict (data.get_tokenizer rebuilds the tokenizer from it)
)


MODEL_KEYS_NEEDED = ("model", "model_args", "tokenizer")  # what building a model (and its tokenizer) from one reads

RUN_CHECKPOINTS = ("best.pt", "last.pt")  # a run directory's checkpoints, in the order its model is taken from


class CheckpointError(ValueError):
    """A checkpoint that is missing, truncated, corrupt, or lacks the keys its reader needs."""


def save_checkpoint(path: str | os.PathLike, obj: dict) -> None:
    """Write `obj` to `path` atomically: temp file in the same directory, fsync, rename over `path`."""
    path = os.fspath(path)
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    prefix = f".{os.path.basename(path)}."
    for stale in glob.glob(os.path.join(glob.escape(directory), glob.escape(prefix) + "*.tmp")):
        os.unlink(stale)  # left by a save that was killed (SIGKILL, power loss): never a checkpoint of its own
    fd, tmp = tempfile.mkstemp(prefix=prefix, suffix=".tmp", dir=directory)
    os.chmod(tmp, 0o666 & ~_umask())  # mkstemp makes 0600 files; give the checkpoint a normal file's mode
    try:
        with os.fdopen(fd, "wb") as f:
            torch.save(obj, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    _fsync_directory(directory)  # make the rename itself durable


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def _fsync_directory(directory: str) -> None:
    if os.name != "posix":
        return
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def load_checkpoint(path: str | os.PathLike, map_location="cpu", required_keys: tuple[str, ...] = ()) -> dict:
    """Load a checkpoint dict onto `map_location`; raise CheckpointError for a missing, truncated or corrupt file,
    or one that lacks any of `required_keys` (pass `TRAIN_KEYS` to resume training)."""
    path = os.fspath(path)
    if not os.path.isfile(path):
        raise CheckpointError(f"checkpoint {path!r}: no such file (train.py writes out_dir/last.pt and best.pt)")
    size = os.path.getsize(path)
    damaged = _failed_crc(path)
    if damaged:
        raise CheckpointError(
            f"checkpoint {path!r} ({size} bytes) is corrupt: its entry {damaged!r} fails its CRC "
            "check (the bytes changed after it was written)"
        )
    try:
        obj = torch.load(path, map_location=map_location, weights_only=True)
    except Exception as e:  # torch raises RuntimeError, EOFError, UnpicklingError, ... depending on the damage
        raise CheckpointError(
            f"checkpoint {path!r} ({size} bytes) is truncated or corrupt and cannot be loaded "
            f"({type(e).__name__}: {str(e).splitlines()[0] if str(e) else 'no detail'})"
        ) from e
    if not isinstance(obj, dict):
        raise CheckpointError(f"checkpoint {path!r}: expected a dict, got {type(obj).__name__}")
    missing = [k for k in required_keys if k not in obj]
    if missing:
        raise CheckpointError(f"checkpoint {path!r}: missing keys {missing}; it has {sorted(obj)}")
    return obj


def run_checkpoints(directory: str | os.PathLike) -> list[str]:
    """The checkpoints a run directory holds, best.pt first: the run's model is the first of them that loads."""
    return [p for name in RUN_CHECKPOINTS if os.path.isfile(p := os.path.join(directory, name))]


def checkpoint_beside(path: str) -> str | None:
    """The other checkpoint of path's run directory (last.pt beside best.pt, or best.pt beside last.pt), if any: what
    a message about a damaged one offers instead."""
    name = os.path.basename(path)
    return next((p for p in run_checkpoints(os.path.dirname(path)) if os.path.basename(p) != name), None)


def intact_checkpoint_beside(path: str, required_keys: tuple[str, ...] = ()) -> str | None:
    """checkpoint_beside(path) where that one is intact (its CRCs pass, it loads as a dict with `required_keys`; the
    tensors stay on disk), else None: a message about a damaged checkpoint offers only one that works."""
    other = checkpoint_beside(path)
    if other is None or _failed_crc(other):
        return None
    return other if loads_with_keys(other, required_keys) else None


def loads_with_keys(path: str, keys: tuple[str, ...]) -> bool:
    """Whether `path` loads as a dict holding every one of `keys`; only its structure is read (mmap leaves the
    tensors on disk). Missing, truncated, not a checkpoint: False, whatever the error."""
    try:
        obj = torch.load(path, map_location="cpu", mmap=True, weights_only=True)
    except Exception:
        return False
    return isinstance(obj, dict) and all(k in obj for k in keys)


def _failed_crc(path: str) -> str | None:
    """The first entry of a torch.save zip archive whose bytes fail their CRC-32, else None. torch.load itself reads
    the tensors without checking, so flipped bits would load as wrong weights. Not a zip archive: None (torch.load
    then reports what is wrong)."""
    try:
        with zipfile.ZipFile(path) as archive:
            return archive.testzip()
    except (zipfile.BadZipFile, zipfile.LargeZipFile, OSError, EOFError):
        return None


def model_from_checkpoint(ckpt: dict, path: str, **overrides):
    """The GPT that a checkpoint's model_args (with `overrides` replacing some of them) and weights make; where they
    do not (a damaged checkpoint, or one from another model.py), a CheckpointError that names `path`."""
    from model import GPT, GPTConfig

    try:
        model = GPT(GPTConfig(**dict(ckpt["model_args"], **overrides)))
        weights = clean_state_dict(ckpt["model"])
        mismatch = weights_mismatch(model.state_dict(), weights)
        if mismatch is None:
            model.load_state_dict(weights)
    except (TypeError, ValueError, RuntimeError, KeyError, AttributeError) as e:
        raise CheckpointError(
            f"checkpoint {path!r}: its model_args and weights do not make a model ({type(e).__name__}: {first_line(e)})"
        ) from None
    if mismatch is not None:  # load_state_dict's message has these on lines that a one-line error would drop
        raise CheckpointError(
            f"checkpoint {path!r}: its model_args and weights do not make a model (its weights do not fit the "
            f"model its model_args describe: {mismatch})"
        )
    return model


def weights_mismatch(expected: dict, weights: dict, shown: int = 3) -> str | None:
    """Where a state dict does not fit a model's (`expected`, the model's own state_dict), in one line: its missing,
    unexpected and mis-sized keys, the first `shown` of each and how many in all; None where it fits."""
    missing = [k for k in expected if k not in weights]
    unexpected = [k for k in weights if k not in expected]
    resized = [
        f"{k} ({_shape(weights[k])} in the checkpoint, {_shape(v)} in the model)"
        for k, v in expected.items()
        if k in weights and getattr(weights[k], "shape", None) != v.shape
    ]
    parts = []
    for what, keys in (("missing", missing), ("unexpected", unexpected), ("mis-sized", resized)):
        if keys:
            more = f", ... ({len(keys) - shown} more)" if len(keys) > shown else ""
            parts.append(f"{len(keys)} {what} key{'s' if len(keys) > 1 else ''}: {', '.join(keys[:shown])}{more}")
    return "; ".join(parts) or None


def _shape(tensor) -> str:
    shape = getattr(tensor, "shape", None)
    return str(list(shape)) if shape is not None else f"(a {type(tensor).__name__})"


def first_line(e: Exception) -> str:
    """An exception's message for a one-line error: its first line."""
    return str(e).splitlines()[0] if str(e) else "no detail"


def clean_state_dict(state_dict: dict) -> dict:
    """Strip the `_orig_mod.` (torch.compile) and `module.` (DDP) prefixes so names match a plain GPT."""
    prefixes = ("_orig_mod.", "module.")
    out = {}
    for name, tensor in state_dict.items():
        changed = True
        while changed:
            changed = False
            for p in prefixes:
                if name.startswith(p):
                    name, changed = name[len(p) :], True
        out[name] = tensor
    return out
