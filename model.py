"""A small GPT with a choice of attention: MHA, GQA, MQA or DeepSeek-V2's multi-head latent attention (MLA).

The model is nanoGPT's GPT-2 (pre-LayerNorm blocks, GELU MLP, tied embeddings) with the attention made
configurable. Every variant has two interchangeable attention paths behind one switch (`causal_attention`):
our Triton flash-attention kernel (`attention_kernels.flash_gqa_attention`, differentiable, no K/V repetition for GQA)
and plain PyTorch (the reference, and the fallback on machines without a GPU). `attn_backend="auto"` picks
Triton on CUDA and PyTorch elsewhere.

    python -c "from model import GPT, GPTConfig; GPT(GPTConfig(attention='gqa', n_kv_head=4))"
    python -c "from model import GPT; GPT.from_pretrained('gpt2')"      # needs transformers and the network

Attention variants (h = head_dim = n_embd // n_head). A size field left at None or 0 takes the variant's natural
value, resolved here, in one place, so that a config names a variant and a size and nothing derived from them:
    mha   n_kv_head == n_head K/V heads (None -> n_head; another value is an error)
    gqa   n_kv_head K/V heads, 1 <= n_kv_head <= n_head, dividing n_head (None -> groups of 4 query heads:
          n_head // 4, or the largest divisor of n_head below it, at least 1)
    mqa   one K/V head (None -> 1; another value is an error)
    mla   K/V compressed into a latent c_kv of kv_lora_rank (RMSNorm'd) plus a RoPE key of qk_rope_head_dim
          shared by all heads; per-head up-projections W_UK (c_kv -> qk_nope_head_dim) and W_UV
          (c_kv -> v_head_dim); optional query compression (q_lora_rank > 0). Dims left at 0 follow DeepSeek-V2's
          ratios to h (there h = 128): kv_lora_rank 4h, qk_rope_head_dim h/2 (even, at least 2),
          qk_nope_head_dim = v_head_dim = h. n_kv_head resolves to n_head (training materializes n_head K/V
          heads). The MLA fields are ignored by the other variants.

Positions: pos_embedding="learned" adds GPT-2's learned absolute position embedding to the token embedding;
"rope" uses rotary embeddings instead (GQA family: all head_dim dims of q and k are rotated, rotate-half
pairing (i, i + D/2) as in GPT-NeoX/Llama; wherever Triton runs, by `attention_kernels.rope_qkv`, whatever the
attention backend, so both backends train the same model at the same cost outside attention). MLA rotates only
its decoupled RoPE part (q_rope and the shared k_rope) whatever pos_embedding says, because the absorbed decode
needs position-free nope keys; for MLA pos_embedding="learned" additionally adds the learned absolute embedding,
"rope" adds nothing else.

Generation: `forward(idx, cache=cache)` appends idx to every sequence held by `cache` and returns their logits.
Before anything changes it checks the cache's `batch_size` (and, where the cache has them, `check_model` and
`lens`: cache.py's caches do); then it calls only `cache.reserve(T)` (positions of the new tokens), then per layer
`cache.append` / `cache.attend` (GQA family) or `cache.append_latent` / `cache.attend_latent` (MLA, whose decode
calls `cache.attend_latent_inputs` instead wherever `triton_runs` and no gradient is wanted). Prefill (T > 1) runs
`causal_attention` over the cached prefix (bottom-right causal: the flash kernel on the triton backend, SDPA on the
torch one); decode (T == 1) leaves the attention to the cache.
MLA decodes in the absorbed form: q_absorbed = q_nope W_UK[h] attends to the latent cache, and the value
up-projection W_UV[h] maps the latent output afterwards, so the cache holds only kv_lora_rank + qk_rope_head_dim
numbers per token per layer. W_UK is applied to the query per head, in the launch that also writes the step's
latent into the cache (`attention_kernels.mla_decode_inputs`), and W_UV is folded into the output projection
(`MultiHeadLatentAttention.absorbed_weights`).

Dropout: applied to the embeddings and to each residual branch; there is no dropout on the attention
probabilities (the flash kernel has none, and both paths must compute the same function).
"""

from __future__ import annotations

import inspect
import math
import os
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from attention_kernels import flash_gqa_attention
from attention_kernels.loss import linear_cross_entropy
from attention_kernels.projections import decode_linear
from attention_kernels.reference import causal_mask
from attention_kernels.rope import rope_qkv


def linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    norm: "LayerNorm | None" = None,
    gelu: bool = False,
    residual: torch.Tensor | None = None,
) -> torch.Tensor:
    """residual + gelu(norm(x) @ weight.T + bias), each part optional; F.linear without them.

    With a norm, GELU or residual the projection is a decode step's, at a few rows (GPT.forward decides, see
    `fused_rows`): one launch of attention_kernels.decode_linear with the norm before it and the GELU or residual
    add after it, which reads the weights faster than cuBLAS's or Inductor's one-row products and saves the
    neighbours' launches (docs/kernel-notes.md, "Few-row projections"). Without them, a single row under
    torch.compile (the decode step of the PyTorch attention backend) is written as a matmul and then the bias:
    Inductor turns a one-row aten.mm into a fused reduction when coordinate-descent tuning is on
    (generate.compile_model), but it leaves addmm, F.linear's form with a bias, to cuBLAS."""
    if norm is not None or gelu or residual is not None:
        y = decode_linear(
            x.reshape(-1, x.shape[-1]),
            weight,
            bias,
            norm_weight=None if norm is None else norm.weight,
            norm_bias=None if norm is None else norm.bias,
            eps=norm.eps if norm is not None else LayerNorm.eps,
            gelu=gelu,
            residual=None if residual is None else residual.reshape(-1, residual.shape[-1]),
        )
        return y.view(*x.shape[:-1], -1)
    if bias is not None and torch.compiler.is_compiling() and math.prod(x.shape[:-1]) == 1:
        return x @ weight.t() + bias
    return F.linear(x, weight, bias)


class Linear(nn.Linear):
    """nn.Linear through `linear` (the same parameters and state dict)."""

    def forward(
        self,
        x: torch.Tensor,
        *,
        norm: LayerNorm | None = None,
        gelu: bool = False,
        residual: torch.Tensor | None = None,
    ) -> torch.Tensor:
        return linear(x, self.weight, self.bias, norm=norm, gelu=gelu, residual=residual)


ATTENTIONS = ("mha", "gqa", "mqa", "mla")
# Decode steps of at most this many rows run their projections through decode_linear (`GPT.fused_rows`). The kernel
# takes up to 8, but its tiles are tuned for one: at 8 rows a compiled step with it was slower than one with cuBLAS's
# projections, at one row faster (docs/kernel-notes.md, "Few-row projections").
FUSED_MAX_ROWS = 1
POS_EMBEDDINGS = ("learned", "rope")
ATTN_BACKENDS = ("triton", "torch", "auto")
GPT2_NAMES = ("gpt2", "gpt2-medium", "gpt2-large", "gpt2-xl")

# Dense bf16 tensor-core peaks (FLOP/s) from the vendors' datasheets, matched against
# torch.cuda.get_device_name() in this order (the first substring that occurs wins: "H100 PCIe" before "H100").
# The NVL (PCIe-card) parts run at lower clocks than the SXM modules.
PEAK_BF16_FLOPS = (
    ("GH200", 989e12),
    ("H200 NVL", 835e12),
    ("H200", 989e12),
    ("H100 PCIe", 756e12),
    ("H100 NVL", 835e12),
    ("H100", 989e12),
    ("H800", 989e12),
    ("B200", 2250e12),
    ("A100", 312e12),
    ("A800", 312e12),
    ("L40S", 362e12),
    ("L40", 181e12),
    ("L4", 121e12),
)


def _invalid(field: str, got, valid: str):
    raise ValueError(f"GPTConfig.{field}: got {got!r}; valid: {valid}")


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


@dataclass
class GPTConfig:
    vocab_size: int = 50304  # GPT-2's 50257 padded up to a multiple of 64
    block_size: int = 1024
    n_layer: int = 12
    n_head: int = 12
    n_embd: int = 768
    dropout: float = 0.0
    bias: bool = True  # biases in the Linears and LayerNorms, as GPT-2
    attention: str = "mha"  # one of ATTENTIONS
    n_kv_head: int | None = None  # K/V heads; None (or 0): the variant's (see the module docstring)
    kv_lora_rank: int = 0  # MLA: latent width D_c (0: 4 h)
    q_lora_rank: int = 0  # MLA: query compression width (0 = one plain query projection)
    qk_nope_head_dim: int = 0  # MLA: per-head query/key dims without position (0: h)
    qk_rope_head_dim: int = 0  # MLA: per-head query dims / shared key dims with RoPE, even (0: h / 2)
    v_head_dim: int = 0  # MLA: per-head value dims (0: h)
    pos_embedding: str = "learned"  # one of POS_EMBEDDINGS
    rope_theta: float = 10000.0
    attn_backend: str = "auto"  # one of ATTN_BACKENDS

    def __post_init__(self):
        for field in ("vocab_size", "block_size", "n_layer", "n_head", "n_embd"):
            value = getattr(self, field)
            if not _is_int(value) or value < 1:
                _invalid(field, value, "a positive int")
        if not _is_number(self.dropout) or not 0.0 <= self.dropout < 1.0:
            _invalid("dropout", self.dropout, "a float in [0, 1)")
        if not isinstance(self.bias, bool):
            _invalid("bias", self.bias, "True | False")
        for field, choices in (
            ("attention", ATTENTIONS),
            ("pos_embedding", POS_EMBEDDINGS),
            ("attn_backend", ATTN_BACKENDS),
        ):
            if getattr(self, field) not in choices:
                _invalid(field, getattr(self, field), " | ".join(repr(c) for c in choices))
        if not _is_number(self.rope_theta) or not self.rope_theta > 0:
            _invalid("rope_theta", self.rope_theta, "a positive float")
        if self.attention == "mla":
            self._check_mla()
        else:
            self._check_gqa_family()

    def _check_gqa_family(self):
        if self.n_embd % self.n_head:
            _invalid("n_embd", self.n_embd, f"a multiple of n_head={self.n_head}")
        if self.pos_embedding == "rope" and self.head_dim % 2:
            _invalid("n_embd", self.n_embd, f"n_embd // n_head even for RoPE (head_dim {self.head_dim})")
        derived = {"mha": self.n_head, "mqa": 1}.get(self.attention)
        if derived is not None:  # mha / mqa fix the head count: None means "derive it"
            if self.n_kv_head not in (None, 0, derived):
                _invalid("n_kv_head", self.n_kv_head, f"None or {derived} for attention={self.attention!r}")
            self.n_kv_head = derived
            return
        if self.n_kv_head in (None, 0):  # groups of 4 query heads per K/V head, where n_head allows
            self.n_kv_head = max(g for g in range(1, max(1, self.n_head // 4) + 1) if self.n_head % g == 0)
        n_kv = self.n_kv_head
        if not _is_int(n_kv) or not 1 <= n_kv <= self.n_head or self.n_head % n_kv:
            _invalid("n_kv_head", n_kv, f"an int in [1, n_head={self.n_head}] that divides n_head for attention='gqa'")

    def _check_mla(self):
        h = self.head_dim
        natural = dict(kv_lora_rank=4 * h, qk_nope_head_dim=h, qk_rope_head_dim=max(2, h // 4 * 2), v_head_dim=h)
        for field, value in natural.items():
            if getattr(self, field) == 0:  # DeepSeek-V2's ratio to the head dim
                if self.n_embd % self.n_head:
                    _invalid(field, 0, f"a positive int, or 0 with n_embd a multiple of n_head={self.n_head}")
                setattr(self, field, value)
            value = getattr(self, field)
            if not _is_int(value) or value < 1:
                _invalid(field, value, "a positive int for attention='mla' (or 0: DeepSeek-V2's ratio to the head dim)")
        if self.qk_rope_head_dim % 2:
            _invalid("qk_rope_head_dim", self.qk_rope_head_dim, "an even int (RoPE rotates pairs)")
        if not _is_int(self.q_lora_rank) or self.q_lora_rank < 0:
            _invalid("q_lora_rank", self.q_lora_rank, "an int >= 0 (0 = no query compression)")
        if self.n_kv_head not in (None, 0, self.n_head):
            _invalid("n_kv_head", self.n_kv_head, f"None or n_head={self.n_head} for attention='mla'")
        self.n_kv_head = self.n_head

    @property
    def head_dim(self) -> int:
        """h = n_embd // n_head: the GQA family's per-head dim, and what MLA's dims left at 0 are ratios of."""
        return self.n_embd // self.n_head

    @property
    def label(self) -> str:
        """The variant with the number that tells its runs apart: "mha", "gqa-kv4", "mqa", "mla-r256"."""
        if self.attention == "gqa":
            return f"gqa-kv{self.n_kv_head}"
        if self.attention == "mla":
            return f"mla-r{self.kv_lora_rank}"
        return self.attention

    @property
    def qk_head_dim(self) -> int:
        """D_qk of the attention kernels: head_dim, or MLA's nope + rope."""
        return self.qk_nope_head_dim + self.qk_rope_head_dim if self.attention == "mla" else self.head_dim

    @property
    def v_dim(self) -> int:
        """D_v of the attention kernels: head_dim, or MLA's v_head_dim."""
        return self.v_head_dim if self.attention == "mla" else self.head_dim

    @property
    def rope_dim(self) -> int:
        """How many dims of each query/key head RoPE rotates (0: no RoPE)."""
        if self.attention == "mla":
            return self.qk_rope_head_dim
        return self.head_dim if self.pos_embedding == "rope" else 0


def triton_runs(t: torch.Tensor, backend: str) -> bool:
    """Do our RoPE, loss-head and MLA decode-input (`attention_kernels.mla_decode_inputs`, through
    cache.attend_latent_inputs) kernels run on t? On CUDA in the kernels' dtypes (fp16, bf16, fp32), whatever the
    attention backend, so the two backends differ in attention alone; on the CPU under the interpreter, which the
    triton backend there implies."""
    return (t.is_cuda and t.dtype != torch.float64) or backend == "triton"


def causal_attention(q, k, v, backend: str) -> torch.Tensor:
    """The one attention switch. q (B, H_q, S_q, D_qk), k (B, H_kv, S_kv, D_qk), v (B, H_kv, S_kv, D_v) ->
    (B, H_q, S_q, D_v). Scores are scaled by 1/sqrt(D_qk), every variant's scale (MLA's 1/sqrt(nope + rope) too),
    which is the ops' default. Causal with bottom-right alignment: query i sits at position S_kv - S_q + i, so a
    cached prefix of S_kv - S_q tokens is visible to every query. Query head h reads K/V head h // (H_q // H_kv)."""
    if backend == "triton":
        return flash_gqa_attention(q, k, v, causal=True)
    # Plain PyTorch: the math of attention_kernels.reference.attention_reference, differentiable, in the input dtype
    # (SDPA accumulates in fp32 like the flash kernel; an fp32 (S_q, S_kv) score matrix per head would not fit
    # at training sizes). K/V are repeated to the query heads explicitly.
    group = q.shape[1] // k.shape[1]
    if group > 1:
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    if q.shape[2] == k.shape[2]:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)
    mask = causal_mask(q.shape[2], k.shape[2], q.device)  # SDPA's is_causal is top-left aligned
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


def rope_cos_sin(positions: torch.Tensor, dim: int, theta: float):
    """positions (B|1, T) -> cos, sin (B|1, T, dim / 2) in fp32 (bf16 angles would be off by whole radians)."""
    inv_freq = theta ** (-torch.arange(0, dim, 2, device=positions.device, dtype=torch.float32) / dim)
    angles = positions[..., None].float() * inv_freq
    return angles.cos(), angles.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate the pairs (i, i + D/2) of x (B, T, H, D) or (B, T, D) by the angles of cos/sin (B|1, T, D/2)."""
    if x.ndim == 4:
        cos, sin = cos[:, :, None], sin[:, :, None]
    xf = x.float()
    x1, x2 = xf.chunk(2, dim=-1)
    # [x1 cos - x2 sin, x2 cos + x1 sin] as one expression over the whole vector, whose cats feed only products:
    # Inductor fuses it into one kernel, where a cat of the two rotated halves would be a kernel per half.
    rotated = torch.cat([-x2, x1], dim=-1)
    return (xf * torch.cat([cos, cos], dim=-1) + rotated * torch.cat([sin, sin], dim=-1)).type_as(x)


class LayerNorm(nn.Module):
    """LayerNorm with an optional bias (PyTorch's has no bias=False before 2.1)."""

    eps = 1e-5

    def __init__(self, ndim: int, bias: bool):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(ndim))
        self.bias = nn.Parameter(torch.zeros(ndim)) if bias else None

    def forward(self, x):
        return F.layer_norm(x, self.weight.shape, self.weight, self.bias, self.eps)


class RMSNorm(nn.Module):
    """MLA's norm of the compressed latents; computed in fp32, returned in the input dtype."""

    def __init__(self, ndim: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(ndim))
        self.eps = eps

    def forward(self, x):
        return F.rms_norm(x.float(), self.weight.shape, self.weight.float(), self.eps).type_as(x)


class CausalSelfAttention(nn.Module):
    """MHA / GQA / MQA: n_head query heads over n_kv_head K/V heads; c_attn projects only the K/V heads kept."""

    def __init__(self, config: GPTConfig, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.n_head, self.n_kv_head = config.n_head, config.n_kv_head
        self.head_dim = config.head_dim
        self.scale = 1.0 / math.sqrt(self.head_dim)
        # Rows [q | k | v]; for MHA this is exactly GPT-2's c_attn.
        self.c_attn = Linear(config.n_embd, (self.n_head + 2 * self.n_kv_head) * self.head_dim, bias=config.bias)
        self.c_proj = Linear(config.n_embd, config.n_embd, bias=config.bias)
        self.resid_dropout = nn.Dropout(config.dropout)

    def forward(self, x, rope, cache, backend: str, norm=None, residual=None):
        """With norm and residual (a decode step's few rows, `Block`), x is the block's input: the norm runs in the
        first projection's launch, the residual add in the last's, and the block's new residual stream returns."""
        B, T, _ = x.shape
        H, H_kv, D = self.n_head, self.n_kv_head, self.head_dim
        qkv = self.c_attn(x, norm=norm)
        if rope is not None and triton_runs(qkv, backend):
            # One launch splits the heads and rotates q and k, and one packs their gradients back into qkv's: the
            # backward Inductor makes of the split, apply_rope and the concatenation runs ten times its bytes' time.
            q, k, v = rope_qkv(qkv, *rope, H, H_kv)
        else:
            q, k, v = qkv.split([H * D, H_kv * D, H_kv * D], dim=2)
            q, k, v = q.view(B, T, H, D), k.view(B, T, H_kv, D), v.view(B, T, H_kv, D)
            if rope is not None:
                q, k = apply_rope(q, *rope), apply_rope(k, *rope)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # (B, H|H_kv, T, D)
        if cache is None:
            y = causal_attention(q, k, v, backend)
        elif T == 1:
            y = cache.attend(self.layer_idx, q, k, v, self.scale)
        else:
            k, v = cache.append(self.layer_idx, k, v)  # (B, H_kv, S, D): the cached prefix and these T tokens
            k, v = k.to(q.dtype), v.to(q.dtype)  # the cache may store another dtype than autocast computes in
            y = causal_attention(q, k, v, backend)
        y = y.transpose(1, 2).reshape(B, T, H * D)
        return self.resid_dropout(self.c_proj(y, residual=residual))


class MultiHeadLatentAttention(nn.Module):
    """DeepSeek-V2 MLA. Letters: D_c = kv_lora_rank, D_n = qk_nope_head_dim, D_r = qk_rope_head_dim,
    D_v = v_head_dim. Per head h: k_nope = c_kv W_UK[h]^T, v = c_kv W_UV[h]^T, k = [k_nope, k_rope] with k_rope
    shared by every head; q = [q_nope, q_rope]."""

    def __init__(self, config: GPTConfig, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.n_head = config.n_head
        self.d_c, self.d_n = config.kv_lora_rank, config.qk_nope_head_dim
        self.d_r, self.d_v = config.qk_rope_head_dim, config.v_head_dim
        self.scale = 1.0 / math.sqrt(self.d_n + self.d_r)
        q_dim = self.n_head * (self.d_n + self.d_r)
        if config.q_lora_rank > 0:
            self.q_a_proj = Linear(config.n_embd, config.q_lora_rank, bias=config.bias)
            self.q_a_norm = RMSNorm(config.q_lora_rank)
            self.q_b_proj = Linear(config.q_lora_rank, q_dim, bias=config.bias)
        else:
            self.q_proj = Linear(config.n_embd, q_dim, bias=config.bias)
        self.kv_a_proj = Linear(config.n_embd, self.d_c + self.d_r, bias=config.bias)  # W_DKV and W_KR
        self.kv_a_norm = RMSNorm(self.d_c)
        # Rows per head [W_UK[h] (D_n) | W_UV[h] (D_v)]. No bias: the absorbed decode multiplies these weights
        # into the query and the output, and a bias would need terms of its own there.
        self.kv_b_proj = nn.Linear(self.d_c, self.n_head * (self.d_n + self.d_v), bias=False)
        self.c_proj = Linear(self.n_head * self.d_v, config.n_embd, bias=config.bias)
        self.resid_dropout = nn.Dropout(config.dropout)

    def forward(self, x, rope, cache, backend: str, norm=None, residual=None):
        """norm and residual: as CausalSelfAttention's (decode only)."""
        B, T, _ = x.shape
        H = self.n_head
        if cache is not None and T == 1:
            return self._decode_absorbed(x, rope, cache, backend, norm, residual)
        q, kv = self._query_and_latent(x)
        q_nope, q_rope = q.split([self.d_n, self.d_r], dim=-1)
        c_kv, k_rope = kv.split([self.d_c, self.d_r], dim=-1)
        c_kv = self.kv_a_norm(c_kv)  # (B, T, D_c)
        q_rope, k_rope = apply_rope(q_rope, *rope), apply_rope(k_rope, *rope)  # k_rope (B, T, D_r), no head axis
        if cache is not None:
            c_kv, k_rope = cache.append_latent(self.layer_idx, c_kv, k_rope)  # (B, S, D_c), (B, S, D_r)
            c_kv, k_rope = c_kv.to(q_nope.dtype), k_rope.to(q_rope.dtype)
        y = self._attend_unabsorbed(q_nope, q_rope, c_kv, k_rope, backend)
        y = y.transpose(1, 2).reshape(B, T, H * self.d_v)  # y (B, H, T, D_v)
        return self.resid_dropout(self.c_proj(y))

    def _query_and_latent(self, x, norm=None, w_in=None, b_in=None):
        """x (B, T, C) -> the query q (B, T, H, D_n + D_r) and kv (B, T, D_c + D_r), the latent and the shared RoPE
        key before kv_a_norm and RoPE. norm: the block's norm, run in each projection's launch (decode only).
        w_in, b_in: `absorbed_weights`' rows of q_proj then kv_a_proj (decode without query compression), so one
        matmul gives q and kv."""
        H, d_qk, d_kv = self.n_head, self.d_n + self.d_r, self.d_c + self.d_r
        if w_in is not None:
            q, kv = linear(x, w_in, b_in, norm=norm).split([H * d_qk, d_kv], dim=-1)
        elif hasattr(self, "q_a_proj"):
            q, kv = self.q_b_proj(self.q_a_norm(self.q_a_proj(x, norm=norm))), self.kv_a_proj(x, norm=norm)
        else:
            q, kv = self.q_proj(x, norm=norm), self.kv_a_proj(x, norm=norm)
        return q.view(*x.shape[:-1], H, d_qk), kv

    def _up_weights(self):
        """W_UK (H, D_n, D_c) and W_UV (H, D_v, D_c), views of kv_b_proj.weight."""
        w = self.kv_b_proj.weight.view(self.n_head, self.d_n + self.d_v, self.d_c)
        return w.split([self.d_n, self.d_v], dim=1)

    def _attend_unabsorbed(self, q_nope, q_rope, c_kv, k_rope, backend):
        """Training and prefill: materialize per-head K (D_n + D_r) and V (D_v) and run `causal_attention`.
        q_nope, q_rope (B, T, H, D_n | D_r). Q, K and V are built in (B, S, H, D) memory and passed as (B, H, S, D)
        views, as the other attention passes them: the flash kernel's output and gradients follow that order, so no
        reshape around it copies."""
        B, S, _ = c_kv.shape
        H = self.n_head
        kv = self.kv_b_proj(c_kv).view(B, S, H, self.d_n + self.d_v)
        k_nope, v = kv.split([self.d_n, self.d_v], dim=-1)  # (B, S, H, D_n), (B, S, H, D_v)
        k = torch.cat([k_nope, k_rope[:, :, None].expand(B, S, H, self.d_r)], dim=-1)
        q = torch.cat([q_nope, q_rope], dim=-1)
        return causal_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), backend)

    def _decode_absorbed(self, x, rope, cache, backend: str, norm=None, residual=None):
        """Decode, x (B, 1, C): q_nope . k_nope = (q_nope W_UK[h]) . c_kv, so the query moves into the latent space
        and every head attends to the one shared latent cache, whose output W_UV[h] then maps to the head's values.
        W_UK is applied to the query per head (its weights are D_n x D_c a head, far fewer bytes than a projection
        folded with it); W_UV is folded into the output projection (`absorbed_weights`), so one matmul takes the
        heads' latent outputs to the residual stream."""
        B, H, d_n, d_c, d_r = x.shape[0], self.n_head, self.d_n, self.d_c, self.d_r
        # GPT.forward refreshed the decode weights before the blocks: the call that checks them stays out of any
        # compiled graph, and here it would split the block's graph (a kernel more a layer).
        w_in, b_in, w_out = self._absorbed
        q, kv = self._query_and_latent(x, norm, w_in, b_in)  # (B, 1, H, D_n + D_r), (B, 1, D_c + D_r)
        w_uk = self._up_weights()[0]  # (H, D_n, D_c)
        if triton_runs(x, backend) and not torch.is_grad_enabled():
            # One launch absorbs W_UK into the query, rotates the RoPE parts, normalizes the latent and writes the
            # token into the cache: in PyTorch that is a dozen small kernels a layer and the cache's write.
            cos, sin = rope[0][:, 0], rope[1][:, 0]  # (B, D_r / 2): the row's one new position
            norm_kv = self.kv_a_norm
            latent = cache.attend_latent_inputs(
                self.layer_idx,
                q.view(B, H, d_n + d_r),
                kv.view(B, d_c + d_r),
                cos,
                sin,
                norm_kv.weight,
                norm_kv.eps,
                w_uk,
                self.scale,
            )  # (B, H, D_c)
        else:
            q_nope, q_rope = q.split([d_n, d_r], dim=-1)
            q_absorbed = torch.einsum("bthn,hnc->bhtc", q_nope, w_uk)  # (B, H, 1, D_c)
            c_kv, k_rope = kv.split([d_c, d_r], dim=-1)
            # the query heads' RoPE parts and the shared RoPE key rotate together, as one more head (one kernel)
            ropes = apply_rope(torch.cat([q_rope, k_rope[:, :, None]], dim=2), *rope)
            q_rope, k_rope = ropes[:, :, :H], ropes[:, :, H]
            c_kv = self.kv_a_norm(c_kv)
            latent = cache.attend_latent(self.layer_idx, q_absorbed, q_rope.transpose(1, 2), c_kv, k_rope, self.scale)
        # the dropout here, not in the caller: a compiled region of its own would copy its input to its output
        latent = latent.reshape(B, 1, H * d_c)
        return self.resid_dropout(linear(latent, w_out, self.c_proj.bias, residual=residual))

    def _absorb_sources(self) -> list[torch.Tensor]:
        """The weights `absorbed_weights` is built from."""
        sources = [self.kv_b_proj.weight, self.c_proj.weight]
        if not hasattr(self, "q_a_proj"):
            sources += [self.q_proj.weight, self.q_proj.bias, self.kv_a_proj.weight, self.kv_a_proj.bias]
        return [t for t in sources if t is not None]

    @torch.compiler.disable
    def absorbed_weights(self) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor]:
        """The decode's projections: (w_in, b_in, w_out).

        w_out (C, H D_c) = per head W_O[h] W_UV[h] (DeepSeek-V2, section 2.1.2): the heads' latent outputs straight to
        the residual stream, one matmul where the unfolded form takes a batched per-head matmul more. Its weights
        are D_c / D_v times W_O's; the query side keeps its own weights, with W_UK applied per head after the
        projection (`_decode_absorbed`), because folding W_UK in makes the query projection D_c / D_n times larger.
        w_in, b_in: without query compression, the rows of q_proj then of kv_a_proj, so one matmul of x gives the
        query and the new token's latent and RoPE key; None with it. They are kept beside the model's own weights,
        for decode only: no gradient flows through them.

        W_out is computed in fp32 and rounded once to the weights' dtype. All three are kept until a source weight
        changes (its version counter, storage, dtype or device), so that a decode step reads them and a CUDA graph
        replays them as they are. They are plain tensors even when first built under torch.inference_mode, which
        would make them unusable in a later forward that autograd records."""
        sources = self._absorb_sources()
        key = tuple((t._version, t.data_ptr(), t.dtype, t.device) for t in sources)
        if getattr(self, "_absorbed_key", None) != key:
            with torch.inference_mode(False), torch.no_grad():
                self._absorbed = self._decode_weights()
            self._absorbed_key = key
        return self._absorbed

    def _decode_weights(self) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor]:
        """(w_in, b_in, w_out) of `absorbed_weights`, built from the current weights."""
        w_in = b_in = None
        if not hasattr(self, "q_a_proj"):  # config.bias gives both projections a bias or neither
            w_in = torch.cat([self.q_proj.weight, self.kv_a_proj.weight])
            if self.q_proj.bias is not None:
                b_in = torch.cat([self.q_proj.bias, self.kv_a_proj.bias])
        w_uv = self._up_weights()[1].float()  # (H, D_v, D_c)
        w_o = self.c_proj.weight.float().view(-1, self.n_head, self.d_v)  # (C, H, D_v)
        w_out = torch.einsum("ohv,hvc->ohc", w_o, w_uv).reshape(w_o.shape[0], self.n_head * self.d_c)
        return w_in, b_in, w_out.to(self.c_proj.weight.dtype)


class MLP(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.c_fc = Linear(config.n_embd, 4 * config.n_embd, bias=config.bias)
        self.gelu = nn.GELU(approximate="tanh")  # GPT-2's "gelu_new": from_pretrained matches it exactly
        self.c_proj = Linear(4 * config.n_embd, config.n_embd, bias=config.bias)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x, norm=None, residual=None):
        """norm and residual: as CausalSelfAttention's (decode only; GELU then runs in c_fc's launch)."""
        if norm is None and residual is None:
            return self.dropout(self.c_proj(self.gelu(self.c_fc(x))))
        return self.dropout(self.c_proj(self.c_fc(x, norm=norm, gelu=True), residual=residual))


class Block(nn.Module):
    def __init__(self, config: GPTConfig, layer_idx: int):
        super().__init__()
        self.ln_1 = LayerNorm(config.n_embd, bias=config.bias)
        attention = MultiHeadLatentAttention if config.attention == "mla" else CausalSelfAttention
        self.attn = attention(config, layer_idx)
        self.ln_2 = LayerNorm(config.n_embd, bias=config.bias)
        self.mlp = MLP(config)

    def forward(self, x, rope, cache, backend: str, fused: bool = False):
        if fused:  # a decode step's few rows (`fused_rows`): the norms and residual adds ride in the projections
            x = self.attn(x, rope, cache, backend, norm=self.ln_1, residual=x)
            return self.mlp(x, norm=self.ln_2, residual=x)
        x = x + self.attn(self.ln_1(x), rope, cache, backend)
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.config = config
        modules = dict(
            wte=nn.Embedding(config.vocab_size, config.n_embd),
            drop=nn.Dropout(config.dropout),
            h=nn.ModuleList([Block(config, i) for i in range(config.n_layer)]),
            ln_f=LayerNorm(config.n_embd, bias=config.bias),
        )
        if config.pos_embedding == "learned":
            modules["wpe"] = nn.Embedding(config.block_size, config.n_embd)
        self.transformer = nn.ModuleDict(modules)
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        self.transformer.wte.weight = self.lm_head.weight  # weight tying
        self.apply(self._init_weights)
        # GPT-2: residual projections scaled by 1/sqrt(2 * n_layer) (two residual additions per block).
        for name, p in self.named_parameters():
            if name.endswith("c_proj.weight"):
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * config.n_layer))

    @staticmethod
    def _init_weights(module):
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def attn_backend_for(self, device) -> str:
        """config.attn_backend resolved for tensors on `device`: "auto" is Triton on CUDA, PyTorch elsewhere."""
        if self.config.attn_backend != "auto":
            return self.config.attn_backend
        return "triton" if torch.device(device).type == "cuda" else "torch"

    def forward(self, idx, targets=None, cache=None, last=None):
        """idx (B, T) token ids -> (logits (B, T, vocab_size), loss or None). With a cache, idx are new tokens
        appended to every cached sequence (positions from cache.reserve); without one, idx is the whole sequence.
        last (B,) int64 on idx's device: only the logits at those positions of each row, (B, 1, vocab_size), as a
        prefill needs them (the full logits of a long prompt batch take gigabytes). With targets the logits are
        detached and the loss carries the gradient (`logits_and_loss`)."""
        self._check_inputs(idx, targets)
        B, T = idx.shape
        if last is not None and (targets is not None or last.shape != (B,)):  # before reserve changes the cache
            raise ValueError(f"last: got shape {tuple(last.shape)}; valid: (B={B},) positions, without targets")
        if cache is not None:
            self._check_cache(cache, B, T)  # before reserve, which changes the cache
            positions = cache.reserve(T)  # (B, T)
        else:
            positions = torch.arange(T, device=idx.device)[None]  # (1, T)
        self._check_positions(positions, T, cache)
        if cache is not None and T == 1 and self.config.attention == "mla":
            # The decode weights (re)built here, outside any compiled block (_decode_absorbed), and before the
            # embedding: a fused projection reads its weights before it waits for the kernel before it
            # (decode_linear), so that kernel must not be the one that writes them.
            for block in self.transformer.h:
                block.attn.absorbed_weights()
        x, rope = self.embed(idx, positions)
        backend = self.attn_backend_for(idx.device)
        fused = self.fused_rows(B, T, cache, backend)
        for block in self.transformer.h:
            x = block(x, rope, cache, backend, fused)
        if last is not None:
            x = x[torch.arange(B, device=x.device), last][:, None]
        return self.logits_and_loss(x, targets, fused)

    def fused_rows(self, B: int, T: int, cache, backend: str) -> bool:
        """Does this forward run its projections as few-row kernels with their norms, GELU and residual adds inside
        (`linear`)? A decode step (one new token a row, a cache) of at most FUSED_MAX_ROWS rows on the Triton backend,
        with no gradient (the kernel has no backward) and no active dropout (the kernel has none)."""
        return (
            cache is not None
            and T == 1
            and B <= FUSED_MAX_ROWS
            and backend == "triton"
            and not torch.is_grad_enabled()
            and not (self.training and self.config.dropout > 0)
        )

    def embed(self, idx, positions):
        """The token (and learned position) embeddings of idx (B, T) at positions (B or 1, T), and RoPE's
        (cos, sin) there (None without RoPE). A method of its own so that torch.compile can take it as one region
        (generate.compile_model)."""
        x = self.transformer.wte(idx)
        if self.config.pos_embedding == "learned":
            x = x + self.transformer.wpe(positions)
        x = self.transformer.drop(x)
        rope = rope_cos_sin(positions, self.config.rope_dim, self.config.rope_theta) if self.config.rope_dim else None
        return x, rope

    def logits_and_loss(self, x, targets=None, fused: bool = False):
        """The final norm and the output projection of x (B, T, n_embd), and with targets the mean cross-entropy:
        (logits (B, T, vocab_size), loss or None). A method of its own so that torch.compile can take it as one
        region (train_step.compile_model), where the final norm fuses with what follows it. fused: the
        norm runs in the projection's launch (`fused_rows`).

        With targets, the logits come back detached: the loss is what trains. Wherever Triton runs and a gradient
        is wanted, the output projection and the loss are `attention_kernels.linear_cross_entropy`, which forms the
        logits' gradient in the forward's pass over them; elsewhere (and for an evaluation's loss) F.cross_entropy.
        (A compiled region whose logits output could take a gradient would also get a zero gradient of the logits'
        size in its backward: 3.3 GB filled and read again at 32 x 1,024 tokens.) For a loss of your own over the
        logits, call without targets."""
        if targets is not None and torch.is_grad_enabled() and triton_runs(x, self.attn_backend_for(x.device)):
            h = self.transformer.ln_f(x)
            logits, loss = linear_cross_entropy(h.view(-1, h.size(-1)), self.lm_head.weight, targets.reshape(-1))
            return logits.view(*x.shape[:-1], -1), loss
        if fused:
            logits = linear(x, self.lm_head.weight, norm=self.transformer.ln_f)
        else:
            logits = self.lm_head(self.transformer.ln_f(x))
        loss = None
        if targets is not None:
            loss = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.reshape(-1), ignore_index=-1)
            logits = logits.detach()
        return logits, loss

    @staticmethod
    def _check_inputs(idx, targets):
        """idx's type, rank and dtype, and targets' shape: host-side metadata only. The token values are not checked
        here: reading them from a GPU would sync every step (generate checks its prompts on the host)."""
        if not isinstance(idx, torch.Tensor):
            raise TypeError(f"idx: got {type(idx).__name__} {idx!r:.40}; valid: a (B, T) tensor of token ids")
        if idx.dim() != 2:
            raise ValueError(f"idx: got shape {tuple(idx.shape)}; valid: (B, T) token ids")
        if idx.dtype not in (torch.int64, torch.int32):  # what the embedding takes
            raise TypeError(f"idx: got dtype {idx.dtype}; valid: (B, T) token ids of dtype torch.int64 (or int32)")
        if targets is not None and (not isinstance(targets, torch.Tensor) or targets.shape != idx.shape):
            got = f"shape {tuple(targets.shape)}" if isinstance(targets, torch.Tensor) else type(targets).__name__
            raise ValueError(f"targets: got {got}; valid: None or token ids of idx's shape {tuple(idx.shape)}")

    def _check_cache(self, cache, B: int, T: int):
        """A cache made for another model or batch, or a step past learned positions, is refused before
        cache.reserve grows anything (the lengths live on the host: no device sync)."""
        cfg = self.config
        if hasattr(cache, "check_model"):  # cache.py's caches know what they hold; a minimal cache need not
            cache.check_model(cfg)
        if B != cache.batch_size:
            raise ValueError(
                f"idx: got a batch of {B}; valid: the cache's {cache.batch_size} sequences (or a "
                "cache.view of some of them)"
            )
        lens = getattr(cache, "lens", None)
        if cfg.pos_embedding == "learned" and T > 0 and lens and max(lens) + T > cfg.block_size:
            raise ValueError(
                f"cache: position {max(lens) + T - 1} reached; valid: positions < "
                f"block_size={cfg.block_size} (learned position embeddings)"
            )

    def _check_positions(self, positions, T: int, cache):
        """Learned positions stop at block_size; RoPE has no table, so it may go on (extrapolating)."""
        if self.config.pos_embedding != "learned":
            return
        limit = self.config.block_size
        if cache is None and T > limit:
            raise ValueError(f"idx: got a sequence of {T} tokens; valid: at most block_size={limit}")
        # cache.py's caches were checked before reserve, from their host-side lens (_check_cache). This is for a cache
        # without them (tests' ReferenceCache), whose positions live on the device: reading them on a GPU would sync
        # every decode step, so the check runs on the CPU only (generate checks prompt and new tokens up front; on a
        # GPU an out-of-range position still fails loudly, as the embedding's device-side index assert).
        if cache is not None and T > 0 and positions.device.type == "cpu":
            last = int(positions.max())
            if last >= limit:
                raise ValueError(
                    f"cache: position {last} reached; valid: positions < block_size={limit} "
                    "(learned position embeddings)"
                )

    def crop_block_size(self, block_size: int):
        """Shrink the context (e.g. to fine-tune a GPT-2 checkpoint on shorter blocks)."""
        if not 1 <= block_size <= self.config.block_size:
            raise ValueError(f"block_size: got {block_size}; valid: 1..{self.config.block_size}")
        self.config.block_size = block_size
        if "wpe" in self.transformer:
            self.transformer.wpe.weight = nn.Parameter(self.transformer.wpe.weight[:block_size])

    def num_params(self, non_embedding: bool = True) -> int:
        """Parameter count; non_embedding drops the position table (the token table is tied to lm_head)."""
        n = sum(p.numel() for p in self.parameters())
        if non_embedding and "wpe" in self.transformer:
            n -= self.transformer.wpe.weight.numel()
        return n

    def configure_optimizers(self, weight_decay: float, learning_rate: float, betas, device_type: str):
        """AdamW; weight decay on matrices and embeddings (>= 2-d) only, not on biases and norm gains."""
        params = [p for p in self.parameters() if p.requires_grad]
        groups = [
            {"params": [p for p in params if p.dim() >= 2], "weight_decay": weight_decay},
            {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
        ]
        fused = device_type == "cuda" and "fused" in inspect.signature(torch.optim.AdamW).parameters
        return torch.optim.AdamW(groups, lr=learning_rate, betas=betas, **({"fused": True} if fused else {}))

    def flops_per_token(self, seq_len: int | None = None) -> float:
        """Training FLOPs (forward + backward) per token of a seq_len-token sequence (default block_size).
        Matmuls: 6 per weight of every Linear (lm_head included; embedding lookups are free), from the actual
        projection shapes of the variant. Attention: per layer and head, the scores cost 2 D_qk and P V 2 D_v
        FLOPs per (query, key) pair, a causal token sees seq_len / 2 keys on average (the kernels skip masked
        tiles), times 3 for forward + backward: 3 * n_layer * n_head * (D_qk + D_v) * seq_len. (nanoGPT/PaLM
        count the full square, twice this term.)"""
        cfg = self.config
        T = cfg.block_size if seq_len is None else seq_len
        n_matmul = sum(m.weight.numel() for m in self.modules() if isinstance(m, nn.Linear))
        return 6 * n_matmul + 3 * cfg.n_layer * cfg.n_head * (cfg.qk_head_dim + cfg.v_dim) * T

    def estimate_mfu(self, fwdbwd_per_iter: int, dt: float, peak_flops: float | None = None) -> float | None:
        """Model FLOPs utilization: achieved FLOP/s of fwdbwd_per_iter block_size-token sequences in dt seconds
        over the GPU's dense bf16 peak (PEAK_BF16_FLOPS, or peak_flops). None where the peak is unknown (the
        CPU, an unlisted GPU)."""
        if peak_flops is None:
            peak_flops = peak_bf16_flops(next(self.parameters()).device)
        if not peak_flops:
            return None
        flops_per_iter = self.flops_per_token() * self.config.block_size * fwdbwd_per_iter
        return flops_per_iter / dt / peak_flops

    def kv_cache_bytes_per_token(self, dtype: torch.dtype = torch.bfloat16) -> int:
        """Cache bytes one token costs across all layers: K and V of n_kv_head heads, or MLA's latent + rope key."""
        cfg = self.config
        size = torch.empty((), dtype=dtype).element_size()
        if cfg.attention == "mla":
            return cfg.n_layer * (cfg.kv_lora_rank + cfg.qk_rope_head_dim) * size
        return 2 * cfg.n_layer * cfg.n_kv_head * cfg.head_dim * size

    @classmethod
    def from_pretrained(cls, name_or_path: str, override_args: dict | None = None) -> "GPT":
        """OpenAI GPT-2 weights (GPT2_NAMES, through transformers and the hub) or a local directory written by
        GPT2LMHeadModel.save_pretrained, into an MHA model with learned positions. override_args may set
        dropout and attn_backend."""
        override_args = dict(override_args or {})
        unknown = sorted(set(override_args) - {"dropout", "attn_backend"})
        if unknown:
            raise ValueError(f"override_args: got keys {unknown}; valid: 'dropout', 'attn_backend'")
        is_dir = os.path.isdir(name_or_path)
        if not is_dir and name_or_path not in GPT2_NAMES:
            raise ValueError(
                f"name_or_path: got {name_or_path!r}; valid: one of {GPT2_NAMES} or a directory "
                "saved by GPT2LMHeadModel.save_pretrained"
            )
        try:
            from transformers import GPT2LMHeadModel
        except ImportError as e:
            raise ImportError("GPT.from_pretrained needs transformers: pip install transformers") from e
        try:
            hf, info = GPT2LMHeadModel.from_pretrained(name_or_path, output_loading_info=True)
        except OSError as e:
            hint = (
                "is it a directory written by GPT2LMHeadModel.save_pretrained?"
                if is_dir
                else "hub names need the network; offline, pass a directory written by GPT2LMHeadModel.save_pretrained"
            )
            raise OSError(f"could not load GPT-2 weights {name_or_path!r} ({e}); {hint}") from e
        # transformers only warns about weights the checkpoint lacks (another architecture's directory, say) and
        # leaves them randomly initialized: that would be a silently untrained model. (lm_head is tied to wte.)
        missing = sorted(k for k in info["missing_keys"] if not k.endswith(_GPT2_BUFFERS) and k != "lm_head.weight")
        if missing:
            raise ValueError(
                f"name_or_path: {name_or_path!r} lacks GPT-2 weights {missing[:5]} "
                f"({len(missing)} in all); valid: GPT-2 weights saved by GPT2LMHeadModel.save_pretrained"
            )
        config = GPTConfig(**_config_from_gpt2(hf.config), **{"dropout": 0.0, **override_args})
        model = cls(config)
        _copy_gpt2_weights(hf.state_dict(), model)
        return model


_GPT2_BUFFERS = (".attn.masked_bias", ".attn.bias")  # causal-mask buffers of older transformers versions


def _config_from_gpt2(hf_config) -> dict:
    """GPTConfig fields of a transformers GPT2Config; settings this model does not implement are refused."""
    supported = {
        "activation_function": ("gelu_new", "gelu_pytorch_tanh"),
        "layer_norm_epsilon": (1e-5,),
        "scale_attn_weights": (True,),
        "scale_attn_by_inverse_layer_idx": (False,),
        "n_inner": (None, 4 * hf_config.n_embd),
    }
    for field, valid in supported.items():
        if getattr(hf_config, field, valid[0]) not in valid:
            raise ValueError(f"GPT2Config.{field}: got {getattr(hf_config, field)!r}; valid: {valid}")
    return dict(
        vocab_size=hf_config.vocab_size,
        block_size=hf_config.n_positions,
        n_layer=hf_config.n_layer,
        n_head=hf_config.n_head,
        n_embd=hf_config.n_embd,
        bias=True,
        attention="mha",
        pos_embedding="learned",
    )


def _copy_gpt2_weights(sd_hf: dict, model: GPT):
    """Copy a GPT2LMHeadModel state_dict into model. HF's Conv1D stores weights (in, out): transposed here."""
    sd_hf = {k: v for k, v in sd_hf.items() if not k.endswith(_GPT2_BUFFERS) and k != "lm_head.weight"}  # tied
    sd = model.state_dict()
    ours = set(sd) - {"lm_head.weight"}
    if ours != set(sd_hf):
        raise ValueError(
            f"GPT-2 state_dict: keys differ; missing {sorted(ours - set(sd_hf))[:5]}, "
            f"unexpected {sorted(set(sd_hf) - ours)[:5]}"
        )
    conv1d = ("attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight")
    with torch.no_grad():
        for key, value in sd_hf.items():
            sd[key].copy_(value.t() if key.endswith(conv1d) else value)


def peak_bf16_flops(device) -> float | None:
    """The dense bf16 peak of the GPU holding `device` (PEAK_BF16_FLOPS), None for the CPU and unlisted GPUs."""
    device = torch.device(device)
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((peak for key, peak in PEAK_BF16_FLOPS if key in name), None)
