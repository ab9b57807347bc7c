"""CPU benchmark: one decode step's attention over the KV cache, megarl's kernel vs torch SDPA.

    python bench/bench_decode_attention.py [--reps 7] [--threads 1] [--quick]

Per shape, `layers` separate caches of [rows, kv_heads, max_len, d] fp32 (the engine's layout)
are filled with random values, and one decode step is timed: a query of one token per row
attends over the first `cached` positions of every layer's cache in turn, so the cache streams
from memory as in generation rather than staying in L3. Left padding masks a few positions of
a quarter of the rows, as ragged prompts do. Variants, interleaved rep by rep:
- `megarl kernel`: models/decode_attention.py on megarl._cpu (csrc/cpu_decode_attention.cpp);
- `SDPA`: torch.nn.functional.scaled_dot_product_attention with the boolean mask, what megarl
  ran before (and what it runs where the kernel is not built);
- `matmul + softmax`: q K^T, masked softmax, then P V with torch.matmul (KV heads expanded for
  grouped-query shapes), the eager path of transformers' Llama.
Each prints CPU ms per layer (best and median over reps) and the bytes of K and V read per
second; the kernel's output is checked against SDPA's.
"""
import argparse
import os
import statistics
import sys
import time

import torch
import torch.nn.functional as F

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

# (name, rows, heads, kv_heads, head_dim, layers, cached positions)
SHAPES = [
    ("default RL step, early (64 x 8 heads)", 64, 8, 8, 64, 8, 48),
    ("default RL step, mid", 64, 8, 8, 64, 8, 96),
    ("default RL step, last", 64, 8, 8, 64, 8, 160),
    ("realistic, 16 rows x 4 heads, 400 cached", 16, 4, 4, 64, 4, 400),
    ("realistic, 1,200 cached", 16, 4, 4, 64, 4, 1200),
    ("GQA 16 / 2 heads, d 128, 64 rows, 512 cached", 64, 16, 2, 128, 4, 512),
]


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--quick", action="store_true", help="two small shapes, 2 reps: a smoke run")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    from megarl.models.decode_attention import cpu_kernel, decode_attention

    if cpu_kernel() is None:
        sys.exit("megarl._cpu is not built (pip install --no-build-isolation -e . with a C++ compiler)")
    shapes = SHAPES
    if args.quick:
        shapes, args.reps = [(n, 8, h, g, d, 2, s) for n, _, h, g, d, _, s in SHAPES[:2]], 2

    print(f"\n## Decode attention over the KV cache, fp32, {args.threads} thread(s), {args.reps} interleaved reps, "
          "CPU ms per layer\n")
    print("| shape | variant | best ms | median ms | best GB/s (K and V read) | max abs diff from SDPA |")
    print("|---|---|---|---|---|---|")
    g = torch.Generator().manual_seed(0)
    for name, rows, heads, kv_heads, d, layers, cached in shapes:
        max_len = cached + 64
        caches = [(torch.randn(rows, kv_heads, max_len, d, generator=g), torch.randn(rows, kv_heads, max_len, d, generator=g))
                  for _ in range(layers)]
        queries = [torch.randn(1, rows, heads, d, generator=g).permute(1, 2, 0, 3) for _ in range(layers)]
        masked = torch.zeros(rows, max_len, dtype=torch.bool)
        masked[: rows // 4, : min(7, cached - 1)] = True
        mask = masked[:, None, None, :cached]
        scale = d ** -0.5

        def views(i):
            k, v = caches[i]
            return queries[i], k[:, :, :cached], v[:, :, :cached]

        def kernel(i):
            q, k, v = views(i)
            return decode_attention(q, k, v, mask, scale=scale)

        def sdpa(i):
            q, k, v = views(i)
            return F.scaled_dot_product_attention(q, k, v, attn_mask=~mask, scale=scale, enable_gqa=heads != kv_heads)

        def eager(i):
            q, k, v = views(i)
            if heads != kv_heads:
                k, v = k.repeat_interleave(heads // kv_heads, 1), v.repeat_interleave(heads // kv_heads, 1)
            s = torch.matmul(q, k.transpose(-1, -2)) * scale
            return torch.matmul(torch.softmax(s.masked_fill(mask, float("-inf")), -1), v)

        variants = {"megarl kernel": kernel, "SDPA": sdpa, "matmul + softmax": eager}
        diffs = {n: max((fn(i) - sdpa(i)).abs().max().item() for i in range(layers)) for n, fn in variants.items()}
        times = {n: [] for n in variants}
        for _ in range(args.reps):
            for n, fn in variants.items():
                c0 = time.process_time()
                for i in range(layers):
                    fn(i)
                times[n].append((time.process_time() - c0) / layers)
        nbytes = 2 * rows * kv_heads * cached * d * 4
        for n, ts in times.items():
            print(f"| {name} | {n} | {min(ts) * 1e3:.3f} | {statistics.median(ts) * 1e3:.3f} | "
                  f"{nbytes / min(ts) / 1e9:.1f} | {diffs[n]:.1e} |")
        ratio = [b / a for a, b in zip(times["megarl kernel"], times["SDPA"])]
        print(f"| {name} | SDPA / kernel | {min(times['SDPA']) / min(times['megarl kernel']):.2f}x best | "
              f"{statistics.median(ratio):.2f}x median | | |")


if __name__ == "__main__":
    main()
