"""attention_kernels/_host.py: the launch cache (`Launcher`) that takes repeated launches past Triton's JITFunction.run.

Its key must be at least as fine as Triton's specialization, or a launch would reuse a kernel compiled for other
arguments; `test_spec_determines_triton_specialization` checks that against Triton's own specializer on the CPU.
The cache's plumbing runs here against a stand-in kernel (the interpreter has no compiled kernels to keep), and on
a GPU against the real flash kernels (`test_cached_launches_match_triton_launches`)."""

import types

import pytest
import torch
from conftest import DEVICE
from triton._C.libtriton import native_specialize_impl
from triton.backends.nvidia.compiler import CUDABackend

from attention_kernels import _host


def _triton_spec(a):
    return native_specialize_impl(CUDABackend, a, False, True, True)


def _descriptors():
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor as GluonDescriptor
    from triton.tools.tensor_descriptor import TensorDescriptor

    from attention_kernels import sm90

    out = []
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        base = torch.empty(2, 3, 256, 128, dtype=dtype)
        for block in ([1, 1, 64, 128], [1, 1, 128, 128], [1, 1, 64, 64]):
            out.append(sm90.descriptor(base, block))
            out.append(GluonDescriptor.from_tensor(base, block, sm90._nvmma_layout(tuple(block), dtype)))
            out.append(TensorDescriptor.from_tensor(base, block))
        out.append(sm90.descriptor(base[..., :64], [1, 1, 64, 64]))  # another tensor's strides: same kernel
    return out


def test_spec_determines_triton_specialization():
    """Any two arguments `_spec` cannot tell apart get the same specialization from Triton (so one compiled kernel
    serves both), over ints at every boundary Triton cares about, floats, bools, None, tensors of several dtypes
    at aligned and misaligned offsets, and TMA descriptors of Gluon and Triton."""
    ints = [
        0,
        1,
        -1,
        2,
        3,
        15,
        16,
        17,
        31,
        32,
        48,
        64,
        1000,
        1024,
        4096,
        -16,
        -17,
        2**31 - 16,
        2**31 - 1,
        2**31,
        2**31 + 16,
        -(2**31),
        -(2**31) - 16,
        2**62,
        2**63 - 16,
        2**63,
        2**63 + 16,
        2**64 - 16,
    ]
    flat = {
        dtype: torch.empty(64, dtype=dtype)
        for dtype in (torch.float32, torch.bfloat16, torch.float16, torch.int32, torch.int64, torch.uint8)
    }
    tensors = [t[i:] for t in flat.values() for i in (0, 1, 2, 3, 4, 8, 16)]
    values = ints + [0.5, 1.0, -2.0, True, False, None] + tensors + _descriptors()
    seen = {}
    for v in values:
        key, want = _host._spec(v), _triton_spec(v)
        assert seen.setdefault(key, want) == want, f"{v!r:.60}: key {key} also stands for {seen[key]}, got {want}"
    # and the key is no finer than needed: only the bools, kept apart by value, share one specialization ('u1')
    keys_per_spec = {}
    for key, want in seen.items():
        keys_per_spec.setdefault(str(want), []).append(key)
    assert {spec: keys for spec, keys in keys_per_spec.items() if len(keys) > 1} == {str(("u1", None)): [True, False]}
    with pytest.raises(_host._Unkeyed):
        _host._spec((1, 2))  # a tuple argument: Triton's own path


class _Param:
    def __init__(self, num, name, is_constexpr):
        self.num, self.name, self.is_constexpr = num, name, is_constexpr


class _Compiled:
    def __init__(self, calls):
        self.calls, self.function, self.packed_metadata = calls, "function", "metadata"

    def run(self, gx, gy, gz, stream, function, metadata, launch_metadata, enter, exit, *args):
        self.calls.append(("cached", (gx, gy, gz), stream, function, metadata, launch_metadata, enter, exit, args))


class _Kernel:
    """A stand-in for a compiled JITFunction: kernel(x_ptr, n, BLOCK: constexpr, FLAG: constexpr)."""

    def __init__(self):
        self.params = [_Param(0, "x", False), _Param(1, "n", False), _Param(2, "BLOCK", True), _Param(3, "FLAG", True)]
        self.device_caches, self.pre_run_hooks, self.calls = {}, [], []

    def __getitem__(self, grid):
        def run(*args, **kwargs):
            self.calls.append(("triton", grid, args, kwargs))
            return _Compiled(self.calls)

        return run


@pytest.fixture
def stand_in(monkeypatch):
    active = types.SimpleNamespace(get_current_device=lambda: 0, get_current_stream=lambda device: 1234)
    monkeypatch.setattr(_host, "driver", types.SimpleNamespace(active=active))
    monkeypatch.delenv("ZOO_LAUNCH_CACHE", raising=False)
    kernel = _Kernel()
    return kernel, _host.Launcher(kernel)


def _paths(kernel):
    return [c[0] for c in kernel.calls]


def test_launcher_reuses_the_compiled_kernel(stand_in):
    kernel, launch = stand_in
    x = torch.empty(64, dtype=torch.float32)
    launch[(4,)](x, 32, BLOCK=64, FLAG=True, num_warps=4)
    launch[(5, 2)](x, 48, BLOCK=64, FLAG=True, num_warps=4)  # 48: divisible by 16 as 32 is, same kernel
    assert _paths(kernel) == ["triton", "cached"]
    assert kernel.calls[0] == ("triton", (4,), (x, 32), dict(BLOCK=64, FLAG=True, num_warps=4))
    # the compiled kernel's launcher: the grid in three dims, the stream, no launch metadata or hooks, and every
    # parameter in order, the constexprs included (as JITFunction.run passes them)
    assert kernel.calls[1] == ("cached", (5, 2, 1), 1234, "function", "metadata", None, None, None, (x, 48, 64, True))


@pytest.mark.parametrize(
    "change",
    [
        "n not divisible by 16",
        "n is 1",
        "misaligned pointer",
        "other dtype",
        "constexpr",
        "constexpr by position",
        "option",
    ],
)
def test_launcher_key_tells_specializations_apart(stand_in, change):
    """Whatever Triton would compile anew for, the cache does not reuse a kernel for."""
    kernel, launch = stand_in
    x = torch.empty(64, dtype=torch.float32)
    base = dict(args=(x, 32), kwargs=dict(BLOCK=64, FLAG=True, num_warps=4))
    other = {
        "n not divisible by 16": dict(args=(x, 33)),
        "n is 1": dict(args=(x, 1)),
        "misaligned pointer": dict(args=(x[1:], 32)),
        "other dtype": dict(args=(x.half(), 32)),
        "constexpr": dict(kwargs=dict(BLOCK=128, FLAG=True, num_warps=4)),
        "constexpr by position": dict(args=(x, 32, 128), kwargs=dict(FLAG=True, num_warps=4)),
        "option": dict(kwargs=dict(BLOCK=64, FLAG=True, num_warps=8)),
    }[change]
    other = {**base, **other}
    if change == "constexpr by position":
        base = dict(args=(x, 32, 64), kwargs=dict(FLAG=True, num_warps=4))
    for call in (base, other, base, other):
        launch[(1,)](*call["args"], **call["kwargs"])
    assert _paths(kernel) == ["triton", "triton", "cached", "cached"]
    assert kernel.calls[3][-1][2] == (128 if "constexpr" in change else 64)


@pytest.mark.parametrize("case", ["cache off", "launch hook", "callable grid", "default left out", "odd argument"])
def test_launcher_falls_back_to_triton(stand_in, monkeypatch, case):
    """Cases the cache does not cover take Triton's own path on every launch."""
    kernel, launch = stand_in
    x = torch.empty(64, dtype=torch.float32)
    grid, args, kwargs = (1,), (x, 32), dict(BLOCK=64, FLAG=True)
    if case == "cache off":
        monkeypatch.setenv("ZOO_LAUNCH_CACHE", "0")
    elif case == "launch hook":
        monkeypatch.setattr(_host.knobs.runtime.launch_enter_hook, "calls", [lambda metadata: None])
    elif case == "callable grid":
        grid = lambda meta: (1,)  # noqa: E731
    elif case == "default left out":
        kwargs = dict(BLOCK=64)
    else:
        args = ((1, 2), 32)
    for _ in range(3):
        launch[grid](*args, **kwargs)
    assert _paths(kernel) == ["triton"] * 3


def test_launcher_of_an_interpreted_kernel_is_triton_s_path():
    """Under the interpreter (the CPU suite) every launch is the kernel's own; `launcher` keeps one per kernel."""
    from attention_kernels.flash_triton import flash_fwd_kernel

    launch = _host.launcher(flash_fwd_kernel)
    assert launch is _host.launcher(flash_fwd_kernel)
    assert launch.compiled_path == (DEVICE == "cuda")


@pytest.mark.gpu
@pytest.mark.skipif(
    DEVICE != "cuda",
    reason="compiled kernels exist on a GPU only; the stand-in tests above cover the cache's logic on the CPU",
)
def test_cached_launches_match_triton_launches(monkeypatch):
    """On the GPU, flash attention forward and backward twice through the cache (the second call never enters
    JITFunction.run) give bitwise the results of Triton's own launches (ZOO_LAUNCH_CACHE=0)."""
    from attention_kernels import flash_gqa_attention

    q = torch.randn(2, 8, 300, 64, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(2, 2, 300, 64, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(2, 2, 300, 64, device="cuda", dtype=torch.bfloat16)
    do = torch.randn(2, 8, 300, 64, device="cuda", dtype=torch.bfloat16)

    def step():
        leaves = [x.clone().requires_grad_() for x in (q, k, v)]
        out = flash_gqa_attention(*leaves, causal=True)
        return (out, *torch.autograd.grad(out, leaves, do))

    monkeypatch.setenv("ZOO_LAUNCH_CACHE", "0")
    want = step()
    monkeypatch.delenv("ZOO_LAUNCH_CACHE")
    step()  # fills the cache
    runs = []
    for launch in list(_host._LAUNCHERS.values()):
        kernel = launch.kernel
        monkeypatch.setattr(kernel, "run", lambda *a, _run=kernel.run, **kw: runs.append(1) or _run(*a, **kw))
    got = step()
    assert not runs, "a repeated launch went through JITFunction.run"
    for name, g, w in zip(("out", "dq", "dk", "dv"), got, want):
        assert torch.equal(g, w), name


def test_kernel_modules_import_as_a_dag():
    """The package's modules import each other at their top only (an import inside a function would hide a loop)
    and without a loop, so each one imports alone: a topological order of their imports exists."""
    import ast
    import graphlib
    import pathlib

    package = pathlib.Path(_host.__file__).parent
    names = {p.stem for p in package.glob("*.py")}
    graph = {}
    for path in package.glob("*.py"):
        tree = ast.parse(path.read_text())
        top = {id(node) for node in tree.body}
        top |= {id(node) for stmt in tree.body if isinstance(stmt, ast.Try) for node in stmt.body}
        deps = set()
        for node in ast.walk(tree):
            if not isinstance(node, (ast.Import, ast.ImportFrom)):
                continue
            if isinstance(node, ast.ImportFrom) and node.module == "attention_kernels":
                found = {alias.name for alias in node.names} & names
            elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("attention_kernels."):
                found = {node.module.split(".")[1]}
            elif isinstance(node, ast.Import):
                found = {a.name.split(".")[1] for a in node.names if a.name.startswith("attention_kernels.")}
            else:
                continue
            assert not found or id(node) in top, f"{path.name}:{node.lineno}: imports {sorted(found)} inside a block"
            deps |= found
        graph[path.stem] = deps - {path.stem}
    order = list(graphlib.TopologicalSorter(graph).static_order())  # raises CycleError on a loop
    assert set(order) >= names


def test_keyed_launch_reuses_the_kernel_of_its_key(stand_in):
    """A keyed launch looks up the caller's key instead of the arguments' `_spec`s: a second launch of the key takes
    the compiled kernel, and another key compiles (or finds) its own."""
    kernel, launch = stand_in
    x = torch.empty(64, dtype=torch.float32)
    launch.keyed("a", (1,))(x, 32, BLOCK=64, FLAG=True)
    launch.keyed("a", (2,))(x, 48, BLOCK=64, FLAG=True)
    launch.keyed("b", (1,))(x, 32, BLOCK=64, FLAG=True)
    assert _paths(kernel) == ["triton", "cached", "triton"]
    launch.keyed(None, (1,))(x, 32, BLOCK=64, FLAG=True)  # no key: the `_spec`s, as launch[grid]
    launch[(1,)](x, 32, BLOCK=64, FLAG=True)
    assert _paths(kernel)[3:] == ["triton", "cached"]


def test_keyed_launch_check_catches_a_key_that_stands_for_two_specializations(stand_in, monkeypatch):
    """With ZOO_LAUNCH_CHECK=1 (conftest sets it for the suite), one key given to arguments that Triton specializes
    differently (32 divisible by 16, 33 not) is an error, not a kernel compiled for the wrong arguments."""
    kernel, launch = stand_in
    monkeypatch.setenv("ZOO_LAUNCH_CHECK", "1")
    x = torch.empty(64, dtype=torch.float32)
    launch.keyed("a", (1,))(x, 32, BLOCK=64, FLAG=True)
    launch.keyed("a", (1,))(x, 48, BLOCK=64, FLAG=True)  # the same specialization: fine
    with pytest.raises(AssertionError, match="stood for two specializations"):
        launch.keyed("a", (1,))(x, 33, BLOCK=64, FLAG=True)


def test_launch_cache_starts_over_at_its_bound(stand_in, monkeypatch):
    """Keyed launches add a key per op signature (a long generation run meets every prompt length), so a kernel's
    cache is bounded: at MAX_LAUNCH_KEYS it starts over, and a key it dropped compiles (or finds) its kernel again."""
    kernel, launch = stand_in
    monkeypatch.setattr(_host, "MAX_LAUNCH_KEYS", 2)
    x = torch.empty(64, dtype=torch.float32)
    for key in ("a", "b", "a", "c", "a"):
        launch.keyed(key, (1,))(x, 32, BLOCK=64, FLAG=True)
    assert _paths(kernel) == ["triton", "triton", "cached", "triton", "triton"]
    assert len(launch.cache) == 2
