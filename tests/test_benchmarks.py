"""The benchmarks' CPU paths: the documented smoke runs of bench_generate.py and bench_train.py (the same code as
the H200 tables, on tiny models, the Triton kernels under the interpreter), and the GPU-only benchmarks' message
where there is no GPU."""

import os
import subprocess
import sys

import pytest
import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_script(*args: str) -> str:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # the script sets it for --device cpu
    run = subprocess.run(
        [sys.executable, os.path.join(REPO, "benchmarks", args[0]), *args[1:]],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=REPO,
        env=env,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    return run.stdout


def table_rows(stdout: str, first_column: str) -> list[list[str]]:
    return [
        [c.strip() for c in line.split("|")]
        for line in stdout.splitlines()
        if line.split("|")[0].strip() == first_column
    ]


def test_bench_generate_cpu_smoke_run():
    """`--device cpu` (argparse's spelling, as well as --device=cpu) runs every cache of both variants through our
    kernels under the interpreter, beside the torch backend and the no-cache reference."""
    out = run_script(
        "bench_generate.py",
        "--device",
        "cpu",
        "--tiny",
        "--batches",
        "2",
        "--variants",
        "gqa,mla",
        "--prompt_len",
        "8",
        "--new_tokens",
        "4",
    )
    caches = {(r[0], r[1], r[2]) for r in table_rows(out, "gqa") + table_rows(out, "mla")}
    for backend in ("triton", "torch"):
        assert {
            ("gqa", "grouped", backend),
            ("gqa", "paged", backend),
            ("mla", "mla", backend),
            ("mla", "paged_mla", backend),
        } <= caches, out


def test_bench_train_cpu_smoke_run():
    out = run_script("bench_train.py", "--device=cpu", "--tiny", "--modes", "eager", "--steps", "1", "--batch", "1")
    rows = table_rows(out, "eager")
    assert [r[1] for r in rows] == ["mha", "gqa", "mqa", "mla"], out
    assert all(float(r[2]) > 0 and float(r[3]) > 0 for r in rows), out  # triton ms, torch ms


def test_gpu_benchmarks_say_they_need_a_gpu(monkeypatch):
    """bench_flash.py and bench_decode.py time against SDPA and the ceilings on a GPU: without one, a message that
    says what runs on the CPU instead, not torch's "not compiled with CUDA" traceback."""
    from benchmarks.common import require_cuda

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(
        SystemExit,
        match=r"bench_flash.py times the kernels on a CUDA GPU, and torch sees none "
        r"here; on the CPU, `pytest -n auto` runs the kernels",
    ):
        require_cuda("bench_flash.py")
