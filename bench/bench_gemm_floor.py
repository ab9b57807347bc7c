"""CPU benchmark: the GEMM floor of bench/bench_rl_step.py's default GRPO step, per GEMM library.

    python bench/bench_gemm_floor.py [--reps 5] [--threads 1] [--hidden 512] [--ffn 1408] [--layers 8]
                                     [--heads 8] [--kv-heads 8] [--vocab 32000] [--prompts 8]
                                     [--samples 8] [--prompt-len 32] [--new-tokens 128] [--tokens N]

Every GEMM of the step's linears (q/k/v + o, gated MLP, LM head), in the three shapes they take
(forward y = x W^T, input gradient dx = dy W, weight gradient dW = dy^T x) at the training token
count, and the forward at one decode step's row count, is timed with each implementation,
interleaved (impl A, B, C, A, B, C, ...) so that load from others on the machine hits them alike:
  mm-fp32      torch's fp32 matmul (MKL / the default BLAS), what F.linear runs on CPU today,
               into a fresh output per call (at an LM head's shape, page faults are a share)
  mm-fp32-out  the same GEMM into an output allocated once per shape
  onednn-fp32  torch.ops.mkldnn._linear_pointwise (oneDNN's fp32 inner product): the forward
               and grad(input) (dy times W read as its transpose); not grad(weight), whose dy^T
               it would need copied: counted at its forward rate in the floor
  mm-bf16      bf16 matmul (oneDNN with AVX-512 BF16 / AMX where the CPU has them)
  bf16-via-fp32  bf16 operands through fp32 sgemm, the result rounded to bf16 once
Each is checked against a float64 product (max relative error over the output's scale).
Reported per shape: best and median GFLOP/s; then the floor of one step: the step's GEMM FLOPs
(generation over every decode step, reference + actor scoring forward, training forward +
backward; no prompt logits, as megarl computes them) divided by each library's rate on each
shape, in CPU-seconds (single thread: CPU-s = wall-s).
"""
import argparse
import os
import statistics
import time

import torch
import torch.nn.functional as F


def _mm_into_reused_output():
    """MKL's fp32 x w^T written into one output per shape, allocated on first use."""
    outs = {}

    def fn(x, w):
        key = (x.shape[0], w.shape[0])
        if key not in outs:
            outs[key] = torch.empty(key, dtype=x.dtype)
        return torch.mm(x, w.t(), out=outs[key])

    return fn


def impls():
    out = {"mm-fp32": (torch.float32, lambda x, w: F.linear(x, w)),
           "mm-fp32-out": (torch.float32, _mm_into_reused_output())}
    if torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise"):
        out["onednn-fp32"] = (torch.float32, lambda x, w: torch.ops.mkldnn._linear_pointwise(x, w, None, "none", [], ""))
    out["mm-bf16"] = (torch.bfloat16, lambda x, w: F.linear(x, w))
    out["bf16-via-fp32"] = (torch.bfloat16, lambda x, w: F.linear(x.float(), w.float()).to(torch.bfloat16))
    return out


def linears(a):
    """(name, out_features, in_features, tokens kind) of one layer's linears and the LM head."""
    head_dim = a.hidden // a.heads
    return [("qkv", (a.heads + 2 * a.kv_heads) * head_dim, a.hidden), ("o", a.hidden, a.heads * head_dim),
            ("fc1 (gate+up)", 2 * a.ffn, a.hidden), ("fc2", a.hidden, a.ffn), ("lm head", a.vocab, a.hidden)]


def step_flops(a):
    """GEMM FLOPs of one GRPO step per (linear, kind): generation, scoring, training."""
    rows, T = a.prompts * a.samples, a.prompt_len + a.new_tokens
    flops = {}
    for name, n, k in linears(a):
        layers = 1 if name == "lm head" else a.layers
        tok_all = rows * T
        tok_head = rows * (a.new_tokens)  # logits only for the response-predicting columns
        tok = tok_head if name == "lm head" else tok_all
        # generation: prefill of the prompt + one decode step per new token (rows each)
        gen_tok = rows * (a.prompt_len + a.new_tokens) if name != "lm head" else rows * a.new_tokens
        flops[(name, "decode fwd")] = 2 * gen_tok * n * k * layers
        # scoring: reference forward (old log-probs come from the rollout); training fwd + 2 bwd GEMMs
        flops[(name, "fwd")] = 2 * 2 * tok * n * k * layers
        flops[(name, "dgrad")] = 2 * tok * n * k * layers
        flops[(name, "wgrad")] = 2 * tok * n * k * layers
    return flops


def operands(kind, M, n, k, dtype, g):
    """(x, w) so that fn(x, w) = x w^T computes the kind's GEMM: forward [M,k]x[n,k]^T, dgrad
    [M,n]x[k,n]^T (= dy W), wgrad [n,M]x[k,M]^T (= dy^T x)."""
    if kind in ("fwd", "decode fwd"):
        shapes = ((M, k), (n, k))
    elif kind == "dgrad":
        shapes = ((M, n), (k, n))
    else:
        shapes = ((n, M), (k, M))
    return [torch.randn(s, generator=g).to(dtype) for s in shapes]


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1)
    for name, default in (("hidden", 512), ("ffn", 1408), ("layers", 8), ("heads", 8), ("kv-heads", 8),
                          ("vocab", 32000), ("prompts", 8), ("samples", 8), ("prompt-len", 32), ("new-tokens", 128)):
        ap.add_argument(f"--{name}", type=int, default=default)
    ap.add_argument("--tokens", type=int, default=0,
                    help="rows of the training GEMMs (default: the step's, prompts x samples x length)")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    rows, T = a.prompts * a.samples, a.prompt_len + a.new_tokens
    libs = impls()
    print(f"torch {torch.__version__}, {os.cpu_count()} CPUs ({torch.backends.cpu.get_cpu_capability()}), "
          f"{a.threads} thread(s), {time.strftime('%Y-%m-%d')}, command: python bench/bench_gemm_floor.py "
          f"--reps {a.reps} --threads {a.threads} --hidden {a.hidden} --ffn {a.ffn} --layers {a.layers} "
          f"--heads {a.heads} --kv-heads {a.kv_heads} --vocab {a.vocab} --prompts {a.prompts} "
          f"--samples {a.samples} --prompt-len {a.prompt_len} --new-tokens {a.new_tokens}"
          + (f" --tokens {a.tokens}" if a.tokens else "") + "\n")
    print("| linear | GEMM | M x N x K | " + " | ".join(f"{n} best / median GFLOP/s (rel err)" for n in libs) + " |")
    print("|---|---|---|" + "---|" * len(libs))
    g = torch.Generator().manual_seed(0)
    rates = {}  # (linear, kind, lib) -> best GFLOP/s
    for name, n, k in linears(a):
        tok = a.tokens or rows * (a.new_tokens if name == "lm head" else T)
        for kind in ("fwd", "dgrad", "wgrad", "decode fwd"):
            M = rows if kind == "decode fwd" else tok
            x32, w32 = operands(kind, M, n, k, torch.float32, g)
            ref = (x32.double() @ w32.double().T)
            scale = ref.abs().max().item()
            mnk = (x32.shape[0], w32.shape[0], x32.shape[1])
            times, errs = {lib: [] for lib in libs}, {}
            for lib, (dtype, fn) in libs.items():
                if lib == "onednn-fp32" and kind == "wgrad":
                    continue  # needs dy^T in memory, a copy: counted at its forward rate below
                x, w = x32.to(dtype), w32.to(dtype)
                if lib == "bf16-via-fp32" and kind != "wgrad":
                    w = w.float()  # a weight: converted once per block by megarl, not per GEMM
                errs[lib] = ((fn(x, w).double() - ref).abs().max().item() / scale, x, w)
            for _ in range(a.reps):
                for lib, (err, x, w) in errs.items():
                    fn = libs[lib][1]
                    t0 = time.perf_counter()
                    fn(x, w)
                    times[lib].append(time.perf_counter() - t0)
            flop = 2 * mnk[0] * mnk[1] * mnk[2]
            cells = []
            for lib in libs:
                if not times[lib]:
                    cells.append("-")
                    continue
                best, med = flop / min(times[lib]) / 1e9, flop / statistics.median(times[lib]) / 1e9
                rates[(name, kind, lib)] = best
                cells.append(f"{best:.0f} / {med:.0f} ({errs[lib][0]:.0e})")
            print(f"| {name} | {kind} | {mnk[0]}x{mnk[1]}x{mnk[2]} | " + " | ".join(cells) + " |", flush=True)

    flops = step_flops(a)
    total = sum(flops.values())
    print(f"\nGEMM work of one step: {total / 1e9:.0f} GFLOP (generation {sum(v for (_, kd), v in flops.items() if kd == 'decode fwd') / 1e9:.0f}, "
          f"scoring + training {sum(v for (_, kd), v in flops.items() if kd != 'decode fwd') / 1e9:.0f}); "
          "prefill counted at decode rates (upper bound)\n")
    print("| library | floor CPU-s per step (best rates) |")
    print("|---|---|")
    for lib in libs:
        secs = 0.0
        for (name, kind), f in flops.items():
            r = rates.get((name, kind, lib)) or rates[(name, "fwd", lib)]  # oneDNN: backward at its forward rate
            secs += f / (r * 1e9)
        print(f"| {lib} | {secs:.2f} |")
    print("\n(onednn-fp32's grad(weight) GEMMs are counted at its forward rate: a floor if oneDNN ran them too.)")


if __name__ == "__main__":
    main()
