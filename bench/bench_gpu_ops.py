"""GPU benchmark of the fused CUDA kernels against the HBM floor (and the naive formula).

    python bench/bench_gpu_ops.py [--hbm-tbps 3.35] [--tokens 8192] [--vocab 152064] [--iters 20]
                                  [--json out.json] [--rl-step [--quick] [--workload realistic]]
    python bench/bench_gpu_ops.py --head [--tokens 16384] [--vocab 152064] [--hidden 4096]
    python bench/bench_gpu_ops.py --decode [--shape 1b|8b] [--rows 8,64,256] [--new-tokens 256]
    torchrun --nproc-per-node 2 bench/bench_gpu_ops.py --decode --shape 8b     # TP 2

Log-probs/entropy, bf16 logits [tokens, vocab]: the forward must read the logits once, the
backward read them once more and write the gradient once, so the floors are
    fwd  = N V 2 B / HBM bandwidth            (0.74 ms for 8192 x 152064 on an H100 SXM)
    fwd+bwd = 3 N V 2 B / HBM bandwidth      (2.2 ms)
GAE fp32 [512, 4096] with a bool mask reads r, v, mask and writes adv, ret:
    (4 + 4 + 1 + 4 + 4) B T bytes / bandwidth  (12.5 us on an H100 SXM)
Times are CUDA-event medians over --iters calls after warm-up; GAE is also timed from a CUDA
graph of 20 calls to remove the per-call CPU overhead (which exceeds a 12.5 us kernel). Peak
memory is torch.cuda.max_memory_allocated above the inputs. --hbm-tbps is the peak bandwidth
of the GPU (H100 SXM 3.35, H100 PCIe 2.0, H200 4.8; default: looked up from the device name in
PEAKS). Prints a markdown table; --json also writes the rows (what `megarl doctor --gpu` reads).

--rl-step: one GRPO step (actor + KL reference, bf16, one GPU) at a 1B-class Llama shape
(hidden 2048, 16 layers, ffn 5632, 16/8 heads, vocab 32000; 8 prompts x 8 samples, 128 prompt and
256 new tokens, --quick: 64), after one warm-up step: rollout tokens/s (generated tokens / the
generate phase's seconds) and the step's MFU = model FLOPs / step seconds / the device's dense
BF16 peak, with model FLOPs = 2 P per generated token (decode) + 2 P per token for each of the
two scoring forwards (old log-probs, reference) + 6 P per token trained on, P = the GEMM parameters
(layers + output layer; attention's s^2 FLOPs and the embedding lookup are not counted).
--workload realistic: the same model with bench_rl_step's realistic lengths and vocabulary (vocab
151936, prompts of 40..200 tokens, EOS-ended long-tailed responses, mean target 128, up to 512
new tokens, --quick 256); one warm-up step, then --steps timed steps, phase seconds; --profile:
torch.profiler tables of one more step's scoring and training (the profiler starts when its
generation returns).

--decode: the rollout engine alone (MegatronRolloutEngine.generate, random bf16 weights, prompts of
128 tokens, --new-tokens each with no stop id), at each --rows, with decode steps three ways:
"eager" (the per-step path: a host read per token), "static" (the graph-safe step, no CUDA graph)
and "graphs" (the same step captured per bucket and replayed). Each way's engine generates once
untimed (as the RL step before would: its graphs are captured then and kept), then the timed
call. Reported per way: generated tokens per second (generate call, prefill included), the mean decode step in ms, and that against the
step's HBM floor: one read of the weights (all GEMM parameters and the LM head, bf16) plus the KV
cache the step attends to (2 x layers x rows x KV heads x head dim x 2 bytes per cached token, at
the mean cached length), over the device's peak bandwidth. --shape 1b is the --rl-step model;
8b is Llama-3.1-8B's shape (hidden 4096, 32 layers, ffn 14336, 32/8 heads, vocab 128256). Under
torchrun the model is split over the processes by tensor parallelism (TP = the world size, one
GPU each, the captured step holding the TP collectives); the floor is then one GPU's: its shard
of the weights and of the KV heads.

--head: the fused output layer + log-prob (megarl.ops.linear_logprobs_and_entropy; "fused-lp"
without entropy) against output layer -> [T, V] logits -> logprobs_and_entropy ("unfused"), bf16
hidden [T, h] and weight [V, h] (default 8 x 2048 tokens, V 152064, h 4096: issue 25's memory
target), scoring (fwd, no grad) and training (fwd+bwd, grads of hidden and weight). Time: CUDA-event
median; GEMM TFLOP/s over the GEMMs the op needs (fwd 2 T V h; fwd+bwd 6 T V h, the fused path
recomputes the logits: 8 T V h executed); extra peak: max_memory_allocated above the inputs, the
gradients subtracted, against one fp32 [T, V] logits tensor.
"""
import argparse
import json
import os
import statistics
import sys
import tempfile
import time

import torch

from megarl.ops import gae, kernel_backend, logprobs_and_entropy

# device-name fragment -> (HBM peak TB/s, dense BF16 peak TFLOP/s), from the vendors' data sheets;
# the first fragment the name contains wins (so "H100 PCIe" precedes "H100")
PEAKS = [("H100 PCIe", 2.0, 756), ("H100 NVL", 3.9, 835), ("H100", 3.35, 989), ("GH200", 4.0, 989),
         ("H200", 4.8, 989), ("B200", 8.0, 2250), ("A100-SXM4-80GB", 2.039, 312), ("A100 80GB PCIe", 1.935, 312),
         ("A100", 1.555, 312), ("L40S", 0.864, 362)]


def device_peaks(name: str):
    """(HBM TB/s, BF16 TFLOP/s) of a device name, or None when it is not in PEAKS."""
    return next(((bw, fl) for frag, bw, fl in PEAKS if frag in name), None)


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
    ap.add_argument("--hbm-tbps", type=float, default=None, help="HBM peak (default: PEAKS by device name)")
    ap.add_argument("--tokens", type=int, default=None, help="logit rows (default 8192; --head 16384)")
    ap.add_argument("--vocab", type=int, default=152064)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--skip-naive", action="store_true", help="naive needs ~3x 5 GB of fp32 copies")
    ap.add_argument("--json", default=None, metavar="PATH", help="also write the rows as JSON")
    ap.add_argument("--rl-step", action="store_true", help="rollout tokens/s and RL-step MFU at a 1B shape instead")
    ap.add_argument("--quick", action="store_true", help="--rl-step: 64 new tokens instead of 256")
    ap.add_argument("--workload", choices=("default", "realistic"), default="default",
                    help="--rl-step: realistic = 152k vocabulary, ragged EOS-ended responses")
    ap.add_argument("--steps", type=int, default=1, help="--rl-step --workload realistic: timed steps each")
    ap.add_argument("--profile", action="store_true", help="--rl-step --workload realistic: profile one more step")
    ap.add_argument("--head", action="store_true", help="fused output layer + log-prob vs logits + op instead")
    ap.add_argument("--hidden", type=int, default=4096, help="--head: hidden size")
    ap.add_argument("--decode", action="store_true", help="rollout tokens/s and the decode step against its HBM floor")
    ap.add_argument("--shape", choices=("1b", "8b"), default="1b", help="--decode: model shape")
    ap.add_argument("--rows", default="8,64,256", help="--decode: comma-separated row counts")
    ap.add_argument("--new-tokens", type=int, default=256, help="--decode: tokens generated per row")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("no CUDA device: this benchmark needs a GPU")
    name = torch.cuda.get_device_name()
    peaks = device_peaks(name)
    if args.decode:
        if peaks is None and args.hbm_tbps is None:
            raise SystemExit(f"{name} is not in PEAKS (bench/bench_gpu_ops.py): pass --hbm-tbps")
        rows = bench_decode(args, (args.hbm_tbps or peaks[0]) * 1e12)
        lead = not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0
        return write_json(args.json if lead else None, name, rows)
    if args.rl_step or args.head:
        if peaks is None:
            raise SystemExit(f"{name} is not in PEAKS (bench/bench_gpu_ops.py): its BF16 peak is unknown")
        if args.head:
            return write_json(args.json, name, bench_head(args))
        if args.workload == "realistic":
            return write_json(args.json, name, bench_rl_step_realistic(args))
        return write_json(args.json, name, [bench_rl_step(args, peaks[1] * 1e12)])
    if args.hbm_tbps is None:
        if peaks is None:
            raise SystemExit(f"{name} is not in PEAKS (bench/bench_gpu_ops.py): pass --hbm-tbps")
        args.hbm_tbps = peaks[0]
    bw = args.hbm_tbps * 1e12
    args.tokens = args.tokens or 8192
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, megarl backend "
          f"{kernel_backend()!r}, {time.strftime('%Y-%m-%d')}, HBM peak {args.hbm_tbps} TB/s, "
          f"command: python bench/bench_gpu_ops.py --hbm-tbps {args.hbm_tbps} --tokens {args.tokens} "
          f"--vocab {args.vocab} --iters {args.iters}")
    if kernel_backend() != "cuda":
        print("WARNING: megarl._C is not loaded; the numbers below are the torch path")
    print()
    print("| op | shape | impl | time | HBM floor | % of peak BW | extra peak MiB |")
    print("|---|---|---|---|---|---|---|")

    rows = bench_logprobs(args, bw) + bench_gae(args, bw)
    write_json(args.json, name, rows, hbm_tbps=args.hbm_tbps)


def write_json(path, device, rows, **extra):
    if path:
        with open(path, "w") as f:
            json.dump({"device": device, "torch": torch.__version__, "backend": kernel_backend(), **extra,
                       "rows": rows}, f, indent=1)


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
    rows = []
    for name, fn in impls:
        ms = cuda_time(lambda: fn(x, t), args.iters)
        mem = peak_extra_mib(lambda: fn(x, t))
        floor = nbytes / bw * 1e3
        rows.append(_row("logprobs_fwd", f"bf16 {N}x{V}", name, ms, floor, nbytes))
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
        rows.append(_row("logprobs_fwd_bwd", f"bf16 {N}x{V}", name, ms, floor, 3 * nbytes))
        print(f"| logprobs+entropy fwd+bwd | bf16 {N}x{V} | {name} | {ms:.3f} ms | {floor:.3f} ms "
              f"| {100 * floor / ms:.0f}% | {mem:.0f} (beyond grad) |", flush=True)
    return rows


def _row(op, shape, impl, ms, floor_ms, nbytes):
    """One JSON row: achieved GB/s over the bytes the op must move, and % of the HBM peak."""
    return {"op": op, "shape": shape, "impl": impl, "ms": ms, "floor_ms": floor_ms,
            "gbps": nbytes / (ms * 1e-3) / 1e9, "pct_of_peak": 100 * floor_ms / ms}


def bench_gae(args, bw):
    B, T = 512, 4096
    r = torch.randn(B, T, device="cuda")
    v = torch.randn(B, T, device="cuda")
    m = torch.arange(T, device="cuda")[None] < torch.randint(1, T + 1, (B, 1), device="cuda")
    nbytes = (4 + 4 + 1 + 4 + 4) * B * T
    floor_us = nbytes / bw * 1e6
    us_call = cuda_time(lambda: gae(r, v, m, 0.99, 0.95), args.iters) * 1e3
    us_graph = graph_time_us(lambda: gae(r, v, m, 0.99, 0.95))
    rows = []
    for label, op, us in (("per call", "gae_call", us_call), ("CUDA graph", "gae_graph", us_graph)):
        rows.append(_row(op, f"fp32 {B}x{T}", "megarl", us * 1e-3, floor_us * 1e-3, nbytes))
        print(f"| gae ({label}) | fp32 {B}x{T} | megarl | {us:.1f} us | {floor_us:.1f} us "
              f"| {100 * floor_us / us:.0f}% | |", flush=True)
    return rows


def bench_rl_step(args, bf16_peak_flops):
    """Rollout tokens/s and MFU of one GRPO step at the 1B shape (see the module docstring)."""
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import bench_rl_step as rl

    new_tokens = 64 if args.quick else 256
    shape = argparse.Namespace(hidden=2048, ffn=5632, layers=16, heads=16, kv_heads=8, vocab=32000, prompts=8,
                               samples=8, prompt_len=128, new_tokens=new_tokens, micro_batch=8, beta=0.04,
                               old_logprobs="recompute", max_pos=128 + new_tokens, workload="default",
                               prompt_min=128, precision="bf16")  # the GPU's precision
    with tempfile.TemporaryDirectory() as work:
        model_dir, prompts_file = rl.build_assets(shape, work)
        stage = rl.build_megarl(shape, model_dir, prompts_file, work)
        stage.step(1)  # warm-up: allocations, kernel selection
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        m = stage.step(2)
        torch.cuda.synchronize()
        seconds = time.perf_counter() - t0
    h, L, V = shape.hidden, shape.layers, shape.vocab
    hd = h // shape.heads
    params = L * (h * (shape.heads + 2 * shape.kv_heads) * hd + shape.heads * hd * h + 3 * h * shape.ffn) + h * V
    rows = shape.prompts * shape.samples
    generated = rows * m["rollout/response_len_mean"]
    tokens = rows * shape.prompt_len + generated
    flops = 2 * params * generated + 2 * 2 * params * tokens + 6 * params * tokens
    mfu = flops / seconds / bf16_peak_flops
    print(f"| RL step (GRPO, 1B, bf16) | {rows} x ({shape.prompt_len} + {new_tokens}) | "
          f"{seconds:.2f} s | rollout {m['perf/generate_tokens_per_s']:.0f} tokens/s | MFU {100 * mfu:.1f}% |")
    return {"op": "rl_step", "shape": f"1B, {rows} x ({shape.prompt_len} + {new_tokens})", "seconds": seconds,
            "rollout_tokens_per_s": m["perf/generate_tokens_per_s"], "mfu": mfu, "model_flops": flops}


DECODE_SHAPES = {"1b": dict(num_layers=16, hidden_size=2048, ffn_hidden_size=5632, num_attention_heads=16,
                            num_kv_heads=8, vocab_size=32000),
                 "8b": dict(num_layers=32, hidden_size=4096, ffn_hidden_size=14336, num_attention_heads=32,
                            num_kv_heads=8, vocab_size=128256)}


def bench_decode(args, bw):
    """Rollout tokens/s and the decode step against its HBM floor, eager / static / graphs."""
    from megarl.config import ModelConfig, ParallelConfig
    from megarl.roles.role import Role
    from megarl.rollout.engine import MegatronRolloutEngine, SamplingParams
    from megarl.runtime.distributed import init_distributed

    prompt, T = 128, args.new_tokens
    shape = DECODE_SHAPES[args.shape]
    tp = int(os.environ.get("WORLD_SIZE", "1"))  # torchrun: tensor parallel over its processes
    init_distributed(tp, 1, seed=1)
    lead = not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0
    say = print if lead else (lambda *a, **k: None)
    mc = ModelConfig(**shape, max_position_embeddings=prompt + T, init_std=0.02)
    role = Role("actor", mc, ParallelConfig(tp=tp), head="lm", precision="bf16", seed=1)
    # what a decode step reads whole on this GPU: its shard of every linear and of the LM head (the
    # tied embedding, when tied); of the input embedding only the rows looked up
    weights = sum(p.numel() for n, p in role.model.named_parameters() if "embedding" not in n)
    weights += mc.vocab_size * mc.hidden_size // tp if mc.tie_embeddings else 0
    hd = mc.hidden_size // mc.num_attention_heads
    launch = f"torchrun --nproc-per-node {tp} " if tp > 1 else "python "
    say(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, {time.strftime('%Y-%m-%d')}, "
        f"{args.shape} shape, TP {tp} ({weights / 1e9:.2f}B GEMM parameters per GPU), bf16, prompts {prompt} + {T} "
        f"new tokens, HBM peak {bw / 1e12:.2f} TB/s; command: {launch}bench/bench_gpu_ops.py --decode "
        f"--shape {args.shape} --rows {args.rows} --new-tokens {T}\n")
    say("| rows | decode | tokens/s | decode step | HBM floor | x floor | CUDA graphs (captured in the call) "
        "| host syncs |")
    say("|---|---|---|---|---|---|---|---|")
    out = []
    g = torch.Generator().manual_seed(0)
    for rows in (int(r) for r in args.rows.split(",")):
        prompts = torch.randint(1, mc.vocab_size, (rows, prompt), generator=g).tolist()
        kv_bytes = 2 * mc.num_layers * rows * (mc.num_kv_heads // tp) * hd * 2 * (prompt + T / 2)
        floor_ms = (2 * weights + kv_bytes) / bw * 1e3
        for way, kw in (("eager", dict(static_decode=False)), ("static", dict(static_decode=True, cuda_graphs=False)),
                        ("graphs", dict(static_decode=True, cuda_graphs=True))):
            eng = MegatronRolloutEngine(role, vocab_size=mc.vocab_size, pad_id=0, max_batch_size=rows, **kw)
            params = SamplingParams(temperature=1.0, max_new_tokens=T)
            eng.generate(prompts, params, seed=0)  # an RL step before: allocations, kernel choice, captures
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            r = eng.generate(prompts, params, seed=1)
            torch.cuda.synchronize()
            seconds = time.perf_counter() - t0
            tokens = int(r.response_lens.sum())
            step_ms = r.stats["decode_s"] / max(T - 1, 1) * 1e3
            row = {"op": "decode", "shape": args.shape, "tp": tp, "rows": rows, "way": way,
                   "tokens_per_s": tokens / seconds,
                   "decode_step_ms": step_ms, "hbm_floor_ms": floor_ms, "x_floor": step_ms / floor_ms,
                   "cuda_graphs": r.stats.get("cuda_graphs", 0), "captured": r.stats.get("cuda_graphs_captured", 0),
                   "host_syncs": r.stats.get("host_syncs", T - 1)}
            out.append(row)
            say(f"| {rows} | {way} | {row['tokens_per_s']:,.0f} | {step_ms:.2f} ms | {floor_ms:.2f} ms | "
                f"{row['x_floor']:.1f}x | {row['cuda_graphs']} ({row['captured']}) | {row['host_syncs']} |")
    return out


def bench_head(args):
    """Fused output layer + log-prob vs logits + op (see the module docstring's --head)."""
    import torch.nn.functional as F

    from megarl.ops import linear_logprobs_and_entropy

    T, V, h = args.tokens or 16384, args.vocab, args.hidden
    torch.manual_seed(0)
    hidden = torch.randn(T, h, device="cuda", dtype=torch.bfloat16)
    weight = (torch.randn(V, h, device="cuda") * h ** -0.5).to(torch.bfloat16)
    t = torch.randint(0, V, (T,), device="cuda")
    logits_mib = T * V * 4 / 2**20
    grads_mib = (hidden.numel() + weight.numel()) * 2 / 2**20
    impls = {"fused": lambda x, w: linear_logprobs_and_entropy(x, w, t),
             "fused-lp": lambda x, w: linear_logprobs_and_entropy(x, w, t, with_entropy=False),
             "unfused": lambda x, w: logprobs_and_entropy(F.linear(x, w), t)}
    with torch.no_grad():
        ref = impls["unfused"](hidden, weight)
        got = impls["fused"](hidden, weight)
    diff = max((a - b).abs().max().item() for a, b in zip(got, ref))
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, backend {kernel_backend()!r}, "
          f"{time.strftime('%Y-%m-%d')}, command: python bench/bench_gpu_ops.py --head --tokens {T} --vocab {V} "
          f"--hidden {h} --iters {args.iters}")
    print(f"<!-- fused vs unfused (bf16): max abs diff of log-prob / entropy {diff:.2e} -->\n")
    print("| mode | impl | time | GEMM TFLOP/s | extra peak MiB | % of fp32 logits |")
    print("|---|---|---|---|---|---|")
    rows = []
    for mode in ("fwd", "fwd+bwd"):
        bwd = mode == "fwd+bwd"
        x, w = hidden.detach().requires_grad_(bwd), weight.detach().requires_grad_(bwd)

        for impl, fn in impls.items():
            def once(fn=fn):
                x.grad = w.grad = None
                if bwd:
                    lp, ent = fn(x, w)
                    (lp.sum() + (0.0 if ent is None else ent.sum())).backward()
                else:
                    with torch.no_grad():
                        fn(x, w)

            ms = cuda_time(once, args.iters)
            extra = peak_extra_mib(once, reset=lambda: (setattr(x, "grad", None), setattr(w, "grad", None)))
            extra -= grads_mib if bwd else 0.0
            flops = (6 if bwd else 2) * T * V * h
            rows.append({"op": f"head_{mode}", "shape": f"bf16 {T}x{V}x{h}", "impl": impl, "ms": ms,
                         "tflops": flops / ms / 1e9, "extra_mib": extra, "pct_of_logits": 100 * extra / logits_mib})
            print(f"| {mode} | {impl} | {ms:.2f} ms | {flops / ms / 1e9:.0f} | {extra:.0f} | "
                  f"{100 * extra / logits_mib:.1f}% |", flush=True)
        x.grad = w.grad = None
    return rows


def bench_rl_step_realistic(args):
    """Phase seconds of GRPO steps at the 1B shape on the realistic workload (one warm-up step,
    then --steps timed steps)."""
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import bench_rl_step as rl

    new_tokens = 256 if args.quick else 512
    shape = argparse.Namespace(hidden=2048, ffn=5632, layers=16, heads=16, kv_heads=8, vocab=rl.REALISTIC["vocab"],
                               prompts=8, samples=8, prompt_len=rl.REALISTIC["prompt_len"], prompt_min=40,
                               new_tokens=new_tokens, mean_len=128, micro_batch=8, beta=0.04,
                               old_logprobs="recompute", max_pos=rl.REALISTIC["prompt_len"] + new_tokens,
                               workload="realistic", precision="bf16")
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, {time.strftime('%Y-%m-%d')}, command: "
          f"python bench/bench_gpu_ops.py --rl-step --workload realistic --steps {args.steps}"
          f"{' --quick' if args.quick else ''}{' --profile' if args.profile else ''}\n")
    print("| step | step s | " + " | ".join(rl.PHASES) + " | response len mean / max | peak GiB |")
    print("|---|---|" + "---|" * len(rl.PHASES) + "---|---|")
    rows = []
    with tempfile.TemporaryDirectory() as work:
        model_dir, prompts_file = rl.build_assets(shape, work)
        stage = rl.build_megarl(shape, model_dir, prompts_file, work)
        plan = range(1 + args.steps)  # the first is a warm-up
        for step in range(1, len(plan) + 1):
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            r = rl.megarl_step(stage, step)
            torch.cuda.synchronize()
            peak = torch.cuda.max_memory_allocated() / 2**30
            lens = r["response_lens"]
            label = f"{step}{' (warm-up)' if step == 1 else ''}"
            print(f"| {label} | {r['wall']:.2f} | " + " | ".join(f"{r['phases'][p]:.2f}" for p in rl.PHASES)
                  + f" | {sum(lens) / len(lens):.0f} / {max(lens)} | {peak:.1f} |", flush=True)
            if step > 1:
                rows.append({"op": "rl_step_realistic", "seconds": r["wall"],
                             "phases": r["phases"], "response_lens": lens, "peak_gib": peak})
        if args.profile:  # where one step's scoring and training time goes
            from torch.profiler import ProfilerActivity, profile

            # the profiler starts when generation returns: thousands of decode steps' events
            # would take minutes to summarise, and the question is scoring and training
            prof = profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], record_shapes=True)
            generate = stage.engine.generate

            def generate_then_profile(*a, **k):
                out = generate(*a, **k)
                torch.cuda.synchronize()
                prof.start()
                return out

            stage.engine.generate = generate_then_profile
            try:
                rl.megarl_step(stage, len(plan) + 1)
                torch.cuda.synchronize()
            finally:
                prof.stop()
                stage.engine.generate = generate
            for key in ("self_cpu_time_total", "self_device_time_total"):
                print(prof.key_averages().table(sort_by=key, row_limit=14, max_name_column_width=60))
            print(prof.key_averages(group_by_input_shape=True).table(sort_by="cpu_time_total", row_limit=10,
                                                                     max_name_column_width=40))
    return rows


if __name__ == "__main__":
    main()
