"""Plain PyTorch references for every op in `attention_kernels`, in fp32 math.

They materialize the full score matrix, so they are slow and memory-hungry, and they are the ground truth: every
kernel test compares against them, and the model's `attn_backend="torch"` path is built from the same math.
Outputs are fp32 (callers cast); `lse` is the natural-log log-sum-exp of the scaled scores, fp32.

Layouts (the same letters everywhere in the repo):
    prefill      q (B, H_q, S_q, D_qk)   k (B, H_kv, S_kv, D_qk)   v (B, H_kv, S_kv, D_v)
    decode       q (B, H_q, D)           k (B, H_kv, S_max, D)     seq_lens (B,) int32
    paged        k_pages (num_pages, page_size, H_kv, D)           block_table (B, max_pages) int32
    MLA          q_absorbed (B, H, D_c)  q_rope (B, H, D_r)        c_kv (B, S_max, D_c)  k_rope (B, S_max, D_r)
    RoPE         qkv (B, T, (H_q + 2 H_kv) D)                       cos, sin (B|1, T, D/2)
    MLA RoPE     q (B, H, D_c + D_r)     kv (B, D_c + D_r)           cos, sin (B|1, D_r/2)
    loss head    x (N, C)                weight (V, C)               targets (N,) int64
    paged MLA    c_kv_pages (num_pages, page_size, D_c)            k_rope_pages (num_pages, page_size, D_r)
"""

from __future__ import annotations

import math

import torch


def _expand_kv(x: torch.Tensor, group: int) -> torch.Tensor:
    # (B, H_kv, S, D) -> (B, H_kv * group, S, D): query head h reads KV head h // group.
    return x.repeat_interleave(group, dim=1) if group > 1 else x


def causal_mask(s_q: int, s_kv: int, device) -> torch.Tensor:
    """Bottom-right aligned: query i sits at position s_kv - s_q + i and sees keys at positions <= its own."""
    q_pos = s_kv - s_q + torch.arange(s_q, device=device)
    return q_pos[:, None] >= torch.arange(s_kv, device=device)[None, :]


def attention_reference(q, k, v, *, scale: float | None = None, causal: bool = False):
    """Full-sequence MHA/GQA/MQA attention. Returns (out (B, H_q, S_q, D_v) fp32, lse (B, H_q, S_q) fp32)."""
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    group = q.shape[1] // k.shape[1]
    kq, vq = _expand_kv(k.float(), group), _expand_kv(v.float(), group)
    scores = torch.einsum("bhmd,bhnd->bhmn", q.float(), kq) * scale
    if causal:
        scores = scores.masked_fill(~causal_mask(q.shape[2], k.shape[2], q.device), float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    p = torch.exp(scores - lse[..., None])
    return torch.einsum("bhmn,bhnd->bhmd", p, vq), lse


def decode_reference(q, k, v, seq_lens, *, scale: float, q_rope=None, k_rope=None):
    """One query token per sequence over a contiguous cache; sequence b sees its first seq_lens[b] tokens.
    q_rope (B, H_q, D_r) / k_rope (B, H_kv, S_max, D_r) add a second score term (MLA's decoupled RoPE key).
    Returns (out (B, H_q, D_v) fp32, lse (B, H_q) fp32)."""
    group = q.shape[1] // k.shape[1]
    scores = torch.einsum("bhd,bhnd->bhn", q.float(), _expand_kv(k.float(), group))
    if q_rope is not None:
        scores = scores + torch.einsum("bhr,bhnr->bhn", q_rope.float(), _expand_kv(k_rope.float(), group))
    scores = scores * scale
    positions = torch.arange(k.shape[2], device=q.device)
    scores = scores.masked_fill(positions[None, None, :] >= seq_lens.long()[:, None, None], float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    p = torch.exp(scores - lse[..., None])
    return torch.einsum("bhn,bhnd->bhd", p, _expand_kv(v.float(), group)), lse


def gather_pages(pages: torch.Tensor, block_table: torch.Tensor, length: int) -> torch.Tensor:
    """Rebuild the first `length` tokens of every sequence from a page pool.
    (num_pages, page_size, H, D) -> (B, H, length, D); (num_pages, page_size, D) -> (B, length, D)."""
    page_size = pages.shape[1]
    n_pages = -(-length // page_size)
    table = block_table[:, :n_pages].long()
    x = pages[table]  # (B, n_pages, page_size, [H,] D)
    x = x.reshape(table.shape[0], n_pages * page_size, *pages.shape[2:])[:, :length]
    return x.transpose(1, 2) if pages.ndim == 4 else x


def paged_decode_reference(q, k_pages, v_pages, block_table, seq_lens, *, scale: float, q_rope=None, k_rope_pages=None):
    """decode_reference over a paged cache (the pages are gathered into a contiguous cache first)."""
    n = int(seq_lens.max())
    k, v = gather_pages(k_pages, block_table, n), gather_pages(v_pages, block_table, n)
    k_rope = gather_pages(k_rope_pages, block_table, n) if k_rope_pages is not None else None
    return decode_reference(q, k, v, seq_lens, scale=scale, q_rope=q_rope, k_rope=k_rope)


def mla_decode_reference(q_absorbed, q_rope, c_kv, k_rope, seq_lens, *, scale: float):
    """Absorbed MLA decode: every head attends to the one shared latent cache, K = [c_kv, k_rope], V = c_kv.
    Returns (latent out (B, H, D_c) fp32, lse (B, H) fp32); the per-head value up-projection stays outside."""
    return decode_reference(
        q_absorbed, c_kv[:, None], c_kv[:, None], seq_lens, scale=scale, q_rope=q_rope, k_rope=k_rope[:, None]
    )


def paged_mla_decode_reference(q_absorbed, q_rope, c_kv_pages, k_rope_pages, block_table, seq_lens, *, scale: float):
    n = int(seq_lens.max())
    c_kv, k_rope = gather_pages(c_kv_pages, block_table, n), gather_pages(k_rope_pages, block_table, n)
    return mla_decode_reference(q_absorbed, q_rope, c_kv, k_rope, seq_lens, scale=scale)


def mla_unabsorbed_reference(q_nope, q_rope, c_kv, k_rope, w_uk, w_uv, *, scale: float):
    """MLA with per-head K/V materialized from the latent: k_nope = c_kv W_UK[h]^T, v = c_kv W_UV[h]^T.
    q_nope (B, H, D_nope), w_uk (H, D_nope, D_c), w_uv (H, D_v, D_c). Returns out (B, H, D_v) fp32."""
    k_nope = torch.einsum("bnc,hdc->bhnd", c_kv.float(), w_uk.float())
    values = torch.einsum("bnc,hvc->bhnv", c_kv.float(), w_uv.float())
    scores = torch.einsum("bhd,bhnd->bhn", q_nope.float(), k_nope)
    scores = scores + torch.einsum("bhr,bnr->bhn", q_rope.float(), k_rope.float())
    p = torch.softmax(scores * scale, dim=-1)
    return torch.einsum("bhn,bhnv->bhv", p, values)


def absorb_query(q_nope, w_uk):
    """q_absorbed[b, h] = q_nope[b, h] @ W_UK[h]: scores against c_kv then equal scores against k_nope."""
    return torch.einsum("bhd,hdc->bhc", q_nope.float(), w_uk.float())


def unabsorb_output(latent, w_uv):
    """out[b, h] = latent[b, h] @ W_UV[h]^T: the value up-projection applied after attention."""
    return torch.einsum("bhc,hvc->bhv", latent.float(), w_uv.float())


def decode_linear_reference(
    x, weight, bias=None, *, norm_weight=None, norm_bias=None, eps=1e-5, gelu=False, residual=None
):
    """decode_linear's math unfused, in fp32: residual + gelu(layer_norm(x) @ weight.T + bias). The norm's output is
    rounded to x's dtype first, as F.layer_norm returns it to the projection of the unfused model."""
    h = x.float()
    if norm_weight is not None:
        shift = None if norm_bias is None else norm_bias.float()
        h = torch.nn.functional.layer_norm(h, h.shape[-1:], norm_weight.float(), shift, eps).to(x.dtype).float()
    y = torch.nn.functional.linear(h, weight.float(), None if bias is None else bias.float())
    if gelu:
        y = torch.nn.functional.gelu(y, approximate="tanh")
    return y if residual is None else y + residual.float()


def rope_qkv_reference(qkv, cos, sin, n_head: int, n_kv_head: int):
    """rope_qkv's math in fp32: the rows [q | k | v] split into heads, q and k rotated (rotate-half: dims i and
    i + D/2 pair up), v as it is. Returns (q, k, v), (B, T, heads, D) each."""
    B, T, width = qkv.shape
    D = width // (n_head + 2 * n_kv_head)
    q, k, v = qkv.float().view(B, T, -1, D).split([n_head, n_kv_head, n_kv_head], dim=2)
    cos, sin = cos[:, :, None], sin[:, :, None]
    return _rotate_half(q, cos, sin), _rotate_half(k, cos, sin), v


def _rotate_half(x, cos, sin):
    """RoPE in fp32 with rotate-half pairing: [x1 cos - x2 sin, x2 cos + x1 sin] for x = [x1 | x2]."""
    x1, x2 = x.float().chunk(2, dim=-1)
    cos, sin = cos.float(), sin.float()
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


def linear_cross_entropy_reference(x, weight, targets, ignore_index: int = -1):
    """linear_cross_entropy's math in fp32: (logits = x @ weight.T, the mean cross-entropy over the rows whose
    target is not ignore_index)."""
    logits = x.float() @ weight.float().t()
    return logits, torch.nn.functional.cross_entropy(logits, targets, ignore_index=ignore_index)


def mla_decode_inputs_reference(q, kv, cos, sin, norm_weight, eps: float, w_uk):
    """mla_decode_inputs' math in fp32: (q_absorbed = q_nope W_UK[h] (B, H, D_c), the query heads' RoPE parts
    rotated (B, H, D_r), the latent RMS-normalized (B, D_c), the RoPE key rotated (B, D_r)) from q (B, H, D_n + D_r),
    kv (B, D_c + D_r) and w_uk (H, D_n, D_c); the kernel stores the last two in the cache."""
    d_n, d_c = w_uk.shape[1], w_uk.shape[2]
    q_absorbed = torch.einsum("bhn,hnc->bhc", q[..., :d_n].float(), w_uk.float())
    latent = kv[:, :d_c].float()
    latent = latent * torch.rsqrt(latent.pow(2).mean(-1, keepdim=True) + eps) * norm_weight.float()
    q_rope = _rotate_half(q[..., d_n:], cos[:, None], sin[:, None])
    return q_absorbed, q_rope, latent, _rotate_half(kv[:, d_c:], cos, sin)
