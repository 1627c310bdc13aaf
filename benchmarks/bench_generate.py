"""Decode speed and cache memory of every attention variant and cache, on GPT-2-small-sized random models.

    python3 benchmarks/bench_generate.py                       # the H200 table (under 3 minutes)
    python3 benchmarks/bench_generate.py --device=cpu --tiny   # a smoke run of the same code on the CPU

For each variant (mha, gqa with 4 KV heads, mqa, mla) and each cache that fits it, a batch of random prompts of
--prompt_len tokens is prefilled and then --new_tokens tokens are decoded greedily through generate.generate, with the
Triton kernels; decode tokens/s = batch * decode steps / decode seconds (device-synchronized). Baselines in the same
run: the same caches on the plain PyTorch attention (backend "torch", attention_kernels/reference.py) and, at batch 1,
no cache at all (the full forward every step). "cache GB/s" is the bytes of cache every decode step reads (the whole
context of every sequence, all layers) over the step time, an end-to-end lower bound on the attention's
bandwidth: the step also runs the projections, the MLP and Python, so it is not a kernel measurement.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

# --device=cpu (or --device cpu): the Triton kernels run on CPU tensors under the interpreter, set before import.
_device = argparse.ArgumentParser(add_help=False)
_device.add_argument("--device")
if _device.parse_known_args()[0].device == "cpu":
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.common import ceilings, header, print_table, require_cuda  # noqa: E402
from model import GPT, GPTConfig  # noqa: E402
from generate import generate  # noqa: E402

GPT2_SMALL = dict(n_layer=12, n_head=12, n_embd=768, block_size=1024, vocab_size=50304, bias=True, dropout=0.0)
TINY = dict(n_layer=2, n_head=4, n_embd=64, block_size=256, vocab_size=512, bias=True, dropout=0.0)
VARIANTS = {
    "mha": dict(attention="mha"),
    "gqa": dict(attention="gqa", n_kv_head=4),
    "mqa": dict(attention="mqa"),
    # DeepSeek-V2's proportions at GPT-2-small width: latent 4 x head_dim, rope half a head
    "mla": dict(attention="mla", kv_lora_rank=256, qk_nope_head_dim=64, qk_rope_head_dim=32, v_head_dim=64),
}
TINY_MLA = dict(attention="mla", kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16)
CACHES = {"mla": ("mla", "paged_mla")}


def build(variant: str, backend: str, args) -> GPT:
    torch.manual_seed(0)
    shape = TINY if args.tiny else GPT2_SMALL
    fields = TINY_MLA if args.tiny and variant == "mla" else VARIANTS[variant]
    model = GPT(GPTConfig(**shape, **fields, attn_backend=backend))
    return model.to(args.device, getattr(torch, args.dtype)).eval()


def run_one(model, cache: str, batch: int, args) -> dict:
    vocab = model.config.vocab_size
    g = torch.Generator().manual_seed(batch)
    prompts = torch.randint(0, vocab, (batch, args.prompt_len), generator=g).tolist()
    generate(model, prompts, cache, max_new_tokens=2, page_size=args.page_size)  # compile the kernels, warm up
    t0 = time.perf_counter()
    _, stats = generate(model, prompts, cache, max_new_tokens=args.new_tokens, page_size=args.page_size)
    s = stats.summary()
    steps = max(stats.decode_steps, 1)
    mean_ctx = args.prompt_len + args.new_tokens / 2
    bytes_per_step = stats.cache_bytes_per_token * batch * mean_ctx
    return {
        "decode tok/s": s["decode_tokens_per_s"],
        "ms/step": 1e3 * stats.decode_s / steps,
        "prefill tok/s": s["prefill_tokens_per_s"],
        "cache GB/s": bytes_per_step / (stats.decode_s / steps) / 1e9 if cache != "none" else None,
        "KiB/token": stats.cache_bytes_per_token / 1024 if cache != "none" else None,
        "cache MiB": stats.cache_bytes_allocated / 2**20 if cache != "none" else None,
        "wall s": time.perf_counter() - t0,
    }


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--batches", default=None, help="comma-separated (default 1,64; with --tiny 1,4)")
    p.add_argument("--variants", default="mha,gqa,mqa,mla")
    p.add_argument("--prompt_len", type=int, default=512)
    p.add_argument("--new_tokens", type=int, default=64)
    p.add_argument("--page_size", type=int, default=16)
    p.add_argument("--tiny", action="store_true", help="a 2-layer model (CPU smoke run)")
    p.add_argument("--no_baselines", action="store_true", help="skip the torch-backend and no-cache rows")
    args = p.parse_args()
    if args.tiny:
        args.prompt_len, args.new_tokens = min(args.prompt_len, 32), min(args.new_tokens, 8)
    args.batches = args.batches or ("1,4" if args.tiny else "1,64")
    print(header())
    if args.device == "cuda":
        require_cuda("bench_generate.py (without --device=cpu)")
        print("ceilings: " + ", ".join(f"{k} {v:.1f}" for k, v in ceilings().items()))
    print(
        f"prompt {args.prompt_len} tokens, {args.new_tokens} new tokens, dtype {args.dtype}, "
        f"page {args.page_size}, {'tiny' if args.tiny else 'GPT-2 small'} models"
    )
    rows = []
    for variant in args.variants.split(","):
        backends = ["triton"] if args.no_baselines else ["triton", "torch"]
        for backend in backends:
            model = build(variant, backend, args)
            for batch in (int(b) for b in args.batches.split(",")):
                kinds = list(CACHES.get(variant, ("grouped", "paged")))
                if backend == "torch" and batch == 1 and not args.no_baselines:
                    kinds.append("none")
                for cache in kinds:
                    row = {
                        "variant": variant,
                        "cache": cache,
                        "backend": backend,
                        "batch": batch,
                        **run_one(model, cache, batch, args),
                    }
                    rows.append(row)
                    print(
                        f"  {variant} {cache} {backend} B{batch}: {row['decode tok/s']:.1f} decode tok/s",
                        file=sys.stderr,
                        flush=True,
                    )
            del model
            if args.device == "cuda":
                torch.cuda.empty_cache()
    print_table(
        rows,
        [
            "variant",
            "cache",
            "backend",
            "batch",
            "decode tok/s",
            "ms/step",
            "prefill tok/s",
            "cache GB/s",
            "KiB/token",
            "cache MiB",
            "wall s",
        ],
    )


if __name__ == "__main__":
    main()
