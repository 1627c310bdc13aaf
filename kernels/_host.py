"""Host-side helpers of the launchers. Integers: Triton 3.6 wraps `triton.cdiv` and `triton.next_power_of_2` as
constexpr functions (for use inside kernels), which costs about 3 us a call on the host; a backward launch
computed a dozen of them. Inside kernels, keep Triton's. Timing: `behind_sleep`, the GPU-alone timing that the
config tuner (flash._gpu_ms) and the benchmarks (benchmarks/common.bench_gpu_ms) share."""

import torch


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def next_power_of_2(n: int) -> int:
    """The smallest power of two >= n (0 for n = 0, as Triton's)."""
    return 1 << (n - 1).bit_length() if n > 0 else 0


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
