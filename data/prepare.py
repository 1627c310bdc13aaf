"""Prepare a dataset into data/<name>/{train.bin, val.bin, meta.json} (layout in data/__init__.py).

    python -m data.prepare pydoc                          # embedded, offline, character-level (train.py does it)
    python -m data.prepare char --input=book.txt --name=book   # any local text file, character-level
    python -m data.prepare tinystories                    # GPT-2 BPE; --max_docs=100000 for a quick subset
    python -m data.prepare fineweb_edu --max_docs=2000000 # streamed from the hub, GPT-2 BPE
    python -m data.prepare openwebtext --max_docs=500000  # streamed from the hub, GPT-2 BPE

Hub datasets go through `datasets.load_dataset` (streamed by default, so a subset needs no full download) and
tiktoken's GPT-2 encoding, one end-of-text token after each document. Both need the network the first time;
without it they stop with a message naming the offline alternative (`--dataset=pydoc`). Every file is written to a
temporary name and renamed into place, meta.json last, so an interrupted run never leaves a half dataset behind.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import tempfile
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from urllib.parse import urlparse

import numpy as np

from data import OFFLINE_HINT, DataError, char_meta, dataset_dir, get_tokenizer, tiktoken_meta, token_dtype


@dataclass
class HubSource:
    """Arguments of `datasets.load_dataset` for one dataset, and where its text and splits are."""

    path: str  # hub id ("roneneldan/TinyStories") or a builder for local files ("json", "text", "parquet")
    name: str | None = None  # the hub config ("sample-10BT")
    data_files: dict | None = None  # local files per split: {"train": [...], "validation": [...]}
    text_field: str = "text"
    train_split: str = "train"
    val_split: str | None = None  # None: hold out every `val_every`-th training document instead
    val_every: int = 1000

    @property
    def on_hub(self) -> bool:
        return self.data_files is None


HUB_DATASETS = {
    "tinystories": HubSource("roneneldan/TinyStories", val_split="validation"),
    "fineweb_edu": HubSource("HuggingFaceFW/fineweb-edu", name="sample-10BT"),
    "openwebtext": HubSource("Skylion007/openwebtext"),
}


# ----------------------------------------------------------------------------------------------- character level


def pydoc_text() -> str:
    """Python's bundled documentation topics (the text behind `help("assert")`), in a fixed order."""
    from pydoc_data.topics import topics

    return "\n\n".join(topics[k] for k in sorted(topics))


def prepare_pydoc(directory: str) -> dict:
    return prepare_char_text(pydoc_text(), directory, source="pydoc_data.topics (Python's bundled documentation)")


def prepare_char_file(input_path: str, directory: str, val_fraction: float = 0.1) -> dict:
    if not os.path.isfile(input_path):
        raise DataError(f"input: got {input_path!r}, which is not a file; valid: a path to a UTF-8 text file")
    try:
        with open(input_path, encoding="utf-8") as f:
            text = f.read()
    except (OSError, UnicodeDecodeError) as e:
        why = e.strerror if isinstance(e, OSError) else f"not UTF-8 text ({e.reason} at byte {e.start})"
        raise DataError(f"input: got {input_path!r}, which cannot be read: {why}; valid: a UTF-8 text file") from None
    return prepare_char_text(text, directory, val_fraction, source=os.path.abspath(input_path))


def prepare_char_text(text: str, directory: str, val_fraction: float = 0.1, source: str = "") -> dict:
    """Character-level: the vocabulary is the text's sorted characters; the last `val_fraction` is validation."""
    if not 0 < val_fraction < 1:
        raise DataError(f"val_fraction: got {val_fraction}; valid: a number in (0, 1)")
    if len(text) < 100:
        raise DataError(f"text: got {len(text)} characters; valid: at least 100")
    tokenizer_meta = char_meta("".join(sorted(set(text))))
    ids = np.array(get_tokenizer(tokenizer_meta).encode(text), dtype=token_dtype(tokenizer_meta["vocab_size"]))
    n_train = int(len(ids) * (1 - val_fraction))
    return write_dataset(directory, [ids[:n_train]], [ids[n_train:]], tokenizer_meta, source=source)


# ----------------------------------------------------------------------------------------------- hub datasets


def prepare_hub(
    source: HubSource,
    directory: str,
    max_docs: int = 0,
    streaming: bool = True,
    tokenizer_meta: dict | None = None,
    chunk_docs: int = 1024,
) -> dict:
    """Tokenize a `datasets` dataset (hub or local files) with GPT-2 BPE (or `tokenizer_meta`) into `directory`.
    `max_docs` > 0 caps the training documents (a subset of a web-scale corpus)."""
    tokenizer_meta = tokenizer_meta or tiktoken_meta("gpt2")  # fails first, and fast, without the network
    tokenizer = get_tokenizer(tokenizer_meta)
    train_docs = _documents(source, source.train_split, streaming)
    if source.val_split is not None:
        val_docs = _documents(source, source.val_split, streaming)
    else:  # hold out every k-th document; a small --max_docs subset still gets ~10 validation documents
        every = min(source.val_every, max(2, max_docs // 10)) if max_docs > 0 else source.val_every
        train_docs, val_docs = _hold_out(train_docs, every)
    if max_docs > 0:
        train_docs = _take(train_docs, max_docs)
        val_docs = _take(val_docs, max(1, max_docs // 100)) if source.val_split is not None else val_docs
    dtype = token_dtype(tokenizer_meta["vocab_size"])

    def tokens(docs: Iterable[str]) -> Iterator[np.ndarray]:
        for chunk in _chunks(docs, chunk_docs):
            ids = []
            for doc_ids in _encode_batch(tokenizer, chunk):
                ids.extend(doc_ids)
                if tokenizer.eot_token is not None:
                    ids.append(tokenizer.eot_token)
            yield np.array(ids, dtype=dtype)

    desc = f"{source.path}" + (f" ({source.name})" if source.name else "")
    return write_dataset(directory, tokens(train_docs), tokens(val_docs), tokenizer_meta, source=desc)


def _documents(source: HubSource, split: str, streaming: bool) -> Iterator[str]:
    """Yield the text of each document of one split; network failures become a DataError with the offline hint."""
    if source.on_hub:
        _check_hub_reachable(source.path)
    try:
        import datasets
    except ImportError:
        raise DataError(f"dataset {source.path!r}: the `datasets` package is not installed; {OFFLINE_HINT}") from None
    try:
        ds = datasets.load_dataset(
            source.path, source.name, data_files=source.data_files, split=split, streaming=streaming
        )
        for row in ds:
            yield row[source.text_field]
    except DataError:
        raise
    except Exception as e:
        hint = f"; {OFFLINE_HINT}" if source.on_hub else ""
        raise DataError(f"dataset {source.path!r} split {split!r}: could not load it ({type(e).__name__}: {e}){hint}")


def _check_hub_reachable(repo: str, timeout: float = 3.0) -> None:
    """Fail in seconds, not after minutes of retries, when the hub cannot be reached (HF_HUB_OFFLINE=1 skips this
    and reads the local HF cache)."""
    if os.environ.get("HF_HUB_OFFLINE", "0") == "1":
        return
    host = urlparse(os.environ.get("HF_ENDPOINT", "https://huggingface.co")).hostname or "huggingface.co"
    try:
        socket.create_connection((host, 443), timeout=timeout).close()
    except OSError as e:
        raise DataError(
            f"dataset {repo!r}: cannot reach {host} ({e}); with a copy in the local HF cache set HF_HUB_OFFLINE=1; "
            f"{OFFLINE_HINT}"
        ) from None


def _hold_out(docs: Iterable[str], every: int) -> tuple[Iterator[str], Iterator[str]]:
    """Split one stream into train and val (every `every`-th document), reading the source once.
    The val list fills while train is consumed; val is written after train, so it is complete by then."""
    held: list[str] = []

    def train() -> Iterator[str]:
        for i, doc in enumerate(docs):
            if i % every == every - 1:
                held.append(doc)
            else:
                yield doc

    return train(), iter(_Deferred(held))


class _Deferred:
    """Iterates over a list that is filled later (when iteration starts, not when this object is made)."""

    def __init__(self, items: list):
        self.items = items

    def __iter__(self):
        return iter(self.items)


def _take(docs: Iterable[str], n: int) -> Iterator[str]:
    for i, doc in enumerate(docs):
        if i >= n:
            return
        yield doc


def _chunks(docs: Iterable[str], n: int) -> Iterator[list[str]]:
    chunk: list[str] = []
    for doc in docs:
        chunk.append(doc)
        if len(chunk) == n:
            yield chunk
            chunk = []
    if chunk:
        yield chunk


def _encode_batch(tokenizer, texts: list[str]) -> list[list[int]]:
    enc = getattr(tokenizer, "enc", None)
    if enc is not None:  # tiktoken encodes a batch on several threads
        return enc.encode_ordinary_batch(texts, num_threads=os.cpu_count() or 1)
    return [tokenizer.encode(t) for t in texts]


# ----------------------------------------------------------------------------------------------- writing


def write_dataset(
    directory: str, train: Iterable[np.ndarray], val: Iterable[np.ndarray], tokenizer_meta: dict, source: str = ""
) -> dict:
    """Write the token chunks of each split and meta.json (last) into `directory`; return the meta dict. An older
    meta.json goes first: until the new one is written the directory holds no dataset that would load (a failed
    run would otherwise leave new .bin files beside the old meta)."""
    try:
        os.makedirs(directory, exist_ok=True)
    except OSError as e:
        raise DataError(
            f"directory: cannot create {directory!r} ({e.strerror}); valid: a writable directory path"
        ) from None
    if os.path.exists(os.path.join(directory, "meta.json")):
        os.remove(os.path.join(directory, "meta.json"))
    dtype = token_dtype(tokenizer_meta["vocab_size"])
    counts = {
        split: _write_tokens(os.path.join(directory, f"{split}.bin"), chunks, dtype)
        for split, chunks in (("train", train), ("val", val))
    }
    for split, n in counts.items():
        if n == 0:
            raise DataError(f"dataset {source!r}: the {split} split came out empty; valid: at least one document")
    meta = {
        "tokenizer": tokenizer_meta,
        "dtype": dtype.name,
        "train_tokens": counts["train"],
        "val_tokens": counts["val"],
        "source": source,
    }
    _write_whole(os.path.join(directory, "meta.json"), lambda f: f.write(json.dumps(meta, indent=1).encode()))
    print(
        f"prepared {directory}: {counts['train']:,} train and {counts['val']:,} val tokens, "
        f"vocab {tokenizer_meta['vocab_size']}, {dtype.name}"
    )
    return meta


def _write_tokens(path: str, chunks: Iterable[np.ndarray], dtype: np.dtype) -> int:
    n = 0

    def write(f):
        nonlocal n
        for chunk in chunks:
            np.asarray(chunk, dtype=dtype).tofile(f)
            n += len(chunk)

    _write_whole(path, write)
    return n


def _write_whole(path: str, write) -> None:
    """write(f) into a temporary file beside path, renamed into place only when it is whole: an interrupted or
    failed write leaves path as it was and no temporary file behind."""
    fd, tmp = _temp_beside(path)
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def _temp_beside(path: str) -> tuple[int, str]:
    """A temporary file in path's directory (so os.replace is atomic), with a normal file's mode (not 0600)."""
    fd, tmp = tempfile.mkstemp(prefix=f".{os.path.basename(path)}.", suffix=".tmp", dir=os.path.dirname(path))
    mask = os.umask(0)
    os.umask(mask)
    os.chmod(tmp, 0o666 & ~mask)
    return fd, tmp


# ----------------------------------------------------------------------------------------------- command line


def _check_name(name: str, input_path: str, reserved: list[str]) -> None:
    """A char dataset's name is a directory under data/: a plain name, none of the built-in datasets', and not
    one that already holds a dataset prepared from another file (that would be replaced in silence)."""
    if not name or name in (".", "..") or os.sep in name or (os.altsep and os.altsep in name) or name == "__pycache__":
        raise DataError(f"--name: got {name!r}; valid: a plain directory name under data/ (no path separators)")
    if name in reserved and name != "char":
        raise DataError(f"--name: got {name!r}, a built-in dataset's name; valid: any other name")
    meta_path = os.path.join(dataset_dir(name), "meta.json")
    if os.path.isfile(meta_path):
        try:
            with open(meta_path, encoding="utf-8") as f:
                source = json.load(f).get("source")
        except (OSError, ValueError, AttributeError):
            source = None
        if source not in (None, os.path.abspath(input_path)):
            raise DataError(
                f"--name: {name!r} already holds a dataset prepared from {source!r}; valid: another "
                f"--name, or delete {os.path.dirname(meta_path)} first"
            )


def main(argv: list[str] | None = None) -> None:
    names = ["pydoc", "char", *HUB_DATASETS]
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("dataset", choices=names)
    p.add_argument("--out_dir", default="", help="where to write (default data/<dataset>, or data/<name> for char)")
    p.add_argument("--input", default="", help="char: the UTF-8 text file to prepare")
    p.add_argument("--name", default="char", help="char: the dataset name (train.py --dataset=NAME)")
    p.add_argument("--max_docs", type=int, default=0, help="hub: cap the number of training documents (0: all)")
    p.add_argument("--no_streaming", action="store_true", help="hub: download the whole split first")
    args = p.parse_args(argv)
    if args.max_docs < 0:
        p.error(f"--max_docs: got {args.max_docs}; valid: 0 (all documents) or a positive int")
    if args.dataset != "char" and (args.input or args.name != "char"):
        p.error(f"--input / --name: given for {args.dataset}; valid: only with char")
    if args.dataset == "pydoc":
        prepare_pydoc(dataset_dir("pydoc", args.out_dir))
    elif args.dataset == "char":
        if not args.input:
            p.error("char: --input is required (the UTF-8 text file to prepare)")
        if not args.out_dir:
            _check_name(args.name, args.input, names)
        prepare_char_file(args.input, dataset_dir(args.name, args.out_dir))
    else:
        out = dataset_dir(args.dataset, args.out_dir)
        prepare_hub(HUB_DATASETS[args.dataset], out, max_docs=args.max_docs, streaming=not args.no_streaming)


if __name__ == "__main__":
    try:
        main()
    except DataError as e:
        raise SystemExit(f"error: {e}") from None
    except KeyboardInterrupt:  # every file is renamed into place whole, meta.json last: nothing to clean up
        print("\nstopped (Ctrl-C): no file was left half-written; the same command prepares it", file=sys.stderr)
        sys.exit(130)
