"""Head dims the kernels do not tile natively: below 16 or not a multiple of 16 (8, 24, 40, and D_qk != D_v).

The flash ops zero-pad Q/K and V to the next multiple of 16 inside the op (the softmax scale stays that of the true
D_qk) and drop the padding columns of the output and the gradients; the decode ops tile the head dim in
power-of-two blocks of at least 16 columns, masked past D. Checked at the op level against
attention_kernels.reference (forward, backward, the lse gradient, preallocated outputs, torch.compile and the custom
ops' fake kernels), and at the model level: a GPT with head dim 8 or 24 trains (logits and every gradient) and
decodes through a KV cache on the Triton kernels exactly as the plain PyTorch path computes it.

Runs on the CPU under TRITON_INTERPRET=1 in fp32 and on the GPU in fp16/bf16 (the kernels) and fp32 (the model).
"""

import copy

import pytest
import torch
from conftest import DEVICE, DTYPE_IDS, KERNEL_DTYPES, assert_close

from attention_kernels import (
    flash_gqa_attention,
    flash_gqa_backward,
    flash_gqa_forward,
    grouped_decode,
    mla_decode,
    paged_grouped_decode,
    reference,
)
from attention_kernels.flash import MAX_HEAD_DIM, MIN_HEAD_DIM, _backward, _forward
from cache import make_cache
from model import GPT, GPTConfig

OP_DTYPES = [torch.float32] if DEVICE == "cpu" else KERNEL_DTYPES

# (B, H_q, H_kv, S, D_qk, D_v, causal): every D in (8, 24, 40) at S 17 and 63, and D_qk != D_v.
FLASH_CASES = [
    (2, 4, 2, 17, 8, 8, True),
    (1, 4, 1, 63, 8, 8, False),
    (1, 2, 2, 17, 24, 24, False),
    (1, 4, 2, 63, 24, 24, True),
    (1, 4, 4, 17, 40, 40, True),
    (1, 2, 1, 63, 40, 40, False),
    (1, 4, 2, 17, 8, 24, True),
]


def flash_id(case) -> str:
    b, h_q, h_kv, s, d_qk, d_v, causal = case
    d = f"D{d_qk}" if d_qk == d_v else f"D{d_qk}x{d_v}"
    return f"B{b}-Hq{h_q}-Hkv{h_kv}-S{s}-{d}" + ("-causal" if causal else "")


def flash_inputs(case, dtype, bshd: bool = False):
    """q, k, v and an output gradient; bshd: (B, S, H, D) memory seen as (B, H, S, D), as the model passes them."""
    b, h_q, h_kv, s, d_qk, d_v, _ = case

    def make(h, d):
        if bshd:
            return torch.randn(b, s, h, d, device=DEVICE, dtype=dtype).transpose(1, 2)
        return torch.randn(b, h, s, d, device=DEVICE, dtype=dtype)

    return make(h_q, d_qk), make(h_kv, d_qk), make(h_kv, d_v), make(h_q, d_v)


def reference_grads(q, k, v, do, dlse, causal):
    """The fp32 reference's out, lse and the gradients of sum(out * do) + sum(lse * dlse)."""
    q32, k32, v32 = (x.detach().float().requires_grad_() for x in (q, k, v))
    out, lse = reference.attention_reference(q32, k32, v32, causal=causal)
    ((out * do.float()).sum() + (lse * dlse.float()).sum()).backward()
    return out.detach(), lse.detach(), q32.grad, k32.grad, v32.grad


@pytest.mark.parametrize("dtype", OP_DTYPES, ids=DTYPE_IDS.get)
@pytest.mark.parametrize("case", FLASH_CASES, ids=flash_id)
def test_flash_forward_backward_at_any_head_dim(case, dtype):
    """flash_gqa_forward and autograd (a loss on out and on lse) against the reference, the scale that of the true
    D_qk, with the model's (B, S, H, D) memory layout; the output and the gradients have the inputs' shapes."""
    causal = case[-1]
    q, k, v, do = flash_inputs(case, dtype, bshd=True)
    leaves = [x.detach().requires_grad_() for x in (q, k, v)]
    out, lse = flash_gqa_forward(*leaves, causal=causal)
    dlse = torch.randn_like(lse)
    grads = torch.autograd.grad((out * do).sum() + (lse * dlse).sum(), leaves)
    ref_out, ref_lse, *ref_grads = reference_grads(q, k, v, do, dlse, causal)
    assert out.shape == do.shape and lse.shape == do.shape[:3]
    assert_close(out, ref_out, dtype, "out")
    assert_close(lse, ref_lse, torch.float32 if dtype == torch.float32 else dtype, "lse")
    for name, got, want, leaf in zip(("dq", "dk", "dv"), grads, ref_grads, leaves):
        assert got.shape == leaf.shape, name
        assert_close(got, want, dtype, name, grad=True)


@pytest.mark.parametrize("case", [FLASH_CASES[0], FLASH_CASES[6]], ids=flash_id)
def test_flash_launchers_fill_preallocated_buffers(case):
    """_forward and _backward at a padded head dim write every element of NaN-poisoned out, lse, dq, dk, dv given
    as views (any strides), and nothing past them; flash_gqa_backward gives the same gradients."""
    dtype, causal = OP_DTYPES[0], case[-1]
    q, k, v, do = flash_inputs(case, dtype)

    def poisoned_view(like, dtype=dtype):  # a view of a wider NaN buffer
        base = torch.full((*like.shape[:-1], like.shape[-1] + 3), float("nan"), device=DEVICE, dtype=dtype)
        return base, base[..., : like.shape[-1]]

    out_base, out = poisoned_view(do)
    lse = torch.full(do.shape[:3], float("nan"), device=DEVICE)
    _forward(q, k, v, None, causal, out=out, lse=lse)
    bases, views = zip(*(poisoned_view(x) for x in (q, k, v)))
    dq, dk, dv = _backward(q, k, v, out, lse, do, None, causal, grads=views)
    ref_out, ref_lse, *ref_grads = reference_grads(q, k, v, do, torch.zeros_like(lse), causal)
    assert_close(out, ref_out, dtype, "out")
    assert_close(lse, ref_lse, torch.float32 if dtype == torch.float32 else dtype, "lse")
    for name, got, want in zip(("dq", "dk", "dv"), (dq, dk, dv), ref_grads):
        assert_close(got, want, dtype, name, grad=True)
    for name, base, view in zip(("out", "dq", "dk", "dv"), (out_base,) + bases, (out, dq, dk, dv)):
        assert view.data_ptr() == base.data_ptr(), f"{name}: not written in place"
        assert torch.isnan(base[..., view.shape[-1] :]).all(), f"{name}: written past its view"
    public = flash_gqa_backward(q, k, v, out, lse, do, causal=causal)
    for name, got, want in zip(("dq", "dk", "dv"), public, (dq, dk, dv)):
        assert torch.equal(got, want), f"flash_gqa_backward {name}"


def test_flash_custom_ops_at_a_padded_head_dim():
    """The custom ops torch.compile traces: their fake kernels give the real outputs' shapes, dtypes and strides at
    a padded head dim (torch.library.opcheck), and a compiled forward + backward (fullgraph) matches the
    reference."""
    dtype = OP_DTYPES[0]
    case = (1, 4, 2, 17, 8, 24, True)
    q, k, v, do = flash_inputs(case, dtype, bshd=True)
    torch.library.opcheck(torch.ops.zoo.flash_fwd.default, (q, k, v, 0.3, True))
    out, lse = torch.ops.zoo.flash_fwd(q, k, v, 0.3, True)
    torch.library.opcheck(torch.ops.zoo.flash_bwd.default, (q, k, v, out, lse, do, None, 0.3, True))

    torch._dynamo.reset()
    backend = "inductor" if DEVICE == "cuda" else "aot_eager"
    compiled = torch.compile(lambda q, k, v: flash_gqa_attention(q, k, v, causal=True), fullgraph=True, backend=backend)
    leaves = [x.detach().requires_grad_() for x in (q, k, v)]
    got = compiled(*leaves)
    grads = torch.autograd.grad(got, leaves, do)
    ref_out, _, *ref_grads = reference_grads(q, k, v, do, torch.zeros(q.shape[:3], device=DEVICE), True)
    assert_close(got, ref_out, dtype, "compiled out")
    for name, g, want in zip(("dq", "dk", "dv"), grads, ref_grads):
        assert_close(g, want, dtype, f"compiled {name}", grad=True)


def test_flash_head_dim_limits():
    """The ops take every head dim from MIN_HEAD_DIM (1) to MAX_HEAD_DIM (256); outside that, a ValueError that
    says what is valid."""
    assert (MIN_HEAD_DIM, MAX_HEAD_DIM) == (1, 256)
    dtype = OP_DTYPES[0]
    q, k, v = (torch.randn(1, 2, 5, 1, device=DEVICE, dtype=dtype) for _ in range(3))
    ref, _ = reference.attention_reference(q, k, v, causal=True)
    assert_close(flash_gqa_attention(q, k, v, causal=True), ref, dtype, "D=1 out")
    for d_qk, d_v, name, got in ((0, 8, "q", 0), (8, 0, "v", 0), (257, 8, "q", 257), (8, 257, "v", 257)):
        q, k = (torch.randn(1, 2, 5, d_qk, device=DEVICE, dtype=dtype) for _ in range(2))
        v = torch.randn(1, 2, 5, d_v, device=DEVICE, dtype=dtype)
        with pytest.raises(ValueError, match=rf"{name}: got head dim {got}; valid: a head dim from 1 to 256"):
            flash_gqa_attention(q, k, v)


# ---------------------------------------------------------------------------------------------------- decode


@pytest.mark.parametrize("dtype", OP_DTYPES, ids=DTYPE_IDS.get)
@pytest.mark.parametrize("d,d_v", [(8, 8), (24, 24), (40, 40), (5, 3)], ids=["D8", "D24", "D40", "D5x3"])
def test_grouped_and_paged_decode_at_any_head_dim(d, d_v, dtype):
    """grouped_decode and paged_grouped_decode (8-token pages, a shuffled block table) over ragged lengths, one and
    three splits, against the reference."""
    b, h_q, h_kv, s, page = 3, 4, 2, 37, 8
    q = torch.randn(b, h_q, d, device=DEVICE, dtype=dtype)
    k = torch.randn(b, h_kv, s, d, device=DEVICE, dtype=dtype)
    v = torch.randn(b, h_kv, s, d_v, device=DEVICE, dtype=dtype)
    seq_lens = torch.tensor([37, 1, 20], device=DEVICE, dtype=torch.int32)
    pages = torch.randperm(3 * 5, device=DEVICE).view(3, 5).to(torch.int32)
    k_pages = torch.randn(15, page, h_kv, d, device=DEVICE, dtype=dtype)
    v_pages = torch.randn(15, page, h_kv, d_v, device=DEVICE, dtype=dtype)
    ref_out, ref_lse = reference.decode_reference(q, k, v, seq_lens, scale=d**-0.5)
    ref_paged, ref_paged_lse = reference.paged_decode_reference(q, k_pages, v_pages, pages, seq_lens, scale=0.3)
    lse_dtype = torch.float32 if dtype == torch.float32 else dtype
    for splits in (1, 3):
        out, lse = grouped_decode(q, k, v, seq_lens, scale=d**-0.5, num_splits=splits)
        assert_close(out, ref_out, dtype, f"grouped out, {splits} splits")
        assert_close(lse, ref_lse, lse_dtype, f"grouped lse, {splits} splits")
        out, lse = paged_grouped_decode(q, k_pages, v_pages, pages, seq_lens, scale=0.3, num_splits=splits)
        assert_close(out, ref_paged, dtype, f"paged out, {splits} splits")
        assert_close(lse, ref_paged_lse, lse_dtype, f"paged lse, {splits} splits")


def test_mla_decode_at_a_small_latent():
    """mla_decode with a latent of 8 and a RoPE key of 4 (below the 16 columns of a tile) against the reference."""
    dtype = OP_DTYPES[0]
    b, h, s, d_c, d_r = 2, 5, 30, 8, 4
    shapes = ((b, h, d_c), (b, h, d_r), (b, s, d_c), (b, s, d_r))
    q_abs, q_rope, c_kv, k_rope = (torch.randn(*shape, device=DEVICE, dtype=dtype) for shape in shapes)
    seq_lens = torch.tensor([30, 9], device=DEVICE, dtype=torch.int32)
    out, lse = mla_decode(q_abs, q_rope, c_kv, k_rope, seq_lens, scale=0.3, num_splits=2)
    ref_out, ref_lse = reference.mla_decode_reference(q_abs, q_rope, c_kv, k_rope, seq_lens, scale=0.3)
    assert_close(out, ref_out, dtype, "mla out")
    assert_close(lse, ref_lse, torch.float32 if dtype == torch.float32 else dtype, "mla lse")


# ----------------------------------------------------------------------------------------------------- model

# n_embd / n_head = 8 (below the kernels' 16) and 24 (not a multiple of 16); GQA groups of 4 and 2.
MODELS = {
    "D8": dict(n_embd=64, n_head=8, n_kv_head=2, pos_embedding="learned"),
    "D24": dict(n_embd=96, n_head=4, n_kv_head=2, pos_embedding="rope"),
}


def make_model(name: str, backend: str) -> GPT:
    torch.manual_seed(0)
    config = GPTConfig(
        vocab_size=64, block_size=32, n_layer=2, dropout=0.0, attention="gqa", attn_backend=backend, **MODELS[name]
    )
    return GPT(config).to(DEVICE)


def assert_scaled_close(got, ref, tol: float, name: str):
    """max |got - ref| <= tol * max |ref| (elementwise rtol is meaningless for gradients that cross zero). fp32
    on both paths: the kernels and SDPA differ in summation order only (~1e-6 relative)."""
    got32, ref32 = got.detach().float(), ref.detach().float()
    assert got32.shape == ref32.shape, f"{name}: shape {tuple(got32.shape)} != {tuple(ref32.shape)}"
    err, scale = (got32 - ref32).abs().max().item(), ref32.abs().max().item()
    assert err <= tol * scale + 1e-12, f"{name}: max err {err:.3e} > {tol:g} * max|ref| {scale:.3e}"


@pytest.mark.parametrize("name", list(MODELS))
def test_model_trains_on_the_kernels_at_any_head_dim(name):
    """Logits, loss and every gradient of the Triton path equal the plain PyTorch path's with the same weights."""
    torch_model = make_model(name, "torch")
    triton_model = copy.deepcopy(torch_model)
    triton_model.config.attn_backend = "triton"
    assert torch_model.config.qk_head_dim == int(name[1:])
    idx = torch.randint(0, 64, (2, 19), device=DEVICE)
    targets = torch.randint(0, 64, (2, 19), device=DEVICE)
    results = []
    for model in (torch_model, triton_model):
        logits, loss = model(idx, targets)
        loss.backward()
        results.append((logits, loss, {n: p.grad for n, p in model.named_parameters()}))
    (ref_logits, ref_loss, ref_grads), (logits, loss, grads) = results
    assert_scaled_close(logits, ref_logits, 1e-4, "logits")
    assert_scaled_close(loss, ref_loss, 1e-4, "loss")
    for param, ref_grad in ref_grads.items():
        assert grads[param] is not None, f"{param}: no gradient"
        assert_scaled_close(grads[param], ref_grad, 2e-4, f"grad {param}")


@pytest.mark.parametrize("kind", ["grouped", "paged"])
@pytest.mark.parametrize("name", list(MODELS))
def test_model_decodes_on_the_kernels_at_any_head_dim(name, kind):
    """Prefill 9 tokens into a cache.make_cache cache (Triton decode kernels), then decode 4 tokens one at a time
    (T = 1) through the model on the Triton kernels: each step's logits equal the full forward's (recomputed over
    every token so far) at the same positions."""
    model = make_model(name, "triton").eval()
    idx = torch.randint(0, 64, (2, 13), device=DEVICE)
    cache = make_cache(kind, model.config, 2, 16, device=DEVICE, backend="triton", page_size=8)
    with torch.no_grad():
        full, _ = model(idx)
        logits, _ = model(idx[:, :9], cache=cache)
        assert_scaled_close(logits, full[:, :9], 1e-4, "prefill logits")
        for t in range(9, 13):
            logits, _ = model(idx[:, t : t + 1], cache=cache)
            assert_scaled_close(logits[:, -1], full[:, t], 1e-4, f"decode logits of token {t}")
