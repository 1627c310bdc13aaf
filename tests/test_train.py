"""train.py end to end on the CPU with tiny models: every attention config learns; resume is bit-for-bit; Ctrl-C
saves and resumes; 2-process gloo DDP matches one process on the same global batch; wandb writes an offline run
with the logged metrics; bad config values, a corrupt checkpoint and a NaN loss stop with clear messages.
train.py runs as a subprocess where the entry point matters (torchrun, signals, exit codes), in-process elsewhere."""

import glob
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time

import numpy as np
import pytest
import torch
from conftest import DEVICE, read_wandb_records

import train
from checkpoint import TRAIN_KEYS, CheckpointError, load_checkpoint, save_checkpoint
from configurator import ConfigError
from model import GPT

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# 8 heads of 8 dims: the model config gives GQA 2 K/V heads and MLA a 32-wide latent and a 4-dim RoPE key.
TINY = [
    "--n_layer=1",
    "--n_head=8",
    "--n_embd=64",
    "--block_size=32",
    "--batch_size=4",
    "--eval_iters=2",
    "--attn_backend=torch",
    "--device=cpu",
    "--warmup_iters=2",
    "--learning_rate=3e-3",
]


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    from data import ensure_dataset

    directory = str(tmp_path_factory.mktemp("data") / "pydoc")
    ensure_dataset("pydoc", directory)
    return directory


def run_inprocess(data_dir, out_dir, *args, config=None):
    files = [os.path.join(ROOT, "configs", f"{config}.py")] if config else []
    return train.main([*TINY, *files, f"--data_dir={data_dir}", f"--out_dir={out_dir}", *args])


def metrics(out_dir):
    with open(os.path.join(out_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def subprocess_env(**extra):
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=ROOT, **extra)
    env.pop("TRITON_INTERPRET", None)  # the runs here use the torch backend
    return env


def descendants(pid: int) -> list[int]:
    """Every process below pid, from /proc (torchrun starts its workers in sessions of their own)."""
    children = {}
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{entry}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError):  # gone meanwhile
            continue
        children.setdefault(ppid, []).append(int(entry))
    found, todo = [], [pid]
    while todo:
        below = children.get(todo.pop(), [])
        found += below
        todo += below
    return found


def run_with_stacks_on_hang(cmd: list[str], env: dict, cwd, timeout: float) -> subprocess.CompletedProcess:
    """subprocess.run, except that a run still going after timeout seconds fails the test with every process's
    Python stack (faulthandler on SIGABRT): a collective that never completes shows where each rank waits."""
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=dict(env, PYTHONFAULTHANDLER="1"), cwd=cwd
    )
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        for pid in [*descendants(proc.pid), proc.pid]:
            try:
                os.kill(pid, signal.SIGABRT)
            except ProcessLookupError:
                pass
        try:
            out, err = proc.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            out, err = proc.communicate()
        pytest.fail(
            f"{cmd[:6]} ran past {timeout} s; its output, then every process's stack:\n{out[-6000:]}\n{err[-12000:]}"
        )
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


@pytest.mark.parametrize("variant", ["mha", "gqa", "mqa", "mla"])
def test_each_attention_config_lowers_the_loss(data_dir, tmp_path, variant):
    result = run_inprocess(
        data_dir, tmp_path, "--max_iters=40", "--eval_interval=40", "--log_interval=20", config=variant
    )
    first, last = metrics(tmp_path)[0], metrics(tmp_path)[-1]
    assert first["iter"] == 0 and last["iter"] == 40
    assert last["val_loss"] < first["val_loss"] - 0.5, (first, last)
    assert result["losses"]["val"] == last["val_loss"]
    ckpt = load_checkpoint(tmp_path / "last.pt", required_keys=TRAIN_KEYS)
    assert ckpt["model_args"]["attention"] == variant and ckpt["config"]["attention"] == variant
    assert ckpt["model_args"]["n_kv_head"] == {"mha": 8, "gqa": 2, "mqa": 1, "mla": 8}[variant]
    assert ckpt["iter_num"] == 40 and ckpt["tokenizer"]["kind"] == "char"
    assert os.path.isfile(tmp_path / "best.pt")
    check_metrics_schema(metrics(tmp_path), GPT(train.GPTConfig(**ckpt["model_args"])), max_iters=40)


# The keys of every metrics.jsonl eval line (compare.py builds its table from them) and their types.
METRICS_SCHEMA = dict(
    iter=int,
    train_loss=float,
    val_loss=float,
    lr=float,
    tokens_per_sec=(float, type(None)),
    mfu=(float, type(None)),
    tokens=int,
    params=int,
    kv_cache_bytes_per_token=int,
    kv_cache_dtype=str,
    peak_memory_bytes=(int, type(None)),
    attention=str,
    n_kv_head=(int, type(None)),
    kv_lora_rank=int,
    dataset=str,
    seed=int,
    size=str,
    token_budget=int,
    time=float,
)


def check_metrics_schema(lines, model, max_iters):
    """Every line has exactly the schema's keys, of its types, with the values of this TINY run (on the CPU:
    float32, no peak memory, no MFU)."""
    tokens_per_iter = 4 * 32  # batch_size x block_size x 1 micro-step
    mla = model.config.attention == "mla"
    for line in lines:
        assert set(line) == set(METRICS_SCHEMA), set(line) ^ set(METRICS_SCHEMA)
        for key, types in METRICS_SCHEMA.items():
            assert isinstance(line[key], types) and not isinstance(line[key], bool), (key, line[key])
        assert line["tokens"] == line["iter"] * tokens_per_iter
        assert line["token_budget"] == max_iters * tokens_per_iter
        assert line["params"] == model.num_params()
        assert line["kv_cache_bytes_per_token"] == model.kv_cache_bytes_per_token(torch.float32)
        assert line["kv_cache_dtype"] == "float32" and line["peak_memory_bytes"] is None
        assert line["attention"] == model.config.attention
        assert line["n_kv_head"] == (None if mla else model.config.n_kv_head)
        assert line["kv_lora_rank"] == (model.config.kv_lora_rank if mla else 0)
        assert line["dataset"] == "pydoc" and line["seed"] == 1337 and line["size"] == "L1-E64-H8-T32"
        assert abs(line["time"] - time.time()) < 600
    assert lines[0]["tokens_per_sec"] is None and lines[-1]["tokens_per_sec"] > 0  # none measured before iteration 1


def test_progress_line_shows_throughput_mfu_and_peak_memory():
    config = dict(max_iters=100)
    line = train.format_progress(10, config, 2.5, 3e-4, 0.125, 32768.0, 0.4123, 3 * 2**30 + 2**29)
    assert line == (
        "iter 10/100 | loss 2.5000 | lr 3.00e-04 | 125.0 ms/iter | 32,768 tok/s | mfu 41.2% | peak mem 3.50 GiB"
    )
    cpu = train.format_progress(10, config, 2.5, 3e-4, 0.125, 32768.0, None, None)  # no MFU peak, no CUDA memory
    assert cpu == "iter 10/100 | loss 2.5000 | lr 3.00e-04 | 125.0 ms/iter | 32,768 tok/s | mfu n/a"
    assert train.peak_memory_bytes("cpu") is None


def test_resume_continues_bit_for_bit(data_dir, tmp_path, capsys):
    # Dropout and gradient accumulation on: the restored RNG and sampler states both matter.
    common = [
        "--dropout=0.1",
        "--gradient_accumulation_steps=2",
        "--eval_interval=3",
        "--log_interval=1",
        "--lr_decay_iters=6",
    ]
    run_inprocess(data_dir, tmp_path / "a", *common, "--max_iters=6")
    uninterrupted = [line for line in capsys.readouterr().out.splitlines() if line.startswith(("iter ", "eval "))]
    run_inprocess(data_dir, tmp_path / "b", *common, "--max_iters=3")
    first_half = [line for line in capsys.readouterr().out.splitlines() if line.startswith(("iter ", "eval "))]
    run_inprocess(data_dir, tmp_path / "b", *common, "--max_iters=6", "--init_from=resume")
    out = capsys.readouterr().out
    assert f"resumed from iteration 3 ({tmp_path / 'b' / 'last.pt'})\n" in out
    second_half = [line for line in out.splitlines() if line.startswith(("iter ", "eval "))]

    def strip_timing(lines):
        # iteration (without the /max_iters), loss, lr; not the timings
        return [[line.split(" | ")[0].split("/")[0], *line.split(" | ")[1:3]] for line in lines]

    assert strip_timing(first_half + second_half) == strip_timing(uninterrupted)
    a, b = load_checkpoint(tmp_path / "a" / "last.pt"), load_checkpoint(tmp_path / "b" / "last.pt")
    assert a["iter_num"] == b["iter_num"] == 6
    for name, tensor in a["model"].items():
        assert torch.equal(tensor, b["model"][name]), f"{name} differs after resume"
    for pa, pb in zip(a["optimizer"]["state"].values(), b["optimizer"]["state"].values()):
        assert torch.equal(pa["exp_avg_sq"], pb["exp_avg_sq"])
    assert metrics(tmp_path / "a")[-1]["val_loss"] == metrics(tmp_path / "b")[-1]["val_loss"]


def test_ctrl_c_saves_the_last_iteration_and_resumes(data_dir, tmp_path):
    cmd = [
        sys.executable,
        os.path.join(ROOT, "train.py"),
        *TINY,
        f"--data_dir={data_dir}",
        f"--out_dir={tmp_path}",
        "--max_iters=100000",
        "--eval_interval=100000",
        "--log_interval=1",
    ]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=subprocess_env())
    lines = []
    deadline = time.time() + 120
    for line in proc.stdout:
        lines.append(line)
        if line.startswith("iter 3/") or time.time() > deadline:
            break
    proc.send_signal(signal.SIGINT)
    # The rest through the same text buffer as the lines above: communicate(timeout=) reads the raw pipe and would
    # drop lines that buffer already holds (a fast GPU prints the next iteration's line before this loop stops). A
    # reader thread with a deadline, so that a pipe held open by a stray child cannot hang the test.
    rest = []
    reader = threading.Thread(target=lambda: rest.append(proc.stdout.read()), daemon=True)
    reader.start()
    reader.join(timeout=120)
    if reader.is_alive():
        proc.kill()
        reader.join(timeout=10)
    proc.wait(timeout=30)
    output = "".join(lines + rest)
    assert proc.returncode == 128 + signal.SIGINT, output  # saved, not finished: a shell loop over runs stops
    assert "SIGINT: stopping after this iteration" in output and "interrupted: saved" in output
    last_logged = max(int(line.split()[1].split("/")[0]) for line in output.splitlines() if line.startswith("iter "))
    ckpt = load_checkpoint(tmp_path / "last.pt", required_keys=TRAIN_KEYS)
    assert ckpt["iter_num"] == last_logged >= 3  # log_interval=1: every completed iteration printed its line
    result = run_inprocess(
        data_dir, tmp_path, "--eval_interval=100000", f"--max_iters={ckpt['iter_num'] + 2}", "--init_from=resume"
    )
    assert result["iter_num"] == ckpt["iter_num"] + 2


def test_ctrl_c_saves_when_stdout_is_a_closed_pipe(data_dir, tmp_path):
    """`python train.py ... | tee log`, then Ctrl-C: tee dies and the pipe closes, so every later print raises
    BrokenPipeError; the stop notice, the save and the exit status must not depend on it."""
    cmd = [
        sys.executable,
        os.path.join(ROOT, "train.py"),
        *TINY,
        f"--data_dir={data_dir}",
        f"--out_dir={tmp_path}",
        "--max_iters=100000",
        "--eval_interval=100000",
        "--log_interval=1",
    ]
    stderr = open(tmp_path / "stderr", "w+")
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=stderr, text=True, env=subprocess_env())
    deadline = time.time() + 120
    for line in proc.stdout:
        if line.startswith("iter 2/") or time.time() > deadline:
            break
    proc.stdout.close()  # the reader is gone, as tee after Ctrl-C
    proc.send_signal(signal.SIGINT)
    proc.wait(timeout=120)
    stderr.seek(0)
    err = stderr.read()
    assert proc.returncode == 128 + signal.SIGINT, err
    assert "SIGINT: stopping after this iteration" in err and "Traceback" not in err and "Exception" not in err, err
    assert load_checkpoint(tmp_path / "last.pt", required_keys=TRAIN_KEYS)["iter_num"] >= 2


def test_seed_sets_the_initial_weights_and_the_data_order(data_dir, tmp_path):
    """--seed=N: another seed, another initialisation and batch order; the same seed, the same run. The eval batches
    are the same for every seed (the loss at iteration 0 differs only through the weights)."""
    for name, seed in (("a", 1), ("b", 2), ("c", 1)):
        run_inprocess(data_dir, tmp_path / name, f"--seed={seed}", "--max_iters=1", "--eval_interval=1")
    a, b, c = (load_checkpoint(tmp_path / name / "last.pt") for name in "abc")
    assert a["config"]["seed"] == 1 and b["config"]["seed"] == 2
    assert all(torch.equal(a["model"][k], c["model"][k]) for k in a["model"])
    assert not torch.equal(a["model"]["lm_head.weight"], b["model"]["lm_head.weight"])
    assert metrics(tmp_path / "a")[0]["val_loss"] != metrics(tmp_path / "b")[0]["val_loss"]
    config = dict(train.DEFAULTS, block_size=32, batch_size=4)
    draws = {s: train.BatchSampler(10_000, dict(config, seed=s), train.Dist()).next() for s in (1, 2)}
    assert not torch.equal(draws[1], draws[2])
    assert torch.equal(draws[1], train.BatchSampler(10_000, dict(config, seed=1), train.Dist()).next())


def test_init_from_gpt2_without_transformers_is_a_message(data_dir, tmp_path, monkeypatch):
    def no_transformers(*args, **kwargs):
        raise ImportError("GPT.from_pretrained needs transformers: pip install transformers")

    monkeypatch.setattr(train.GPT, "from_pretrained", no_transformers)
    with pytest.raises(train.ConfigError, match="init_from: GPT.from_pretrained needs transformers"):
        run_inprocess(data_dir, tmp_path / "out", "--init_from=gpt2", "--max_iters=1")


def test_a_run_names_its_cache_dtype_and_says_where_it_went(data_dir, tmp_path, capsys, monkeypatch):
    """The model line gives the KV cache in the run's dtype and, for MLA, what it caches instead of K/V heads; the
    end of a run names its checkpoints and the commands to run next (compare.py with the run's folder where
    compare.py alone, which reads the folders of the current one, would not find it)."""
    run_inprocess(data_dir, tmp_path / "out-mla", "--max_iters=2", "--eval_interval=2", config="mla")
    out = capsys.readouterr().out
    assert "model: mla, 1 layer, 8 heads, latent cache 32 + 4 per token and layer, 64 wide, " in out
    assert "KV cache 144 bytes/token in float32, attention via torch" in out  # 1 layer x (32 + 4) x 4 bytes
    last, best = tmp_path / "out-mla" / "last.pt", tmp_path / "out-mla" / "best.pt"
    assert f"saved: {last} (iteration 2) and {best} (val loss " in out
    run = tmp_path / "out-mla"
    assert f"next: `python sample.py --out_dir={run}` generates from it, `python compare.py {run}` tabulates it" in out
    monkeypatch.chdir(tmp_path)
    train.say_where_it_went("out-mla", 2, 1.0)
    assert "generates from it, `python compare.py` compares the runs here" in capsys.readouterr().out
    run_inprocess(data_dir, tmp_path / "eval", "--eval_only=True", f"--init_from={tmp_path / 'out-mla'}")
    out = capsys.readouterr().out
    assert "model: mla, 1 layer, 8 heads, latent cache 32 + 4 per token and layer, 64 wide, " in out
    assert "saved:" not in out, "nothing trained, nothing saved"
    run_inprocess(data_dir, tmp_path / "out-mla", "--eval_only=True", "--init_from=resume")
    assert "saved:" not in capsys.readouterr().out, "an eval of a resumed run's checkpoint saves nothing either"
    run_inprocess(data_dir, tmp_path / "out-gqa", "--max_iters=1", config="gqa")
    out = capsys.readouterr().out
    assert "model: gqa, 1 layer, 8 heads / 2 KV heads, 64 wide, " in out
    assert "KV cache 128 bytes/token in float32" in out  # 2 (K, V) x 1 layer x 2 heads x 8 dims x 4 bytes


def test_get_batch_gathers_windows_and_their_next_tokens(tmp_path):
    """x is each window of block_size tokens, y the same window one token on; from a memory-mapped split too."""
    path = tmp_path / "tokens.bin"
    np.arange(100, dtype=np.uint16).tofile(path)
    for tokens in (np.arange(100, dtype=np.uint16), np.memmap(path, dtype=np.uint16, mode="r")):
        x, y = train.get_batch(tokens, torch.tensor([0, 7, 90]), 9, "cpu")
        assert x.dtype == y.dtype == torch.int64 and x.shape == y.shape == (3, 9)
        assert x[1].tolist() == list(range(7, 16)) and y[1].tolist() == list(range(8, 17)) and y[2, -1] == 99
    micro = list(train.micro_batches(tokens, torch.tensor([[0, 1], [2, 3]]), 4, "cpu"))
    assert [x[:, 0].tolist() for x, _ in micro] == [[0, 1], [2, 3]]


def test_docstring_commands_have_no_runs_of_spaces():
    """--help prints the docstring: its commands are copied from there, so no padding inside or after them."""
    for line in train.__doc__.splitlines():
        assert not re.search(r"\S {9,}", line), line


def test_an_out_dir_holding_this_finished_run_is_kept_and_another_run_is_refused_first(data_dir, tmp_path):
    """The README's loop (`for v in ...; do python train.py configs/$v.py || break; done`) after one variant was
    trained: the finished run with the same config is kept (status 0, one line), so the loop goes on; a different
    run in the out_dir is refused before anything else is printed, on stderr with status 2, so the loop stops."""
    args = [*TINY, f"--data_dir={data_dir}", f"--out_dir={tmp_path / 'out'}", "--max_iters=2", "--eval_interval=2"]
    train.main([*args, os.path.join(ROOT, "configs", "gqa.py")])  # writes tmp/out-gqa
    loop = (
        "for v in gqa mha; do "
        f'{sys.executable} {os.path.join(ROOT, "train.py")} {" ".join(args)} {ROOT}/configs/$v.py "$@" || exit; '
        "echo loop-went-on-after-$v; done"
    )

    def run_loop(*extra):
        return subprocess.run(
            ["bash", "-c", loop, "loop", *extra], capture_output=True, text=True, timeout=300, env=subprocess_env()
        )

    ok = run_loop()
    assert ok.returncode == 0, ok.stderr[-3000:]
    out = ok.stdout.splitlines()
    assert out[0] == (
        f"{tmp_path / 'out-gqa'} already holds this run, finished at iteration 2 (same config): kept; "
        "--overwrite=True trains it again"
    )
    assert out[1] == "loop-went-on-after-gqa" and out[-1] == "loop-went-on-after-mha", ok.stdout[-3000:]
    assert load_checkpoint(tmp_path / "out-mha" / "last.pt")["iter_num"] == 2

    refused = run_loop("--max_iters=3")  # another token budget: not the run out-gqa holds
    assert refused.returncode == 2 and refused.stdout == "", refused.stdout[-3000:]
    assert refused.stderr.startswith(
        f"error: out_dir: {str(tmp_path / 'out-gqa')!r} already holds a run (last.pt, best.pt, metrics.jsonl); "
        "valid: --init_from=resume to continue it, another --out_dir, or --overwrite=True"
    ), refused.stderr
    assert "That run differs from this one in max_iters (2 there, 3 here)" in refused.stderr

    ckpt = load_checkpoint(tmp_path / "out-gqa" / "last.pt")  # the same run, stopped before its end
    save_checkpoint(tmp_path / "out-gqa" / "last.pt", dict(ckpt, iter_num=1))
    with pytest.raises(
        ConfigError, match=r"holds this run \(same config\), stopped at iteration 1 of 2; valid: --init_from=resume"
    ):
        train.main([*args, os.path.join(ROOT, "configs", "gqa.py")])


def test_ddp_two_gloo_processes_match_one_process(data_dir, tmp_path):
    # Global batch: 2 micro-steps of 4 sequences per iteration. One process runs both micro-steps; two
    # processes run one each and all-reduce. Same sampler draws, so the same global batch.
    args = [
        *TINY,
        "--gradient_accumulation_steps=2",
        "--max_iters=4",
        "--eval_interval=2",
        "--log_interval=1",
        f"--data_dir={data_dir}",
    ]
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node=2",
        os.path.join(ROOT, "train.py"),
        *args,
        f"--out_dir={tmp_path / 'ddp'}",
    ]
    proc = run_with_stacks_on_hang(cmd, subprocess_env(), tmp_path, timeout=240)  # about 10 s on 2 cores
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert proc.stdout.count("eval 4:") == 1, "only rank 0 prints"
    assert "over 2 processes" in proc.stdout
    train.main([*args, f"--out_dir={tmp_path / 'one'}"])

    ddp, one = load_checkpoint(tmp_path / "ddp" / "last.pt"), load_checkpoint(tmp_path / "one" / "last.pt")
    assert set(ddp["model"]) == set(GPT(train.GPTConfig(**ddp["model_args"])).state_dict()), "no module. prefixes"
    assert len(ddp["rng"]) == 2, "every rank's RNG state is saved"
    # Float sums in another order (all-reduce of two half-gradients vs one accumulation): rounding-level
    # differences, amplified a little by Adam's normalisation over 4 steps.
    for name, tensor in one["model"].items():
        torch.testing.assert_close(ddp["model"][name], tensor, atol=1e-5, rtol=1e-4, msg=name)
    for m_ddp, m_one in zip(metrics(tmp_path / "ddp"), metrics(tmp_path / "one")):
        assert m_ddp["iter"] == m_one["iter"]
        assert m_ddp["val_loss"] == pytest.approx(m_one["val_loss"], rel=1e-5)
        assert m_ddp["train_loss"] == pytest.approx(m_one["train_loss"], rel=1e-5)


def test_wandb_without_credentials_writes_an_offline_run(data_dir, tmp_path):
    pytest.importorskip("wandb")  # a core dependency, but the GPU machine has none
    env = subprocess_env(HOME=str(tmp_path))  # no ~/.netrc: no credentials
    for key in ("WANDB_MODE", "WANDB_API_KEY", "WANDB_DIR"):
        env.pop(key, None)
    cmd = [
        sys.executable,
        os.path.join(ROOT, "train.py"),
        *TINY,
        os.path.join(ROOT, "configs", "mla.py"),
        f"--data_dir={data_dir}",
        f"--out_dir={tmp_path / 'out'}",
        "--max_iters=4",
        "--eval_interval=2",
        "--log_interval=2",
        "--wandb_log=True",
        "--wandb_group=test-group",
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    runs = glob.glob(str(tmp_path / "out" / "wandb" / "offline-run-*" / "run-*.wandb"))  # beside the checkpoints
    assert len(runs) == 1, os.listdir(tmp_path / "out")
    assert f"wandb sync {os.path.dirname(runs[0])}" in proc.stdout

    records = read_wandb_records(runs[0])
    history = [
        {i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in r.history.item}
        for r in records
        if r.WhichOneof("record_type") == "history"
    ]
    logged = set().union(*history)
    assert {"train/loss", "val/loss", "lr", "tokens_per_sec", "train/running_loss", "tokens"} <= logged, logged
    assert "peak_memory_bytes" not in logged and "mfu" not in logged  # on the CPU: no CUDA memory, no MFU peak
    evals = [h for h in history if "val/loss" in h]
    assert [h["_step"] for h in evals] == [0, 2, 4]
    assert [h["tokens"] for h in evals] == [0, 2 * 4 * 32, 4 * 4 * 32]  # tokens seen: the charts' x-axis
    assert evals[-1]["val/loss"] == pytest.approx(metrics(tmp_path / "out")[-1]["val_loss"])
    metric_steps = {r.metric.name: r.metric.step_metric for r in records if r.WhichOneof("record_type") == "metric"}
    assert metric_steps.get("val/loss") == "tokens" and metric_steps.get("train/loss") == "tokens", metric_steps
    summary = {}
    for r in records:
        if r.WhichOneof("record_type") == "summary":
            summary.update({i.key: json.loads(i.value_json) for i in r.summary.update})
    line = metrics(tmp_path / "out")[-1]
    for key in ("params", "kv_cache_bytes_per_token", "kv_cache_dtype", "size", "token_budget"):
        assert summary[key] == line[key], (key, summary.get(key), line[key])
    run = next(r.run for r in records if r.WhichOneof("record_type") == "run")
    assert run.run_group == "test-group"
    config = {i.key: json.loads(i.value_json) for i in run.config.update if i.key != "_wandb"}
    assert config["attention"] == "mla" and config["kv_lora_rank"] == 32 and config["qk_rope_head_dim"] == 4
    assert config["n_kv_head"] == 8 and config["qk_nope_head_dim"] == config["v_head_dim"] == 8
    # n_layer x (kv_lora_rank + qk_rope_head_dim) x 4 bytes: at the dtype the run trains in (float32 on the CPU)
    assert config["kv_cache_bytes_per_token"] == 1 * (32 + 4) * 4 and config["params"] > 0
    assert config["kv_cache_dtype"] == "float32"


def test_unknown_key_stops_the_entry_point_with_the_valid_keys(tmp_path):
    proc = subprocess.run(
        [sys.executable, os.path.join(ROOT, "train.py"), "--n_layers=2"],
        capture_output=True,
        text=True,
        timeout=120,
        env=subprocess_env(),
        cwd=tmp_path,
    )
    assert proc.returncode != 0
    assert "error: override '--n_layers=2': unknown config key 'n_layers' (did you mean n_layer?)" in proc.stderr
    assert "valid keys: attention, attn_backend, backend, batch_size" in proc.stderr
    assert "Traceback" not in proc.stderr


@pytest.mark.parametrize(
    "argv, needle",
    [
        (["--batch_size=big"], "batch_size='big' has type str, but batch_size takes type int"),
        (["--device=tpu"], "device: got 'tpu'"),
        (["--device=mps"], "device: got 'mps'; valid: 'auto', 'cpu', 'cuda', 'cuda:N' (Apple's MPS is not supported"),
        (["--dtype=float8"], "dtype: got 'float8'"),
        (["--attention=linear"], "GPTConfig.attention: got 'linear'"),
        (["--attention=gqa", "--n_kv_head=3"], "GPTConfig.n_kv_head: got 3"),
        (["--init_from=gpt5"], "init_from: got 'gpt5'"),
        (["--learning_rate=-1"], "learning_rate: got -1.0; valid: a finite number >= 0"),
        (["--learning_rate=1e400"], "learning_rate: got inf; valid: a finite number >= 0"),
        (["--rope_theta=1e400"], "rope_theta: got inf; valid: a finite number > 0"),
        (["--beta2=1.5"], "beta2: got 1.5; valid: a number in [0, 1)"),
        (["--backend=mpi"], "backend: got 'mpi'; valid: 'auto', 'nccl', 'gloo'"),
        (["--device=cuda:99"], "device: got 'cuda:99'"),
        (["--cuda_graphs=True"], "cuda_graphs: got True on device 'cpu'; valid: True on a CUDA device, else False"),
        (["--min_lr=0.5"], "min_lr: got 0.5; valid: <= learning_rate (0.003)"),
        (["--max_iters=0"], "max_iters: got 0; valid: an int >= 1 (--eval_only=True evaluates a model"),
        (["--eval_only=True"], "eval_only: got True with --init_from=scratch, which would evaluate random weights"),
        (["--seed=99999999999999999999"], "seed: got 99999999999999999999; valid: an int in [0, 2**63 - 1]"),
        (["--seed=-1"], "seed: got -1; valid: an int in [0, 2**63 - 1]"),
        (["--n_layer=100000000"], "before any activation; valid: a model that fits its"),
    ],
    ids=[
        "type",
        "device",
        "device-mps",
        "dtype",
        "attention",
        "n_kv_head",
        "init_from",
        "lr",
        "lr-inf",
        "rope-theta-inf",
        "beta2",
        "backend",
        "cuda-index",
        "cuda-graphs-on-cpu",
        "min-lr-above-lr",
        "max-iters-0",
        "eval-only-from-scratch",
        "seed-overflow",
        "seed-negative",
        "model-too-large",
    ],
)
def test_bad_values_fail_with_clear_message(data_dir, tmp_path, argv, needle):
    with pytest.raises(ConfigError) as e:
        run_inprocess(data_dir, tmp_path, *argv)
    assert needle in str(e.value)
    assert not os.listdir(tmp_path), "nothing written for a refused run"


def test_values_only_refused_where_they_act():
    """min_lr above learning_rate is refused only where the schedule decays to it; the largest valid seed runs."""
    config = dict(train.DEFAULTS, min_lr=0.5, decay_lr=False, seed=2**63 - 1)
    train.check_config(config, train.Dist())
    assert train.get_lr(10**6, config) == config["learning_rate"]
    torch.manual_seed(config["seed"] + 1)  # what a second rank seeds with


def test_cuda_graphs_refuse_several_processes():
    config = dict(train.DEFAULTS, cuda_graphs=True, gradient_accumulation_steps=2)
    with pytest.raises(ConfigError, match="cuda_graphs: got True with 2 processes; valid: True in a single process"):
        train.check_config(config, train.Dist(rank=0, local_rank=0, world_size=2))


@pytest.mark.gpu
@pytest.mark.skipif(
    DEVICE != "cuda",
    reason="CUDA graphs need a CUDA GPU; on the CPU cuda_graphs=True is refused "
    "(test_bad_values_fail_with_clear_message)",
)
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_cuda_graphs_train_like_eager(data_dir, tmp_path, dtype, monkeypatch):
    # Two micro-steps per iteration (the replays must add into the gradients, not overwrite them) on the Triton
    # kernels; float16 runs the GradScaler inside the graph. The graph replays the eager step's kernels on the
    # same inputs, so the two runs agree to the last bits but for reduction orders that can differ between
    # launches (cuBLAS may pick another algorithm under capture): 4 Adam steps keep that at rounding level.
    # Two heads of 16, the kernels' smallest head dim. A counting GraphedMicroStep shows the graphed run captured
    # one graph and replayed it for every micro-step (2 x 4), and the eager run none.
    import train_step

    built, replays = [], []

    class CountedGraph(train_step.GraphedMicroStep):
        def __init__(self, *args, **kwargs):
            built.append(1)
            super().__init__(*args, **kwargs)

        def __call__(self, x, y):
            replays.append(1)
            return super().__call__(x, y)

    monkeypatch.setattr(train_step, "GraphedMicroStep", CountedGraph)
    args = [
        "--n_head=2",
        "--n_embd=32",
        "--device=cuda",
        f"--dtype={dtype}",
        "--attn_backend=triton",
        "--gradient_accumulation_steps=2",
        "--max_iters=4",
        "--eval_interval=2",
        "--log_interval=1",
    ]
    eager = run_inprocess(data_dir, tmp_path / "eager", *args)
    assert not built and not replays, "the eager run built a CUDA graph"
    graphed = run_inprocess(data_dir, tmp_path / "graphed", *args, "--cuda_graphs=True")
    assert len(built) == 1, f"{len(built)} graphs captured"
    assert len(replays) == 2 * 4, f"{len(replays)} replays for 2 micro-steps x 4 iterations"
    for m_graph, m_eager in zip(metrics(tmp_path / "graphed"), metrics(tmp_path / "eager")):
        assert m_graph["train_loss"] == pytest.approx(m_eager["train_loss"], rel=1e-3)
        assert m_graph["val_loss"] == pytest.approx(m_eager["val_loss"], rel=1e-3)
    assert graphed["iter_num"] == eager["iter_num"] == 4
    a, b = load_checkpoint(tmp_path / "eager" / "last.pt"), load_checkpoint(tmp_path / "graphed" / "last.pt")
    for name, tensor in a["model"].items():
        torch.testing.assert_close(b["model"][name], tensor, atol=1e-3, rtol=1e-3, msg=name)


def test_init_from_a_directory_without_a_model_fails_clearly(data_dir, tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConfigError, match=r"init_from: got '.*empty', a directory with no checkpoint \(best.pt"):
        run_inprocess(data_dir, tmp_path / "out", f"--init_from={tmp_path / 'empty'}")
    (tmp_path / "empty" / "config.json").write_text("{}")  # looks like save_pretrained's: transformers decides
    with pytest.raises(ConfigError, match="init_from: could not load GPT-2 weights .*empty"):
        run_inprocess(data_dir, tmp_path / "out", f"--init_from={tmp_path / 'empty'}")


def test_init_from_a_run_starts_a_new_run_from_its_model(data_dir, tmp_path, capsys):
    """--init_from=<run directory> takes that run's best.pt (the architecture too) into a new run: iteration 0,
    a fresh optimizer and schedule, this run's block_size (RoPE), its own out_dir."""
    run_inprocess(data_dir, tmp_path / "a", "--max_iters=6", "--eval_interval=3", config="gqa")
    source = load_checkpoint(tmp_path / "a" / "best.pt")
    capsys.readouterr()
    args = [f"--init_from={tmp_path / 'a'}", "--max_iters=2", "--eval_interval=2", "--block_size=16"]
    result = run_inprocess(data_dir, tmp_path / "b", *args)  # the default config: MHA, which the model is not
    out = capsys.readouterr().out
    assert "init_from: the model is the checkpoint's; not taken from this run's config: attention='mha'" in out
    assert f"init_from: the model of {tmp_path / 'a' / 'best.pt'} (its iteration 6); a new run" in out
    ckpt = load_checkpoint(tmp_path / "b" / "last.pt")
    assert ckpt["model_args"] == dict(source["model_args"], block_size=16)
    assert ckpt["config"]["attention"] == "gqa" and ckpt["config"]["block_size"] == 16  # the config tells the truth
    assert result["iter_num"] == 2 and [m["iter"] for m in metrics(tmp_path / "b")] == [0, 2]
    assert ckpt["optimizer"]["state"][0]["step"] == 2, "a fresh AdamW, not the source run's"
    for name, tensor in source["model"].items():  # started from the source's weights, then trained
        assert not torch.equal(ckpt["model"][name], tensor), name
    first = metrics(tmp_path / "b")[0]
    assert first["train_loss"] < metrics(tmp_path / "a")[0]["train_loss"] - 0.3, "iteration 0 is a trained model"

    kept = run_inprocess(data_dir, tmp_path / "b", f"{args[0]}/", *args[1:])  # the same again (a tab's slash): kept
    assert kept.get("kept") and kept["iter_num"] == 2
    relative = f"--init_from={os.path.relpath(tmp_path / 'a')}"  # the same run spelled from the working directory
    assert run_inprocess(data_dir, tmp_path / "b", relative, *args[1:]).get("kept")
    run_inprocess(data_dir, tmp_path / "c", "--max_iters=2", "--eval_interval=2")
    with pytest.raises(ConfigError, match=r"That run differs from this one in init_from \('.*a' there, '.*c' here\)"):
        run_inprocess(data_dir, tmp_path / "b", *args[1:], f"--init_from={tmp_path / 'c'}")
    # Resumed, the run still records where it began (compare.py keeps it apart from runs from scratch).
    run_inprocess(data_dir, tmp_path / "b", *args[1:], "--max_iters=4", "--init_from=resume")
    assert load_checkpoint(tmp_path / "b" / "last.pt")["config"]["init_from"] == str(tmp_path / "a")


def test_init_from_a_run_refuses_what_would_lose_or_misread_it(data_dir, tmp_path):
    run_inprocess(data_dir, tmp_path / "a", "--max_iters=2", "--eval_interval=2", "--pos_embedding=learned")
    with pytest.raises(
        ConfigError,
        match=r"init_from: got '.*a/last.pt', a checkpoint of the run in this out_dir .*"
        r"valid: --init_from=resume to continue that run, or another --out_dir",
    ):
        run_inprocess(data_dir, tmp_path / "a", f"--init_from={tmp_path / 'a' / 'last.pt'}")
    with pytest.raises(ConfigError, match=r"block_size: got 64; valid: at most 32, the learned positions of"):
        run_inprocess(data_dir, tmp_path / "b", f"--init_from={tmp_path / 'a'}", "--block_size=64")
    ckpt = load_checkpoint(tmp_path / "a" / "best.pt")
    save_checkpoint(tmp_path / "a" / "best.pt", dict(ckpt, tokenizer=dict(ckpt["tokenizer"], chars="xyz")))
    with pytest.raises(
        ConfigError,
        match=r"^dataset: 'pydoc' is tokenized differently from the checkpoint's data \(here char tokens, vocabulary "
        r"\d+; the checkpoint's char tokens, vocabulary \d+ with other symbols, dataset 'pydoc'\); valid: a dataset "
        r"prepared with",
    ):
        run_inprocess(data_dir, tmp_path / "b", f"--init_from={tmp_path / 'a'}")
    (tmp_path / "a" / "best.pt").write_bytes((tmp_path / "a" / "best.pt").read_bytes()[:-1000])
    with pytest.raises(
        CheckpointError,
        match=r"best.pt.*truncated or corrupt.*valid: the other checkpoint beside "
        r"it, --init_from=.*last.pt",
    ):
        run_inprocess(data_dir, tmp_path / "b", f"--init_from={tmp_path / 'a'}")
    assert not (tmp_path / "b").exists(), "nothing written for a run that was refused"


def test_corrupt_checkpoint_fails_to_resume_clearly(data_dir, tmp_path):
    run_inprocess(data_dir, tmp_path, "--max_iters=2", "--eval_interval=2")
    path = tmp_path / "last.pt"
    path.write_bytes(path.read_bytes()[:-1000])
    with pytest.raises(CheckpointError, match="last.pt.*is truncated or corrupt"):
        run_inprocess(data_dir, tmp_path, "--max_iters=4", "--init_from=resume")
    shutil.rmtree(tmp_path)
    with pytest.raises(CheckpointError, match="no such file"):
        run_inprocess(data_dir, tmp_path, "--max_iters=4", "--init_from=resume")


def test_a_new_run_never_replaces_another_runs_files_unasked(data_dir, tmp_path):
    """A scratch run into an out_dir that holds a run is refused (the old checkpoint untouched) until it resumes,
    moves, or says --overwrite=True; then the old run's files are gone, not mixed with the new run's."""
    run_inprocess(data_dir, tmp_path, "--max_iters=4", "--eval_interval=2")
    before = (tmp_path / "last.pt").read_bytes()
    with pytest.raises(
        ConfigError,
        match=r"out_dir: .* already holds a run \(last\.pt, best\.pt, metrics\.jsonl\); "
        r"valid: --init_from=resume .* --overwrite=True",
    ):
        run_inprocess(data_dir, tmp_path, "--max_iters=2", "--eval_interval=2")
    assert (tmp_path / "last.pt").read_bytes() == before
    run_inprocess(data_dir, tmp_path, "--max_iters=2", "--eval_interval=2", "--overwrite=True")
    assert [m["iter"] for m in metrics(tmp_path)] == [0, 2]
    assert load_checkpoint(tmp_path / "last.pt")["iter_num"] == 2


@pytest.mark.parametrize(
    "out_dir, needle",
    [
        ("", r"out_dir: got ''; valid: a directory path"),
        ("FILE", r"out_dir: got '.*FILE' \(a file\); valid: a directory path"),
    ],
)
def test_bad_out_dir_fails_clearly(data_dir, tmp_path, out_dir, needle):
    if out_dir == "FILE":
        out_dir = str(tmp_path / "FILE")
        open(out_dir, "w").close()
    with pytest.raises(ConfigError, match=needle):
        train.main([*TINY, f"--data_dir={data_dir}", f"--out_dir={out_dir}", "--max_iters=1"])


def test_resume_names_the_model_settings_it_does_not_take(data_dir, tmp_path, capsys):
    """On resume the model is the checkpoint's: a changed architecture or block_size is named, not dropped in
    silence (and block_size is not reported as changed, since the run keeps the checkpoint's)."""
    run_inprocess(data_dir, tmp_path, "--max_iters=2", "--eval_interval=2")
    capsys.readouterr()
    result = run_inprocess(data_dir, tmp_path, "--max_iters=3", "--init_from=resume", "--n_layer=2", "--block_size=16")
    out = capsys.readouterr().out
    assert result["iter_num"] == 3
    assert "resume: the model is the checkpoint's; not taken from this run's config: " in out
    assert "n_layer=2 (checkpoint: 1)" in out and "block_size=16 (checkpoint: 32)" in out
    assert "block_size 32 -> 16 changed" not in out
    lines = len(metrics(tmp_path))
    again = run_inprocess(data_dir, tmp_path, "--max_iters=3", "--init_from=resume")
    assert again["iter_num"] == 3 and len(metrics(tmp_path)) == lines, "a finished run resumed appends nothing"
    assert "resume: the run already finished at iteration 3 (max_iters=3)" in capsys.readouterr().out


@pytest.mark.parametrize(
    "argv, needle",
    [
        (
            ["--attn_backend=triton"],
            r"attn_backend: got 'triton' on device 'cpu'; valid: 'torch' or 'auto' there, or "
            r"TRITON_INTERPRET=1",
        ),
        (
            ["--attn_backend=triton", "--n_embd=1040", "--n_head=4"],
            r"which take head dims from 1 to 256, and this model's query/key "
            r"head dim is 260; valid: --attn_backend=torch",
        ),
    ],
)
def test_triton_backend_limits_fail_before_training(data_dir, tmp_path, monkeypatch, argv, needle):
    """The Triton kernels' limits (a GPU or the interpreter; head dims 1-256) are config errors before anything is
    written, not a kernel's ValueError at the first step."""
    if "--n_head=4" not in argv:
        monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    else:
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    with pytest.raises(ConfigError, match=needle):
        run_inprocess(data_dir, tmp_path / "out", *argv)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    "damage, needle",
    [
        (
            "n_layer",
            r"its model_args and weights do not make a model \(its weights do not fit the model its model_args "
            r"describe: 6 missing keys: transformer\.h\.1\.ln_1\.weight, .*, \.\.\. \(3 more\)\)$",
        ),
        (  # weights of a layer more than model_args says (and one tensor of another shape): named, not a first line
            "extra_layer",
            r"its model_args and weights do not make a model \(its weights do not fit the model its model_args "
            r"describe: 6 unexpected keys: transformer\.h\.1\.ln_1\.weight, .*, \.\.\. \(3 more\); 1 mis-sized "
            r"key: transformer\.h\.0\.ln_1\.weight \(\[3\] in the checkpoint, \[64\] in the model\)\)$",
        ),
        ("new_field", r"its model_args and weights do not make a model \(TypeError: .*new_field"),
        ("rng", r"its training state \(optimizer, scaler, sampler, RNG\) does not fit this model \(KeyError"),
    ],
)
def test_checkpoint_that_does_not_fit_its_model_fails_clearly(data_dir, tmp_path, damage, needle):
    """A loadable checkpoint whose contents disagree (edited model_args, a field from another model.py, a broken RNG
    state) is a CheckpointError naming the file, not a traceback from load_state_dict or GPTConfig."""
    run_inprocess(data_dir, tmp_path, "--max_iters=2", "--eval_interval=2")
    ckpt = load_checkpoint(tmp_path / "last.pt")
    if damage == "n_layer":
        ckpt["model_args"]["n_layer"] = 2
    elif damage == "extra_layer":
        ckpt["model"].update({k.replace(".h.0.", ".h.1."): v for k, v in ckpt["model"].items() if ".h.0." in k})
        ckpt["model"]["transformer.h.0.ln_1.weight"] = torch.ones(3)
    elif damage == "new_field":
        ckpt["model_args"]["new_field"] = 1
    else:
        ckpt["rng"] = [{}]
    save_checkpoint(tmp_path / "last.pt", ckpt)
    with pytest.raises(CheckpointError, match=r"checkpoint '.*last\.pt': " + needle):
        run_inprocess(data_dir, tmp_path, "--max_iters=4", "--init_from=resume")


def test_checkpoint_with_flipped_bytes_or_stale_temp_files(tmp_path):
    """torch.load does not check the archive's CRCs, so changed tensor bytes would load as wrong weights:
    load_checkpoint checks them. A save killed mid-write leaves a hidden temp file; the next save removes it."""
    path = tmp_path / "last.pt"
    save_checkpoint(path, {"w": torch.randn(1000, 100)})
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=r"is corrupt: its entry 'archive/data/0' fails its CRC check"):
        load_checkpoint(path)
    (tmp_path / ".last.pt.killed.tmp").write_bytes(b"half a checkpoint")
    (tmp_path / ".best.pt.other.tmp").write_bytes(b"another checkpoint's")
    save_checkpoint(path, {"a": 1})
    assert sorted(os.listdir(tmp_path)) == [".best.pt.other.tmp", "last.pt"]
    assert load_checkpoint(path) == {"a": 1}


def test_nan_loss_stops_and_keeps_the_last_good_checkpoint(data_dir, tmp_path, monkeypatch):
    forward, calls = GPT.forward, {"train": 0}

    def poisoned_forward(self, idx, targets=None, cache=None):  # the 4th training forward returns a NaN loss
        logits, loss = forward(self, idx, targets, cache)
        if self.training:
            calls["train"] += 1
            if calls["train"] >= 4:
                loss = loss * float("nan")
        return logits, loss

    monkeypatch.setattr(GPT, "forward", poisoned_forward)
    # Eval (and checkpoint) every 2 iterations, progress every 3: the NaN of iteration 4 is caught by the check
    # before the eval at 4, so last.pt stays the one of iteration 2.
    with pytest.raises(train.NonFiniteLoss, match=r"train loss became nan in iterations 4\.\.4"):
        run_inprocess(data_dir, tmp_path, "--max_iters=10", "--eval_interval=2", "--log_interval=3")
    ckpt = load_checkpoint(tmp_path / "last.pt", required_keys=TRAIN_KEYS)
    assert ckpt["iter_num"] == 2
    assert all(torch.isfinite(t).all() for t in ckpt["model"].values())
    assert [m["iter"] for m in metrics(tmp_path)] == [0, 2]


def test_triton_backend_trains_like_torch(data_dir, tmp_path):
    # The flash kernel against the PyTorch path in a real training run: on the CPU under the Triton interpreter
    # (conftest sets TRITON_INTERPRET=1 without a GPU) in fp32, on a GPU in fp16 autocast (GradScaler on).
    # head_dim 16, the kernels' smallest.
    args = ["--n_head=2", "--n_embd=32", "--max_iters=2", "--eval_interval=2", "--eval_iters=1", "--batch_size=2"]
    if DEVICE == "cuda":
        args += ["--device=cuda", "--dtype=float16"]
    torch_run = run_inprocess(data_dir, tmp_path / "torch", *args)
    triton_run = run_inprocess(data_dir, tmp_path / "triton", *args, "--attn_backend=triton")
    if DEVICE == "cpu":  # fp32 both ways: the two paths agree to fp32 rounding
        assert triton_run["losses"]["val"] == pytest.approx(torch_run["losses"]["val"], rel=1e-4)
        a, b = load_checkpoint(tmp_path / "torch" / "last.pt"), load_checkpoint(tmp_path / "triton" / "last.pt")
        for name, tensor in a["model"].items():
            torch.testing.assert_close(b["model"][name], tensor, atol=1e-5, rtol=1e-4, msg=name)
    else:  # fp16 attention outputs (~2^-11 relative each) through 2 Adam steps: losses agree to ~1e-3
        assert triton_run["losses"]["val"] == pytest.approx(torch_run["losses"]["val"], rel=2e-3)


def test_checkpoint_resumes_on_the_cpu(data_dir, tmp_path):
    # Written on this machine's device (the GPU where there is one), resumed on the CPU (map_location).
    run_inprocess(data_dir, tmp_path, f"--device={DEVICE}", "--max_iters=2", "--eval_interval=2")
    result = run_inprocess(
        data_dir, tmp_path, "--device=cpu", "--max_iters=4", "--eval_interval=2", "--init_from=resume"
    )
    assert result["iter_num"] == 4
    assert load_checkpoint(tmp_path / "last.pt")["config"]["device"] == "cpu"


def test_resume_uses_this_devices_adamw_implementation(data_dir, tmp_path):
    # A checkpoint written on CUDA carries fused=True in its param groups; a resume elsewhere must not inherit it
    # (and a CPU checkpoint resumed on CUDA must get the fused kernel).
    run_inprocess(data_dir, tmp_path, "--device=cpu", "--max_iters=2", "--eval_interval=2")
    ckpt = load_checkpoint(tmp_path / "last.pt")
    for group in ckpt["optimizer"]["param_groups"]:
        group["fused"] = True
    save_checkpoint(tmp_path / "last.pt", ckpt)
    run_inprocess(data_dir, tmp_path, "--device=cpu", "--max_iters=4", "--eval_interval=2", "--init_from=resume")
    groups = load_checkpoint(tmp_path / "last.pt")["optimizer"]["param_groups"]
    assert [g["fused"] for g in groups] == [None, None]


def test_finetune_from_gpt2_weights_in_a_local_directory(data_dir, tmp_path):
    # --init_from takes GPT-2 hub names (network) or a directory in GPT2LMHeadModel.save_pretrained's format:
    # a tiny random GPT-2 here, with room for the 103-104 characters of the pydoc vocabulary.
    transformers = pytest.importorskip("transformers")  # the test extra; the GPU machine may lack it
    hf_config = transformers.GPT2Config(
        vocab_size=128, n_positions=64, n_embd=32, n_layer=1, n_head=2, bos_token_id=0, eos_token_id=0
    )
    transformers.GPT2LMHeadModel(hf_config).save_pretrained(tmp_path / "hf")
    args = [f"--init_from={tmp_path / 'hf'}", "--max_iters=6", "--eval_interval=6", "--block_size=32"]
    result = run_inprocess(data_dir, tmp_path / "out", *args)
    ckpt = load_checkpoint(tmp_path / "out" / "last.pt")
    assert ckpt["model_args"]["attention"] == "mha" and ckpt["model_args"]["pos_embedding"] == "learned"
    assert ckpt["model_args"]["block_size"] == 32, "cropped from the checkpoint's 64 positions"
    assert ckpt["model"]["transformer.wpe.weight"].shape == (32, 32)
    assert ckpt["config"]["n_embd"] == 32 and ckpt["config"]["vocab_size"] == 128  # the config tells the truth
    first, last = metrics(tmp_path / "out")[0], metrics(tmp_path / "out")[-1]
    assert last["val_loss"] < first["val_loss"] and result["iter_num"] == 6
    again = run_inprocess(data_dir, tmp_path / "out", *args)  # the same again: kept (the model is GPT-2's)
    assert again.get("kept") and again["iter_num"] == 6
    with pytest.raises(ConfigError, match=r"block_size: got 128; valid: at most 64, the learned positions of"):
        run_inprocess(data_dir, tmp_path / "longer", f"--init_from={tmp_path / 'hf'}", "--block_size=128")


def test_a_finished_run_on_other_data_is_refused_not_kept(data_dir, tmp_path):
    """The kept-run check compares the data directory a run trains on: the same run on a copy of its data elsewhere
    is another run (refused, the key named), while another spelling of the same directory is the same run."""
    args = ["--max_iters=2", "--eval_interval=2"]
    run_inprocess(data_dir, tmp_path / "out", *args)
    copy = shutil.copytree(data_dir, tmp_path / "copy")
    with pytest.raises(
        ConfigError, match=r"That run differs from this one in data_dir \('.*pydoc' there, '.*copy' here\)"
    ):
        run_inprocess(copy, tmp_path / "out", *args)
    assert run_inprocess(f"{data_dir}/./", tmp_path / "out", *args).get("kept")


def test_tokens_count_across_resumes_that_change_the_batch(data_dir, tmp_path):
    """metrics.jsonl's tokens are the training tokens seen, kept in the checkpoint across a resume with another batch
    size; a checkpoint from before that count counts its iterations at its own config's batch."""
    run_inprocess(data_dir, tmp_path, "--max_iters=2", "--eval_interval=2")  # 128 tokens per iteration
    run_inprocess(data_dir, tmp_path, "--max_iters=4", "--eval_interval=2", "--init_from=resume", "--batch_size=2")
    assert [(m["iter"], m["tokens"]) for m in metrics(tmp_path)] == [(0, 0), (2, 256), (4, 256 + 2 * 64)]
    assert metrics(tmp_path)[-1]["token_budget"] == 384 and load_checkpoint(tmp_path / "last.pt")["tokens"] == 384
    ckpt = load_checkpoint(tmp_path / "last.pt")
    del ckpt["tokens"]  # as written before the count was kept: 4 iterations at its batch of 2 x 32 tokens
    save_checkpoint(tmp_path / "last.pt", ckpt)
    run_inprocess(data_dir, tmp_path, "--max_iters=6", "--eval_interval=2", "--init_from=resume", "--batch_size=8")
    assert metrics(tmp_path)[-1]["tokens"] == metrics(tmp_path)[-1]["token_budget"] == 4 * 64 + 2 * 256


def test_refusals_suggest_resume_only_where_last_pt_can_resume(data_dir, tmp_path):
    """An out_dir left with metrics.jsonl alone (or a damaged last.pt) is refused without suggesting
    --init_from=resume, which would fail there; eval_only evaluates a run's checkpoint without training."""
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "metrics.jsonl").write_text('{"iter": 0}\n')
    with pytest.raises(ConfigError) as e:
        run_inprocess(data_dir, tmp_path / "out", "--max_iters=2")
    assert "already holds a run (metrics.jsonl); valid: another --out_dir, or --overwrite=True" in str(e.value)
    assert "--init_from=resume" not in str(e.value)

    run_inprocess(data_dir, tmp_path / "a", "--max_iters=2", "--eval_interval=2")
    result = run_inprocess(data_dir, tmp_path / "eval", "--eval_only=True", f"--init_from={tmp_path / 'a'}")
    assert result["iter_num"] == 0 and not os.path.exists(tmp_path / "eval" / "last.pt")
    (tmp_path / "a" / "last.pt").write_bytes(b"")
    with pytest.raises(ConfigError) as e:
        run_inprocess(data_dir, tmp_path / "a", f"--init_from={tmp_path / 'a' / 'best.pt'}")
    assert str(e.value).endswith("valid: another --out_dir for a new run from its model")


def test_resume_from_a_damaged_last_pt_names_the_intact_best_pt(data_dir, tmp_path):
    run_inprocess(data_dir, tmp_path, "--max_iters=2", "--eval_interval=2")
    (tmp_path / "last.pt").write_bytes((tmp_path / "last.pt").read_bytes()[:-1000])
    with pytest.raises(
        CheckpointError,
        match=r"last\.pt' \(\d+ bytes\) is truncated or corrupt .*; valid: a new run from the intact checkpoint "
        r"beside it, --init_from=.*best\.pt with another --out_dir$",
    ):
        run_inprocess(data_dir, tmp_path, "--max_iters=4", "--init_from=resume")
    (tmp_path / "best.pt").write_bytes(b"")  # no intact one to offer: none offered
    with pytest.raises(CheckpointError) as e:
        run_inprocess(data_dir, tmp_path, "--max_iters=4", "--init_from=resume")
    assert "truncated or corrupt" in str(e.value) and "valid:" not in str(e.value)


def test_resume_drops_metrics_lines_after_its_checkpoint(data_dir, tmp_path, capsys):
    """A run that died between an eval's metrics line and its checkpoint left a line the resumed run writes again:
    the resume drops it (one line on stderr), so each iteration has one line. eval_only on the resumed checkpoint
    appends nothing: that iteration's line is there."""
    run_inprocess(data_dir, tmp_path, "--max_iters=2", "--eval_interval=2")
    path = tmp_path / "metrics.jsonl"
    lines = path.read_text().splitlines()
    late = json.dumps(dict(json.loads(lines[-1]), iter=4))  # written at iteration 4; last.pt stayed at 2
    path.write_text("\n".join([*lines, late, "not json, kept"]) + "\n")
    capsys.readouterr()
    run_inprocess(data_dir, tmp_path, "--max_iters=4", "--eval_interval=2", "--init_from=resume")
    out, err = capsys.readouterr()
    assert (
        f"note: {path}: 1 line(s) after iteration 2 (written after the checkpoint the run resumes from) dropped" in err
    )
    assert path.read_text().count("not json, kept") == 1
    path.write_text("".join(line for line in path.open() if "not json" not in line))
    assert [m["iter"] for m in metrics(tmp_path)] == [0, 2, 4]
    result = run_inprocess(data_dir, tmp_path, "--eval_only=True", "--init_from=resume")
    out, err = capsys.readouterr()
    assert result["iter_num"] == 4 and "eval 4: metrics.jsonl has this iteration's line already" in out
    assert [m["iter"] for m in metrics(tmp_path)] == [0, 2, 4] and "dropped" not in err


def test_resume_drops_a_metrics_line_cut_short(data_dir, tmp_path, capsys):
    """A crash mid-write leaves metrics.jsonl's last line without its newline: a resume drops a partial line (one
    line on stderr) and ends a whole one, so every line stays one JSON record."""
    run_inprocess(data_dir, tmp_path, "--max_iters=2", "--eval_interval=2")
    path = tmp_path / "metrics.jsonl"
    path.write_text(path.read_text() + '{"iter": 12, "tok')
    capsys.readouterr()
    run_inprocess(data_dir, tmp_path, "--max_iters=4", "--eval_interval=2", "--init_from=resume")
    err = capsys.readouterr().err
    assert f"note: {path}: its last line was cut short (a run killed while writing it): " in err
    assert """'{"iter": 12, "tok'; dropped before appending\n""" in err
    assert [m["iter"] for m in metrics(tmp_path)] == [0, 2, 4]
    path.write_text(path.read_text()[:-1])  # a whole record without its newline: kept
    run_inprocess(data_dir, tmp_path, "--max_iters=6", "--eval_interval=2", "--init_from=resume")
    assert [m["iter"] for m in metrics(tmp_path)] == [0, 2, 4, 6] and "cut short" not in capsys.readouterr().err
