"""CPU benchmark: the output layer + a per-token loss in training (forward + backward), four ways
interleaved in one process: the loss outside the fused op (`linear_logprobs_and_entropy`: its
backward recomputes each chunk's logits unless all tokens fit in one chunk) or inside it
(`linear_token_loss`: each chunk's gradient taken in the forward), each with the row passes over
the fp32 logits in megarl._cpu (`logprob_stats` / `logprob_grad`) or in torch. Scoring
(forward only, no grad) is timed for both row paths too.

    python bench/bench_token_loss.py [--reps 5] [--shapes 2048x151936x256,1024x32000x512]

The loss is PPO's clipped surrogate with an entropy bonus and a k3 KL term (algorithms.ppo_token_loss),
token-mean. Prints a markdown table of CPU seconds per call, best / median of --reps rounds
(each round runs every variant once, in turn). 1 thread.
"""
import argparse
import os
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--shapes", default="2048x151936x256,1024x32000x512", help="T x V x h, comma-separated")
    args = ap.parse_args()
    sys.path.insert(0, ROOT)
    import torch

    from megarl.algorithms import ppo_token_loss
    from megarl.models import cpu_kernels
    from megarl.ops import linear_logprobs_and_entropy, linear_token_loss
    from megarl.ops import logprobs as lp_mod

    torch.set_num_threads(1)
    kernels = lp_mod._cpu_kernels
    if cpu_kernels.load() is None:
        sys.exit("megarl._cpu is not built here: nothing to compare the torch row passes with")
    print(f"torch {torch.__version__}, {time.strftime('%Y-%m-%d %H:%M')}, 1 thread, command: python "
          f"bench/bench_token_loss.py --reps {args.reps} --shapes {args.shapes}\n")
    print("| T x V x h | mode | loss | row passes | CPU s best | CPU s median |")
    print("|---|---|---|---|---|---|")
    for shape in args.shapes.split(","):
        T, V, h = map(int, shape.split("x"))
        g = torch.Generator().manual_seed(0)
        hidden = torch.randn(T, h, generator=g).requires_grad_()
        weight = (torch.randn(V, h, generator=g) * h ** -0.5).requires_grad_()
        t = torch.randint(0, V, (T,), generator=g)
        old = torch.randn(T, generator=g) * 0.1 - 12.0
        adv = torch.randn(T, generator=g)

        def loss_of(lp, ent, pos):
            per_token, _ = ppo_token_loss(lp, old[pos], adv[pos], entropy=ent, entropy_coef=0.01,
                                          ref_logp=old[pos], kl_coef=0.04)
            return per_token.sum() / T

        def outside():
            lp, ent = linear_logprobs_and_entropy(hidden, weight, t, with_entropy=True)
            loss_of(lp, ent, slice(None)).backward()

        def inside():
            loss, _, _ = linear_token_loss(hidden, weight, t, lambda pos, lp, ent: loss_of(lp, ent, pos),
                                           with_entropy=True)
            loss.backward()

        def scoring():
            with torch.no_grad():
                linear_logprobs_and_entropy(hidden, weight, t, with_entropy=False)

        variants = {(mode, name, rows): fn for mode, name, fn in
                    (("fwd+bwd", "outside the op", outside), ("fwd+bwd", "inside the op", inside),
                     ("fwd (scoring)", "-", scoring)) for rows in ("megarl._cpu", "torch")}
        times = {k: [] for k in variants}
        for _ in range(args.reps + 1):  # the first round warms up
            for (mode, name, rows), fn in variants.items():
                lp_mod._cpu_kernels = kernels if rows == "megarl._cpu" else (lambda x: None)
                hidden.grad = weight.grad = None
                c0 = time.process_time()
                fn()
                times[(mode, name, rows)].append(time.process_time() - c0)
        lp_mod._cpu_kernels = kernels
        for (mode, name, rows), ts in times.items():
            ts = ts[1:]
            print(f"| {shape} | {mode} | {name} | {rows} | {min(ts):.2f} | {statistics.median(ts):.2f} |", flush=True)


if __name__ == "__main__":
    main()
