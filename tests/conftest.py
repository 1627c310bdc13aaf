"""Shared test setup. Without a GPU the Triton kernels run on CPU tensors under the interpreter; that switch must
be set before anything imports triton, which is why it lives here, at the top of the first file pytest loads."""

import os

import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"
    # The tests' tensors are tiny and the interpreter is single-threaded numpy: intra-op threads only add
    # synchronization, and on a busy 2-core machine spinning OpenMP workers made a tiny generate() ~50x slower.
    torch.set_num_threads(1)

# Every launch whose caller keys it (`Launcher.keyed`) also checks that its key never stands for two of Triton's
# specializations: the GPU suite runs each keyed launch path of the package under this check.
os.environ["ZOO_LAUNCH_CHECK"] = "1"

import pytest  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"

# bf16 gives wrong results under the triton 3.6 interpreter, so the CPU tests fp32 and fp16 and the GPU tests fp16
# and bf16: every kernel test runs on both machines, each with the dtypes that machine computes right.
KERNEL_DTYPES = [torch.float16, torch.bfloat16] if DEVICE == "cuda" else [torch.float32, torch.float16]
DTYPE_IDS = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}  # test ids: ids=DTYPE_IDS.get

# Tolerances against the fp32 reference, per input dtype. The kernels round P (the softmax numerator) to the
# input dtype before the P@V product, as every flash kernel does, so the error is that of one rounding of P
# and of V: ~2^-8 relative for bf16, ~2^-11 for fp16; fp32 inputs use tf32-free fp32 dots on the interpreter.
TOLERANCES = {
    torch.float32: dict(atol=2e-4, rtol=2e-4),
    torch.float16: dict(atol=2e-3, rtol=2e-3),
    torch.bfloat16: dict(atol=1.6e-2, rtol=1.6e-2),
}
# Gradients sum many rounded products (dS has the rounding of P and of dP), so they get 4x the forward's budget.
GRAD_TOLERANCES = {dt: dict(atol=4 * t["atol"], rtol=4 * t["rtol"]) for dt, t in TOLERANCES.items()}


def assert_close(got: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype, name: str, grad: bool = False):
    """assert_close on fp32 values with the dtype's tolerance; the message gives max and mean error."""
    tol = (GRAD_TOLERANCES if grad else TOLERANCES)[dtype]
    got32, ref32 = got.float(), ref.float()
    assert not torch.isnan(got32).any(), f"{name}: NaN in the output"
    err = (got32 - ref32).abs()
    bound = tol["atol"] + tol["rtol"] * ref32.abs()
    bad = err > bound
    if bad.any():
        raise AssertionError(
            f"{name} ({dtype}): {int(bad.sum())}/{err.numel()} elements out of tolerance "
            f"(atol={tol['atol']}, rtol={tol['rtol']}); max err {err.max().item():.3e}, "
            f"mean err {err.mean().item():.3e}, max |ref| {ref32.abs().max().item():.3e}"
        )


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


@pytest.fixture(autouse=True)
def _fp32_matmuls():
    """train.main turns on TF32 matmuls for its process, as nanoGPT does; a test after it in the same worker
    compares fp32 paths at fp32 tolerances, which TF32's 10-bit mantissa (5e-4 relative) would not meet."""
    saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved


# ---------------------------------------------------------------------------------------- decode-kernel tests


@pytest.fixture
def poison_decode_outputs(monkeypatch):
    """Outputs and split partials of the decode kernels start as NaN: an element a kernel forgets to write fails
    the NaN check of assert_close."""
    from attention_kernels import split_kv

    def poisoned(shape, device, dtype):
        return torch.full(shape, float("nan"), device=device, dtype=dtype)

    monkeypatch.setattr(split_kv, "new_empty", poisoned)


def spy_launches(monkeypatch) -> list[tuple[str, bool]]:
    """(kernel name, launch_pdl) of every launch through `_host.Launcher` from now on, in order: the list fills as
    the kernels launch (clear it between steps)."""
    from attention_kernels import _host

    launches = []
    launch = _host.Launcher.launch

    def spy(self, grid, args, kwargs, given=None):
        launches.append((getattr(self.kernel, "__name__", "?"), bool(kwargs.get("launch_pdl", False))))
        return launch(self, grid, args, kwargs, given)

    monkeypatch.setattr(_host.Launcher, "launch", spy)
    return launches


def check_dependent_chain(step, x0: torch.Tensor, check, monkeypatch, links: int = 3):
    """A chain of `links` decode calls `step(x) -> (out, lse)`, each taking the previous output as its query, so
    that each launch reads what the launch before it wrote. With plain launches (ZOO_PDL=0) every link passes
    `check(x, out, lse, name)` (against the reference on its own query). `_host.pdl` allows programmatic
    dependent launches exactly on a CUDA GPU of capability 9.0 or newer: there, with ZOO_PDL=1, the chain takes
    them (some launch passes launch_pdl=True), and every output, eager and replayed from a CUDA graph, is bit for
    bit the plain one. Elsewhere (the CPU's interpreter, older GPUs) ZOO_PDL=1 launches plainly too, and the
    second chain checks only that a rerun gives the same bits."""
    from attention_kernels import _host

    launches = spy_launches(monkeypatch)  # the last chain's launches

    def chain():
        launches.clear()
        x, outs = x0, []
        for _ in range(links):
            x, lse = step(x)
            outs += [x, lse]
        return outs

    def took_pdl() -> bool:
        return any(pdl for _, pdl in launches)

    dependent = x0.is_cuda and torch.version.hip is None and torch.cuda.get_device_capability(x0.device)[0] >= 9
    monkeypatch.setenv("ZOO_PDL", "0")
    assert not _host.pdl(x0.device)
    plain = chain()
    assert launches and not took_pdl(), f"ZOO_PDL=0 still made a dependent launch: {launches}"
    x = x0
    for i in range(links):
        check(x, plain[2 * i], plain[2 * i + 1], f"decode {i} of the chain")
        x = plain[2 * i]
    monkeypatch.setenv("ZOO_PDL", "1")
    assert _host.pdl(x0.device) == dependent
    again = chain()
    assert took_pdl() == dependent, f"dependent launches expected: {dependent}; (kernel, launch_pdl): {launches}"
    what = "the dependent launches" if dependent else "a rerun of the plain launches"
    assert all(torch.equal(a, b) for a, b in zip(plain, again)), f"{what} differ from the plain launches"
    if x0.is_cuda:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            replayed = chain()
        assert took_pdl() == dependent, f"captured (kernel, launch_pdl): {launches}"
        graph.replay()
        torch.cuda.synchronize()
        assert all(torch.equal(a, b) for a, b in zip(plain, replayed)), f"{what}, replayed, differ from the plain"


def read_wandb_records(path):
    """Records of a .wandb file: a LevelDB-style log (7-byte file header, 32 KiB blocks, 7-byte record headers:
    crc32 u32, length u16, type u8 with FULL=1 FIRST=2 MIDDLE=3 LAST=4), each payload a wandb Record protobuf."""
    from wandb.proto import wandb_internal_pb2

    data = open(path, "rb").read()
    assert data[:4] == b":W&B", "not a wandb run file"
    pos, block, payload, records = 7, 32768, b"", []
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a header is zero padding
            pos += block - pos % block
            continue
        length, kind = int.from_bytes(data[pos + 4 : pos + 6], "little"), data[pos + 6]
        payload += data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(payload)
            records.append(record)
            payload = b""
    return records


def ragged_lens(batch: int, s_max: int) -> torch.Tensor:
    """Sequence lengths in [1, s_max] on DEVICE (int32) that always include s_max and 1 (when batch allows)."""
    lens = torch.randint(1, s_max + 1, (batch,))
    lens[0] = s_max
    if batch > 1:
        lens[1] = 1
    return lens.to(torch.int32).to(DEVICE)


# One compile worker per test process, started at its first compile and fed one JSON spec per line: a subprocess,
# because the tests' own process runs the interpreter (which never compiles), and one for all compiles, because a
# fresh process per kernel spent 4-5 s of a 2-core CI machine importing torch and triton each time (37 kernels).
_COMPILE_WORKER = """
import json, os, subprocess, sys, tempfile, traceback
import triton
from triton import knobs
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from triton.experimental.gluon import language as gl
from triton.experimental.gluon._runtime import GluonASTSource

def descriptor(block, dtype):
    layout = gl.NVMMASharedLayout.get_default_for(block, getattr(gl, dtype))
    short = dict(bfloat16="bf16", float16="fp16", float32="fp32")[dtype]
    return f"tensordesc<{short}[{','.join(map(str, block))}],{layout!r}>"

def compile_one(spec):
    kernel = getattr(__import__(spec["module"], fromlist=["_"]), spec["kernel"])
    types = {k: descriptor(**v) if isinstance(v, dict) else v for k, v in spec["types"].items()}
    const = spec["constants"]
    sig = {n: "constexpr" if n in const else types.get(n, "i32") for n in kernel.arg_names}
    source = (GluonASTSource if spec["gluon"] else ASTSource)(kernel, sig, const)
    compiled = triton.compile(source, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4, **spec["options"]})
    ptxas = knobs.nvidia.ptxas.path  # the ptxas whose version set the PTX's .version (TRITON_PTXAS_PATH, else Triton's)
    with tempfile.TemporaryDirectory() as tmp:
        open(os.path.join(tmp, "k.ptx"), "w").write(compiled.asm["ptx"])
        run = subprocess.run([ptxas, "-arch=sm_90a", "-v", os.path.join(tmp, "k.ptx"), "-o",
                              os.path.join(tmp, "k.cubin")], capture_output=True, text=True)
    return dict(ptx=compiled.asm["ptx"], ttgir=compiled.asm["ttgir"], shared=compiled.metadata.shared,
                ptxas=run.stderr + run.stdout)

for line in sys.stdin:
    try:
        result = compile_one(json.loads(line))
    except Exception:
        result = dict(error=traceback.format_exc())
    sys.stdout.write("@@compiled " + json.dumps(result) + "\\n")
    sys.stdout.flush()
"""
_compile_worker = None  # (subprocess.Popen, its stderr file)


def _compile_process():
    import subprocess
    import sys
    import tempfile

    global _compile_worker
    if _compile_worker is None or _compile_worker[0].poll() is not None:
        env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
        root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
        stderr = tempfile.TemporaryFile(mode="w+")  # a file, not a pipe: a full pipe nobody reads would block it
        proc = subprocess.Popen(
            [sys.executable, "-c", _COMPILE_WORKER],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=stderr,
            text=True,
            env=env,
            cwd=root,
        )
        _compile_worker = (proc, stderr)
    return _compile_worker


def compile_gluon_sm90(
    module: str, kernel: str, types: dict, constants: dict, options: dict | None = None, gluon: bool = True
) -> dict:
    """Compile a Gluon kernel (gluon=False: a Triton-language one) for sm_90 on any machine (in the compile worker,
    a subprocess without the interpreter; Gluon has none, and the interpreter never compiles) and assemble it with
    ptxas: {"ptx", "ttgir" (the layouts Triton chose), "shared" (bytes), "ptxas" (its -v report: registers, spills,
    warnings)}. `types` maps argument names to Triton signature strings, or a TMA descriptor as {"block": [...],
    "dtype": "bfloat16"} (its NVMMA layout is the default for that block); arguments not named are i32. `options`
    adds compile options (maxnreg, num_stages) to num_warps=4, or replaces it."""
    import json

    proc, stderr = _compile_process()
    spec = dict(module=module, kernel=kernel, types=types, constants=constants, options=options or {}, gluon=gluon)
    proc.stdin.write(json.dumps(spec) + "\n")
    proc.stdin.flush()
    for line in proc.stdout:  # anything else the compiler prints to stdout is skipped
        if line.startswith("@@compiled "):
            result = json.loads(line[len("@@compiled ") :])
            assert "error" not in result, f"compiling {module}.{kernel}:\n{result.get('error', '')[-3000:]}"
            return result
    stderr.seek(0)  # it died (the next compile starts a new one: `_compile_process` polls it)
    raise AssertionError(f"the compile worker exited compiling {module}.{kernel}:\n{stderr.read()[-3000:]}")


def setmaxnreg_counts(ptx: str) -> set[str]:
    """The register counts the warp roles of a warp-specialized kernel ask for (setmaxnreg)."""
    import re

    return set(re.findall(r"setmaxnreg\.(?:inc|dec)\.sync\.aligned\.u32\s+(\d+)", ptx))


def spill_bytes(ptxas_report: str) -> list[tuple[int, int]]:
    """(store, load) spill bytes per function from ptxas -v."""
    import re

    return [(int(a), int(b)) for a, b in re.findall(r"(\d+) bytes spill stores, (\d+) bytes spill loads", ptxas_report)]
