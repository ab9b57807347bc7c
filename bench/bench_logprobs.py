"""CPU benchmark: megarl.ops.logprobs_and_entropy (torch path) vs the naive formula.

    python bench/bench_logprobs.py [--reps 3] [--threads N] [--shapes 4096x32000,2048x152064]
                                   [--dtypes float32,bfloat16] [--modes fwd,fwd+bwd]

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
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        base = _rss_kib("VmRSS")
        once()
        res["extra_mib"] = (_rss_kib("VmHWM") - base) / 1024
    else:
        wall_s, cpu_s = best_wall_and_cpu(once, reps)
        res.update(wall_s=wall_s, cpu_s=cpu_s)
    return res


def run_child(spec, reps, threads, env):
    out = subprocess.run([sys.executable, __file__, "--child", spec, "--reps", str(reps),
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
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        impl, shape, dtype, mode, what = args.child.split(":")
        res = child(impl, tuple(map(int, shape.split("x"))), dtype, mode, what, args.reps,
                    args.threads)
        print("RESULT " + json.dumps(res))
        return

    import torch

    print(f"torch {torch.__version__}, {os.cpu_count()} CPUs, {time.strftime('%Y-%m-%d')}, "
          f"command: python bench/bench_logprobs.py --reps {args.reps} --threads {args.threads} "
          f"--shapes {args.shapes} --dtypes {args.dtypes} --modes {args.modes}")
    print()
    print("| logits | dtype | mode | impl | threads | extra peak MiB | % of logits | extra-grad % "
          "| wall s | CPU s | wall speed-up |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    base_env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    mem_env = dict(base_env, MALLOC_MMAP_THRESHOLD_="65536")
    for shape in args.shapes.split(","):
        for dtype in args.dtypes.split(","):
            for mode in args.modes.split(","):
                naive_wall = None
                for impl in ("naive", "megarl"):
                    spec = f"{impl}:{shape}:{dtype}:{mode}"
                    try:
                        mem = run_child(spec + ":mem", 1, args.threads, mem_env)
                        tim = run_child(spec + ":time", args.reps, args.threads, base_env)
                    except RuntimeError as exc:
                        print(f"| {shape} | {dtype} | {mode} | {impl} | FAILED {exc!r} |")
                        continue
                    pct = 100 * mem["extra_mib"] / mem["logits_mib"]
                    minus_grad = pct - 100 if mode == "fwd+bwd" else pct
                    naive_wall = tim["wall_s"] if impl == "naive" else naive_wall
                    speed = f"{naive_wall / tim['wall_s']:.2f}x" if naive_wall else "-"
                    print(f"| {shape} | {dtype} | {mode} | {impl} | {tim['threads']} "
                          f"| {mem['extra_mib']:.0f} | {pct:.0f}% | {minus_grad:.0f}% "
                          f"| {tim['wall_s']:.3f} | {tim['cpu_s']:.3f} | {speed} |", flush=True)


if __name__ == "__main__":
    main()
