"""write_tokens against index_put, on the CPU (interpreter) and the GPU: a contiguous cache's head-major storage seen
token-major, a paged pool with shuffled pages, a latent pair of two widths (one head, dims not powers of two),
prefill (T > 1) and decode, a dtype conversion on the way in, broadcast row indices, and every bad input."""

import pytest
import torch
from conftest import DEVICE, DTYPE_IDS, KERNEL_DTYPES

from attention_kernels import write_tokens


def _reference(dst, x, pages, slots):
    ref = dst.clone()
    ref[pages.long(), slots.long()] = x.to(dst.dtype)
    return ref


@pytest.mark.parametrize("dtype", KERNEL_DTYPES, ids=DTYPE_IDS.get)
@pytest.mark.parametrize("T", [1, 5])
def test_contiguous_cache_rows_at_their_positions(dtype, T):
    """Rows 3 and 1 of a (B, H, S, D) cache, seen token-major as the caches keep it, each from its own start;
    fp32 new tokens stored in the cache's dtype."""
    B, H, S, D = 4, 3, 16, 32
    k_store = torch.randn(B, H, S, D, device=DEVICE).to(dtype)
    v_store = torch.randn(B, H, S, 24, device=DEVICE).to(dtype)
    k_dst, v_dst = k_store.transpose(1, 2), v_store.transpose(1, 2)  # (B, S, H, D), strided
    rows = torch.tensor([3, 1], device=DEVICE)
    positions = torch.tensor([2, 9], device=DEVICE)[:, None] + torch.arange(T, device=DEVICE)
    pages = rows[:, None].expand_as(positions)  # stride 0 along T, as the grouped cache passes it
    k_new = torch.randn(2, H, T, D, device=DEVICE).transpose(1, 2)  # (n, T, H, D), strided like a model's k
    v_new = torch.randn(2, T, H, 24, device=DEVICE)
    k_ref, v_ref = _reference(k_dst, k_new, pages, positions), _reference(v_dst, v_new, pages, positions)
    write_tokens(k_dst, v_dst, k_new, v_new, pages, positions)
    assert torch.equal(k_dst, k_ref) and torch.equal(v_dst, v_ref)


@pytest.mark.parametrize("dtype", KERNEL_DTYPES, ids=DTYPE_IDS.get)
def test_paged_latent_pair_of_two_widths(dtype):
    """MLA's latent (48 wide) and RoPE key (12 wide) as one head each, into shuffled pages of a pool, int32
    indices; the other slots stay as they were."""
    num_pages, page_size, n, T = 7, 4, 3, 6
    c_pool = torch.randn(num_pages, page_size, 48, device=DEVICE).to(dtype)
    r_pool = torch.randn(num_pages, page_size, 12, device=DEVICE).to(dtype)
    flat = torch.randperm(num_pages * page_size, device=DEVICE)[: n * T].view(n, T)
    pages, slots = (flat // page_size).int(), (flat % page_size).int()
    c_new, r_new = torch.randn(n, T, 48, device=DEVICE).to(dtype), torch.randn(n, T, 12, device=DEVICE).to(dtype)
    c_ref = _reference(c_pool[:, :, None], c_new[:, :, None], pages, slots)
    r_ref = _reference(r_pool[:, :, None], r_new[:, :, None], pages, slots)
    write_tokens(c_pool[:, :, None], r_pool[:, :, None], c_new[:, :, None], r_new[:, :, None], pages, slots)
    assert torch.equal(c_pool[:, :, None], c_ref) and torch.equal(r_pool[:, :, None], r_ref)


def test_bad_inputs_fail_clearly_and_write_nothing():
    dst_a, dst_b = torch.zeros(2, 8, 2, 16, device=DEVICE), torch.zeros(2, 8, 2, 16, device=DEVICE)
    a, b = torch.ones(2, 1, 2, 16, device=DEVICE), torch.ones(2, 1, 2, 16, device=DEVICE)
    pages = torch.tensor([[0], [1]], device=DEVICE)
    slots = torch.tensor([[3], [4]], device=DEVICE)
    cases = [
        (dict(a=a[:, :, :1]), "b: got shape (2, 1, 2, 16); valid: (n=2, T=1, H=1, D_b)"),
        (dict(b=b[..., :8]), "b_dst: got shape (2, 8, 2, 16); valid: (P, S, H=2, D=8)"),
        (dict(a=a[0]), "a: got shape (1, 2, 16); valid: a 4-d tensor (n, T, H, D_a)"),
        (dict(dst_b=dst_b[:, :4]), "b_dst: got shape (2, 4, 2, 16); valid: (P=2, S=8, ...) as a_dst"),
        (dict(pages=pages.float()), "pages: got torch.float32 shape (2, 1); valid: an int32 or int64 tensor"),
        (dict(slots=slots[:1]), "slots: got torch.int64 shape (1, 1); valid: an int32 or int64 tensor of shape"),
        (dict(slots=slots + 4), "slots: got values in [7, 8]; valid: values in [0, 8)"),
        (dict(pages=-pages), "pages: got values in [-1, 0]; valid: values in [0, 2)"),
        (dict(a=a.int()), "a: got dtype torch.int32; valid: torch.float16, torch.bfloat16 or torch.float32"),
    ]
    write_tokens(torch.zeros_like(dst_a), torch.zeros_like(dst_b), a, b, pages, slots)  # checks kept: still refused
    for change, message in cases:
        args = {**dict(dst_a=dst_a, dst_b=dst_b, a=a, b=b, pages=pages, slots=slots), **change}
        with pytest.raises(ValueError) as err:
            write_tokens(args["dst_a"], args["dst_b"], args["a"], args["b"], args["pages"], args["slots"])
        assert message in str(err.value), (change, str(err.value))
        assert not dst_a.any() and not dst_b.any()


def test_checks_run_once_per_signature(monkeypatch):
    """The shape checks run on a signature's first write (shapes, strides, dtypes, devices, alignment) and are kept:
    a cache's every layer writes with one signature; another T or a transposed view is checked anew."""
    from attention_kernels import cache_write

    monkeypatch.setattr(cache_write, "_CHECKED", set())
    calls = []
    check = cache_write._check
    monkeypatch.setattr(cache_write, "_check", lambda *args: calls.append(1) or check(*args))
    dst_a, dst_b = torch.zeros(2, 8, 2, 16, device=DEVICE), torch.zeros(2, 8, 2, 16, device=DEVICE)
    for T in (1, 1, 3, 3, 1):
        a, b = torch.randn(2, T, 2, 16, device=DEVICE), torch.randn(2, T, 2, 16, device=DEVICE)
        slots = torch.arange(T, device=DEVICE)[None].expand(2, T)
        pages = torch.tensor([[0], [1]], device=DEVICE).expand(2, T)
        write_tokens(dst_a, dst_b, a, b, pages, slots)
        assert torch.equal(dst_a, _reference(dst_a, a, pages, slots))
    assert len(calls) == 2
    a_t = torch.randn(2, 2, 1, 16, device=DEVICE).transpose(1, 2)  # (2, 1, 2, 16) with other strides
    write_tokens(dst_a, dst_b, a_t, a_t, pages[:, :1], slots[:, :1])
    assert len(calls) == 3


def test_compiled_write_goes_through_the_custom_op():
    """Under torch.compile(fullgraph=True) write_tokens traces as the zoo::write_tokens op (eagerly it launches
    directly): the compiled write stores what the eager one does."""
    dst = [torch.zeros(2, 8, 2, 16, device=DEVICE) for _ in range(4)]
    a, b = torch.randn(2, 3, 2, 16, device=DEVICE), torch.randn(2, 3, 2, 16, device=DEVICE)
    pages = torch.tensor([[1], [0]], device=DEVICE).expand(2, 3)
    slots = torch.tensor([[0, 1, 2], [5, 6, 7]], device=DEVICE)
    write_tokens(dst[0], dst[1], a, b, pages, slots)
    compiled = torch.compile(lambda *args: write_tokens(*args, validate=False), fullgraph=True, backend="aot_eager")
    compiled(dst[2], dst[3], a, b, pages, slots)
    assert torch.equal(dst[2], dst[0]) and torch.equal(dst[3], dst[1]) and dst[0].abs().sum() > 0
