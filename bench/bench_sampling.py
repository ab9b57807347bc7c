"""CPU benchmark: the decode step's draw (`rollout.sampling.sample_tokens`): megarl._cpu's
`sample_rows` (csrc/cpu_sampling.cpp, what megarl runs on a CPU where it is built), torch's ops
with fp32 exp clamped at -87 below the row's max (the fallback), and the plain `exp(z - max z)`
that clamp replaced.

    python bench/bench_sampling.py [--reps 30] [--threads 1]

torch's vectorised CPU exp leaves its fast path for inputs whose result is denormal or 0 (below
about -87.3, and -inf): logits spread wider than that (peaked or low-temperature distributions)
or filtered by top-k / top-p (-inf everywhere but the kept ids) made the exp pass 10-40x slower.
Rows x vocabulary as in bench_rl_step.py's workloads; logits N(0, spread^2); the two variants
interleaved after a warm-up, best / median ms per call, and in how many rows each drew the
kernel's ids (the kernel's exp and block sums round differently from torch's: a uniform within
rounding of a token boundary may pick the neighbour).
"""
import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    import megarl.rollout.sampling as sampling

    clamped, cpu_sampler = sampling._exp_below_max, sampling.cpu_sampler
    torch_ops = lambda filtered: None  # noqa: E731
    variants = {"megarl._cpu kernel": (clamped, cpu_sampler), "torch, clamped exp": (clamped, torch_ops),
                "torch, plain exp": (lambda z, zmax: torch.exp(z - zmax), torch_ops)}
    if cpu_sampler(torch.zeros(1, 4)) is None:
        del variants["megarl._cpu kernel"]  # not built here
    print(f"\n## sample_tokens per decode step, fp32, {args.threads} thread(s), best / median ms of {args.reps}\n")
    print("| rows x vocabulary | logits | " + " | ".join(variants) + " | rows drawn alike |")
    print("|---|---|" + "---|" * len(variants) + "---|")
    g = torch.Generator().manual_seed(0)
    for rows, vocab in ((64, 32000), (16, 151936), (64, 151936)):
        for spread, top_k in ((4.0, 0), (30.0, 0), (4.0, 50)):
            logits = torch.randn(rows, vocab, generator=g) * spread
            params = sampling.SamplingParams(top_k=top_k)
            filtered = sampling.filter_logits(logits, params)
            u = sampling.row_uniforms(1, torch.arange(rows), 0)
            times = {name: [] for name in variants}
            ids = {}
            try:
                for rep in range(args.reps + 1):  # rep 0: warm-up, untimed
                    for name, (exp_fn, sampler) in variants.items():
                        sampling._exp_below_max, sampling.cpu_sampler = exp_fn, sampler
                        t0 = time.perf_counter()
                        ids[name] = sampling.sample_tokens(filtered, params, u)[0]
                        if rep:
                            times[name].append(time.perf_counter() - t0)
            finally:
                sampling._exp_below_max, sampling.cpu_sampler = clamped, cpu_sampler
            first = ids[next(iter(variants))]
            same = min(int((v == first).sum()) for v in ids.values())
            label = f"N(0, {spread:g}^2)" + (f", top-k {top_k}" if top_k else "")
            cells = " | ".join(f"{min(t) * 1e3:.2f} / {statistics.median(t) * 1e3:.2f}" for t in times.values())
            print(f"| {rows} x {vocab} | {label} | {cells} | {same} of {rows} |")


if __name__ == "__main__":
    main()
