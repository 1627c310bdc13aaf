"""The benchmarks' CPU paths: the documented smoke runs of benchmarks.bench_generate and benchmarks.bench_train (the
same code as the H200 tables, on tiny models, the Triton kernels under the interpreter), run as modules the way the
README gives them, and the GPU-only benchmarks' message where there is no GPU."""

import os
import subprocess
import sys

import pytest
import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_module(module: str, *args: str) -> str:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # the benchmark sets it for --device cpu
    run = subprocess.run(
        [sys.executable, "-m", f"benchmarks.{module}", *args],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=REPO,
        env=env,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    return run.stdout


def table(stdout: str, first_column: str) -> list[dict[str, str]]:
    """The rows of the table whose header starts with `first_column`, as {column: cell}."""
    lines = stdout.splitlines()
    start = next(i for i, line in enumerate(lines) if line.split("|")[0].strip() == first_column)
    header = [c.strip() for c in lines[start].split("|")]
    rows = []
    for line in lines[start + 2 :]:
        cells = [c.strip() for c in line.split("|")]
        if len(cells) != len(header):
            break
        rows.append(dict(zip(header, cells)))
    return rows


def test_bench_generate_cpu_smoke_run():
    """`--device cpu` (argparse's spelling, as well as --device=cpu): both models pass the check against the eager
    loop, then a batch and the ragged prompts run four ways (our static engine, the same over compiled blocks, our
    eager loop, the peer), and --profile lists what a decode step of each fixed batch spends, compiled ours and the
    peer's."""
    out = run_module("bench_generate", "--device", "cpu", "--tiny", "--profile")
    assert "gqa check: max logit error vs eager" in out and "mla check: max logit error vs eager" in out, out
    for variant in ("gqa", "mla"):
        assert f"profile {variant} auto B2 compiled:" in out and f"profile {variant} B2 peer:" in out, out
    rows = table(out, "model")
    assert [(r["model"], r["batch"]) for r in rows] == [
        ("gqa", "2"),
        ("gqa", "ragged"),
        ("mla", "2"),
        ("mla", "ragged"),
    ]
    for r in rows:
        assert all(float(r[f"{name} tok/s"]) > 0 for name in ("engine", "compiled", "eager", "peer")), r
        assert float(r["engine/peer"]) > 0 and float(r["compiled/peer"]) > 0
        prefill = r["prefill s (engine, compiled, eager, peer)"]
        if r["batch"] == "ragged":  # each way's prefill seconds, as measured
            assert len(prefill.split(", ")) == 4 and all(float(x) > 0 for x in prefill.split(", ")), r
        else:
            assert prefill == "-", r


def test_bench_train_cpu_smoke_run():
    out = run_module("bench_train", "--device=cpu", "--tiny", "--modes", "eager", "--steps", "1", "--batch", "1")
    rows = table(out, "mode")
    assert [r["variant"] for r in rows] == ["mha", "gqa", "mqa", "mla"], out
    assert all(
        float(r["ours tok/s"].replace(",", "")) > 0 and float(r["SDPA tok/s"].replace(",", "")) > 0 for r in rows
    )


def test_gpu_benchmarks_say_they_need_a_gpu(monkeypatch):
    """bench_flash and bench_decode time against SDPA and the ceilings on a GPU: without one, a message that says
    what runs on the CPU instead, not torch's "not compiled with CUDA" traceback."""
    from benchmarks.common import require_cuda

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(
        SystemExit,
        match=r"bench_flash.py times the kernels on a CUDA GPU, and torch sees none "
        r"here; on the CPU, `pytest -n auto` runs the kernels",
    ):
        require_cuda("bench_flash.py")
