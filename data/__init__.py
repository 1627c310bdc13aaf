"""Datasets as memory-mapped token files, and the tokenizers that made them.

A prepared dataset is a directory `data/<name>/` with
    train.bin, val.bin   flat token ids (uint16 when the vocabulary fits, else uint32), read with np.memmap
    meta.json            {"tokenizer": {...}, "dtype": "uint16", "train_tokens": ..., "val_tokens": ..., ...}
The tokenizer dict is what checkpoints carry (`tokenizer` key) and what `get_tokenizer` rebuilds a tokenizer from:
    {"kind": "char", "chars": "...", "vocab_size": N, "eot_token": None}      character-level, works offline
    {"kind": "tiktoken", "encoding": "gpt2", "vocab_size": 50257, "eot_token": 50256}   GPT-2 BPE

Datasets (prepare with `python -m data.prepare NAME`, see data/prepare.py):
    pydoc        Python's bundled documentation (`pydoc_data`), ~0.5 MB of English prose, character-level.
                 No network; train.py prepares it automatically the first time it is used.
    char         any local text file, character-level (`python -m data.prepare char --input=book.txt`)
    tinystories  roneneldan/TinyStories, GPT-2 BPE (small: ~470M tokens; --max_docs for a subset)
    fineweb_edu  HuggingFaceFW/fineweb-edu sample-10BT, GPT-2 BPE (web-scale; streamed, --max_docs to cap)
    openwebtext  Skylion007/openwebtext, GPT-2 BPE (web-scale; streamed, --max_docs to cap)
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

import numpy as np

DATA_ROOT = os.path.dirname(os.path.abspath(__file__))
OFFLINE_HINT = "offline, use the embedded character-level dataset instead: --dataset=pydoc"


class DataError(ValueError):
    """A dataset or tokenizer that cannot be prepared or loaded (unknown name, no network, missing files)."""


# ----------------------------------------------------------------------------------------------- tokenizers


class CharTokenizer:
    """One token per character of a fixed alphabet (the characters of the training text, sorted)."""

    def __init__(self, chars: str):
        if len(set(chars)) != len(chars):
            raise DataError("char tokenizer: meta['chars'] has repeated characters; re-prepare the dataset")
        self.chars = chars
        self.stoi = {c: i for i, c in enumerate(chars)}
        self.vocab_size = len(chars)
        self.eot_token: int | None = None

    def encode(self, text: str) -> list[int]:
        try:
            return [self.stoi[c] for c in text]
        except KeyError as e:
            raise ValueError(
                f"text: character {e.args[0]!r} is not in this character-level vocabulary "
                f"({self.vocab_size} characters seen in the training text)"
            ) from None

    def decode(self, ids: list[int]) -> str:
        try:
            return "".join(self.chars[i] for i in ids)
        except IndexError:
            bad = next(i for i in ids if not 0 <= i < self.vocab_size)
            raise ValueError(f"ids: token {bad} is outside the vocabulary [0, {self.vocab_size})") from None


class TiktokenTokenizer:
    """A tiktoken BPE encoding (GPT-2's by default); its files are downloaded once, then cached by tiktoken."""

    def __init__(self, encoding: str = "gpt2"):
        try:
            import tiktoken
        except ImportError:
            raise DataError(f"tokenizer {encoding!r}: the tiktoken package is not installed; {OFFLINE_HINT}") from None
        try:
            self.enc = tiktoken.get_encoding(encoding)
        except Exception as e:  # no network and no cached BPE file: requests/urllib errors of many kinds
            raise DataError(
                f"tokenizer {encoding!r}: tiktoken could not load its BPE files ({type(e).__name__}: {e}); it "
                f"downloads them once (cached in $TIKTOKEN_CACHE_DIR); {OFFLINE_HINT}"
            ) from e
        self.vocab_size = self.enc.n_vocab
        self.eot_token: int | None = self.enc.eot_token

    def encode(self, text: str) -> list[int]:
        return self.enc.encode_ordinary(text)

    def decode(self, ids: list[int]) -> str:
        return self.enc.decode(list(ids))


Tokenizer = CharTokenizer | TiktokenTokenizer


def get_tokenizer(meta: dict) -> Tokenizer:
    """Rebuild the tokenizer described by `meta` (a dataset's meta.json, its "tokenizer" entry, or a checkpoint's
    `tokenizer` dict)."""
    if not isinstance(meta, dict):
        raise DataError(f"meta: got {type(meta).__name__}; valid: a dict with a 'kind' key ('char' or 'tiktoken')")
    tok = meta.get("tokenizer", meta)
    kind = tok.get("kind")
    if kind == "char":
        return CharTokenizer(tok["chars"])
    if kind == "tiktoken":
        return TiktokenTokenizer(tok.get("encoding", "gpt2"))
    raise DataError(f"meta['kind']: got {kind!r}; valid: 'char' or 'tiktoken'")


def char_meta(chars: str) -> dict:
    return {"kind": "char", "chars": chars, "vocab_size": len(chars), "eot_token": None}


def tiktoken_meta(encoding: str = "gpt2") -> dict:
    tok = TiktokenTokenizer(encoding)
    return {"kind": "tiktoken", "encoding": encoding, "vocab_size": tok.vocab_size, "eot_token": tok.eot_token}


def token_dtype(vocab_size: int) -> np.dtype:
    return np.dtype(np.uint16) if vocab_size <= 2**16 else np.dtype(np.uint32)


# ----------------------------------------------------------------------------------------------- prepared data


@dataclass
class TokenData:
    """A prepared dataset: memory-mapped train/val tokens and its meta dict."""

    train: np.memmap
    val: np.memmap
    meta: dict

    @property
    def vocab_size(self) -> int:
        return self.meta["tokenizer"]["vocab_size"]


def dataset_dir(name: str, data_dir: str = "") -> str:
    return data_dir or os.path.join(DATA_ROOT, name)


def load_dataset_dir(directory: str) -> TokenData:
    """Open a prepared dataset directory (train.bin, val.bin, meta.json). Each file is checked against meta.json
    first: a missing, unreadable, empty or truncated one is a DataError that names it, not a traceback later."""
    redo = "re-prepare the dataset (`python -m data.prepare NAME`; pydoc: delete the directory, train.py rebuilds it)"
    meta_path = os.path.join(directory, "meta.json")
    if not os.path.isfile(meta_path):
        raise DataError(f"dataset directory {directory!r}: no meta.json (prepare it with `python -m data.prepare`)")
    try:
        with open(meta_path, encoding="utf-8") as f:
            meta = json.load(f)
    except (OSError, ValueError) as e:  # unreadable, not UTF-8, not JSON
        raise DataError(f"{meta_path}: not a readable JSON file ({type(e).__name__}: {e}); {redo}") from None
    tok = meta.get("tokenizer") if isinstance(meta, dict) else None
    if not isinstance(tok, dict) or not isinstance(tok.get("vocab_size"), int) or "dtype" not in meta:
        raise DataError(f"{meta_path}: expected keys 'tokenizer' (with 'vocab_size') and 'dtype'; {redo}")
    if tok.get("kind") == "char" and len(tok.get("chars", "")) != tok["vocab_size"]:
        raise DataError(
            f"{meta_path}: vocab_size {tok['vocab_size']} but {len(tok.get('chars', ''))} characters; {redo}"
        )
    if meta["dtype"] not in ("uint16", "uint32"):
        raise DataError(f"{meta_path}: dtype {meta['dtype']!r}; valid: 'uint16' or 'uint32'; {redo}")
    dtype = np.dtype(meta["dtype"])
    splits = []
    for split in ("train", "val"):
        path = os.path.join(directory, f"{split}.bin")
        if not os.path.isfile(path):
            raise DataError(f"{path}: missing; {redo}")
        size = os.path.getsize(path)
        expected = meta.get(f"{split}_tokens")
        if size == 0 or size % dtype.itemsize or (expected is not None and size != expected * dtype.itemsize):
            want = f"{expected:,} {dtype.name} tokens" if expected is not None else f"whole {dtype.name} tokens"
            raise DataError(
                f"{path}: {size:,} bytes, where meta.json says {want}: the file is empty, truncated or "
                f"from another preparation; {redo}"
            )
        splits.append(np.memmap(path, dtype=dtype, mode="r"))
    return TokenData(train=splits[0], val=splits[1], meta=meta)


def prepared_datasets() -> list[str]:
    """The datasets prepared under data/ other than the built-in names (`data.prepare char --name=NAME`)."""
    from data import prepare

    builtin = {"pydoc", "char", *prepare.HUB_DATASETS}
    return sorted(
        d for d in os.listdir(DATA_ROOT) if d not in builtin and os.path.isfile(os.path.join(DATA_ROOT, d, "meta.json"))
    )


def ensure_dataset(name: str, data_dir: str = "") -> TokenData:
    """Load dataset `name` (from `data_dir` when given, else data/<name>/). The embedded `pydoc` dataset is prepared
    on first use; the others must be prepared first with `python -m data.prepare NAME`."""
    directory = dataset_dir(name, data_dir)
    if not os.path.isfile(os.path.join(directory, "meta.json")):
        from data import prepare

        if name == "pydoc":
            prepare.prepare_pydoc(directory)
        elif name == "char":
            raise DataError(
                f"dataset 'char' is not prepared in {directory}: run `python -m data.prepare char "
                f"--input=your_text.txt` first (any local text file, no network)"
            )
        elif name in prepare.HUB_DATASETS:
            raise DataError(
                f"dataset {name!r} is not prepared in {directory}: run `python -m data.prepare {name}` first "
                f"(it needs the network for hub datasets); {OFFLINE_HINT}"
            )
        else:
            valid = ", ".join(["pydoc", "char", *prepare.HUB_DATASETS, *prepared_datasets()])
            raise DataError(
                f"dataset: got {name!r} with no prepared data in {directory}; valid: {valid}, or a text "
                f"file of your own prepared as {name!r} (`python -m data.prepare char --input=FILE "
                f"--name={name}`)"
            )
    loaded = load_dataset_dir(directory)
    _check_source(name, directory, loaded.meta.get("source"))
    return loaded


def _check_source(name: str, directory: str, source) -> None:
    """A built-in dataset's name must find that dataset (`--dataset=tinystories --data_dir=<a pydoc copy>` would
    train on pydoc and record tinystories). Other names (char datasets) are whatever the directory holds."""
    from data import prepare

    expected = "pydoc_data" if name == "pydoc" else getattr(prepare.HUB_DATASETS.get(name), "path", None)
    if expected is not None and isinstance(source, str) and not source.startswith(expected):
        raise DataError(
            f"dataset: got {name!r}, but {directory} holds a dataset prepared from {source!r}; valid: "
            f"the --dataset that directory was prepared as, or a --data_dir holding {name}"
        )
