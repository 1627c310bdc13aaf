"""data/: the embedded pydoc dataset and local text files round-trip through the character tokenizer; the hub
path (`datasets.load_dataset`) on small local json/text files; the clear errors without the network."""

import json
import os
import re

import numpy as np
import pytest

import data
from data import DataError, ensure_dataset, get_tokenizer, load_dataset_dir
from data import prepare as prep


def test_pydoc_prepares_offline_and_round_trips(tmp_path):
    meta = prep.prepare_pydoc(str(tmp_path))
    ds = load_dataset_dir(str(tmp_path))
    text = prep.pydoc_text()
    assert len(text) > 400_000, "pydoc_data should hold the ~0.5 MB of Python's documentation topics"
    assert ds.train.dtype == np.uint16 and meta["dtype"] == "uint16"
    assert len(ds.train) + len(ds.val) == len(text) == meta["train_tokens"] + meta["val_tokens"]
    assert 0.05 < len(ds.val) / len(text) < 0.15
    tok = get_tokenizer(json.load(open(tmp_path / "meta.json")))  # from the file, as train/sample do
    assert tok.vocab_size == ds.vocab_size == len(set(text)) and tok.eot_token is None
    assert tok.decode(np.concatenate([ds.train, ds.val]).tolist()) == text
    assert tok.decode(tok.encode("The assert statement")) == "The assert statement"
    with pytest.raises(ValueError, match="character '\u2603' is not in this character-level vocabulary"):
        tok.encode("snow \u2603")
    with pytest.raises(ValueError, match="token 999 is outside the vocabulary"):
        tok.decode([1, 999])


def test_ensure_dataset_prepares_pydoc_once(tmp_path):
    directory = str(tmp_path / "pydoc")
    first = ensure_dataset("pydoc", directory)
    mtime = os.path.getmtime(os.path.join(directory, "train.bin"))
    second = ensure_dataset("pydoc", directory)
    assert os.path.getmtime(os.path.join(directory, "train.bin")) == mtime
    assert np.array_equal(first.val, second.val)
    assert not [f for f in os.listdir(directory) if f.endswith(".tmp")]


def test_char_dataset_from_a_local_file_via_the_cli(tmp_path):
    text = "".join(f"line {i}: the quick brown fox jumps over the lazy dog\n" for i in range(50))
    src = tmp_path / "book.txt"
    src.write_text(text)
    prep.main(["char", f"--input={src}", f"--out_dir={tmp_path / 'book'}"])
    ds = load_dataset_dir(str(tmp_path / "book"))
    assert get_tokenizer(ds.meta).decode(np.concatenate([ds.train, ds.val]).tolist()) == text
    with pytest.raises(DataError, match="input: got .*not a file"):
        prep.main(["char", f"--input={tmp_path / 'nope.txt'}"])


def test_ctrl_c_while_writing_leaves_no_half_dataset(tmp_path, monkeypatch):
    """Ctrl-C during a rewrite, just before meta.json: no temporary file is left, and the directory holds no
    dataset that would load (new .bin files beside the old meta.json would be a silently wrong dataset)."""
    text = "".join(f"line {i}: the quick brown fox\n" for i in range(50))
    prep.prepare_char_text(text, str(tmp_path))
    real_replace = os.replace

    def interrupted(src, dst):
        if dst.endswith("meta.json"):
            raise KeyboardInterrupt
        real_replace(src, dst)

    monkeypatch.setattr(prep.os, "replace", interrupted)
    with pytest.raises(KeyboardInterrupt):
        prep.prepare_char_text(text.upper(), str(tmp_path))
    assert sorted(os.listdir(tmp_path)) == ["train.bin", "val.bin"]
    with pytest.raises(DataError):
        load_dataset_dir(str(tmp_path))
    monkeypatch.setattr(prep.os, "replace", real_replace)
    prep.prepare_char_text(text.upper(), str(tmp_path))  # the same command again prepares it
    ds = load_dataset_dir(str(tmp_path))
    assert get_tokenizer(ds.meta).decode(ds.train[:4].tolist()) == "LINE"


def byte_level_encoding():
    """A real tiktoken Encoding built offline (one token per byte, plus <|endoftext|>), standing in for GPT-2's
    BPE files, which tiktoken downloads."""
    import tiktoken

    return tiktoken.Encoding(
        name="bytes",
        pat_str=r"\S+|\s+",
        mergeable_ranks={bytes([i]): i for i in range(256)},
        special_tokens={"<|endoftext|>": 256},
    )


DOCS = [f"Story {i}. Once upon a time a small model read {i} words." for i in range(40)]


@pytest.mark.parametrize("layout", ["json-with-val-split", "text-held-out-val"])
def test_hub_path_on_local_files(tmp_path, monkeypatch, layout):
    pytest.importorskip("datasets")  # a core dependency, but the GPU machine has none
    import tiktoken

    monkeypatch.setattr(tiktoken, "get_encoding", lambda name: byte_level_encoding())
    if layout == "json-with-val-split":
        for split, docs in (("train", DOCS[:30]), ("validation", DOCS[30:])):
            (tmp_path / f"{split}.jsonl").write_text("".join(json.dumps({"story": d}) + "\n" for d in docs))
        source = prep.HubSource(
            "json",
            data_files={s: str(tmp_path / f"{s}.jsonl") for s in ("train", "validation")},
            text_field="story",
            val_split="validation",
        )
        want_train, want_val = DOCS[:30], DOCS[30:]
    else:
        (tmp_path / "all.txt").write_text("\n".join(DOCS) + "\n")  # the "text" builder: one document per line
        source = prep.HubSource("text", data_files={"train": str(tmp_path / "all.txt")}, val_every=10)
        want_val = [d for i, d in enumerate(DOCS) if i % 10 == 9]
        want_train = [d for i, d in enumerate(DOCS) if i % 10 != 9]
    out = str(tmp_path / "out")
    meta = prep.prepare_hub(source, out, chunk_docs=7)  # chunks smaller than the dataset: exercises the writer
    assert meta["tokenizer"] == {"kind": "tiktoken", "encoding": "gpt2", "vocab_size": 257, "eot_token": 256}
    ds = load_dataset_dir(out)
    tok = get_tokenizer(ds.meta)
    for tokens, want in ((ds.train, want_train), (ds.val, want_val)):
        assert tokens.dtype == np.uint16
        assert tok.decode(tokens.tolist()).split("<|endoftext|>")[:-1] == want
        assert tokens[-1] == tok.eot_token


def test_hub_path_max_docs(tmp_path, monkeypatch):
    pytest.importorskip("datasets")  # a core dependency, but the GPU machine has none
    import tiktoken

    monkeypatch.setattr(tiktoken, "get_encoding", lambda name: byte_level_encoding())
    (tmp_path / "all.txt").write_text("\n".join(DOCS) + "\n")
    source = prep.HubSource("text", data_files={"train": str(tmp_path / "all.txt")}, val_every=4)
    prep.prepare_hub(source, str(tmp_path / "out"), max_docs=12, streaming=False)
    ds = load_dataset_dir(str(tmp_path / "out"))
    tok = get_tokenizer(ds.meta)
    assert len(tok.decode(ds.train.tolist()).split("<|endoftext|>")[:-1]) == 12


def test_offline_hub_dataset_fails_fast_naming_pydoc(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_ENDPOINT", "https://127.0.0.1:9")  # a port nothing listens on: refused at once
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    chars = data.char_meta("".join(sorted(set("".join(DOCS)))))
    with pytest.raises(DataError, match="cannot reach 127.0.0.1.*--dataset=pydoc"):
        prep.prepare_hub(prep.HUB_DATASETS["tinystories"], str(tmp_path / "ts"), tokenizer_meta=chars)
    assert not os.path.exists(tmp_path / "ts" / "meta.json")


def test_offline_tokenizer_fails_naming_pydoc(monkeypatch):
    import tiktoken

    def no_network(name):
        raise ConnectionError(f"Failed to resolve 'openaipublic.blob.core.windows.net' for {name}")

    monkeypatch.setattr(tiktoken, "get_encoding", no_network)
    with pytest.raises(DataError, match="tokenizer 'gpt2': tiktoken could not load .*--dataset=pydoc"):
        get_tokenizer({"kind": "tiktoken", "encoding": "gpt2", "vocab_size": 50257, "eot_token": 50256})


def test_unprepared_and_unknown_datasets(tmp_path, monkeypatch):
    with pytest.raises(DataError, match=r"run `python -m data.prepare tinystories` first.*--dataset=pydoc"):
        ensure_dataset("tinystories", str(tmp_path / "ts"))
    with pytest.raises(DataError, match="valid: pydoc, char, tinystories, fineweb_edu, openwebtext"):
        ensure_dataset("shakespeare", str(tmp_path / "sh"))
    # An unknown name lists the datasets prepared under data/ too, and how to prepare one's own text under it.
    monkeypatch.setattr(data, "DATA_ROOT", str(tmp_path / "root"))
    text = tmp_path / "a.txt"
    text.write_text("some text to model, " * 20)
    prep.main(["char", f"--input={text}", "--name=book"])
    ensure_dataset("pydoc")  # built in: not listed twice
    with pytest.raises(
        DataError,
        match=r"got 'shakespeare' with no prepared data in .*root/shakespeare; valid: "
        r"pydoc, char, tinystories, fineweb_edu, openwebtext, book, or a text file "
        r"of your own prepared as 'shakespeare' \(`python -m data.prepare char "
        r"--input=FILE --name=shakespeare`\)",
    ):
        ensure_dataset("shakespeare")
    assert len(ensure_dataset("book").train) > 0
    with pytest.raises(DataError, match="meta\\['kind'\\]: got 'bpe'"):
        get_tokenizer({"kind": "bpe"})


def _damage(directory, how: str):
    """One kind of damage to a prepared dataset's files."""
    meta_path = os.path.join(directory, "meta.json")
    meta = json.load(open(meta_path))
    if how == "no val.bin":
        os.remove(os.path.join(directory, "val.bin"))
    elif how == "meta not json":
        open(meta_path, "w").write("{not json")
    elif how == "meta without dtype":
        del meta["dtype"]
        json.dump(meta, open(meta_path, "w"))
    elif how == "odd bytes":
        with open(os.path.join(directory, "train.bin"), "ab") as f:
            f.write(b"\0")
    elif how == "empty val.bin":
        open(os.path.join(directory, "val.bin"), "wb").close()
    elif how == "truncated train.bin":
        os.truncate(os.path.join(directory, "train.bin"), 1000)
    elif how == "vocab_size lowered":
        meta["tokenizer"]["vocab_size"] = 10
        json.dump(meta, open(meta_path, "w"))
    return {
        "no val.bin": r"val\.bin: missing",
        "meta not json": r"meta\.json: not a readable JSON file",
        "meta without dtype": r"meta\.json: expected keys 'tokenizer' \(with 'vocab_size'\) and 'dtype'",
        "odd bytes": r"train\.bin: [\d,]+ bytes, where meta\.json says [\d,]+ uint16 tokens",
        "empty val.bin": r"val\.bin: 0 bytes, where meta\.json says [\d,]+ uint16 tokens",
        "truncated train.bin": r"train\.bin: 1,000 bytes, where meta\.json says [\d,]+ uint16 tokens",
        "vocab_size lowered": r"meta\.json: vocab_size 10 but \d+ characters",
    }[how]


@pytest.mark.parametrize(
    "how",
    [
        "no val.bin",
        "meta not json",
        "meta without dtype",
        "odd bytes",
        "empty val.bin",
        "truncated train.bin",
        "vocab_size lowered",
    ],
)
def test_damaged_dataset_is_a_data_error(tmp_path, how):
    """A prepared dataset whose files do not match its meta.json is refused with a message naming the file and
    the fix, never a traceback from numpy or json, and never silently trained on (a truncated train.bin)."""
    directory = str(tmp_path / "pydoc")
    ensure_dataset("pydoc", directory)
    pattern = _damage(directory, how)
    with pytest.raises(DataError, match=pattern + ".*re-prepare the dataset"):
        load_dataset_dir(directory)


def test_prepare_cli_refuses_bad_input_and_names(tmp_path, monkeypatch, capsys):
    """A binary --input, an --out_dir that is a file, a --name that is a path or a built-in dataset's, or one that
    holds a dataset from another file, are DataErrors; argument misuse is argparse's error; a failed run leaves no
    meta.json beside new .bin files (the old meta goes first), so nothing half-written loads."""
    text = tmp_path / "a.txt"
    text.write_text("some text to model, " * 20)
    binary = tmp_path / "b.bin"
    binary.write_bytes(bytes(range(256)) * 4)
    with pytest.raises(DataError, match=r"input: got .*b\.bin', which cannot be read: not UTF-8 text"):
        prep.main(["char", f"--input={binary}", f"--out_dir={tmp_path / 'out'}"])
    with pytest.raises(DataError, match=r"directory: cannot create .*a\.txt' \(File exists\)"):
        prep.main(["char", f"--input={text}", f"--out_dir={text}"])
    for name, needle in (
        ("", "a plain directory name"),
        ("../x", "a plain directory name"),
        ("tinystories", "a built-in dataset's name"),
    ):
        with pytest.raises(DataError, match=rf"--name: got '{re.escape(name)}'.*{needle}"):
            prep.main(["char", f"--input={text}", f"--name={name}"])
    monkeypatch.setattr(data, "DATA_ROOT", str(tmp_path / "root"))
    prep.main(["char", f"--input={text}", "--name=mine"])
    other = tmp_path / "c.txt"
    other.write_text("other text to model, " * 20)
    with pytest.raises(DataError, match=r"--name: 'mine' already holds a dataset prepared from .*a\.txt"):
        prep.main(["char", f"--input={other}", "--name=mine"])
    for argv, needle in (
        (["char"], "--input is required"),
        (["pydoc", "--name=x"], "given for pydoc"),
        (["tinystories", "--max_docs=-1"], "--max_docs: got -1"),
    ):
        with pytest.raises(SystemExit):
            prep.main(argv)
        assert needle in capsys.readouterr().err
    directory = tmp_path / "half"
    ensure_dataset("pydoc", str(directory))
    with pytest.raises(DataError, match="the val split came out empty"):
        prep.write_dataset(str(directory), [np.arange(10, dtype=np.uint16)], [], data.char_meta("ab"))
    assert not (directory / "meta.json").exists()


def test_a_builtin_name_must_find_that_dataset(tmp_path):
    """--dataset=tinystories with a --data_dir holding pydoc would train on pydoc and record tinystories."""
    directory = str(tmp_path / "pydoc")
    ensure_dataset("pydoc", directory)
    with pytest.raises(
        DataError,
        match=r"dataset: got 'tinystories', but .* holds a dataset prepared from "
        r"\"pydoc_data\.topics .*valid: the --dataset that directory was prepared as",
    ):
        ensure_dataset("tinystories", directory)
    assert len(ensure_dataset("book", directory).train) > 0  # any other name: what the directory holds
