"""CPU benchmark: megarl.ops.logprobs_and_entropy (torch path) vs the naive formula, and the
fused output layer (megarl.ops.linear_logprobs_and_entropy) vs output layer + op.

    python bench/bench_logprobs.py [--reps 3] [--threads N] [--shapes 4096x32000,2048x152064]
                                   [--dtypes float32,bfloat16] [--modes fwd,fwd+bwd]
    python bench/bench_logprobs.py --head [--reps 1] [--shapes 1024x152064x64,16384x152064x64]
                                   [--max-gib 12]

--head: hidden [T, h] and the output weight [V, h] go to per-token log-prob + entropy, either
"unfused" (F.linear -> [T, V] logits -> logprobs_and_entropy, as RL scores and trains today)
or "fused" (chunked, no logits), "fused-lp" (fused, log-probs only: what RL
scores without an entropy bonus) and "fused-loss" (the loss inside the op, its gradient taken
chunk by chunk in the forward: how RL trains, `linear_token_loss`). fwd = scoring (no grad), fwd+bwd = training (grad
of hidden and weight). Besides the RSS figure, the op's own allocations are counted by the torch
profiler (profile_memory: every CPU allocation and free; "alloc peak" is the highest running
sum, "allocs" the number of allocations). "% of logits" compares with one fp32 [T, V] tensor;
an unfused run that would need more than --max-gib is skipped (its memory is linear in T).

Every (shape, dtype, mode, implementation) runs in fresh subprocesses, one at a time.
Memory: with MALLOC_MMAP_THRESHOLD_=65536, so that glibc serves every block >= 64 KiB with
mmap and returns it to the OS on free (RSS then tracks live memory, whatever allocated it; no
tracemalloc), the child allocates the logits and targets, runs the op once to warm up, resets
the kernel's peak-RSS counter (`echo 5 > /proc/self/clear_refs`), notes the current RSS, runs
the op again and reads VmHWM. "extra" = VmHWM - that RSS: everything the op had live at its
peak on top of its inputs. In fwd+bwd mode the gradient w.r.t. the logits (one logits-sized
tensor any implementation must return) is included; "extra-grad" subtracts it.
Time: a second child with the default allocator runs one warm-up and --reps timed calls;
the table shows the best wall time and the best CPU time (user+sys, all threads; less
sensitive to other processes on a shared machine). Needs Linux (/proc). Prints markdown.
"""
import argparse
import json
import os
import re
import subprocess
import sys
import time

from timing import best_wall_and_cpu

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _rss_kib(field):
    with open("/proc/self/status") as f:
        return int(re.search(rf"{field}:\s+(\d+)", f.read()).group(1))


def naive(x, t):
    """The usual formula: fp32 log_softmax of the whole tensor, gather, entropy from it."""
    import torch

    lsm = torch.log_softmax(x.float(), -1)
    return lsm.gather(-1, t[..., None]).squeeze(-1), -(lsm.exp() * lsm).sum(-1)


def _rss_extra_mib(fn):
    """MiB of RSS above the current one at the peak of fn() (VmHWM after resetting it)."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    base = _rss_kib("VmRSS")
    fn()
    return (_rss_kib("VmHWM") - base) / 1024


def _alloc_peak(fn):
    """(peak MiB of live CPU allocations above the start, number of allocations) during fn()."""
    import itertools

    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    events = sorted((e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"),
                    key=lambda e: e.start_ns())
    sizes = [e.nbytes() for e in events]
    return max(itertools.accumulate(sizes, initial=0)) / 2**20, sum(b > 0 for b in sizes)


def head_child(impl, shape, dtype, mode, what, reps, threads):
    """One fused/unfused output-layer + log-prob run of hidden [T, h] through weight [V, h]."""
    import torch
    import torch.nn.functional as F

    from megarl.ops import linear_logprobs_and_entropy, linear_token_loss, logprobs_and_entropy

    if threads:
        torch.set_num_threads(threads)
    T, V, h = shape
    torch.manual_seed(0)
    dt = getattr(torch, dtype)
    hidden = torch.randn(T, h).to(dt)
    weight = (torch.randn(V, h) * h ** -0.5).to(dt)
    t = torch.randint(0, V, (T,))
    bwd = mode == "fwd+bwd"
    hidden.requires_grad_(bwd), weight.requires_grad_(bwd)

    if impl == "fused-fresh":  # each logit chunk a fresh tensor, as before the per-call workspace
        from megarl.ops import fused_head

        fused_head._workspace = lambda x, elems: None

    def fn(x, tt):
        if impl == "fused-loss":  # the loss inside the op (as RL trains): (loss, lp, ent)
            return linear_token_loss(x, weight, tt, lambda pos, lp, ent: lp.sum() + ent.sum(), with_entropy=True)
        if impl in ("fused", "fused-lp", "fused-fresh"):  # fused-lp: log-probs only, as RL without an entropy bonus
            return linear_logprobs_and_entropy(x, weight, tt, with_entropy=impl != "fused-lp")
        return logprobs_and_entropy(F.linear(x, weight), tt)

    def once(rows=T):
        x = hidden[:rows]
        if bwd:
            hidden.grad = weight.grad = None
            out = fn(x, t[:rows])
            if impl == "fused-loss":
                out[0].backward()
            else:
                lp, ent = out
                (lp.sum() + (ent.sum() if ent is not None else 0.0)).backward()
        else:
            with torch.no_grad():
                fn(x, t[:rows])
        hidden.grad = weight.grad = None

    once(min(T, 512))  # warm-up on a slice: thread pools, lazy init
    res = dict(logits_mib=T * V * 4 / 2**20, threads=torch.get_num_threads())
    if what == "mem":
        res["extra_mib"] = _rss_extra_mib(once)
        res["alloc_peak_mib"], res["allocs"] = _alloc_peak(once)
    else:
        wall_s, cpu_s = best_wall_and_cpu(once, reps)
        res.update(wall_s=wall_s, cpu_s=cpu_s)
    return res


def child(impl, shape, dtype, mode, what, reps, threads):
    import torch

    from megarl.ops import logprobs_and_entropy

    if threads:
        torch.set_num_threads(threads)
    N, V = shape
    torch.manual_seed(0)
    x = torch.empty(N, V, dtype=getattr(torch, dtype))
    for i in range(0, N, 256):  # fill in slices: no full-size fp32 temporary
        x[i:i + 256] = torch.randn(min(256, N - i), V)
    t = torch.randint(0, V, (N,))
    fn = naive if impl == "naive" else (lambda a, b: logprobs_and_entropy(a, b))
    bwd = mode == "fwd+bwd"
    if bwd:
        x.requires_grad_()

    def once():
        if bwd:
            x.grad = None
            lp, ent = fn(x, t)
            (lp.sum() + ent.sum()).backward()
        else:
            with torch.no_grad():
                fn(x, t)

    once()  # warm-up: thread pools, lazy init
    if bwd:
        x.grad = None
    res = dict(logits_mib=x.numel() * x.element_size() / 2**20, threads=torch.get_num_threads())
    if what == "mem":
        res["extra_mib"] = _rss_extra_mib(once)
    else:
        wall_s, cpu_s = best_wall_and_cpu(once, reps)
        res.update(wall_s=wall_s, cpu_s=cpu_s)
    return res


def run_child(spec, reps, threads, env):
    out = subprocess.run([sys.executable, os.path.abspath(__file__), "--child", spec, "--reps", str(reps),
                          "--threads", str(threads)], capture_output=True, text=True, env=env)
    line = [ln for ln in out.stdout.splitlines() if ln.startswith("RESULT ")]
    if out.returncode != 0 or not line:
        raise RuntimeError(f"{spec}: {out.stderr[-500:]}")
    return json.loads(line[0][7:])


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch default)")
    ap.add_argument("--shapes", default="4096x32000,2048x152064")
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--modes", default="fwd,fwd+bwd")
    ap.add_argument("--head", action="store_true", help="fused output layer vs output layer + op; "
                    "--shapes are TxVxh (default 1024x152064x64,16384x152064x64)")
    ap.add_argument("--max-gib", type=float, default=12.0, help="--head: skip unfused runs needing more")
    ap.add_argument("--impls", default="unfused,fused,fused-lp,fused-loss",
                    help="--head: which of unfused, fused, fused-lp, fused-fresh (fused, each logit chunk "
                         "allocated afresh: the op before its per-call workspace), fused-loss (the loss inside "
                         "the op: linear_token_loss, gradients taken in the forward)")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        impl, shape, dtype, mode, what = args.child.split(":")
        run = head_child if impl in ("fused", "fused-lp", "fused-fresh", "fused-loss", "unfused") else child
        res = run(impl, tuple(map(int, shape.split("x"))), dtype, mode, what, args.reps, args.threads)
        print("RESULT " + json.dumps(res))
        return
    if args.head:
        return head_main(args)

    import torch

    print(f"torch {torch.__version__}, {os.cpu_count()} CPUs, {time.strftime('%Y-%m-%d')}, "
          f"command: python bench/bench_logprobs.py --reps {args.reps} --threads {args.threads} "
          f"--shapes {args.shapes} --dtypes {args.dtypes} --modes {args.modes}")
    print()
    print("| logits | dtype | mode | impl | threads | extra peak MiB | % of logits | extra-grad % "
          "| wall s | CPU s | wall speed-up |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    naive_wall = None
    for shape, dtype, mode, impl, mem, tim in measured(args, args.shapes, ("naive", "megarl")):
        pct = 100 * mem["extra_mib"] / mem["logits_mib"]
        minus_grad = pct - 100 if mode == "fwd+bwd" else pct
        naive_wall = tim["wall_s"] if impl == "naive" else naive_wall
        speed = f"{naive_wall / tim['wall_s']:.2f}x" if naive_wall else "-"
        print(f"| {shape} | {dtype} | {mode} | {impl} | {tim['threads']} "
              f"| {mem['extra_mib']:.0f} | {pct:.0f}% | {minus_grad:.0f}% "
              f"| {tim['wall_s']:.3f} | {tim['cpu_s']:.3f} | {speed} |", flush=True)


def measured(args, shapes, impls, skip=lambda shape, dtype, mode, impl: None):
    """(shape, dtype, mode, impl, memory result, time result) per case, in table order, each
    from its own two children; a failure or a `skip` reason is printed as a row instead."""
    base_env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    mem_env = dict(base_env, MALLOC_MMAP_THRESHOLD_="65536")
    for shape in shapes.split(","):
        for dtype in args.dtypes.split(","):
            for mode in args.modes.split(","):
                for impl in impls:
                    why = skip(shape, dtype, mode, impl)
                    if why:
                        print(f"| {shape} | {dtype} | {mode} | {impl} | skipped: {why} |", flush=True)
                        continue
                    spec = f"{impl}:{shape}:{dtype}:{mode}"
                    try:
                        mem = run_child(spec + ":mem", 1, args.threads, mem_env)
                        tim = run_child(spec + ":time", args.reps, args.threads, base_env)
                    except RuntimeError as exc:
                        print(f"| {shape} | {dtype} | {mode} | {impl} | FAILED {exc!r} |")
                        continue
                    yield shape, dtype, mode, impl, mem, tim


def head_main(args):
    import torch

    shapes = args.shapes if args.shapes != "4096x32000,2048x152064" else "1024x152064x64,16384x152064x64"
    print(f"torch {torch.__version__}, {os.cpu_count()} CPUs, {time.strftime('%Y-%m-%d')}, "
          f"command: python bench/bench_logprobs.py --head --reps {args.reps} --threads {args.threads} "
          f"--shapes {shapes} --dtypes {args.dtypes} --modes {args.modes} --max-gib {args.max_gib} --impls {args.impls}")
    print()
    print("| T x V x h | dtype | mode | impl | RSS extra MiB | alloc peak MiB | allocs | % of fp32 logits "
          "(alloc peak) | wall s | CPU s |")
    print("|---|---|---|---|---|---|---|---|---|---|")

    def too_big(shape, dtype, mode, impl):
        T, V, _ = map(int, shape.split("x"))
        need_gib = T * V * torch.tensor([], dtype=getattr(torch, dtype)).element_size() / 2**30
        need_gib *= 2 if mode == "fwd+bwd" else 1  # + the logits' gradient
        if impl == "unfused" and need_gib > args.max_gib:
            return f"needs ~{need_gib:.0f} GiB (> --max-gib {args.max_gib:g}) | | | | |"

    impls = tuple(args.impls.split(","))
    for shape, dtype, mode, impl, mem, tim in measured(args, shapes, impls, too_big):
        pct = 100 * mem["alloc_peak_mib"] / mem["logits_mib"]
        print(f"| {shape} | {dtype} | {mode} | {impl} | {mem['extra_mib']:.0f} "
              f"| {mem['alloc_peak_mib']:.0f} | {mem['allocs']} | {pct:.1f}% "
              f"| {tim['wall_s']:.2f} | {tim['cpu_s']:.2f} |", flush=True)


if __name__ == "__main__":
    main()
