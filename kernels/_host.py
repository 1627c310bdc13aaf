"""Integer helpers for the launchers' host code. Triton 3.6 wraps `triton.cdiv` and `triton.next_power_of_2` as
constexpr functions (for use inside kernels), which costs about 3 us a call on the host; a backward launch
computed a dozen of them. Inside kernels, keep Triton's."""


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def next_power_of_2(n: int) -> int:
    """The smallest power of two >= n (0 for n = 0, as Triton's)."""
    return 1 << (n - 1).bit_length() if n > 0 else 0
