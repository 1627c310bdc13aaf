"""Decode kernels on the GPU: grouped, paged and MLA decode against PyTorch SDPA and the machine's ceilings.

    python -m benchmarks.bench_decode                     # the full grid (several minutes on one H200)
    python -m benchmarks.bench_decode --sections grouped  # one table (grouped: 3 minutes with 3 rounds)
    python -m benchmarks.bench_decode --quick             # a small grid (under 2 minutes)
    python -m benchmarks.bench_decode --tune              # launch-config sweeps (block sizes, warps, stages, splits)

Decode is memory-bound: the measure is bytes of cache read per second (each K/V byte counted once) against the
device copy rate (read + write) measured in the same run. Each shape's cache is made in several copies, at least
four times the L2 together (`common.rotation`), and every call is timed by `common.rotated_ms`: the calls, one
per copy, in rounds of at least 16 calls, are captured in one CUDA graph (the way decode runs in a server, and it
keeps the host's launch cost and the replay's own start out of the numbers) and each call reads a cache the L2
does not hold, with no flush's write-backs in its time. Before
timing, each kernel's output is checked against an fp32 reference on a few sequences of the batch. Our kernels
run with num_splits=None (auto) and with the best of a few fixed split counts, to check the heuristic. The --tune
sweeps time their configs the same way.
"""

from __future__ import annotations

import argparse
import math
import statistics

import torch
import torch.nn.functional as F

from attention_kernels import decode as decode_mod
from attention_kernels import mla as mla_mod
from attention_kernels.decode import grouped_decode, paged_grouped_decode
from attention_kernels.mla import mla_decode, paged_mla_decode
from benchmarks.common import ceilings, env, header, print_table, require_cuda, rotated_ms, rotation

DTYPE = torch.bfloat16
MAX_CACHE_BYTES = 24 * 1024**3  # K + V of one shape; larger shapes of the grid are skipped
TOL = 2e-2  # bf16 output against an fp32 reference: one rounding of P and of the output, ~2^-8 relative


def check(name: str, got: torch.Tensor, ref: torch.Tensor):
    err = (got.float() - ref.float()).abs().max().item()
    if not math.isfinite(err) or err > TOL * max(1.0, ref.abs().max().item()):
        raise AssertionError(f"{name}: max error {err:.3e} against the reference")


def ref_decode_rows(q, k, v, seq_lens, scale, rows):
    """fp32 decode for a few sequences (the full reference would materialize H_q copies of the cache)."""
    outs = []
    group = q.shape[1] // k.shape[1]
    for b in rows:
        n = int(seq_lens[b])
        kb, vb = k[b, :, :n].float(), v[b, :, :n].float()  # (H_kv, n, D)
        qb = q[b].float().reshape(k.shape[1], group, -1)  # (H_kv, G, D)
        p = torch.softmax(qb @ kb.transpose(1, 2) * scale, dim=-1)
        outs.append((p @ vb).reshape(q.shape[1], -1))
    return torch.stack(outs)


def sample_rows(batch: int) -> list[int]:
    return sorted({0, batch // 2, batch - 1})


def to_pages(x: torch.Tensor, page_size: int, table: torch.Tensor | None = None):
    """(B, H_kv, S, D) cache -> shuffled pool (num_pages, page_size, H_kv, D) and block table (B, S / page_size),
    a random one unless given."""
    b, h, s, d = x.shape
    n = s // page_size
    if table is None:
        table = torch.randperm(b * n, device=x.device).reshape(b, n).to(torch.int32)
    pool = torch.empty(b * n, page_size, h, d, device=x.device, dtype=x.dtype)
    pool[table.long()] = x.reshape(b, h, n, page_size, d).permute(0, 2, 3, 1, 4)
    return pool, table


def split_candidates(auto: int) -> list[int]:
    """Fixed split counts to time against the auto pick: 1 and its power-of-two neighbours."""
    return sorted(
        {
            1,
            max(1, auto // 4),
            max(1, auto // 2),
            min(decode_mod.MAX_SPLITS, auto * 2),
            min(decode_mod.MAX_SPLITS, auto * 4),
        }
        - {auto}
    )


def bench_grouped(shapes, fixed_splits: bool, copy_tbps: float, rounds: int = 3) -> list[dict]:
    """Ours (automatic split) against SDPA, alternated for `rounds` rounds: medians, and x_sdpa the median of the
    rounds' paired ratios (x_sdpa_range: their lowest-highest); with fixed_splits, the best fixed split count too."""
    rows = []
    for b, s, h_kv, d in shapes:
        h_q = 32
        cache_bytes = 2 * b * h_kv * s * d * DTYPE.itemsize
        if cache_bytes > MAX_CACHE_BYTES:
            continue
        q = torch.randn(b, h_q, d, device="cuda", dtype=DTYPE)
        copies = rotation(cache_bytes)
        kv = [tuple(torch.randn(b, h_kv, s, d, device="cuda", dtype=DTYPE) for _ in range(2)) for _ in range(copies)]
        k, v = kv[0]
        lens = torch.full((b,), s, device="cuda", dtype=torch.int32)
        scale = d**-0.5
        out, _ = grouped_decode(q, k, v, lens, scale=scale)
        picks = sample_rows(b)
        check(f"grouped B{b} S{s} Hkv{h_kv} D{d}", out[picks], ref_decode_rows(q, k, v, lens, scale, picks))
        sdpa = lambda: F.scaled_dot_product_attention(q[:, :, None], k, v, scale=scale, enable_gqa=True)  # noqa: E731
        check("sdpa", sdpa()[picks, :, 0], ref_decode_rows(q, k, v, lens, scale, picks))
        # Ours and SDPA alternate, so a drift of the machine between two timings falls on both; the pairs' range
        # shows how firm each ratio is.
        times = {"ours": [], "sdpa": []}
        for _ in range(rounds):
            times["ours"].append(
                rotated_ms(lambda i: grouped_decode(q, *kv[i], lens, scale=scale, validate=False), copies)
            )
            times["sdpa"].append(
                rotated_ms(
                    lambda i: F.scaled_dot_product_attention(q[:, :, None], *kv[i], scale=scale, enable_gqa=True),
                    copies,
                )
            )
        t_auto, t_sdpa = statistics.median(times["ours"]), statistics.median(times["sdpa"])
        pairs = sorted(r / o for r, o in zip(times["sdpa"], times["ours"]))
        auto = _auto_splits_grouped(b, h_q, h_kv, s, d)
        row = dict(
            B=b,
            S=s,
            H_kv=h_kv,
            D=d,
            splits=auto,
            copies=copies,
            us=1e3 * t_auto,
            GBps=cache_bytes / t_auto / 1e6,
            sdpa_GBps=cache_bytes / t_sdpa / 1e6,
            x_sdpa=statistics.median(pairs),
            x_sdpa_range=f"{pairs[0]:.3f}-{pairs[-1]:.3f}",
            of_copy=cache_bytes / t_auto / 1e9 / copy_tbps,
        )
        if fixed_splits:
            fixed = {
                n: rotated_ms(
                    lambda i: grouped_decode(q, *kv[i], lens, scale=scale, num_splits=n, validate=False), copies
                )
                for n in split_candidates(auto)
                if n <= min(decode_mod.MAX_SPLITS, math.ceil(s / 64))
            }
            best = min((t, n) for n, t in fixed.items())
            # Every split's time goes into the printed row (not the table): the data to refit auto_num_splits.
            row.update(
                best_fixed=best[1],
                auto_vs_best=best[0] / t_auto,
                split_us={auto: round(1e3 * t_auto, 2)} | {n: round(1e3 * t, 2) for n, t in fixed.items()},
            )
        rows.append(row)
        print(row, flush=True)
        kv = k = v = None  # freed before the next shape's copies
    return rows


def _auto_splits_grouped(b, h_q, h_kv, s, d) -> int:
    return decode_mod.grouped_num_splits(b, h_q, h_kv, s, d, d, DTYPE.itemsize, torch.device("cuda"))


def bench_paged(shapes, copy_tbps: float) -> list[dict]:
    rows = []
    for b, s, h_kv, d, page_size, ragged in shapes:
        h_q = 32
        q = torch.randn(b, h_q, d, device="cuda", dtype=DTYPE)
        g = torch.Generator(device="cpu").manual_seed(b + s)
        lens = (torch.randint(s // 8, s + 1, (b,), generator=g) if ragged else torch.full((b,), s)).to(torch.int32)
        lens = lens.cuda()
        scale = d**-0.5
        # Copies of the cache, each contiguous (k, v) and paged (k_pages, v_pages) under one block table.
        copies, table = rotation(2 * b * h_kv * s * d * DTYPE.itemsize), None
        caches = []
        for _ in range(copies):
            k, v = (torch.randn(b, h_kv, s, d, device="cuda", dtype=DTYPE) for _ in range(2))
            k_pages, table = to_pages(k, page_size, table)
            v_pages, _ = to_pages(v, page_size, table)
            caches.append((k, v, k_pages, v_pages))
        k, v, k_pages, v_pages = caches[0]
        out, _ = paged_grouped_decode(q, k_pages, v_pages, table, lens, scale=scale)
        hopper = decode_mod._sm90_supports(q, k_pages, v_pages, None)
        picks = sample_rows(b)
        check(f"paged B{b} S{s} page{page_size}", out[picks], ref_decode_rows(q, k, v, lens, scale, picks))
        t_paged = rotated_ms(
            lambda i: paged_grouped_decode(q, *caches[i][2:], table, lens, scale=scale, validate=False), copies
        )
        t_contig = rotated_ms(lambda i: grouped_decode(q, *caches[i][:2], lens, scale=scale, validate=False), copies)
        read = 2 * int(lens.sum()) * h_kv * d * DTYPE.itemsize
        row = dict(
            B=b,
            S=s,
            H_kv=h_kv,
            D=d,
            page=page_size,
            lens="ragged" if ragged else "full",
            splits=decode_mod.grouped_num_splits(b, h_q, h_kv, s, d, d, DTYPE.itemsize, q.device, True, hopper),
            us=1e3 * t_paged,
            GBps=read / t_paged / 1e6,
            contig_GBps=read / t_contig / 1e6,
            x_contig=t_contig / t_paged,
        )
        if hopper:  # the Hopper kernel ran: the Triton paged kernel beside it, at its own automatic split (the lever)
            with env("ZOO_DECODE_SM90", "0"):
                check(
                    f"paged B{b} S{s} page{page_size} (Triton)",
                    paged_grouped_decode(q, k_pages, v_pages, table, lens, scale=scale)[0][picks],
                    ref_decode_rows(q, k, v, lens, scale, picks),
                )
                t_triton = rotated_ms(
                    lambda i: paged_grouped_decode(q, *caches[i][2:], table, lens, scale=scale, validate=False), copies
                )
            row.update(triton_GBps=read / t_triton / 1e6, triton_x_contig=t_contig / t_triton)
        rows.append(row)
        print(rows[-1], flush=True)
        caches = k = v = k_pages = v_pages = None  # freed before the next shape's copies
    return rows


def ref_mla_rows(q_abs, q_rope, c_kv, k_rope, lens, scale, rows):
    outs = []
    for b in rows:
        n = int(lens[b])
        s = q_abs[b].float() @ c_kv[b, :n].float().T + q_rope[b].float() @ k_rope[b, :n].float().T
        outs.append(torch.softmax(s * scale, dim=-1) @ c_kv[b, :n].float())
    return torch.stack(outs)


def bench_mla(shapes, fixed_splits: bool) -> list[dict]:
    rows = []
    for b, h, n, page_size in shapes:
        d_c, d_r = 512, 64
        q_abs = torch.randn(b, h, d_c, device="cuda", dtype=DTYPE)
        q_rope = torch.randn(b, h, d_r, device="cuda", dtype=DTYPE)
        lens = torch.full((b,), n, device="cuda", dtype=torch.int32)
        scale = (128 + d_r) ** -0.5
        read = b * n * (d_c + d_r) * DTYPE.itemsize
        copies, table = rotation(read), None
        picks = sample_rows(b)
        caches = []  # per copy: the latent and RoPE caches (c_kv, k_rope), or their pages
        for _ in range(copies):
            c_kv = (0.3 * torch.randn(b, n, d_c, device="cuda")).to(DTYPE)
            k_rope = torch.randn(b, n, d_r, device="cuda", dtype=DTYPE)
            if page_size:
                c_pages, table = to_pages(c_kv[:, None], page_size, table)
                r_pages, _ = to_pages(k_rope[:, None], page_size, table)
                caches.append((c_pages[:, :, 0], r_pages[:, :, 0]))
            else:
                caches.append((c_kv, k_rope))
            if len(caches) == 1:
                ref = ref_mla_rows(q_abs, q_rope, c_kv, k_rope, lens, scale, picks)

        def run(splits=None, i=0):
            if page_size:
                return paged_mla_decode(
                    q_abs, q_rope, *caches[i], table, lens, scale=scale, num_splits=splits, validate=False
                )
            return mla_decode(q_abs, q_rope, *caches[i], lens, scale=scale, num_splits=splits, validate=False)

        check(f"mla B{b} H{h} N{n}", run()[0][picks], ref)
        t = rotated_ms(lambda i: run(i=i), copies)
        flops = 2 * b * h * n * (d_c + d_r) + 2 * b * h * n * d_c
        row = dict(
            B=b, H=h, N=n, page=page_size or "-", copies=copies, us=1e3 * t, TBps=read / t / 1e9, TFLOPs=flops / t / 1e9
        )
        if fixed_splits:
            best = min((rotated_ms(lambda i: run(sp, i), copies), sp) for sp in (1, 2, 4, 8, 16))
            row.update(best_fixed=best[1], auto_vs_best=best[0] / t)
        if mla_mod.mla_sm90 is not None and mla_mod.mla_sm90.supports(q_abs, q_rope, *caches[0], bool(page_size)):
            # The Hopper kernel ran: the Triton kernel beside it, each at its automatic split (the lever).
            with env("ZOO_MLA_SM90", "0"):
                check(f"mla B{b} H{h} N{n} (Triton)", run()[0][picks], ref)
                t_triton = rotated_ms(lambda i: run(i=i), copies)
            row.update(triton_TBps=read / t_triton / 1e9, triton_TFLOPs=flops / t_triton / 1e9)
        rows.append(row)
        print(row, flush=True)
        caches = None  # freed before the next shape's copies
    return rows


def tune(sections: list[str], quick: bool = False):
    """Launch-config sweeps on a few shapes: the data behind the defaults in attention_kernels/decode.py,
    decode_sm90.py and mla.py (quick: the paged sweep on its last two shapes only)."""
    rows = []
    grouped_shapes = [(64, 8192, 8, 128), (8, 32768, 8, 128), (64, 8192, 1, 128), (64, 8192, 8, 64), (64, 1024, 8, 128)]
    for b, s, h_kv, d in grouped_shapes if "grouped" in sections else []:
        q = torch.randn(b, 32, d, device="cuda", dtype=DTYPE)
        cache_bytes = 2 * b * h_kv * s * d * DTYPE.itemsize
        copies = rotation(cache_bytes)
        kv = [tuple(torch.randn(b, h_kv, s, d, device="cuda", dtype=DTYPE) for _ in range(2)) for _ in range(copies)]
        lens = torch.full((b,), s, device="cuda", dtype=torch.int32)
        for block_n in (32, 64, 128):
            for warps in (4, 8):
                for stages in (2, 3, 4):
                    cfg = dict(BLOCK_N=block_n, num_warps=warps, num_stages=stages)
                    try:
                        t = rotated_ms(
                            lambda i: decode_mod._launch_decode(
                                q,
                                *kv[i],
                                None,
                                None,
                                None,
                                lens,
                                d**-0.5,
                                None,
                                paged=False,
                                page_size=1,
                                capacity=s,
                                config=cfg,
                            ),
                            copies,
                        )
                    except Exception as e:  # a config may not fit in shared memory
                        print("skip", b, s, h_kv, d, block_n, cfg, type(e).__name__, flush=True)
                        continue
                    rows.append(
                        dict(
                            op="grouped",
                            shape=f"B{b}-S{s}-Hkv{h_kv}-D{d}",
                            BLOCK_N=block_n,
                            warps=warps,
                            stages=stages,
                            GBps=cache_bytes / t / 1e6,
                        )
                    )
                    print(rows[-1], flush=True)
        kv = None  # freed before the next shape's copies
    if "paged" in sections:
        rows += tune_paged(PAGED_TUNE_SHAPES[-2:] if quick else PAGED_TUNE_SHAPES)
    mla_shapes = [(64, h, 8192) for h in (16, 128) if "mla" in sections or f"mla{h}" in sections]
    for b, h, n in mla_shapes:
        q_abs, q_rope = (
            torch.randn(b, h, 512, device="cuda", dtype=DTYPE),
            torch.randn(b, h, 64, device="cuda", dtype=DTYPE),
        )
        copies = rotation(b * n * 576 * DTYPE.itemsize)
        caches = [
            ((0.3 * torch.randn(b, n, 512, device="cuda")).to(DTYPE), torch.randn(b, n, 64, device="cuda", dtype=DTYPE))
            for _ in range(copies)
        ]
        lens = torch.full((b,), n, device="cuda", dtype=torch.int32)
        flops = 2 * b * h * n * 576 + 2 * b * h * n * 512
        picks = sample_rows(b)
        ref = ref_mla_rows(q_abs, q_rope, *caches[0], lens, 0.07, picks)
        grid = (
            [(16, bn, w, st) for bn in (16, 32, 64) for w in (4, 8) for st in (1, 2, 3)]
            if h <= 16
            else [
                (64, 16, 8, 2),
                (64, 32, 8, 3),
                (64, 64, 8, 1),
                (64, 64, 8, 2),
                (64, 32, 4, 2),
                (32, 64, 4, 2),
                (32, 32, 4, 3),
            ]
        )
        for block_h, block_n, warps, stages in grid:
            cfg = dict(BLOCK_H=block_h, BLOCK_N=block_n, num_warps=warps, num_stages=stages)

            def run(i=0):
                return mla_mod._launch_mla(
                    q_abs, q_rope, *caches[i], None, lens, 0.07, None, paged=False, page_size=1, capacity=n, config=cfg
                )

            try:
                check(f"mla {cfg}", run()[0][picks], ref)
                t = rotated_ms(run, copies)
            except Exception as e:
                print("skip mla", cfg, type(e).__name__, flush=True)
                continue
            rows.append(
                dict(
                    op=f"mla-H{h}",
                    shape=f"B{b}-N{n}",
                    BLOCK_H=block_h,
                    BLOCK_N=block_n,
                    warps=warps,
                    stages=stages,
                    TBps=b * n * 576 * 2 / t / 1e9,
                    TFLOPs=flops / t / 1e9,
                )
            )
            print(rows[-1], flush=True)
    return rows


PAGED_TUNE_SHAPES = [(b, s, h, 128) for b, s in ((1, 65536), (64, 8192), (8, 32768), (128, 4096)) for h in (8,)] + [
    (64, 8192, 1, 128)
]


def tune_paged(shapes=PAGED_TUNE_SHAPES, configs=((64, 3), (64, 4), (64, 2)), page_size: int = 16) -> list[dict]:
    """The Hopper paged kernel (attention_kernels/decode_sm90.py): every ring config at every power-of-two split count,
    on a full-length and a ragged batch of each shape (lengths from [S/8, S]): the data behind decode_sm90.CONFIGS and
    decode.ragged_num_splits. Rows: ms per (config, lens, split), and which split the model picks."""
    rows = []
    for b, s, h_kv, d in shapes:
        q = torch.randn(b, 32, d, device="cuda", dtype=DTYPE)
        copies = rotation(2 * b * h_kv * s * d * DTYPE.itemsize)
        k_pages, table = to_pages(torch.randn(b, h_kv, s, d, device="cuda", dtype=DTYPE), page_size)
        pools = [(k_pages, torch.randn_like(k_pages))] + [
            (torch.randn_like(k_pages), torch.randn_like(k_pages)) for _ in range(copies - 1)
        ]
        if not decode_mod._sm90_supports(q, *pools[0], None):
            print("tune_paged: the Hopper paged kernel does not run here (an sm_90 GPU, Triton 3.6)", flush=True)
            return rows
        g = torch.Generator(device="cpu").manual_seed(b + s)
        for lens_kind in ("full", "ragged"):
            lens = (
                (torch.randint(s // 8, s + 1, (b,), generator=g) if lens_kind == "ragged" else torch.full((b,), s))
                .to(torch.int32)
                .cuda()
            )
            for block_n, stages in configs:
                times = {}
                for n in decode_mod.SPLIT_CHOICES:
                    if n > s // block_n or (n > 2 and b * h_kv * n > 2048):
                        break
                    times[n] = round(
                        1e3
                        * rotated_ms(
                            lambda i: decode_mod._launch_decode(
                                q,
                                *pools[i],
                                None,
                                None,
                                table,
                                lens,
                                d**-0.5,
                                n,
                                paged=True,
                                page_size=page_size,
                                capacity=s,
                                config={"sm90": (block_n, stages)},
                            ),
                            copies,
                        ),
                        2,
                    )
                rows.append(
                    dict(
                        op="paged",
                        shape=f"B{b}-S{s}-Hkv{h_kv}-D{d}-page{page_size}",
                        lens=lens_kind,
                        BLOCK_N=block_n,
                        stages=stages,
                        best_split=min(times, key=times.get),
                        best_us=min(times.values()),
                        model_split=decode_mod.grouped_num_splits(
                            b, 32, h_kv, s, d, d, DTYPE.itemsize, q.device, True, True
                        ),
                        split_us=times,
                    )
                )
                print(rows[-1], flush=True)
    return rows


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--quick", action="store_true", help="a small grid (under 2 minutes); with --tune, fewer shapes"
    )
    parser.add_argument("--tune", action="store_true", help="launch-config sweeps instead of the grid")
    parser.add_argument(
        "--sections",
        default="grouped,paged,mla",
        help="tables to run (or with --tune, sweeps: grouped, paged, mla, mla16, mla128), comma-separated",
    )
    parser.add_argument(
        "--rounds", type=int, default=3, help="grouped: alternated rounds of ours and SDPA per shape (default 3)"
    )
    args = parser.parse_args()
    if args.rounds < 1:
        raise SystemExit(f"--rounds {args.rounds}: expected at least 1")
    require_cuda("bench_decode.py")
    torch.manual_seed(0)
    print(header())
    ceil = ceilings()
    print(
        f"ceilings: copy {ceil['copy_TBps']:.2f} TB/s (read+write), bf16 matmul {ceil['matmul_bf16_TFLOPs']:.0f} "
        f"TFLOP/s",
        flush=True,
    )
    if args.tune:
        rows = tune(args.sections.split(","), args.quick)
        print_table([r for r in rows if r["op"] == "grouped"], ["shape", "BLOCK_N", "warps", "stages", "GBps"])
        print_table(
            [r for r in rows if r["op"] == "paged"],
            ["shape", "lens", "BLOCK_N", "stages", "best_split", "best_us", "model_split"],
        )
        print_table(
            [r for r in rows if r["op"] not in ("grouped", "paged")],
            ["op", "shape", "BLOCK_H", "BLOCK_N", "warps", "stages", "TBps", "TFLOPs"],
        )
        return
    if args.quick:
        grouped = [(b, s, h, 128) for b in (1, 64) for s in (1024, 32768) for h in (1, 8)]
        paged = [(b, s, 8, 128, p, r) for b, s in ((64, 8192), (8, 32768)) for p in (16, 64) for r in (False, True)]
        mla = [(64, 16, 8192, 0), (64, 128, 8192, 0), (64, 16, 8192, 64)]
    else:
        grouped = [
            (b, s, h, d) for d in (128, 64) for h in (8, 1, 32) for b in (1, 8, 32, 128) for s in (1024, 8192, 65536)
        ]
        paged = [
            (b, s, 8, 128, p, r)
            for b, s in ((1, 65536), (64, 8192), (8, 32768), (128, 4096))
            for p in (16, 64)
            for r in (False, True)
        ]
        paged += [(64, 8192, 1, 128, p, r) for p in (16, 64) for r in (False, True)]  # MQA: the widest head tile
        mla = [
            (b, h, n, p)
            for h in (16, 32, 128)
            for b, n in ((16, 8192), (64, 8192), (64, 32768), (128, 4096))
            for p in (0, 16, 64)
        ]
    sections = args.sections.split(",")
    g_rows = bench_grouped(grouped, True, ceil["copy_TBps"], args.rounds) if "grouped" in sections else []
    p_rows = bench_paged(paged, ceil["copy_TBps"]) if "paged" in sections else []
    m_rows = bench_mla(mla, fixed_splits=True) if "mla" in sections else []
    print()
    print(header())
    print(
        f"ceilings: copy {ceil['copy_TBps']:.2f} TB/s, bf16 matmul {ceil['matmul_bf16_TFLOPs']:.0f} TFLOP/s; "
        "H_q = 32; GB/s = K+V bytes read once per second; x_sdpa > 1: we are faster"
    )
    if g_rows:
        print_table(
            g_rows,
            [
                "B",
                "S",
                "H_kv",
                "D",
                "splits",
                "us",
                "GBps",
                "sdpa_GBps",
                "x_sdpa",
                "x_sdpa_range",
                "of_copy",
                "best_fixed",
                "auto_vs_best",
            ],
        )
    if p_rows:
        print()
        print_table(
            p_rows,
            [
                "B",
                "S",
                "H_kv",
                "D",
                "page",
                "lens",
                "splits",
                "us",
                "GBps",
                "contig_GBps",
                "x_contig",
                "triton_GBps",
                "triton_x_contig",
            ],
        )
    if m_rows:
        print()
        print_table(
            m_rows,
            [
                "B",
                "H",
                "N",
                "page",
                "us",
                "TBps",
                "TFLOPs",
                "triton_TBps",
                "triton_TFLOPs",
                "best_fixed",
                "auto_vs_best",
            ],
        )


if __name__ == "__main__":
    main()
