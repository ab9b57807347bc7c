"""CPU benchmark: one RL step's rollout with the linears' weights read in [in, out] memory and
their GEMMs run by oneDNN or by MKL, the LM head's at few rows on its stored [out, in] memory
(megarl._cpu's kernel at 1-32 rows; without it, MKL at 2-4 rows with oneDNN) or not, the layers'
linears at decode rows through the same kernel with each layer one `decode_layer` call or not, and
megatron-core's stored [out, in] with MKL. megarl's default on CPU (models/decode_layout.py and
cpu_gemm.py) is the [in, out] memory and the head's kernel; on an AMD CPU (AVX-512 or AVX2 + FMA)
the layers' kernel too; oneDNN on an AMD CPU with AVX-512, MKL elsewhere. The summary compares
this machine's default with the others. With --score, also the step's
reference scoring with the forward-only linears through oneDNN and through MKL.

    python bench/bench_decode_layout.py [--workload realistic|default] [--reps 3] [--threads 1] [--score]

The model, prompts and sampling are bench_rl_step.py's (realistic: 2 prompts of 40..200 tokens x
8 samples, EOS-ended responses up to 1,024 tokens with mean ~200, vocabulary 151,936, hidden 256,
4 layers; default: 8 x 8 rows, 32 + 128 tokens, hidden 512, 8 layers, vocabulary 32,000). The
same prompts and seed are generated with the variants interleaved, after a warm-up of each;
the table gives best and median wall and CPU seconds (user + sys of the process) per rollout,
the decode steps' share, and how many rows drew the same samples as megarl's default (the
variants differ only by fp32 rounding in the GEMMs, so a draw can flip where two ids'
cumulative masses meet, and the rest of that row differs from there on).
"""
import argparse
import os
import statistics
import sys
import tempfile
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--workload", choices=("realistic", "default"), default="realistic")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--quick", action="store_true", help="a small model and short responses: a smoke run")
    ap.add_argument("--score", action="store_true", help="also time the reference scoring of one step's samples")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    import bench_rl_step as rl

    shape = dict(hidden=512, ffn=1408, layers=8, heads=8, kv_heads=8, vocab=32000, prompts=8, samples=8,
                 prompt_len=32, prompt_min=32, new_tokens=128, mean_len=200)
    if args.workload == "realistic":
        shape.update(rl.REALISTIC, prompts=2, prompt_min=40)
    if args.quick:
        shape.update(hidden=128, ffn=352, layers=2, heads=4, kv_heads=4, vocab=4096, prompts=2, samples=4,
                     prompt_len=16, prompt_min=8, new_tokens=32, mean_len=10)
        args.reps = 1
    a = argparse.Namespace(**shape, workload=args.workload, micro_batch=8, beta=0.04, old_logprobs="rollout",
                           packing="on", precision="fp32")
    a.max_pos = max(256, a.prompt_len + a.new_tokens)

    with tempfile.TemporaryDirectory(prefix="bench_decode_layout_") as work:
        model_dir, prompts_file = rl.build_assets(a, work)
        stage = rl.build_megarl(a, model_dir, prompts_file, work)
        engine = stage.engine
        batch = next(stage.prompts)
        params = stage._sampling(stage.cfg.rl.temperature, stage.cfg.rl.samples_per_prompt)

        from megarl.models import cpu_gemm, cpu_kernels

        head_rows, wide_kernel = cpu_gemm.OUT_MAJOR_MAX_ROWS, cpu_kernels.wide_linear

        def rollout(flags):
            engine.in_major_weights, engine.onednn_linears = flags[:2]
            # the layers' linears at decode rows through the kernel too, each layer one decode_layer call
            engine.layer_kernel = flags[3]
            # the LM head at few rows on [out, in]: megarl._cpu's kernel at 1-32 rows, else MKL at 2-4
            cpu_gemm.OUT_MAJOR_MAX_ROWS = head_rows if flags[2] else 0
            cpu_kernels.wide_linear = wide_kernel if flags[2] else (lambda: None)
            t0, c0 = time.perf_counter(), time.process_time()
            r = engine.generate(batch["prompt_ids"], params, seed=1)
            return time.perf_counter() - t0, time.process_time() - c0, r

        # (in_major_weights, onednn_linears, the head's kernel, the layers' kernel)
        variants = {"[in, out], oneDNN; the head and the layers at few rows on [out, in], each layer one "
                    "decode_layer call (megarl's default on an AMD CPU with AVX-512)": (True, True, True, True),
                    "[in, out], MKL; the head and the layers at few rows on [out, in], each layer one "
                    "decode_layer call (megarl's default on an AMD CPU with AVX2 only)": (True, False, True, True),
                    "[in, out], oneDNN; the head at few rows on [out, in]": (True, True, True, False),
                    "[in, out], oneDNN": (True, True, False, False),
                    "[in, out], MKL; the head at few rows on [out, in] (megarl's default on other CPUs)":
                        (True, False, True, False),
                    "[in, out], MKL": (True, False, False, False),
                    "[out, in] (megatron-core's stored layout), MKL": (False, False, False, False)}
        out = {name: rollout(flag)[2] for name, flag in variants.items()}  # warm-up; the samples compared
        wall = {name: [] for name in variants}
        cpu = {name: [] for name in variants}
        decode = {name: [] for name in variants}
        for _ in range(args.reps):
            for name, flag in variants.items():
                w, c, r = rollout(flag)
                wall[name].append(w)
                cpu[name].append(c)
                decode[name].append(r.stats["decode_s"])
        cpu_gemm.OUT_MAJOR_MAX_ROWS, cpu_kernels.wide_linear = head_rows, wide_kernel
        if args.score:
            scoring = score_ab(stage, args.reps)

    lens = [r.response_lens.float() for r in out.values()]
    print(f"\n## Rollout, {args.workload} workload: {a.prompts} prompts x {a.samples} samples, vocabulary {a.vocab}, "
          f"hidden {a.hidden}, {a.layers} layers, fp32, {args.threads} thread(s), {args.reps} interleaved reps\n")
    print("| weight memory, GEMM library | best s (wall) | median s (wall) | best CPU-s | median CPU-s | median decode s |")
    print("|---|---|---|---|---|---|")
    for name in variants:
        print(f"| {name} | {min(wall[name]):.2f} | {statistics.median(wall[name]):.2f} | {min(cpu[name]):.2f} "
              f"| {statistics.median(cpu[name]):.2f} | {statistics.median(decode[name]):.2f} |")
    default = (True, cpu_gemm.onednn_pays(), True, cpu_gemm.layer_kernel_pays())  # what the engine picks here
    mine = next(name for name, flags in variants.items() if flags == default)
    print(f"\nmegarl's default on this CPU: {mine}")
    for name in variants:
        if name == mine:
            continue
        same = sum(x == y for x, y in zip(out[mine].responses(), out[name].responses()))
        print(f"megarl's default / {name}: {min(cpu[mine]) / min(cpu[name]):.2f}x best, "
              f"{statistics.median(cpu[mine]) / statistics.median(cpu[name]):.2f}x median (CPU-s); "
              f"samples identical to the default's: {same}/{len(lens[0])} rows")
    print("mean response length " + " / ".join(f"{x.mean():.1f}" for x in lens)
          + f" tokens; decode steps {max(r.stats['forwards'] for r in out.values()) - 1}")
    if args.score:
        print(f"\n## Reference scoring of one step's samples ({args.reps} interleaved reps after a warm-up each)\n")
        print("| forward-only linears | best CPU-s | median CPU-s | max abs difference of the log-probs |")
        print("|---|---|---|---|")
        for name, (cpu_s, diff) in scoring.items():
            print(f"| {name} | {min(cpu_s):.2f} | {statistics.median(cpu_s):.2f} | {diff:.1e} |")


def score_ab(stage, reps):
    """The reference role's scoring of one step's samples (RLStage.score, its phases as a step
    runs them), with the reference's forward-only linears through oneDNN and through MKL,
    interleaved. Returns {variant: (CPU-s per rep, max |log-prob difference| to oneDNN's)}."""
    from megarl.roles.phases import PhaseClock

    exp, _ = stage.generate(0, PhaseClock(stage.phases))
    reference = stage.all_roles["reference"]
    variants = {"oneDNN (megarl's default on an AMD CPU with AVX-512)": True, "MKL (megarl's default elsewhere)": False}
    default = reference.onednn_linears

    def score(flag):
        reference.onednn_linears = flag
        c0 = time.process_time()
        stage.score(exp, PhaseClock(stage.phases))
        return time.process_time() - c0, exp.ref_logp.clone()

    ref = {name: score(flag)[1] for name, flag in variants.items()}  # warm-up
    cpu = {name: [] for name in variants}
    for _ in range(reps):
        for name, flag in variants.items():
            cpu[name].append(score(flag)[0])
    reference.onednn_linears = default
    first = next(iter(ref.values()))
    return {name: (cpu[name], float((ref[name] - first).abs().max())) for name in variants}


if __name__ == "__main__":
    main()
