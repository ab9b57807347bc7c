"""GPU benchmark of the fused CUDA kernels against the HBM floor (and the naive formula).

    python bench/bench_gpu_ops.py [--hbm-tbps 3.35] [--tokens 8192] [--vocab 152064] [--iters 20]

Log-probs/entropy, bf16 logits [tokens, vocab]: the forward must read the logits once, the
backward read them once more and write the gradient once, so the floors are
    fwd  = N V 2 B / HBM bandwidth            (0.74 ms for 8192 x 152064 on an H100 SXM)
    fwd+bwd = 3 N V 2 B / HBM bandwidth      (2.2 ms)
GAE fp32 [512, 4096] with a bool mask reads r, v, mask and writes adv, ret:
    (4 + 4 + 1 + 4 + 4) B T bytes / bandwidth  (12.5 us on an H100 SXM)
Times are CUDA-event medians over --iters calls after warm-up; GAE is also timed from a CUDA
graph of 20 calls to remove the per-call CPU overhead (which exceeds a 12.5 us kernel). Peak
memory is torch.cuda.max_memory_allocated above the inputs. --hbm-tbps is the peak bandwidth
of the GPU (H100 SXM 3.35, H100 PCIe 2.0, H200 4.8). Prints a markdown table.
"""
import argparse
import statistics
import time

import torch

from megarl.ops import gae, kernel_backend, logprobs_and_entropy


def naive(x, t):
    lsm = torch.log_softmax(x.float(), -1)
    return lsm.gather(-1, t[..., None]).squeeze(-1), -(lsm.exp() * lsm).sum(-1)


def fused(x, t):
    return logprobs_and_entropy(x, t)


def cuda_time(fn, iters):
    """Median ms of fn() over iters CUDA-event-timed calls (after 3 warm-up calls)."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times)


def peak_extra_mib(fn, reset=None):
    if reset is not None:
        reset()  # e.g. drop the previous gradient so that the baseline excludes it
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    fn()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - base) / 2**20


def graph_time_us(fn, calls=20, iters=20):
    """Per-call us of fn() replayed from a CUDA graph (no CPU launch overhead)."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    return cuda_time(graph.replay, iters) * 1e3 / calls


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--hbm-tbps", type=float, default=3.35)
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--vocab", type=int, default=152064)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--skip-naive", action="store_true", help="naive needs ~3x 5 GB of fp32 copies")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("no CUDA device: this benchmark needs a GPU")
    bw = args.hbm_tbps * 1e12
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, megarl backend "
          f"{kernel_backend()!r}, {time.strftime('%Y-%m-%d')}, HBM peak {args.hbm_tbps} TB/s, "
          f"command: python bench/bench_gpu_ops.py --hbm-tbps {args.hbm_tbps} --tokens {args.tokens} "
          f"--vocab {args.vocab} --iters {args.iters}")
    if kernel_backend() != "cuda":
        print("WARNING: megarl._C is not loaded; the numbers below are the torch path")
    print()
    print("| op | shape | impl | time | HBM floor | % of peak BW | extra peak MiB |")
    print("|---|---|---|---|---|---|---|")

    bench_logprobs(args, bw)
    bench_gae(args, bw)


def bench_logprobs(args, bw):
    N, V = args.tokens, args.vocab
    torch.manual_seed(0)
    x = torch.randn(N, V, device="cuda", dtype=torch.bfloat16)
    t = torch.randint(0, V, (N,), device="cuda")
    lp, ent = fused(x, t)
    rlp, rent = naive(x[:256], t[:256])
    err = max((lp[:256] - rlp).abs().max().item(), (ent[:256] - rent).abs().max().item())
    print(f"<!-- fused vs naive on 256 rows: max abs diff {err:.2e} -->")
    nbytes = x.numel() * x.element_size()
    impls = [("megarl", fused)] + ([] if args.skip_naive else [("naive", naive)])
    for name, fn in impls:
        ms = cuda_time(lambda: fn(x, t), args.iters)
        mem = peak_extra_mib(lambda: fn(x, t))
        floor = nbytes / bw * 1e3
        print(f"| logprobs+entropy fwd | bf16 {N}x{V} | {name} | {ms:.3f} ms | {floor:.3f} ms "
              f"| {100 * floor / ms:.0f}% | {mem:.0f} |", flush=True)
    xg = x.clone().requires_grad_()

    for name, fn in impls:
        def step(fn=fn):
            xg.grad = None
            lp, ent = fn(xg, t)
            (lp.sum() + ent.sum()).backward()

        ms = cuda_time(step, args.iters)
        # the gradient itself (nbytes) is required output, not workspace
        mem = peak_extra_mib(step, reset=lambda: setattr(xg, "grad", None)) - nbytes / 2**20
        floor = 3 * nbytes / bw * 1e3
        print(f"| logprobs+entropy fwd+bwd | bf16 {N}x{V} | {name} | {ms:.3f} ms | {floor:.3f} ms "
              f"| {100 * floor / ms:.0f}% | {mem:.0f} (beyond grad) |", flush=True)


def bench_gae(args, bw):
    B, T = 512, 4096
    r = torch.randn(B, T, device="cuda")
    v = torch.randn(B, T, device="cuda")
    m = torch.arange(T, device="cuda")[None] < torch.randint(1, T + 1, (B, 1), device="cuda")
    floor_us = (4 + 4 + 1 + 4 + 4) * B * T / bw * 1e6
    us_call = cuda_time(lambda: gae(r, v, m, 0.99, 0.95), args.iters) * 1e3
    us_graph = graph_time_us(lambda: gae(r, v, m, 0.99, 0.95))
    for label, us in (("per call", us_call), ("CUDA graph", us_graph)):
        print(f"| gae ({label}) | fp32 {B}x{T} | megarl | {us:.1f} us | {floor_us:.1f} us "
              f"| {100 * floor_us / us:.0f}% | |", flush=True)


if __name__ == "__main__":
    main()
