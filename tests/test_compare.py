"""compare.py on the CPU: the table's numbers are the run directories' (metrics.jsonl and the checkpoint, also for an
older metrics.jsonl without the new keys), in every format; differing runs are flagged and seeds grouped (mean and
sample std); decode speed is measured on tiny checkpoints; the plots are written; missing or corrupt directories give
one clear error; no arguments finds the runs here; --help; a real train.py run compares end to end."""

import csv
import glob
import io
import json
import os
import statistics
import subprocess
import sys
from dataclasses import asdict

import pytest
import torch
from conftest import DEVICE, read_wandb_records

import compare
import train
from checkpoint import save_checkpoint
from compare import CompareError
from configurator import ConfigError
from model import GPT, GPTConfig

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NO_DECODE = ["--decode=False", "--plot="]


def tiny_config(attention: str, n_layer: int = 1) -> GPTConfig:
    mla = dict(kv_lora_rank=16, qk_rope_head_dim=4, qk_nope_head_dim=8, v_head_dim=8) if attention == "mla" else {}
    return GPTConfig(
        vocab_size=32,
        block_size=32,
        n_layer=n_layer,
        n_head=4,
        n_embd=32,
        bias=False,
        attention=attention,
        n_kv_head=2 if attention == "gqa" else None,
        pos_embedding="rope",
        attn_backend="torch",
        **mla,
    )


def make_run(
    directory,
    attention="mha",
    seed=1337,
    n_layer=1,
    dataset="pydoc",
    losses=(4.0, 3.0, 2.5),
    evals_planned=None,
    tok_s=(None, 1000.0, 3000.0),
    new_keys=True,
    dtype="float32",
    init_from="scratch",
    peaks=None,
):
    """A run directory as train.py writes it: metrics.jsonl (an eval every 10 iterations) and best.pt / last.pt
    (train.py's training_state keys) of a tiny model. evals_planned > len(losses): a run stopped early. peaks: the
    peak_memory_bytes of each line (None: a CPU run's)."""
    torch.manual_seed(seed)
    model = GPT(tiny_config(attention, n_layer))
    mc = model.config
    evals = evals_planned or len(losses)
    config = dict(
        train.DEFAULTS,
        out_dir=str(directory),
        seed=seed,
        dataset=dataset,
        dtype=dtype,
        device="cpu",
        batch_size=2,
        block_size=mc.block_size,
        n_layer=n_layer,
        n_head=mc.n_head,
        n_embd=mc.n_embd,
        attention=attention,
        n_kv_head=mc.n_kv_head,
        kv_lora_rank=mc.kv_lora_rank,
        max_iters=10 * (evals - 1),
        wandb_group="test-group",
        init_from=init_from,
    )
    tokens_per_iter = config["batch_size"] * config["block_size"]
    os.makedirs(directory, exist_ok=True)
    with open(os.path.join(directory, "metrics.jsonl"), "w") as f:
        for i, loss in enumerate(losses):
            line = dict(iter=10 * i, train_loss=loss, val_loss=loss, lr=1e-3, tokens_per_sec=tok_s[i], mfu=None)
            if new_keys:
                line.update(
                    tokens=10 * i * tokens_per_iter,
                    params=model.num_params(),
                    kv_cache_bytes_per_token=model.kv_cache_bytes_per_token(train.PTDTYPES[dtype]),
                    kv_cache_dtype=dtype,
                    peak_memory_bytes=peaks[i] if peaks else None,
                    attention=attention,
                    n_kv_head=mc.n_kv_head,
                    kv_lora_rank=mc.kv_lora_rank,
                    dataset=dataset,
                    seed=seed,
                    size=f"L{n_layer}-E{mc.n_embd}-H{mc.n_head}-T{mc.block_size}",
                    token_budget=config["max_iters"] * tokens_per_iter,
                    time=1.0e9 + i,
                )
            f.write(json.dumps(line) + "\n")
    state = dict(
        model=model.state_dict(),
        model_args=asdict(mc),
        config=config,
        iter_num=10 * (len(losses) - 1),
        best_val_loss=min(losses),
        optimizer={},
        scaler={},
        rng=[],
        data_state={},
        tokenizer={"kind": "char", "chars": "".join(chr(65 + i) for i in range(32)), "vocab_size": 32},
    )
    save_checkpoint(os.path.join(directory, "last.pt"), state)
    save_checkpoint(os.path.join(directory, "best.pt"), state)
    return model


def as_json(argv) -> dict:
    return json.loads(compare.main([*argv, "--format=json"])["text"])


def test_table_numbers_come_from_the_files(tmp_path, capsys):
    mha = make_run(tmp_path / "out-mha", "mha", losses=(4.0, 2.5, 2.75))
    make_run(tmp_path / "out-gqa", "gqa")
    make_run(tmp_path / "out-mla", "mla")
    dirs = [str(tmp_path / d) for d in ("out-mha", "out-gqa", "out-mla")]
    rows = {r["attention"]: r for r in as_json([*dirs, *NO_DECODE])["rows"]}
    assert list(rows) == ["mha", "gqa-kv2", "mla-r16"]  # the order given
    r = rows["mha"]
    assert r["params"] == mha.num_params() and r["n"] == 1 and r["seeds"] == [1337]
    assert r["tokens"] == 20 * 2 * 32 and r["token_budget"] == 20 * 2 * 32
    assert r["val_loss_best"] == 2.5 and r["val_loss_final"] == 2.75 and r["val_loss_best_std"] is None
    assert r["train_tokens_per_s"] == 2000.0  # the median of the logged windows (the first eval has none)
    assert r["mfu"] is None and r["train_peak_bytes"] is None and r["decode_tokens_per_s_b1"] is None
    # KV bytes per token, float32: 2 * n_layer * n_kv_head * head_dim * 4 and n_layer * (kv_lora_rank + rope) * 4
    assert (r["kv_bytes_per_token"], r["kv_formula"], r["kv_dtype"]) == (256, "2*1*4*8*4", "float32")
    assert (rows["gqa-kv2"]["kv_bytes_per_token"], rows["gqa-kv2"]["kv_formula"]) == (128, "2*1*2*8*4")
    assert (rows["mla-r16"]["kv_bytes_per_token"], rows["mla-r16"]["kv_formula"]) == (80, "1*(16+4)*4")
    assert not any(row["flags"] for row in rows.values())

    capsys.readouterr()
    text = compare.main([*dirs, *NO_DECODE])["text"]
    assert text == capsys.readouterr().out.rstrip("\n")  # the table alone on stdout
    header, rule, first = text.splitlines()[:3]
    assert header.split()[:4] == ["run", "n", "attention", "params"] and set(rule) <= {"-", " "}
    assert first.split()[:7] == ["out-mha", "1", "mha", "0.01M", "1,280", "2.5000", "2.7500"]
    assert "256 (float32)" in first and "2*1*4*8*4" in first and "2,000" in first and "n/a" in first
    assert "decode tok/s: not measured (--decode=False)" in text


def test_a_run_named_twice_is_one_row(tmp_path):
    make_run(tmp_path / "out-mha", "mha")
    make_run(tmp_path / "out-gqa", "gqa")
    dirs = [str(tmp_path / "out-gqa"), str(tmp_path / "out-mha"), str(tmp_path / "out-gqa") + "/"]
    assert [r["attention"] for r in as_json([*dirs, *NO_DECODE])["rows"]] == ["gqa-kv2", "mha"]


def test_train_peak_memory_is_the_largest_logged(tmp_path):
    """The peak column is the largest peak_memory_bytes over the eval lines (a resumed run's allocator starts its
    peak again, so the last line may hold less), in GiB in the table; seeds share a row as mean ± std."""
    gib = 2**30
    make_run(tmp_path / "a-s1", "gqa", seed=1, peaks=(None, 3 * gib, 2 * gib))
    make_run(tmp_path / "a-s2", "gqa", seed=2, peaks=(gib, 2 * gib, 2 * gib))
    (row,) = as_json([str(tmp_path / "a-s1"), str(tmp_path / "a-s2"), *NO_DECODE])["rows"]
    assert row["n"] == 2 and row["train_peak_bytes"] == 2.5 * gib
    assert row["train_peak_bytes_std"] == pytest.approx(0.5**0.5 * gib)
    text = compare.main([str(tmp_path / "a-s1"), *NO_DECODE])["text"]
    header, _, line = text.splitlines()[:3]
    assert "train peak GiB" in header and " 3.00 " in line


def test_bfloat16_runs_count_two_bytes_and_say_so(tmp_path):
    make_run(tmp_path / "a", "mqa", dtype="bfloat16")
    (row,) = as_json([str(tmp_path / "a"), *NO_DECODE])["rows"]
    assert (row["kv_bytes_per_token"], row["kv_formula"], row["kv_dtype"]) == (
        2 * 1 * 1 * 8 * 2,
        "2*1*1*8*2",
        "bfloat16",
    )


def test_older_metrics_fall_back_to_the_checkpoint(tmp_path):
    make_run(tmp_path / "new", "gqa")
    make_run(tmp_path / "old", "gqa", new_keys=False)
    new, old = as_json([str(tmp_path / "new"), str(tmp_path / "old"), *NO_DECODE])["rows"]
    for key in ("params", "tokens", "kv_bytes_per_token", "kv_dtype", "dataset", "size", "token_budget", "seeds"):
        assert old[key] == new[key], key
    assert new["n"] == old["n"] == 1  # the same seed too: two rows (a rerun is not another seed)


def test_markdown_csv_and_json(tmp_path):
    make_run(tmp_path / "out-mha", "mha")
    make_run(tmp_path / "out-mla", "mla")
    dirs = [str(tmp_path / "out-mha"), str(tmp_path / "out-mla")]
    md = compare.main([*dirs, *NO_DECODE, "--format=markdown"])["text"].splitlines()
    assert md[0].startswith("| run | n | attention |") and md[0].endswith("|")
    assert md[1].startswith("| --- | ---: | --- | ---: |")
    assert md[2].startswith("| out-mha | 1 | mha |") and md[3].startswith("| out-mla | 1 | mla-r16 |")
    assert "| `2*1*4*8*4` |" in md[2] and "| `1*(16+4)*4` |" in md[3]  # code: `*` would be emphasis
    assert md[4] == "" and md[5].startswith("- KV B/token") and "2\\*n_layer\\*n_kv_head" in md[5]
    rows = list(csv.DictReader(io.StringIO(compare.main([*dirs, *NO_DECODE, "--format", "csv"])["text"])))
    assert [r["attention"] for r in rows] == ["mha", "mla-r16"]
    assert float(rows[1]["val_loss_best"]) == 2.5 and int(rows[1]["kv_bytes_per_token"]) == 80
    data = as_json([*dirs, *NO_DECODE])
    assert len(data["rows"]) == 2 and any("KV formula" in line for line in data["notes"])


def test_differing_datasets_sizes_and_budgets_are_flagged(tmp_path):
    make_run(tmp_path / "a", "mha")
    make_run(tmp_path / "b", "gqa")
    make_run(tmp_path / "c", "mqa", dataset="tinystories")
    make_run(tmp_path / "d", "mla", n_layer=2)
    make_run(tmp_path / "e", "mqa", evals_planned=5)  # budget 40 iterations, stopped at 20
    result = compare.main([str(tmp_path / d) for d in "abcde"] + NO_DECODE)
    flags = {r["run"]: r["flags"] for r in result["rows"]}
    assert flags["a"] == flags["b"] == []
    assert flags["c"] == ["dataset tinystories where most runs have pydoc"]
    assert flags["d"] == ["size L2-E32-H4-T32 where most runs have L1-E32-H4-T32"]
    assert flags["e"] == [
        "token budget 2,560 where most runs have 1,280",
        "stopped at 1,280 of its 2,560-token budget (interrupted or still training)",
    ]
    lines = result["text"].splitlines()
    assert [line.split()[0] for line in lines[2:7]] == ["a", "b", "c*", "d*", "e*"]
    assert "* c: dataset tinystories where most runs have pydoc" in lines
    assert "* d: size L2-E32-H4-T32 where most runs have L1-E32-H4-T32" in lines
    md = compare.main([str(tmp_path / d) for d in "abcde"] + NO_DECODE + ["--format=markdown"])["text"]
    assert "| c\\* | 1 | mqa |" in md and "- \\* c: dataset tinystories where most runs have pydoc" in md


def test_without_a_majority_rows_are_compared_with_the_first(tmp_path):
    """No value held by most rows: the note names the first row's value, not the most frequent one."""
    datasets = ("pydoc", "shakespeare", "shakespeare", "tinystories", "openwebtext")
    for name, dataset in zip("abcde", datasets):
        make_run(tmp_path / name, "mha", dataset=dataset)
    result = compare.main([str(tmp_path / d) for d in "abcde"] + NO_DECODE)
    flags = {r["run"]: r["flags"] for r in result["rows"]}
    assert flags["a"] == []
    for name, dataset in zip("bcde", datasets[1:]):
        assert flags[name] == [f"dataset {dataset} where the first row has pydoc"]
    assert "* b: dataset shakespeare where the first row has pydoc" in result["text"].splitlines()


def test_runs_differing_only_in_seed_share_a_row(tmp_path):
    best = {0: 2.0, 1: 2.2, 2: 2.4}
    for s, loss in best.items():
        make_run(tmp_path / f"out-mha-s{s}", "mha", seed=s, losses=(4.0, loss, loss + 0.5), tok_s=(None, 100, 100 + s))
    make_run(tmp_path / "out-gqa-s0", "gqa", seed=0)
    make_run(tmp_path / "out-mha-ft", "mha", seed=3, init_from="out-gqa-s0")  # another experiment: its own row
    dirs = [str(tmp_path / d) for d in ("out-mha-s0", "out-mha-s1", "out-mha-s2", "out-gqa-s0", "out-mha-ft")]
    result = compare.main([*dirs, *NO_DECODE])
    mha, gqa, ft = result["rows"]
    assert ft["n"] == 1 and ft["flags"] == ["started from out-gqa-s0 where most runs have scratch"]
    assert mha["run"] == "out-mha-s{0,1,2}" and mha["n"] == 3 and mha["seeds"] == [0, 1, 2]
    assert mha["val_loss_best"] == pytest.approx(2.2) and mha["val_loss_best_std"] == pytest.approx(0.2)
    assert mha["val_loss_best_std"] == pytest.approx(statistics.stdev(best.values()))  # sample std, n - 1
    assert mha["train_tokens_per_s"] == pytest.approx(100.5) and mha["flags"] == []
    assert gqa["n"] == 1 and gqa["val_loss_best_std"] is None
    row = next(line for line in result["text"].splitlines() if line.startswith("out-mha-s{0,1,2}"))
    assert " 3 " in row and "2.2000 ± 0.2000" in row and "2.7000 ± 0.2000" in row and "1,280 " in row
    assert "n > 1: runs that differ only in seed; mean ± sample standard deviation over them" in result["text"]


@pytest.mark.parametrize("device", ["cpu"] + (["cuda"] if DEVICE == "cuda" else []))
def test_decode_speed_on_the_cpu_and_the_gpu(tmp_path, device):
    """The decode columns, measured where --device says, and the table's note of how they were measured."""
    make_run(tmp_path / "mha", "mha")
    make_run(tmp_path / "mla", "mla")
    args = [str(tmp_path / "mha"), str(tmp_path / "mla"), "--decode_batch=3", "--decode_tokens=4", "--plot="]
    result = compare.main([*args, f"--device={device}"])
    for row in result["rows"]:
        assert row["decode_tokens_per_s_b1"] > 0 and row["decode_tokens_per_s_b3"] > 0, row
    assert "decode tok/s b3" in result["text"].splitlines()[0]
    if device == "cpu":
        assert "on cpu with the plain PyTorch attention (attn_backend=torch) in float32" in result["text"]
    else:
        assert "on cuda through our Triton kernels (generate's default engine: CUDA graphs)" in result["text"]
    with pytest.raises(ConfigError, match=r"--decode_tokens: got 40; mha has block_size 32, .* valid: 2 \.\. 17"):
        compare.main([*args, "--decode_tokens=40"])
    with pytest.raises(ConfigError, match="--decode_batch: got 1; valid: an int >= 2"):
        compare.main([*args, "--decode_batch=1"])


def test_plots_are_written_and_optional(tmp_path, monkeypatch, capsys):
    make_run(tmp_path / "a", "mha")
    make_run(tmp_path / "b", "mla")
    png = tmp_path / "docs" / "compare.png"  # the folder is made
    result = compare.main([str(tmp_path / "a"), str(tmp_path / "b"), "--decode=False", f"--plot={png}"])
    assert result["plot"] == str(png) and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"  # matplotlib: the test extra
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)  # as if matplotlib were not installed
    capsys.readouterr()
    result = compare.main([str(tmp_path / "a"), "--decode=False", f"--plot={tmp_path / 'x.png'}"])
    out, err = capsys.readouterr()
    assert result["plot"] is None and not os.path.exists(tmp_path / "x.png") and out.startswith("run ")
    assert 'pip install -e ".[plot]"' in err


def test_bad_directories_and_options_are_named(tmp_path):
    make_run(tmp_path / "good", "mha")
    os.makedirs(tmp_path / "empty")
    make_run(tmp_path / "no-metrics", "mha")
    os.remove(tmp_path / "no-metrics" / "metrics.jsonl")
    make_run(tmp_path / "corrupt", "mha")
    for name in ("best.pt", "last.pt"):
        (tmp_path / "corrupt" / name).write_bytes(b"not a checkpoint")
    make_run(tmp_path / "bad-line", "mha")
    with open(tmp_path / "bad-line" / "metrics.jsonl", "a") as f:
        f.write("{oops\n")
    cases = {
        "missing": r"'.*missing': no such directory; valid: run directories",
        "empty": r"run directory '.*empty': no checkpoint \(best.pt or last.pt\); valid: a directory train.py wrote",
        "no-metrics": r"run directory '.*no-metrics': no metrics.jsonl",
        "corrupt": r"run directory '.*corrupt': checkpoint '.*best.pt' .*corrupt.*; and checkpoint '.*last.pt'",
        "bad-line": r"metrics.jsonl: line 4 is not an eval record",
    }
    for name, message in cases.items():
        with pytest.raises(CompareError, match=message):
            compare.main([str(tmp_path / "good"), str(tmp_path / name), *NO_DECODE])
    with pytest.raises(ConfigError, match="--format: got 'xml'; valid: table, markdown, csv, json"):
        compare.main([str(tmp_path / "good"), "--format=xml"])
    with pytest.raises(ConfigError, match="unknown config key 'fromat'"):
        compare.main([str(tmp_path / "good"), "--fromat=csv"])


def test_a_corrupt_best_beside_a_good_last_is_noted(tmp_path, capsys):
    make_run(tmp_path / "a", "gqa")
    (tmp_path / "a" / "best.pt").write_bytes(b"\0" * 100)
    (row,) = compare.main([str(tmp_path / "a"), *NO_DECODE])["rows"]
    assert row["attention"] == "gqa-kv2" and row["val_loss_best"] == 2.5
    damaged, used = capsys.readouterr().err.split("; using ")
    assert damaged.startswith("note: checkpoint ") and "best.pt" in damaged and "corrupt" in damaged
    assert used.startswith(str(tmp_path / "a" / "last.pt"))


def test_metrics_cut_short_by_a_kill_keeps_the_complete_lines(tmp_path, capsys):
    make_run(tmp_path / "a", "mha")
    with open(tmp_path / "a" / "metrics.jsonl", "a") as f:
        f.write('{"iter": 30, "val_lo')  # no newline: the write was cut short
    (row,) = compare.main([str(tmp_path / "a"), *NO_DECODE])["rows"]
    assert row["val_loss_final"] == 2.5
    assert "its last line is incomplete" in capsys.readouterr().err


def test_no_arguments_compares_every_run_here(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(CompareError, match="no run directories here .* for v in mha gqa mqa mla"):
        compare.main(NO_DECODE)
    make_run(tmp_path / "out-mla", "mla")
    make_run(tmp_path / "out-mha", "mha")
    make_run(tmp_path / "out-broken", "gqa")
    os.remove(tmp_path / "out-broken" / "metrics.jsonl")
    os.makedirs(tmp_path / "data")  # no checkpoint: not a run
    capsys.readouterr()
    result = compare.main(["--format", "csv", "--decode", "False", "--plot="])  # `--key value` as well
    assert [r["run"] for r in result["rows"]] == ["out-mha", "out-mla"]  # mha, gqa, mqa, mla order
    err = capsys.readouterr().err
    assert "skipped out-broken: run directory 'out-broken': no metrics.jsonl" in err and "skipped data" not in err


def test_help_and_errors_on_the_command_line(tmp_path):
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "compare.py"), "--help"], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("Compare training runs") and "python compare.py out-mha out-gqa" in proc.stdout
    for line in ("  --format=table  # table (aligned plain text)", "  --decode_batch=16", "  --plot=compare.png"):
        assert line in proc.stdout, line
    assert "2 * n_layer * n_kv_head * head_dim * B" in proc.stdout and "--seed=$s --out_dir=out-$v-s$s" in proc.stdout
    assert "or a config file" not in proc.stdout  # its positional arguments are run directories
    proc = subprocess.run(
        [sys.executable, os.path.join(ROOT, "compare.py"), "nowhere"],
        capture_output=True,
        text=True,
        cwd=tmp_path,  # another folder: the script's own modules still import
    )
    assert proc.returncode == 1 and proc.stderr.startswith("error: 'nowhere': no such directory"), proc.stderr
    assert "Traceback" not in proc.stderr
    proc = subprocess.run(
        [sys.executable, os.path.join(ROOT, "compare.py"), "--fromat=csv"], capture_output=True, text=True, cwd=tmp_path
    )
    assert proc.returncode == 2 and proc.stderr.startswith("error: ") and "format" in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr


def test_wandb_summary_run_offline(tmp_path, monkeypatch):
    wandb = pytest.importorskip("wandb")  # a core dependency, but the GPU machine has none
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    monkeypatch.setenv("WANDB_SILENT", "true")
    make_run(tmp_path / "a", "mha")
    make_run(tmp_path / "b", "mla")
    compare.main(
        [str(tmp_path / "a"), str(tmp_path / "b"), "--decode=False", f"--plot={tmp_path / 'c.png'}", "--wandb_log"]
    )
    wandb.teardown()  # the offline file is written by wandb's service after finish() returns; a script's exit waits
    (path,) = glob.glob(str(tmp_path / "wandb" / "offline-run-*" / "run-*.wandb"))
    records = read_wandb_records(path)
    run = next(r.run for r in records if r.WhichOneof("record_type") == "run")
    assert (run.job_type, run.run_group, run.display_name) == ("compare", "test-group", "compare")
    history = [r.history.item for r in records if r.WhichOneof("record_type") == "history"]
    logged = {i.key or i.nested_key[0] for items in history for i in items}
    (table,) = glob.glob(os.path.join(os.path.dirname(path), "files", "media", "table", "comparison_*.table.json"))
    table = json.load(open(table))
    assert "comparison" in logged and table["columns"][:2] == ["run", "runs"]
    assert [row[table["columns"].index("attention")] for row in table["data"]] == ["mha", "mla-r16"]
    assert "plots" in logged


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    from data import ensure_dataset

    directory = str(tmp_path_factory.mktemp("data") / "pydoc")
    ensure_dataset("pydoc", directory)
    return directory


def test_real_train_runs_compare_end_to_end(data_dir, tmp_path):
    tiny = ["--n_layer=1", "--n_head=4", "--n_embd=32", "--block_size=32", "--batch_size=2", "--eval_iters=1"]
    for v in ("gqa", "mla"):
        train.main(
            [
                *tiny,
                os.path.join(ROOT, "configs", f"{v}.py"),
                f"--data_dir={data_dir}",
                f"--out_dir={tmp_path / f'out-{v}'}",
                "--max_iters=4",
                "--eval_interval=2",
                "--log_interval=2",
                "--device=cpu",
                "--attn_backend=torch",
            ]
        )
    dirs = [str(tmp_path / "out-gqa"), str(tmp_path / "out-mla")]
    result = compare.main([*dirs, "--decode_batch=2", "--decode_tokens=3", "--plot="])
    gqa, mla = result["rows"]
    metrics = [json.loads(line) for line in open(tmp_path / "out-mla" / "metrics.jsonl")]
    assert (gqa["attention"], mla["attention"]) == ("gqa-kv1", "mla-r32")
    assert mla["tokens"] == 4 * 2 * 32 and mla["val_loss_final"] == metrics[-1]["val_loss"]
    assert mla["val_loss_best"] == min(m["val_loss"] for m in metrics) and not mla["flags"]
    assert mla["decode_tokens_per_s_b2"] > 0 and gqa["kv_bytes_per_token"] == 2 * 1 * 1 * 8 * 4
