"""The LM head's GEMM at a decode step's few rows, in three weight layouts and two libraries (CPU, fp32).

    python bench/bench_head_layout.py [--vocab 151936] [--hidden 256] [--reps 15] [--threads 1]

A decode step with m live rows multiplies [m, h] by the head's [V, h] weight. MKL's sgemm on that
layout (`F.linear`, what megatron-core's output layer runs) has a dip at 4-8 rows on some CPUs; the
same product as `(W @ x.T).T` (no copy) or `x @ W.t().contiguous()` (a second, [h, V] copy of the
weight) takes other kernels. oneDNN's fp32 inner product (`torch.ops.mkldnn._linear_pointwise`,
what megarl's generation runs at 2+ rows, models/cpu_gemm.py) reads either memory order.
`megarl wide_linear, W` is megarl._cpu's kernel (csrc/cpu_wide_linear.cpp), what generation runs
at 1-32 rows where it is built and the CPU has AVX-512. Prints best / median ms per variant and
the error against float64; the variants are interleaved rep by rep.
"""
import argparse
import os
import statistics
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--vocab", type=int, default=151936)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    g = torch.Generator().manual_seed(0)
    w = torch.randn(args.vocab, args.hidden, generator=g) * 0.02  # [V, h]
    wt = w.t().contiguous()  # [h, V]
    layouts = {"F.linear(x, W)": lambda x: F.linear(x, w), "(W @ x.T).T": lambda x: (w @ x.t()).t(),
               "x @ W.t().contiguous()": lambda x: x @ wt}
    if torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise"):
        onednn = torch.ops.mkldnn._linear_pointwise
        layouts["oneDNN, W"] = lambda x: onednn(x, w, None, "none", [], "")
        layouts["oneDNN, W.t().contiguous()"] = lambda x: onednn(x, wt.t(), None, "none", [], "")
    from megarl.models import cpu_kernels

    kernel = cpu_kernels.wide_linear()
    if kernel is not None:
        layouts["megarl wide_linear, W"] = lambda x: kernel(x, w)
    else:
        print("megarl._cpu.wide_linear: not built or no AVX-512 here; left out\n")
    print(f"LM head {args.vocab} x {args.hidden} fp32, {args.threads} thread(s), best / median ms of {args.reps}\n")
    print("| rows | " + " | ".join(layouts) + " | max rel err vs float64 |")
    print("|---" * (len(layouts) + 2) + "|")
    for m in (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 64):
        x = torch.randn(m, args.hidden, generator=g)
        ref = x.double() @ w.double().t()
        times = {name: [] for name in layouts}
        for _ in range(args.reps):  # the layouts interleaved, rep by rep
            for name, fn in layouts.items():
                t0 = time.perf_counter()
                fn(x)
                times[name].append(time.perf_counter() - t0)
        err = max(((fn(x).double() - ref).abs().max() / ref.abs().max()).item() for fn in layouts.values())
        cells = [f"{1e3 * min(t):.2f} / {1e3 * statistics.median(t):.2f}" for t in times.values()]
        print(f"| {m} | " + " | ".join(cells) + f" | {err:.0e} |")


if __name__ == "__main__":
    main()
