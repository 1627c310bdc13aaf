"""Host-side helpers shared by every launcher: integer arithmetic, the device's properties, launches.

Integers: Triton 3.6 wraps `triton.cdiv` and `triton.next_power_of_2` as constexpr functions (for use inside
kernels), which costs about 3 us a call on the host, so the launchers use the plain versions below; inside kernels,
keep Triton's. Devices: `num_sms`, `capability`, `device_guard`, `pdl`. Launches: `Launcher`, which takes a
kernel's repeated launches past `JITFunction.run`. Timing: `behind_sleep`, the GPU-alone timing that the flash
config tuner and the benchmarks (benchmarks/common.bench_gpu_ms) share.
"""

import contextlib
import functools
import os
import time

import torch
from triton import knobs
from triton.runtime import driver

from attention_kernels import _checks

LOG2E = 1.4426950408889634  # kernels compute exp2(x * log2(e)) = e^x: the scale carries the factor


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def next_power_of_2(n: int) -> int:
    """The smallest power of two >= n (0 for n = 0, as Triton's)."""
    return 1 << (n - 1).bit_length() if n > 0 else 0


@functools.cache
def capability(device_index: int) -> tuple[int, int]:
    """(major, minor) compute capability of a CUDA device, cached: the query costs microseconds per launch."""
    return torch.cuda.get_device_capability(device_index)


@functools.cache
def _sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def num_sms(device: torch.device) -> int:
    """Streaming multiprocessors of the device; the interpreter on the CPU plays a 2-SM GPU (few programs, fast)."""
    if device.type != "cuda":
        return 2
    return _sm_count(device.index if device.index is not None else torch.cuda.current_device())


def device_guard(t: torch.Tensor):
    """Launch on t's GPU: a device switch only when it is not the current one (the switch costs microseconds on
    every call, and a training step makes dozens)."""
    if t.is_cuda and t.device.index != torch.cuda.current_device():
        return torch.cuda.device(t.device)
    return contextlib.nullcontext()


def pdl(device: torch.device) -> bool:
    """Launch the decode kernels and the split combine as programmatic dependents of the kernel before each? On
    sm_90 and newer (ZOO_PDL=0 turns it off) the GPU then starts a launch's programs as the previous kernel's
    programs exit, and `gdc_wait` in the kernel holds each one until that kernel's outputs are visible. It measured
    faster on most decode shapes of the H200 grid (benchmarks/RESULTS.md)."""
    if device.type != "cuda" or _checks.interpreting() or os.environ.get("ZOO_PDL", "1") == "0":
        return False
    if torch.version.hip is not None:  # ROCm reports its own capabilities (MI300: 9.4) and has no such launch
        return False
    return capability(device.index if device.index is not None else torch.cuda.current_device())[0] >= 9


def synced_seconds(fn) -> float:
    """Seconds of one fn() from an idle GPU until its work is done: host and GPU together, more than enqueueing
    alone takes, so a sleep of a few times this outlasts the enqueueing (`behind_sleep`)."""
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return time.perf_counter() - t0


def behind_sleep(enqueue, seconds: float) -> bool:
    """Put the current CUDA stream to sleep for at least `seconds`, call enqueue() (which queues work, and the
    events around it, behind the sleep), and wait for it all. True if the GPU was still asleep when enqueue
    returned: then the queued work ran back to back, never waiting for the host, and its events time the GPU
    alone. False: the sleep was too short for the host's enqueueing; try a longer one."""
    awake = torch.cuda.Event()
    torch.cuda._sleep(int(seconds * 2e9))  # cycles; at most the H100/H200 boost clock (~2 GHz), so >= seconds
    awake.record()
    enqueue()
    asleep = not awake.query()
    torch.cuda.synchronize()
    return asleep


MAX_LAUNCH_KEYS = 4096  # per kernel (and per op's kept checks); a prefill of every prompt length is a signature each


def tensor_signature(tensors) -> tuple:
    """Per tensor (or None) its shape, strides, dtype, device and 16-byte alignment: what an op's shape checks read
    and what Triton specializes a launch on, so that an op may check a signature once and key its launches by it
    (`Launcher.keyed`)."""
    return tuple(
        None if t is None else (t.shape, t.stride(), t.dtype, t.device, t.data_ptr() % 16 == 0) for t in tensors
    )


class Launcher:
    """`Launcher(kernel)[grid](*args, **kwargs)` launches like `kernel[grid](*args, **kwargs)`, and repeated launches
    skip Triton's `JITFunction.run`. That run binds and specializes every argument in Python and looks up the
    compiled kernel on each call, which on the H200's host took more than half of a launch's host time
    (benchmarks/RESULTS.md); a small training step is bound by that host time.

    The first launch of each specialization goes through `kernel[grid]`, which compiles (or finds) the kernel; the
    compiled kernel is kept under a key that is at least as fine as Triton's own: the device, every keyword (the
    constexprs and options such as num_warps), each constexpr passed by position by value, and for the other
    arguments what Triton specializes on (`_spec`: an int's value 1, divisibility by 16 and width; a tensor's dtype
    and 16-byte alignment; a TMA descriptor's dtype, block and layout). Later launches with the same key call the
    compiled kernel's launcher with the arguments in parameter order, which is what `JITFunction.run` ends with.
    Everything else takes Triton's own path: the interpreter, launch hooks (profilers), callable grids, arguments
    of other types, parameters left to their defaults. ZOO_LAUNCH_CACHE=0 turns the cache off.

    `Launcher(kernel).keyed(key, grid)(*args, **kwargs)` takes the caller's `key` in place of the positional
    arguments' `_spec`s: building those (one call per argument, forty for a flash backward launch) was a third of
    the attention ops' own host time. The caller's key must tell apart every pair of argument lists whose `_spec`s
    differ (a plan's shapes, strides, dtypes and alignments; see flash.py); with ZOO_LAUNCH_CHECK=1 (the tests) each
    keyed launch also builds the `_spec`s and raises if one key ever stood for two of them."""

    def __init__(self, kernel):
        self.kernel = kernel
        self.cache: dict = {}
        self.checked: dict = {}  # keyed launches under ZOO_LAUNCH_CHECK=1: key -> the `_spec`s it stood for
        params = getattr(kernel, "params", None)
        self.names = [p.name for p in params] if params is not None else None
        self.constexpr_at = frozenset(p.num for p in params if p.is_constexpr) if params is not None else frozenset()
        # Only a compiled JITFunction (not the interpreter's) has device caches and a compiled kernel to keep.
        self.compiled_path = params is not None and hasattr(kernel, "device_caches")

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.launch(grid, args, kwargs)

    def keyed(self, key, grid):
        return lambda *args, **kwargs: self.launch(grid, args, kwargs, key)

    def launch(self, grid, args, kwargs, given=None):
        if not (self.compiled_path and _launch_cache_on() and type(grid) is tuple and 1 <= len(grid) <= 3):
            return self.kernel[grid](*args, **kwargs)
        if (
            _hooked(knobs.runtime.launch_enter_hook)
            or _hooked(knobs.runtime.launch_exit_hook)
            or self.kernel.pre_run_hooks
        ):
            return self.kernel[grid](*args, **kwargs)
        try:
            key = (
                driver.active.get_current_device(),
                knobs.runtime.debug,
                knobs.compilation.instrumentation_mode,
                tuple(kwargs.items()),
                self._specs(args) if given is None else ("keyed", given),
            )
            entry = self.cache.get(key)
            if given is not None and _launch_check_on():
                self._check_key(key, self._specs(args))
        except (TypeError, _Unkeyed):  # an unhashable constexpr, an argument `_spec` does not know
            return self.kernel[grid](*args, **kwargs)
        if entry is None:
            compiled = self.kernel[grid](*args, **kwargs)
            if hasattr(compiled, "result"):  # an asynchronous compile's future
                compiled = compiled.result()
            if all(name in kwargs for name in self.names[len(args) :]):  # else a default: left to Triton's path
                if len(self.cache) >= MAX_LAUNCH_KEYS:  # keyed launches add a key per op signature: start over
                    self.cache.clear()
                self.cache[key] = compiled
            return compiled
        values = list(args) + [kwargs[name] for name in self.names[len(args) :]]  # every parameter, in order
        stream = driver.active.get_current_stream(key[0])
        entry.run(
            grid[0],
            grid[1] if len(grid) > 1 else 1,
            grid[2] if len(grid) > 2 else 1,
            stream,
            entry.function,
            entry.packed_metadata,
            None,
            None,
            None,
            *values,
        )
        return entry

    def _specs(self, args) -> tuple:
        return tuple(a if i in self.constexpr_at else _spec(a) for i, a in enumerate(args))

    def _check_key(self, key, specs):
        seen = self.checked.setdefault(key, specs)
        if seen != specs:
            raise AssertionError(
                f"launch key {key[-1]!r} of {getattr(self.kernel, '__name__', self.kernel)} stood for two "
                f"specializations:\n{seen}\n{specs}"
            )


class _Unkeyed(Exception):
    """An argument whose specialization `_spec` does not reproduce: its launch takes Triton's own path."""


def _spec(a):
    """What Triton specializes a non-constexpr argument on (`native_specialize_impl`), as a hashable key, or
    _Unkeyed. tests/test_host.py checks that Triton's specialization is a function of this key."""
    if a is None or isinstance(a, bool):
        return a
    if isinstance(a, int):
        return (a == 1, a % 16 == 0, -(2**31) <= a < 2**31, a >= 2**63)
    if isinstance(a, float):
        return float
    if isinstance(a, torch.Tensor):
        return (a.dtype, a.data_ptr() % 16 == 0)
    base, block = getattr(a, "base", None), getattr(a, "block_shape", None)
    if isinstance(base, torch.Tensor) and block is not None:  # a host TMA descriptor (Gluon's or Triton's)
        return type(a), base.dtype, tuple(block), len(a.shape), getattr(a, "layout", None), getattr(a, "padding", None)
    raise _Unkeyed


def _hooked(hook) -> bool:
    """Is a launch hook installed (a profiler's)? Triton 3.6 keeps them in a HookChain, empty by default."""
    return hook is not None and bool(getattr(hook, "calls", True))


def _launch_cache_on() -> bool:
    return os.environ.get("ZOO_LAUNCH_CACHE", "1") != "0"


def _launch_check_on() -> bool:
    return os.environ.get("ZOO_LAUNCH_CHECK", "0") == "1"


_LAUNCHERS: dict = {}


def launcher(kernel) -> Launcher:
    """The one `Launcher` of `kernel` (its cache of compiled kernels lives as long as the process)."""
    found = _LAUNCHERS.get(id(kernel))
    if found is None or found.kernel is not kernel:
        found = _LAUNCHERS[id(kernel)] = Launcher(kernel)
    return found
