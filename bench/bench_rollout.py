"""CPU benchmark: megarl's rollout engine vs Hugging Face transformers' `generate`, greedy, KV cache.

    python bench/bench_rollout.py [--quick] [--reps 3] [--threads 1] [--batch 64] [--prompt-len 64]
                                  [--new-tokens 128] [--hidden 256] [--layers 4] [--vocab 32000]
                                  [--profile]

One random Llama is built with transformers (weights spread as in tests/test_hf_interop.py, so
next-token distributions are peaked and greedy is not decided by rounding), saved, and imported
into megarl through megarl.checkpoint.hf. Both generate `batch` x `new-tokens` greedy tokens
from the same random prompts, interleaved (HF, megarl, megarl without log-probs, HF, ...) after a
warm-up each (HF's greedy computes no log-probs; megarl's default does, for RL);
the table shows best and median tokens/s, by wall time and by CPU time (user+sys of the
process: less sensitive to other processes on a shared machine). Greedy outputs are compared token for token. The KV
cache megarl allocated is printed next to 2 x layers x kv_heads x head_dim x tokens x bytes.
--profile prints torch.profiler's top ops for one megarl decode batch.
"""
import argparse
import os
import statistics
import sys
import tempfile
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def build_hf(args, path):
    import transformers

    config = transformers.LlamaConfig(
        hidden_size=args.hidden, intermediate_size=args.ffn, num_hidden_layers=args.layers,
        num_attention_heads=args.heads, num_key_value_heads=args.kv_heads, vocab_size=args.vocab,
        max_position_embeddings=args.prompt_len + args.new_tokens, rms_norm_eps=1e-5, rope_theta=10000.0,
        tie_word_embeddings=False)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").eval()
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=g)
            p.copy_(1 + 0.2 * noise if name.endswith("norm.weight") else 0.1 * noise)
    model.save_pretrained(path, safe_serialization=True)
    model.generation_config.pad_token_id = 0
    model.generation_config.eos_token_id = None  # run every row to new_tokens, as megarl does without stop ids
    return model


def build_megarl(path):
    from megarl.checkpoint.hf import load_hf_checkpoint
    from megarl.config import ParallelConfig
    from megarl.models.layout import load_full_state_dict
    from megarl.roles.role import Role
    from megarl.runtime.distributed import init_distributed

    init_distributed(1, 1, seed=1)
    mc, canonical = load_hf_checkpoint(path)
    role = Role("actor", mc, ParallelConfig(), head="lm", seed=1)
    load_full_state_dict(role.model, canonical, mc.vocab_size)
    return role, mc


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="batch 16, 32 new tokens, 1 rep: a smoke run")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--ffn", type=int, default=704)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--kv-heads", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--profile", action="store_true")
    args = ap.parse_args()
    if args.quick:
        args.batch, args.new_tokens, args.reps = 16, 32, 1
    torch.set_num_threads(args.threads)

    from megarl.rollout.engine import MegatronRolloutEngine, SamplingParams

    with tempfile.TemporaryDirectory() as tmp:
        hf = build_hf(args, tmp)
        role, mc = build_megarl(tmp)
    engine = MegatronRolloutEngine(role, vocab_size=mc.vocab_size, pad_id=0, max_batch_size=args.batch)
    prompts = torch.randint(1, args.vocab, (args.batch, args.prompt_len), generator=torch.Generator().manual_seed(1))
    params = SamplingParams(greedy=True, max_new_tokens=args.new_tokens)

    def run_hf():
        with torch.no_grad():
            out = hf.generate(prompts, attention_mask=torch.ones_like(prompts), max_new_tokens=args.new_tokens,
                              min_new_tokens=args.new_tokens, do_sample=False)
        return out[:, args.prompt_len:]

    def run_megarl(p=params):
        r = engine.generate(prompts.tolist(), p, seed=0)
        return r.tokens[:, args.prompt_len:], r.stats

    no_lp = SamplingParams(greedy=True, max_new_tokens=args.new_tokens, logprobs=False)
    runs = (("transformers", run_hf), ("megarl", run_megarl), ("megarl, no log-probs", lambda: run_megarl(no_lp)))

    hf_out, (mg_out, stats) = run_hf(), run_megarl()  # warm-up, and the outputs compared below
    times = {name: [] for name, _ in runs}  # wall seconds
    cpu = {name: [] for name, _ in runs}  # user+sys seconds of this process (all threads)
    for _ in range(args.reps):
        for name, fn in runs:
            t0, c0 = time.perf_counter(), time.process_time()
            fn()
            times[name].append(time.perf_counter() - t0)
            cpu[name].append(time.process_time() - c0)

    tokens = args.batch * args.new_tokens
    print(f"\n## Rollout: greedy generation, batch {args.batch} x prompt {args.prompt_len} + {args.new_tokens} new "
          f"tokens, Llama hidden {args.hidden}, {args.layers} layers, {args.heads} heads ({args.kv_heads} KV), "
          f"vocab {args.vocab}, fp32, {args.threads} thread(s), {args.reps} interleaved reps\n")
    print("| engine | best tokens/s (wall) | median tokens/s (wall) | best tokens/CPU-s | median tokens/CPU-s |")
    print("|---|---|---|---|---|")
    for name, ts in times.items():
        print(f"| {name} | {tokens / min(ts):.0f} | {tokens / statistics.median(ts):.0f} "
              f"| {tokens / min(cpu[name]):.0f} | {tokens / statistics.median(cpu[name]):.0f} |")
    print()
    for name in ("megarl", "megarl, no log-probs"):
        for what, d in (("wall", times), ("CPU", cpu)):
            best = min(d["transformers"]) / min(d[name])
            med = statistics.median(d["transformers"]) / statistics.median(d[name])
            print(f"{name} / transformers tokens/s ({what} time): {best:.2f}x best, {med:.2f}x median (target >= 1.5x)")

    same_rows = int((hf_out == mg_out).all(-1).sum())
    diverged = (hf_out != mg_out)
    first = [int(d.nonzero()[0]) for d in diverged if d.any()]
    print(f"greedy outputs equal: {same_rows}/{args.batch} rows identical"
          + (f"; others first differ at steps {sorted(first)}" if first else ""))

    head_dim = args.hidden // args.heads
    cache_tokens = args.batch * (args.prompt_len + args.new_tokens)
    formula = 2 * args.layers * args.kv_heads * head_dim * cache_tokens * 4
    print(f"KV cache: {stats['kv_cache_bytes']} bytes allocated; 2 x {args.layers} layers x {args.kv_heads} kv_heads "
          f"x {head_dim} head_dim x {cache_tokens} tokens x 4 bytes = {formula} "
          f"({stats['kv_cache_bytes'] / formula:.3f}x)")
    print(f"megarl phases (last run): prefill {stats['prefill_s'] * 1e3:.0f} ms, decode "
          f"{stats['decode_s'] * 1e3:.0f} ms over {stats['forwards'] - 1} steps "
          f"({stats['decode_s'] / max(stats['forwards'] - 1, 1) * 1e3:.1f} ms/step)")

    if args.profile:
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CPU]) as prof:
            run_megarl()
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25))
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            run_hf()
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25))


if __name__ == "__main__":
    main()
