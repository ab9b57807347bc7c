"""CPU benchmark: one decode step's attention over the KV cache, megarl's kernel vs torch SDPA.

    python bench/bench_decode_attention.py [--reps 7] [--threads 1] [--quick]
    python bench/bench_decode_attention.py --rollout default|realistic [--ab attention|head|prefix|sampler|step|layers|native]
                                           [--reps 3] [--prompts N]

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

--rollout: the whole generate phase of bench_rl_step.py's workload (same model, prompts and
sampling: 8 x 8 rows x 128 tokens, or the realistic 2 x 8 rows of 40-200 + up to 1,024
tokens), with the kernel and with SDPA in turn, same seed, interleaved; CPU-s per generate call,
and whether the two sampled the same tokens. `--ab head` compares the same way megarl._cpu's
LM-head GEMM at 2-32 rows (csrc/cpu_wide_linear.cpp, models/cpu_gemm.py) against MKL / oneDNN;
`--ab prefix` the kernel reading each prompt's cached positions from its group's first row
(`prefix_rows`, the engine's default) against every row reading its own copy; `--ab sampler`
megarl._cpu's draw (csrc/cpu_sampling.cpp, rollout/sampling.py) against torch's ops; `--ab step`
the decode steps through models/decode_step.py (the engine's default at PP 1) against the model's
own megatron-core modules; `--ab layers` the layers' linears at 1-64 rows through megarl._cpu's
kernel on their [out, in] weights (the engine's `layer_kernel`, default on an AMD CPU) against
oneDNN / MKL on the [in, out] memory (the LM head takes the kernel in both; the layers in torch
operations in both); `--ab native` each decode step's layers as one call of megarl._cpu.decode_layer
(the engine's `native_layers`, its default where `layer_kernel` is on) against decode_step.py's
torch operations with the same kernel for the linears.
--prompts: prompts of the replayed batch (default 8, realistic 2), 8 samples each.
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
    ap.add_argument("--rollout", choices=("default", "realistic"), help="time bench_rl_step.py's generate phase")
    ap.add_argument("--ab", choices=("attention", "head", "prefix", "sampler", "step", "layers", "native"),
                    default="attention",
                    help="--rollout: the kernel compared (decode attention, the LM head's GEMM, shared prompt "
                         "reads in decode attention, the draw, the decode step's path, the layers' linears at "
                         "decode rows, the layers in megarl._cpu.decode_layer)")
    ap.add_argument("--prompts", type=int, help="--rollout: prompts of the batch (default 8; realistic 2)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    from megarl.models.decode_attention import cpu_kernel, decode_attention

    if cpu_kernel() is None:
        sys.exit("megarl._cpu is not built (pip install --no-build-isolation -e . with a C++ compiler)")
    if args.rollout:
        return rollout_ab(args)
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
        caches = [tuple(torch.randn(rows, kv_heads, max_len, d, generator=g) for _ in "kv") for _ in range(layers)]
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


def same_samples(a, b) -> tuple[int, float]:
    """(rows whose response tokens are identical, the largest log-prob difference before each row's
    first differing token). fp32 rounding may flip a draw that lands within ~1e-6 of a boundary:
    the row then goes its own way, which a bug would not explain with equal log-probs before it."""
    same, err = 0, 0.0
    for i in range(a.tokens.shape[0]):
        p, n = int(a.prompt_lens[i]), min(int(a.response_lens[i]), int(b.response_lens[i]))
        diff = (a.tokens[i, p:p + n] != b.tokens[i, p:p + n]).nonzero().flatten()
        first = int(diff[0]) if len(diff) else n
        same += int(len(diff) == 0 and a.response_lens[i] == b.response_lens[i])
        if first:
            err = max(err, float((a.logprobs[i, :first] - b.logprobs[i, :first]).abs().max()))
    return same, err


def rollout_ab(args) -> None:
    import tempfile

    import megarl.models.decode_attention as da
    import megarl.rollout.sampling as sampling
    from megarl.models import cpu_gemm, cpu_kernels

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import bench_rl_step as rl

    w = argparse.Namespace(hidden=512, ffn=1408, layers=8, heads=8, kv_heads=8, vocab=32000, prompts=8, samples=8,
                           prompt_len=32, new_tokens=128, micro_batch=8, beta=0.04, old_logprobs="rollout",
                           workload=args.rollout, mean_len=200, packing="off", precision="fp32",
                           cpu_half_gemm="native")
    if args.rollout == "realistic":
        for k, v in rl.REALISTIC.items():
            setattr(w, k, v)
        w.prompts, w.packing = 2, "on"
    w.prompts = args.prompts or w.prompts
    w.prompt_min = 40 if args.rollout == "realistic" else w.prompt_len
    w.max_pos = max(256, w.prompt_len + w.new_tokens)
    cpu_kernel, wide_linear, cpu_sampler = da.cpu_kernel, cpu_kernels.wide_linear, sampling.cpu_sampler
    if args.ab in ("head", "layers", "native") and wide_linear() is None:
        sys.exit("megarl._cpu.wide_linear does not run here (not built, or no AVX-512)")
    if args.ab == "sampler" and getattr(cpu_kernels.load(), "sample_rows", None) is None:
        sys.exit("megarl._cpu.sample_rows is not built here")
    engine = []  # the stage's engine, once built
    variants = {
        "attention": {"megarl kernel": lambda: setattr(da, "cpu_kernel", cpu_kernel),
                      "SDPA": lambda: setattr(da, "cpu_kernel", lambda: None)},
        "head": {"megarl kernel": lambda: setattr(cpu_kernels, "wide_linear", wide_linear),
                 "MKL / oneDNN": lambda: setattr(cpu_kernels, "wide_linear", lambda: None)},
        "prefix": {"shared prompt reads": lambda: setattr(engine[0], "shared_prompt_reads", True),
                   "own copies": lambda: setattr(engine[0], "shared_prompt_reads", False)},
        "sampler": {"megarl kernel": lambda: setattr(sampling, "cpu_sampler", cpu_sampler),
                    "torch ops": lambda: setattr(sampling, "cpu_sampler", lambda filtered: None)},
        "step": {"decode_step.py": lambda: setattr(engine[0], "decode_fast_path", True),
                 "megatron-core modules": lambda: setattr(engine[0], "decode_fast_path", False)},
        "layers": {"megarl kernel": lambda: setattr(engine[0], "layer_kernel", True),
                   "oneDNN / MKL": lambda: setattr(engine[0], "layer_kernel", False)},
        "native": {"decode_layer": lambda: setattr(engine[0], "native_layers", True),
                   "torch operations": lambda: setattr(engine[0], "native_layers", False)},
    }[args.ab]
    with tempfile.TemporaryDirectory(prefix="bench_decode_attention_") as work:
        model_dir, prompts_file = rl.build_assets(w, work)
        stage = rl.build_megarl(w, model_dir, prompts_file, work)
        engine.append(stage.engine)
        if args.ab in ("layers", "native"):
            stage.engine.layer_kernel = True
            stage.engine.native_layers = args.ab == "native"  # --ab layers: the linears' routing alone
        calls = []  # the first step's generate arguments, replayed
        generate = stage.engine.generate
        stage.engine.generate = lambda *a, **k: calls.append((a, k)) or generate(*a, **k)
        stage.step(0)  # also the warm-up
        stage.engine.generate = generate
        a, k = calls[0]
        times = {name: [] for name in variants}
        lens, rollouts = {}, {}
        for _ in range(args.reps):
            for name, switch in variants.items():
                switch()
                c0 = time.process_time()
                r = generate(*a, **k)
                times[name].append(time.process_time() - c0)
                lens[name], rollouts[name] = r.response_lens.float().mean().item(), r
        da.cpu_kernel, cpu_kernels.wide_linear, sampling.cpu_sampler = cpu_kernel, wide_linear, cpu_sampler
        stage.engine.shared_prompt_reads = stage.engine.decode_fast_path = True
        stage.engine.layer_kernel = cpu_gemm.layer_kernel_pays()  # the engine's defaults
        stage.engine.native_layers = True
    (mine, theirs) = variants
    same, lp_err = same_samples(rollouts[mine], rollouts[theirs])
    print(f"\n## Generate phase of bench_rl_step.py --workload {args.rollout}, fp32, {args.threads} thread(s), "
          f"{w.prompts} x 8 rows, {args.reps} interleaved reps (mean response {lens[mine]:.0f} tokens with {mine}, "
          f"{lens[theirs]:.0f} with {theirs}; sampled tokens identical in {same} of {len(rollouts[mine].tokens)} "
          f"rows, log-probs before any first difference within {lp_err:.1e})\n")
    what = {"attention": "decode attention", "head": "LM head at 2-32 rows", "prefix": "decode attention's reads",
            "sampler": "the draw", "step": "decode steps", "layers": "layers' linears at 1-64 rows",
            "native": "decode steps' layers"}[args.ab]
    print(f"| {what} | best CPU-s | median CPU-s |")
    print("|---|---|---|")
    for name, ts in times.items():
        print(f"| {name} | {min(ts):.2f} | {statistics.median(ts):.2f} |")
    print(f"\n{mine} / {theirs}: {min(times[mine]) / min(times[theirs]):.3f}x best, "
          f"{statistics.median(times[mine]) / statistics.median(times[theirs]):.3f}x median")


if __name__ == "__main__":
    main()
