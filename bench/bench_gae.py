"""CPU benchmark: megarl.ops.gae (vectorised torch path) vs the usual Python loop over T.

    python bench/bench_gae.py [--shape 512x4096] [--reps 3] [--threads N] [--malloc retain|default]

The loop is the one RL frameworks ship (verl's compute_gae_advantage_return: one vectorised
step per token over the batch, masked tokens carried through). Both run on the same fp32
inputs: right-padded responses of random lengths (megarl's prefix path) and responses with
~10% masked holes (megarl's pass-through scan). Outputs are checked to agree on valid tokens.
Wall time is the best of --reps runs (others share this machine); CPU time (user+sys of this
process, all threads) is reported too because it is less sensitive to that sharing.
--malloc retain (the default) re-runs the script with glibc told to keep freed memory
(MALLOC_TRIM_THRESHOLD_, MALLOC_MMAP_THRESHOLD_), as the jemalloc/tcmalloc that training jobs
often preload do. With glibc's defaults, whether the 16 MiB of fresh outputs per call come back
as new pages (a first-touch fault per 4 KiB, ~6 ms per call on this VM) depends on what ran
before, and the same call measured 4 or 11 ms from run to run.
Prints a markdown table.
"""
import argparse
import os
import sys
import time

import torch

from megarl.ops import gae
from timing import best_wall_and_cpu


def gae_loop(r, v, m, gamma, lam):
    """verl-style loop over T; masked tokens pass the running values through."""
    B, T = r.shape
    mf = m.to(r.dtype)
    next_value = torch.zeros(B, dtype=r.dtype)
    last = torch.zeros(B, dtype=r.dtype)
    rev = []
    for t in reversed(range(T)):
        delta = r[:, t] + gamma * next_value - v[:, t]
        new = delta + gamma * lam * last
        next_value = v[:, t] * mf[:, t] + (1 - mf[:, t]) * next_value
        last = new * mf[:, t] + (1 - mf[:, t]) * last
        rev.append(last)
    adv = torch.stack(rev[::-1], dim=1)
    return adv * mf, (adv + v) * mf


def timed(fn, reps):
    fn()  # warm-up
    return best_wall_and_cpu(fn, reps)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shape", default="512x4096")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch default)")
    ap.add_argument("--malloc", choices=["retain", "default"], default="retain",
                    help="retain: glibc keeps freed memory (no first-touch faults on reused outputs)")
    args = ap.parse_args()
    if args.malloc == "retain" and "MALLOC_TRIM_THRESHOLD_" not in os.environ:
        env = dict(os.environ, MALLOC_TRIM_THRESHOLD_=str(1 << 34), MALLOC_MMAP_THRESHOLD_=str(1 << 30))
        os.execve(sys.executable, [sys.executable, *sys.argv], env)  # glibc reads these at start-up
    if args.threads:
        torch.set_num_threads(args.threads)
    B, T = map(int, args.shape.split("x"))
    gamma, lam = 0.99, 0.95
    g = torch.Generator().manual_seed(0)
    r, v = torch.randn(B, T, generator=g), torch.randn(B, T, generator=g)
    lens = torch.randint(1, T + 1, (B,), generator=g)
    masks = {"right-padded": torch.arange(T)[None] < lens[:, None]}
    masks["holed (10%)"] = masks["right-padded"] & (torch.rand(B, T, generator=g) > 0.1)

    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {time.strftime('%Y-%m-%d')}, "
          f"command: python bench/bench_gae.py --shape {args.shape} --reps {args.reps} --threads {args.threads} "
          f"--malloc {args.malloc}")
    print()
    print("| [B, T] | mask | impl | wall ms (best) | CPU ms (best) | wall speed-up | CPU speed-up | max abs diff |")
    print("|---|---|---|---|---|---|---|---|")
    for name, m in masks.items():
        ladv, lret = gae_loop(r, v, m, gamma, lam)
        adv, ret = gae(r, v, m, gamma, lam)
        diff = max((adv - ladv).abs().max().item(), (ret - lret).abs().max().item())
        lw, lc = timed(lambda: gae_loop(r, v, m, gamma, lam), max(1, args.reps))
        ow, oc = timed(lambda: gae(r, v, m, gamma, lam), max(10, 10 * args.reps))
        print(f"| {B}x{T} | {name} | loop | {lw * 1e3:.1f} | {lc * 1e3:.1f} | 1x | 1x | |")
        print(f"| {B}x{T} | {name} | megarl | {ow * 1e3:.2f} | {oc * 1e3:.2f} | {lw / ow:.0f}x "
              f"| {lc / oc:.0f}x | {diff:.1e} |", flush=True)


if __name__ == "__main__":
    main()
