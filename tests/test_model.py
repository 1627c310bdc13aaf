"""model.py: the Triton and plain PyTorch attention paths agree (logits, loss, every gradient) for every attention
variant; the cached forward (prefill, chunked prefill, one-token decode with MLA's absorbed form) reproduces
the full forward; configs fail with the promised errors; from_pretrained matches transformers' GPT-2; the FLOP,
MFU and KV-cache byte counts equal hand-computed numbers.

On a machine without a GPU the Triton kernels run on CPU tensors under TRITON_INTERPRET=1 (see conftest.py)."""

import copy
import dataclasses
import math
import sys

import pytest
import torch
from conftest import DEVICE

import model as model_module
from attention_kernels import reference
from model import GPT, GPTConfig, peak_bf16_flops

TINY = dict(vocab_size=96, block_size=32, n_layer=2, dropout=0.0)
# Head dims >= 16 (the flash kernel's minimum); MLA's D_qk = 16 + 8 = 24 and D_v = 20 are not powers of two.
MLA_DIMS = dict(n_head=4, n_embd=64, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=20)
VARIANTS = {
    "mha": dict(attention="mha", n_head=4, n_embd=64),
    "gqa-g2": dict(attention="gqa", n_head=4, n_kv_head=2, n_embd=64),
    "gqa-g4": dict(attention="gqa", n_head=8, n_kv_head=2, n_embd=128),
    "mqa": dict(attention="mqa", n_head=4, n_embd=64),
    "mla": dict(attention="mla", **MLA_DIMS),
    "mla-qlora": dict(attention="mla", q_lora_rank=24, **MLA_DIMS),
}
POSITIONS = ("learned", "rope")

# Model-level tolerances, as max |got - ref| <= tol * max |ref| per tensor (elementwise rtol is meaningless for
# gradients that cross zero). fp32: the interpreter's kernel and SDPA both compute in fp32 and differ only in
# summation order (~1e-6 relative); two layers, LayerNorm and the backward amplify that well below 1e-4.
# bf16 autocast: both paths round q/k/v, P and the output to bf16 (2^-8 = 3.9e-3 relative each) at different
# points and these roundings feed the following layer, so the logits get 2e-2 and the gradients 4e-2.
MODEL_DTYPES = [torch.float32, torch.bfloat16] if DEVICE == "cuda" else [torch.float32]
MODEL_TOL = {torch.float32: dict(out=1e-4, grad=2e-4), torch.bfloat16: dict(out=2e-2, grad=4e-2)}


def make_config(variant: str, pos: str = "learned", **overrides) -> GPTConfig:
    return GPTConfig(**{**TINY, **VARIANTS[variant], "pos_embedding": pos, **overrides})


def assert_scaled_close(got: torch.Tensor, ref: torch.Tensor, tol: float, name: str):
    got32, ref32 = got.detach().float(), ref.detach().float()
    assert got32.shape == ref32.shape, f"{name}: shape {tuple(got32.shape)} != {tuple(ref32.shape)}"
    assert torch.isfinite(got32).all(), f"{name}: non-finite values"
    err, scale = (got32 - ref32).abs().max().item(), ref32.abs().max().item()
    assert err <= tol * scale + 1e-12, (
        f"{name}: max err {err:.3e} > {tol:g} * max|ref| {scale:.3e} "
        f"(mean err {(got32 - ref32).abs().mean().item():.3e})"
    )


def count_flash_calls(monkeypatch) -> list:
    """Route the model's flash calls through a counter, so a test can tell the Triton path actually ran."""
    calls, flash = [], model_module.flash_gqa_attention

    def counted(q, k, v, **kwargs):
        calls.append((tuple(q.shape), tuple(k.shape), tuple(v.shape)))
        return flash(q, k, v, **kwargs)

    monkeypatch.setattr(model_module, "flash_gqa_attention", counted)
    return calls


def forbid_flash(monkeypatch):
    def fail(*args, **kwargs):
        raise AssertionError("the torch path called the Triton kernel")

    monkeypatch.setattr(model_module, "flash_gqa_attention", fail)


def run_fwd_bwd(model: GPT, idx, targets, dtype):
    model.zero_grad(set_to_none=True)
    with torch.autocast(DEVICE, dtype=torch.bfloat16, enabled=dtype == torch.bfloat16):
        logits, loss = model(idx, targets)
    loss.backward()
    return logits, loss, {n: p.grad for n, p in model.named_parameters()}


# ------------------------------------------------------------------------------------------------------------
# Triton path == PyTorch path
# ------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", MODEL_DTYPES, ids=lambda d: str(d).removeprefix("torch."))
@pytest.mark.parametrize("pos", POSITIONS)
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_triton_path_matches_torch_path(variant, pos, dtype, monkeypatch):
    torch_model = GPT(make_config(variant, pos, attn_backend="torch")).to(DEVICE)
    triton_model = copy.deepcopy(torch_model)
    triton_model.config.attn_backend = "triton"
    B, T = (2, 31) if pos == "learned" else (1, 31)  # batch strides once per variant: B=1 halves the interpreter's work
    idx = torch.randint(0, TINY["vocab_size"], (B, T), device=DEVICE)
    targets = torch.randint(0, TINY["vocab_size"], (B, T), device=DEVICE)

    forbid_flash(monkeypatch)
    ref_logits, ref_loss, ref_grads = run_fwd_bwd(torch_model, idx, targets, dtype)
    monkeypatch.undo()
    calls = count_flash_calls(monkeypatch)
    logits, loss, grads = run_fwd_bwd(triton_model, idx, targets, dtype)

    cfg = triton_model.config
    H_kv = cfg.n_kv_head  # K/V heads reach the kernel unrepeated (MLA: its n_head materialized heads)
    assert (
        calls
        == [((B, cfg.n_head, T, cfg.qk_head_dim), (B, H_kv, T, cfg.qk_head_dim), (B, H_kv, T, cfg.v_dim))] * cfg.n_layer
    )
    tol = MODEL_TOL[dtype]
    assert_scaled_close(logits, ref_logits, tol["out"], "logits")
    assert_scaled_close(loss, ref_loss, tol["out"], "loss")
    assert ref_grads.keys() == grads.keys()
    for name, ref_grad in ref_grads.items():
        assert ref_grad is not None and grads[name] is not None, f"{name}: no gradient"
        assert_scaled_close(grads[name], ref_grad, tol["grad"], f"grad {name}")


@pytest.mark.parametrize("s_q", [9, 5, 1])
def test_torch_path_is_the_reference_math(s_q):
    """The torch path (SDPA with explicit K/V repetition) equals attention_reference, bottom-right causal when
    the queries are fewer than the keys (a cached prefix), with D_qk != D_v."""
    q = torch.randn(2, 6, s_q, 24, device=DEVICE)
    k, v = torch.randn(2, 2, 9, 24, device=DEVICE), torch.randn(2, 2, 9, 20, device=DEVICE)
    got = model_module.causal_attention(q, k, v, "torch")
    ref, _ = reference.attention_reference(q, k, v, causal=True)  # scale 1/sqrt(D_qk)
    assert_scaled_close(got, ref, 1e-5, f"S_q={s_q}")


# ------------------------------------------------------------------------------------------------------------
# The cached forward (the model's side of the cache protocol)
# ------------------------------------------------------------------------------------------------------------


class ReferenceCache:
    """The model <-> cache protocol in its plainest form: every sequence has the same length, tensors grow by
    torch.cat, and decode runs the attention_kernels.reference math. It records each call, so the tests check the
    protocol as well as the numbers. (cache.py's real caches are tested in test_generation.py.)"""

    def __init__(self, batch_size: int, device=DEVICE):
        self.batch_size, self.device, self.length, self.store, self.calls = batch_size, device, 0, {}, []

    def reserve(self, T: int) -> torch.Tensor:
        self.calls.append(("reserve", T))
        positions = torch.arange(self.length, self.length + T, device=self.device)
        self.length += T
        return positions.expand(self.batch_size, T)

    def _grow(self, layer, a, b, dim):
        if layer in self.store:
            a, b = torch.cat([self.store[layer][0], a], dim), torch.cat([self.store[layer][1], b], dim)
        assert a.shape[dim] == self.length, "the model wrote before reserving (or twice)"
        self.store[layer] = (a, b)
        return a, b

    def append(self, layer, k, v):
        self.calls.append(("append", layer))
        return self._grow(layer, k, v, 2)

    def attend(self, layer, q, k, v, scale):
        self.calls.append(("attend", layer, scale))
        k_all, v_all = self._grow(layer, k, v, 2)
        seq_lens = torch.full((self.batch_size,), self.length, dtype=torch.int32, device=self.device)
        out, _ = reference.decode_reference(q[:, :, 0], k_all, v_all, seq_lens, scale=scale)
        return out.to(q.dtype)[:, :, None]

    def append_latent(self, layer, c_kv, k_rope):
        self.calls.append(("append_latent", layer))
        assert c_kv.ndim == 3 and k_rope.ndim == 3, "the latent and the rope key have no head axis"
        return self._grow(layer, c_kv, k_rope, 1)

    def attend_latent(self, layer, q_absorbed, q_rope, c_kv, k_rope, scale):
        self.calls.append(("attend_latent", layer, scale))
        c_all, r_all = self._grow(layer, c_kv, k_rope, 1)
        seq_lens = torch.full((self.batch_size,), self.length, dtype=torch.int32, device=self.device)
        out, _ = reference.mla_decode_reference(
            q_absorbed[:, :, 0], q_rope[:, :, 0], c_all, r_all, seq_lens, scale=scale
        )
        return out.to(q_absorbed.dtype)[:, :, None]

    def attend_latent_inputs(self, layer, q, kv, cos, sin, norm_weight, eps, w_uk, scale):
        """The step's raw projections (the Triton backend's decode): the reference math, then attend_latent's."""
        q_abs, q_rope, c_kv, k_rope = reference.mla_decode_inputs_reference(q, kv, cos, sin, norm_weight, eps, w_uk)
        out = self.attend_latent(layer, q_abs[:, :, None], q_rope[:, :, None], c_kv[:, None], k_rope[:, None], scale)
        self.calls[-1] = ("attend_latent_inputs", layer, scale)
        return out[:, :, 0].to(q.dtype)


# The Triton backend changes the prefill attention (the flash kernel over a cached prefix, bottom-right causal), RoPE
# (rope_qkv) and MLA's decode call (attend_latent_inputs), none of which depends on the position scheme beyond
# RoPE itself: one position scheme is enough there.
CACHED_CASES = [(v, p, "torch") for v in VARIANTS for p in POSITIONS] + [(v, "rope", "triton") for v in VARIANTS]


@pytest.mark.parametrize("variant, pos, backend", CACHED_CASES, ids=["-".join(c) for c in CACHED_CASES])
def test_cached_forward_matches_full_forward(variant, pos, backend):
    """Prefill 12 tokens, prefill 7 more over the cached prefix, then decode 6 one at a time: every step's
    logits equal the full forward's at the same positions (the decode steps run MLA's absorbed form)."""
    model = GPT(make_config(variant, pos, attn_backend=backend)).to(DEVICE).eval()
    cfg = model.config
    B, chunks = 2, [12, 7, 1, 1, 1, 1, 1, 1]
    idx = torch.randint(0, cfg.vocab_size, (B, sum(chunks)), device=DEVICE)
    cache = ReferenceCache(B)
    with torch.no_grad():
        full, _ = model(idx)
        start = 0
        for T in chunks:
            cache.calls.clear()
            logits, _ = model(idx[:, start : start + T], cache=cache)
            assert_scaled_close(logits, full[:, start : start + T], 1e-4, f"logits of tokens {start}..{start + T}")
            start += T
            mla = cfg.attention == "mla"
            if T > 1:
                per_layer = [("append_latent" if mla else "append", i) for i in range(cfg.n_layer)]
            else:
                scale = 1 / math.sqrt(cfg.qk_head_dim)  # MLA: 1/sqrt(nope + rope)
                # MLA's input kernel runs wherever model.triton_runs: the Triton backend, and any backend on CUDA
                inputs = backend == "triton" or DEVICE == "cuda"
                attend = ("attend_latent_inputs" if inputs else "attend_latent") if mla else "attend"
                per_layer = [(attend, i, scale) for i in range(cfg.n_layer)]
            assert cache.calls == [("reserve", T)] + per_layer


@pytest.mark.parametrize("variant", ["mla", "mla-qlora"])
def test_mla_decode_folds_the_up_projections(variant):
    """MLA's decode step runs through absorbed_weights (W_UV folded into the output projection; without query
    compression the query and latent projections joined). With every bias nonzero (the init zeroes them), a decode
    step gives the full forward's logits; the decode weights are kept while the model's stay the same, and rebuilt
    once one changes in place (an optimizer step, a load_state_dict), so a later decode sees the new weights."""
    model = GPT(make_config(variant, "rope")).to(DEVICE).eval()
    attn = model.transformer.h[0].attn
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(".bias"):
                p.normal_(0.0, 0.05)
    assert any(n.endswith("attn.c_proj.bias") for n, _ in model.named_parameters())
    idx = torch.randint(0, model.config.vocab_size, (2, 9), device=DEVICE)

    def decode_logits():
        cache = ReferenceCache(2)
        with torch.no_grad():
            model(idx[:, :8], cache=cache)
            return model(idx[:, 8:], cache=cache)[0]

    with torch.no_grad():
        full = model(idx)[0][:, 8:]
    assert_scaled_close(decode_logits(), full, 1e-4, "decode logits with the folded weights")
    kept = attn.absorbed_weights()
    assert all(a is b for a, b in zip(kept, attn.absorbed_weights())), "the folded weights were rebuilt unchanged"
    with torch.no_grad():
        attn.kv_b_proj.weight.mul_(1.5)  # in place: the version counter moves, the storage stays
        full = model(idx)[0][:, 8:]
    assert_scaled_close(decode_logits(), full, 1e-4, "decode logits after a weight changed in place")
    assert attn.absorbed_weights()[2] is not kept[2]
    with torch.no_grad():
        attn.c_proj.weight.mul_(0.5)
        full = model(idx)[0][:, 8:]
    with torch.inference_mode():  # built here, they must still serve a decode that autograd records
        assert_scaled_close(decode_logits(), full, 1e-4, "decode logits after c_proj changed in place")
    cache = ReferenceCache(2)
    prefill = model(idx[:, :8], cache=cache)[0]
    step = model(idx[:, 8:], cache=cache)[0]
    assert_scaled_close(step, full, 1e-4, "decode logits recorded by autograd")
    (prefill.sum() + step.sum()).backward()
    grad = attn.c_proj.weight.grad
    assert grad is not None and torch.isfinite(grad).all() and grad.abs().max() > 0, "c_proj.weight got no gradient"


def test_mla_decode_under_autocast_takes_fp32_weights():
    """An fp32 MLA model decoding under fp16 autocast through the Triton path and a real cache: the step's
    projections come out in fp16 while W_UK and the latent norm's gain stay fp32 (mla_decode_inputs takes both).
    The decode step's logits equal the full forward's under the same autocast within fp16's rounding."""
    from cache import make_cache

    model = GPT(make_config("mla", "rope", attn_backend="triton")).to(DEVICE).eval()
    idx = torch.randint(0, model.config.vocab_size, (2, 9), device=DEVICE)
    cache = make_cache("mla", model.config, 2, 16, device=DEVICE, dtype=torch.float16, backend="triton")
    with torch.no_grad(), torch.autocast(DEVICE, dtype=torch.float16):
        full = model(idx)[0][:, 8:]
        model(idx[:, :8], cache=cache)
        step = model(idx[:, 8:], cache=cache)[0]
    assert step.dtype == full.dtype
    # fp16 rounds each activation to 2^-11 through the layers; the cache holds the latent in fp16 too
    assert_scaled_close(step.float(), full.float(), 1e-2, "decode logits under autocast")


def test_last_positions_give_those_logits_only():
    """forward(last=...) returns each row's logits at its own position, as a right-padded prefill reads them: the
    same numbers as the full logits there. A shape other than (B,) is refused."""
    model = GPT(make_config("gqa-g2", "rope")).to(DEVICE).eval()
    idx = torch.randint(0, model.config.vocab_size, (3, 10), device=DEVICE)
    last = torch.tensor([9, 0, 4], device=DEVICE)
    with torch.no_grad():
        full, _ = model(idx)
        picked, _ = model(idx, last=last)
    assert picked.shape == (3, 1, model.config.vocab_size)
    torch.testing.assert_close(picked[:, 0], full[torch.arange(3), last], rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match=r"last: got shape \(2,\); valid: \(B=3,\)"):
        model(idx, last=last[:2])


def test_learned_positions_stop_at_block_size():
    """Without a cache always; with one on the CPU only (reading GPU positions would sync every decode step)."""
    model = GPT(make_config("mha", attn_backend="torch"))
    with pytest.raises(ValueError, match="block_size=32"):
        model(torch.zeros(1, 33, dtype=torch.long))
    cache = ReferenceCache(1, device="cpu")
    model(torch.zeros(1, 32, dtype=torch.long), cache=cache)
    with pytest.raises(ValueError, match="position 32 .*block_size=32"):
        model(torch.zeros(1, 1, dtype=torch.long), cache=cache)


def test_rope_runs_past_block_size():
    """RoPE has no position table: a longer sequence runs (what sample.py allows is its own decision)."""
    model = GPT(make_config("gqa-g2", "rope", attn_backend="torch"))
    logits, _ = model(torch.zeros(1, 40, dtype=torch.long))
    assert logits.shape == (1, 40, TINY["vocab_size"])


# ------------------------------------------------------------------------------------------------------------
# Config validation
# ------------------------------------------------------------------------------------------------------------

BAD_CONFIGS = {
    "unknown-attention": (dict(attention="mhx"), "attention", "'mha' | 'gqa' | 'mqa' | 'mla'"),
    "unknown-pos": (dict(pos_embedding="alibi"), "pos_embedding", "'learned' | 'rope'"),
    "unknown-backend": (dict(attn_backend="cuda"), "attn_backend", "'triton' | 'torch' | 'auto'"),
    "zero-heads": (dict(n_head=0), "n_head", "a positive int"),
    "zero-vocab": (dict(vocab_size=0), "vocab_size", "a positive int"),
    "float-layers": (dict(n_layer=2.0), "n_layer", "a positive int"),
    "dropout-1": (dict(dropout=1.0), "dropout", r"\[0, 1\)"),
    "dropout-string": (dict(dropout="0.1"), "dropout", r"\[0, 1\)"),
    "bias-string": (dict(bias="False"), "bias", r"True \| False"),  # a truthy string would mean bias=True
    "theta-string": (dict(rope_theta="1e4"), "rope_theta", "a positive float"),
    "theta-0": (dict(rope_theta=0.0), "rope_theta", "a positive float"),
    "embd-not-divisible": (dict(n_embd=30, n_head=4), "n_embd", "a multiple of n_head=4"),
    "rope-odd-head-dim": (dict(n_embd=12, n_head=4, pos_embedding="rope"), "n_embd", "even for RoPE"),
    "mha-contradicting-kv": (dict(attention="mha", n_head=4, n_kv_head=2), "n_kv_head", "None or 4"),
    "mqa-contradicting-kv": (dict(attention="mqa", n_head=4, n_kv_head=2), "n_kv_head", "None or 1"),
    "gqa-negative-kv": (dict(attention="gqa", n_head=4, n_kv_head=-1), "n_kv_head", "divides n_head"),
    "gqa-kv-not-dividing": (dict(attention="gqa", n_head=4, n_kv_head=3), "n_kv_head", "divides n_head"),
    "gqa-kv-above-heads": (dict(attention="gqa", n_head=4, n_kv_head=8), "n_kv_head", r"\[1, n_head=4\]"),
    "mla-contradicting-kv": (dict(attention="mla", n_kv_head=2, **MLA_DIMS), "n_kv_head", "None or n_head=4"),
    "mla-odd-rope": (dict(attention="mla", **{**MLA_DIMS, "qk_rope_head_dim": 7}), "qk_rope_head_dim", "even"),
    "mla-negative-q-lora": (dict(attention="mla", q_lora_rank=-1, **MLA_DIMS), "q_lora_rank", ">= 0"),
}
for _field in ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"):
    BAD_CONFIGS[f"mla-negative-{_field}"] = (
        dict(attention="mla", **{**MLA_DIMS, _field: -1}),
        _field,
        "a positive int for attention='mla'",
    )
    BAD_CONFIGS[f"mla-derived-{_field}-without-head-dim"] = (  # 0 derives from n_embd / n_head, which is not whole
        dict(attention="mla", **{**MLA_DIMS, "n_embd": 66, _field: 0}),
        _field,
        "or 0 with n_embd a multiple of n_head=4",
    )


@pytest.mark.parametrize("case", list(BAD_CONFIGS))
def test_bad_config_raises(case):
    overrides, field, valid = BAD_CONFIGS[case]
    with pytest.raises(ValueError, match=rf"GPTConfig\.{field}: got .*; valid: .*{valid}"):
        GPTConfig(**{**TINY, "n_head": 4, "n_embd": 64, **overrides})


@pytest.mark.parametrize("variant, expected", [("mha", 4), ("mqa", 1), ("gqa-g4", 2), ("mla", 4)])
def test_n_kv_head_resolution_round_trips(variant, expected):
    config = make_config(variant)
    assert config.n_kv_head == expected
    assert GPTConfig(**dataclasses.asdict(config)) == config  # what a checkpoint's model_args rebuilds


@pytest.mark.parametrize(
    "n_head, n_embd, n_kv_head",
    [(1, 16, 1), (4, 64, 1), (6, 96, 1), (8, 64, 2), (12, 768, 3), (14, 224, 2), (16, 1024, 4), (32, 1024, 8)],
)
def test_unset_sizes_take_the_variants_natural_values(n_head, n_embd, n_kv_head):
    """None or 0 means the variant's own value, derived in the model config alone: GQA groups 4 query heads per K/V
    head (the largest divisor of n_head up to n_head // 4), MHA n_head, MQA 1; MLA takes DeepSeek-V2's ratios to the
    head dim h (latent 4h, RoPE h/2 rounded down to even and at least 2, nope and value h)."""
    size = dict(TINY, n_head=n_head, n_embd=n_embd)
    for unset in (None, 0):
        assert GPTConfig(**size, attention="gqa", n_kv_head=unset).n_kv_head == n_kv_head
        assert GPTConfig(**size, attention="mha", n_kv_head=unset).n_kv_head == n_head
        assert GPTConfig(**size, attention="mqa", n_kv_head=unset).n_kv_head == 1
    h = n_embd // n_head
    mla = GPTConfig(**size, attention="mla")
    assert (mla.kv_lora_rank, mla.qk_nope_head_dim, mla.v_head_dim, mla.n_kv_head) == (4 * h, h, h, n_head)
    assert mla.qk_rope_head_dim == max(2, h // 2 - (h // 2) % 2) and mla.qk_rope_head_dim % 2 == 0
    set_dims = dict(kv_lora_rank=40, qk_nope_head_dim=24, qk_rope_head_dim=6, v_head_dim=20)
    assert {k: getattr(GPTConfig(**size, attention="mla", **set_dims), k) for k in set_dims} == set_dims
    assert GPTConfig(**dataclasses.asdict(mla)) == mla  # resolved values rebuild the same config


def test_mla_fields_are_ignored_by_other_variants():
    config = GPTConfig(**TINY, n_head=4, n_embd=64, attention="gqa", n_kv_head=2, kv_lora_rank=0, q_lora_rank=7)
    assert config.qk_head_dim == 16 and config.v_dim == 16


# ------------------------------------------------------------------------------------------------------------
# The model object
# ------------------------------------------------------------------------------------------------------------


def test_weight_tying_and_init():
    model = GPT(GPTConfig(**{**TINY, **VARIANTS["mha"], "n_layer": 8}))
    assert model.lm_head.weight is model.transformer.wte.weight
    std = model.transformer.h[0].mlp.c_proj.weight.std().item()  # 16384 samples: a 1% estimate
    assert abs(std - 0.02 / math.sqrt(2 * 8)) < 0.05 * 0.02 / math.sqrt(2 * 8)
    assert abs(model.transformer.h[0].mlp.c_fc.weight.std().item() - 0.02) < 0.05 * 0.02
    assert all(not b.any() for n, b in model.named_parameters() if n.endswith(".bias"))


def test_num_params():
    learned, rope = GPT(make_config("mha")), GPT(make_config("mha", "rope"))
    total = sum(p.numel() for p in learned.parameters())
    assert learned.num_params(non_embedding=False) == total
    assert learned.num_params() == total - 32 * 64  # the position table
    assert rope.num_params() == rope.num_params(non_embedding=False) == total - 32 * 64


def test_configure_optimizers_groups():
    model = GPT(make_config("mla-qlora"))
    opt = model.configure_optimizers(weight_decay=0.1, learning_rate=1e-3, betas=(0.9, 0.95), device_type="cpu")
    decay, no_decay = opt.param_groups
    assert decay["weight_decay"] == 0.1 and no_decay["weight_decay"] == 0.0
    assert all(p.dim() >= 2 for p in decay["params"]) and all(p.dim() < 2 for p in no_decay["params"])
    assert len(decay["params"]) + len(no_decay["params"]) == len(list(model.parameters()))
    assert not opt.defaults.get("fused")


def test_attn_backend_for():
    assert GPT(make_config("mha")).attn_backend_for("cpu") == "torch"
    assert GPT(make_config("mha")).attn_backend_for(torch.device("cuda")) == "triton"
    assert GPT(make_config("mha", attn_backend="torch")).attn_backend_for("cuda") == "torch"
    assert GPT(make_config("mha", attn_backend="triton")).attn_backend_for("cpu") == "triton"


def test_crop_block_size():
    model = GPT(make_config("mha", attn_backend="torch"))
    model.crop_block_size(16)
    assert model.config.block_size == 16 and model.transformer.wpe.weight.shape == (16, 64)
    model(torch.zeros(1, 16, dtype=torch.long))
    with pytest.raises(ValueError, match="block_size=16"):
        model(torch.zeros(1, 17, dtype=torch.long))
    with pytest.raises(ValueError, match="block_size: got 17"):
        model.crop_block_size(17)


# ------------------------------------------------------------------------------------------------------------
# Counting: FLOPs, MFU, KV-cache bytes (numbers worked out by hand from the layer shapes)
# ------------------------------------------------------------------------------------------------------------


def test_flops_and_mfu_by_hand():
    gqa = GPT(make_config("gqa-g4"))  # n_embd 128, 8 heads of 16, 2 KV heads
    per_layer = 128 * (8 + 2 * 2) * 16 + 128 * 128 + 128 * 512 + 512 * 128  # c_attn, c_proj, c_fc, mlp.c_proj
    matmul = 2 * per_layer + 128 * 96  # + lm_head
    attention = 3 * 2 * 8 * (16 + 16) * 32  # 3 (fwd+bwd) * n_layer * H * (D_qk + D_v) * T, causal half
    assert matmul == 356352 and attention == 49152
    assert gqa.flops_per_token() == 6 * 356352 + 49152
    # 4 sequences of 32 tokens in 0.5 s against a 1 TFLOP/s peak.
    assert gqa.estimate_mfu(4, 0.5, peak_flops=1e12) == pytest.approx(2187264 * 32 * 4 / 0.5 / 1e12)

    mla = GPT(make_config("mla-qlora"))  # 4 heads, D_c 32, nope 16, rope 8, v 20, q_lora 24
    per_layer = 64 * 24 + 24 * 4 * 24 + 64 * (32 + 8) + 32 * 4 * (16 + 20) + 4 * 20 * 64 + 2 * 64 * 256
    assert per_layer == 48896
    assert mla.flops_per_token() == 6 * (2 * 48896 + 64 * 96) + 3 * 2 * 4 * (24 + 20) * 32


def test_mfu_peaks(monkeypatch):
    model = GPT(make_config("mha"))
    assert model.estimate_mfu(4, 0.5) is None  # the CPU has no bf16 tensor-core peak to compare against
    names = {
        "NVIDIA H200": 989e12,
        "NVIDIA H200 NVL": 835e12,
        "NVIDIA GH200 480GB": 989e12,
        "NVIDIA H100 80GB HBM3": 989e12,
        "NVIDIA H100 PCIe": 756e12,
        "NVIDIA A100-SXM4-80GB": 312e12,
        "NVIDIA L40S": 362e12,
        "NVIDIA L4": 121e12,
        "Tesla T4": None,
    }
    for name, peak in names.items():
        monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None, name=name: name)
        assert peak_bf16_flops(torch.device("cuda", 0)) == peak, name


@pytest.mark.parametrize(
    "variant, dtype, expected",
    [
        ("mha", torch.bfloat16, 2 * 2 * 4 * 16 * 2),  # 2 (K, V) * n_layer * n_kv_head * head_dim * bytes
        ("gqa-g4", torch.bfloat16, 2 * 2 * 2 * 16 * 2),
        ("gqa-g4", torch.float32, 2 * 2 * 2 * 16 * 4),
        ("mqa", torch.float16, 2 * 2 * 1 * 16 * 2),
        ("mla", torch.bfloat16, 2 * (32 + 8) * 2),  # n_layer * (kv_lora_rank + qk_rope_head_dim) * bytes
    ],
)
def test_kv_cache_bytes_per_token(variant, dtype, expected):
    assert GPT(make_config(variant)).kv_cache_bytes_per_token(dtype) == expected


# ------------------------------------------------------------------------------------------------------------
# GPT-2 weights
# ------------------------------------------------------------------------------------------------------------


def test_from_pretrained_local_dir_matches_transformers(tmp_path):
    transformers = pytest.importorskip("transformers")  # the test extra; the GPU machine may lack it
    hf_config = transformers.GPT2Config(vocab_size=96, n_positions=32, n_embd=64, n_layer=2, n_head=4)
    hf = transformers.GPT2LMHeadModel(hf_config).eval()
    hf.save_pretrained(tmp_path)
    model = GPT.from_pretrained(str(tmp_path), override_args={"attn_backend": "torch"}).eval()
    assert model.config.n_layer == 2 and model.config.block_size == 32 and model.config.attention == "mha"
    idx = torch.randint(0, 96, (2, 32))
    with torch.no_grad():
        ours, _ = model(idx)
        theirs = hf(idx).logits
    assert_scaled_close(ours, theirs, 1e-5, "logits vs transformers")


def test_from_pretrained_errors(monkeypatch, tmp_path):
    with pytest.raises(ValueError, match="name_or_path: got 'gpt3'"):
        GPT.from_pretrained("gpt3")
    with pytest.raises(ValueError, match=r"override_args: got keys \['n_layer'\]"):
        GPT.from_pretrained("gpt2", override_args={"n_layer": 3})
    transformers = pytest.importorskip("transformers")  # the test extra; the GPU machine may lack it

    def offline(*args, **kwargs):
        raise OSError("We couldn't connect to 'https://huggingface.co' to load the files")

    monkeypatch.setattr(transformers.GPT2LMHeadModel, "from_pretrained", offline)
    with pytest.raises(OSError, match="offline, pass a directory written by GPT2LMHeadModel.save_pretrained"):
        GPT.from_pretrained("gpt2")
    with pytest.raises(OSError, match="is it a directory written by GPT2LMHeadModel.save_pretrained"):
        GPT.from_pretrained(str(tmp_path))  # a directory without weights
    monkeypatch.setitem(sys.modules, "transformers", None)  # what a missing package looks like to import
    with pytest.raises(ImportError, match="pip install transformers"):
        GPT.from_pretrained("gpt2")


def test_from_pretrained_refuses_another_architecture(tmp_path):
    """transformers loads a Llama directory into GPT2LMHeadModel with a warning and random weights; we refuse."""
    transformers = pytest.importorskip("transformers")  # the test extra; the GPU machine may lack it
    llama = transformers.LlamaConfig(
        vocab_size=96,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=1,
        num_attention_heads=4,
        max_position_embeddings=32,
    )
    transformers.LlamaForCausalLM(llama).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match=r"name_or_path: .* lacks GPT-2 weights \['transformer\."):
        GPT.from_pretrained(str(tmp_path))


# ------------------------------------------------------------------------------------------------------------
# torch.compile
# ------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("variant", ["gqa-g2", "mla-qlora"])
def test_traces_as_one_graph(variant):
    """torch.compile(fullgraph=True) traces the whole Triton-path forward and backward without a graph break
    (the "eager" backend: Dynamo's tracing is what is tested here, not Inductor's code generation)."""
    model = GPT(make_config(variant, "rope", attn_backend="triton")).to(DEVICE)
    compiled = torch.compile(copy.deepcopy(model), backend="eager", fullgraph=True)
    idx = torch.randint(0, TINY["vocab_size"], (1, 20), device=DEVICE)
    ref_logits, ref_loss = model(idx, idx)
    logits, loss = compiled(idx, idx)
    loss.backward()
    assert_scaled_close(logits, ref_logits, 1e-6, "compiled logits")
    assert compiled._orig_mod.lm_head.weight.grad is not None


def test_compile_model_traces_the_training_step_in_two_graphs():
    """train_step.compile_model, as train.py's compile=True applies it: each block and the loss head compile with
    fullgraph=True around our attention ops, forward and backward (the "aot_eager" backend traces the backward
    through AOTAutograd as Inductor does, without Inductor's code generation, which the CPU would spend minutes on),
    the alike blocks share one graph, and a TrainStep through it moves the weights as the eager model's does."""
    from torch._dynamo.utils import counters

    from train_step import TrainStep, compile_model

    torch._dynamo.reset()
    counters.clear()
    eager = GPT(make_config("gqa-g2", "rope", attn_backend="triton")).to(DEVICE)
    compiled = compile_model(copy.deepcopy(eager), backend="aot_eager")
    assert set(compiled.state_dict()) == set(eager.state_dict()), "compiled in place: the same state_dict keys"
    idx = torch.randint(0, TINY["vocab_size"], (2, 20), device=DEVICE)
    batches = [(idx, idx.roll(1, dims=1))] * 2
    losses = {}
    for name, model in (("eager", eager), ("compiled", compiled)):
        optimizer = model.configure_optimizers(0.1, 1e-2, (0.9, 0.95), DEVICE)
        step = TrainStep(
            model, optimizer, torch.amp.GradScaler(enabled=False), dtype="float32", accum_steps=2, grad_clip=1.0
        )
        losses[name] = step(batches).item()
    assert counters["stats"]["unique_graphs"] == 2, dict(counters["stats"])  # one block graph, one head graph
    assert not counters["graph_break"], dict(counters["graph_break"])
    assert losses["compiled"] == pytest.approx(losses["eager"], rel=1e-5)
    for (name, p), q in zip(eager.named_parameters(), compiled.parameters()):
        assert_scaled_close(q, p, 1e-5, f"{name} after a step")


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_the_compiled_head_has_no_gradient_input_for_the_logits(backend):
    """With targets the logits come back detached (F.cross_entropy's path) or non-differentiable (the Triton path,
    linear_cross_entropy), so the compiled loss head's backward takes the loss's gradient alone: an output that
    could take a gradient would get a zero tensor of the logits' size filled and read there."""
    from functorch.compile import make_boxed_func
    from torch._functorch.aot_autograd import aot_module_simplified

    tangents = []

    def record_backward(gm, _):
        tangents.extend(tuple(n.meta["val"].shape) for n in gm.graph.nodes if n.name.startswith("tangents"))
        return make_boxed_func(gm.forward)

    def record(gm, inputs):
        forward = lambda g, _: make_boxed_func(g.forward)  # noqa: E731
        return aot_module_simplified(gm, inputs, fw_compiler=forward, bw_compiler=record_backward)

    torch._dynamo.reset()
    model = GPT(make_config("gqa-g2", "rope", attn_backend=backend)).to(DEVICE)
    head = torch.compile(model.logits_and_loss, fullgraph=True, backend=record)
    x = torch.randn(2, 20, model.config.n_embd, device=DEVICE, requires_grad=True)
    targets = torch.randint(0, TINY["vocab_size"], (2, 20), device=DEVICE)
    logits, loss = head(x, targets)
    loss.backward()
    assert tangents == [()], tangents  # the scalar loss's, nothing of the logits' (2, 20, vocab) shape
    assert not logits.requires_grad and x.grad is not None
    logits, loss = model(targets)  # without targets the logits are the differentiable output
    assert logits.requires_grad and loss is None


def test_linear_one_row_under_compile_is_a_matmul_then_bias():
    """model.linear writes a single row under torch.compile as matmul + bias (the form Inductor fuses into a GEMV
    at decode): the same values as F.linear, compiled or not, with and without a bias, one row or several."""
    from model import linear

    torch.manual_seed(0)
    weight, bias = torch.randn(48, 32), torch.randn(48)
    compiled = torch.compile(linear, dynamic=True)
    for rows in ((1, 1), (3, 1), (1, 5)):
        x = torch.randn(*rows, 32)
        for b in (bias, None):
            want = torch.nn.functional.linear(x, weight, b)
            torch.testing.assert_close(linear(x, weight, b), want, rtol=0, atol=0)  # eager: F.linear itself
            torch.testing.assert_close(compiled(x, weight, b), want, rtol=1e-5, atol=1e-5)  # summation order only
    seen = []
    torch.compile(lambda x: linear(x, weight, bias), backend=lambda gm, _: seen.append(gm.code) or gm.forward)(
        x[:1, :1]
    )
    assert "linear" not in seen[0] and "matmul" in seen[0], seen[0]


@pytest.mark.parametrize("variant", ["mha", "gqa-g2", "mla", "mla-qlora"])
@pytest.mark.parametrize("bias", [True, False])
def test_decode_rows_fused_equal_the_unfused_step(variant, bias, monkeypatch):
    """A decode step on the Triton backend runs its projections through attention_kernels.decode_linear with the
    norms, GELU and residual adds inside (`GPT.fused_rows`; here at 3 rows, FUSED_MAX_ROWS raised to the kernel's
    limit): the same logits as the unfused step (fp32, summation order only), through one launch per projection and
    the LM head."""
    from attention_kernels import projections as kernel_module
    from cache import make_cache

    torch.manual_seed(0)
    cfg = GPTConfig(**TINY, **VARIANTS[variant], bias=bias, attn_backend="triton")
    model = GPT(cfg).to(DEVICE).eval()
    prompt, token = torch.randint(0, 96, (3, 5), device=DEVICE), torch.randint(0, 96, (3, 1), device=DEVICE)
    launches = []
    run = kernel_module._run
    monkeypatch.setattr(kernel_module, "_run", lambda *a, **k: launches.append(1) or run(*a, **k))
    logits = {}
    for fused in (True, False):
        monkeypatch.setattr(model_module, "FUSED_MAX_ROWS", kernel_module.MAX_ROWS if fused else 0)
        cache = make_cache("mla" if cfg.attention == "mla" else "grouped", cfg, 3, 16, device=DEVICE, backend="triton")
        with torch.no_grad():
            model(prompt, cache=cache)
            logits[fused] = model(token, cache=cache)[0]
    # per layer the Q/K/V (or MLA's joined query and latent) projection, the output one and the MLP's two; with
    # query compression MLA's down-projections of the query and the latent take the norm (its up-projection is a
    # plain one)
    per_layer = 5 if variant == "mla-qlora" else 4
    assert len(launches) == per_layer * cfg.n_layer + 1
    scale = logits[False].abs().max()
    assert (logits[True] - logits[False]).abs().max() <= 1e-5 * scale


def test_fused_rows_only_where_the_kernel_computes_the_same_step():
    """fused_rows: a cached one-token step of at most FUSED_MAX_ROWS rows on the Triton backend, without autograd and
    without active dropout; anything else runs the unfused forward."""
    model = GPT(GPTConfig(**{**TINY, "dropout": 0.1}, **VARIANTS["mha"]))
    cache = object()
    model.eval()
    with torch.no_grad():
        assert model.fused_rows(model_module.FUSED_MAX_ROWS, 1, cache, "triton")
        assert not model.fused_rows(model_module.FUSED_MAX_ROWS + 1, 1, cache, "triton")  # a GEMM's batch
        assert not model.fused_rows(1, 2, cache, "triton")  # prefill
        assert not model.fused_rows(1, 1, None, "triton")  # no cache: not a decode step
        assert not model.fused_rows(1, 1, cache, "torch")  # the plain PyTorch backend
        model.train()
        assert not model.fused_rows(1, 1, cache, "triton")  # dropout active
    model.eval()
    assert not model.fused_rows(1, 1, cache, "triton")  # autograd on: the kernel has no backward
