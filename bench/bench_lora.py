"""LoRA beside full fine-tuning: GRPO on the synthetic task, memory, and how the rollout runs the adapters.

    python bench/bench_lora.py grpo --run-dir R [--seeds 1234 4321 777] [--steps 60] [--lora-lr 6e-4]
    python bench/bench_lora.py memory [--run-dir R]
    python bench/bench_lora.py generation [--reps 3]

grpo: one SFT model (`configs/tiny_sft.yaml`, the quick start's), then for each seed a full GRPO
run (`configs/tiny_grpo.yaml` as shipped) and a LoRA one (the same plus `model.lora`, rank 16 on
all four targets, its own lr), each in a run dir of its own linking R's `sft/` and `data/`;
held-out sampled pass@1 every `--eval-interval` steps. Prints one JSON line per finished run and
a markdown table at the end.
memory: the estimator's per-GPU figures of an 8B GRPO step with a KL reference
(`configs/llama31_8b_grpo.yaml`, 8 GPUs), full and LoRA; and the measured peak of the tiny
model on CPU (a few GRPO steps from random weights, full and LoRA): the residency ledger's peak
bytes of role states and the process's peak resident set.
generation: the rollout engine on a LoRA actor with the adapters applied in place (two skinny
GEMMs per adapted linear and step) against the same actor merged (W + s B A written into the
base weights before generating, and the base restored after): wall time per generation of
rows x tokens, the merge and restore included.
"""
import argparse
import json
import os
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
LORA = ["model.lora.rank=16", "model.lora.alpha=32"]


def _megarl(args, log) -> int:
    """Run the CLI; returns the process's own peak resident set (KiB)."""
    cmd = [sys.executable, "-m", "megarl.cli.main", *args]
    with open(log, "w") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, cwd=ROOT)
        _, status, usage = os.wait4(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode:
        raise subprocess.CalledProcessError(proc.returncode, cmd)
    return usage.ru_maxrss


def _evals(stage_dir):
    out = {}
    with open(os.path.join(stage_dir, "metrics.jsonl")) as f:
        for line in f:
            r = json.loads(line)
            if "eval/pass_at_1" in r:
                out[int(r.get("step", 0))] = (r["eval/pass_at_1"], r.get("eval/pass_at_4"))
    return out


def grpo(args):
    base = os.path.abspath(args.run_dir)
    if not os.path.isfile(os.path.join(base, "sft", "checkpoints", "latest")):
        _megarl(["sft", "--config", "configs/tiny_sft.yaml", f"train.run_dir={base}", "tracking.backend=none"],
                os.path.join(base + ".sft.log"))
    rows = []
    for seed in args.seeds:
        for name, extra in (("full", []), ("lora", [*LORA, f"optim.lr={args.lora_lr}"])):
            run = os.path.join(base, f"{name}_{seed}")
            os.makedirs(run, exist_ok=True)
            for link in ("sft", "data"):
                if not os.path.exists(os.path.join(run, link)):
                    os.symlink(os.path.join(base, link), os.path.join(run, link))
            t0 = time.time()
            _megarl(["rl", "--config", "configs/tiny_grpo.yaml", f"train.run_dir={run}", f"train.seed={seed}",
                     "data.seed=1234", f"train.steps={args.steps}", f"train.eval_interval={args.eval_interval}",
                     f"rl.eval_prompts={args.eval_prompts}", "tracking.backend=none", "checkpoint.save_interval=0",
                     *extra], os.path.join(run, "rl.log"))
            row = {"run": name, "seed": seed, "wall_s": round(time.time() - t0), "pass": _evals(os.path.join(run, "rl"))}
            print(json.dumps(row), flush=True)
            rows.append(row)
    steps = sorted({s for r in rows for s in r["pass"]})
    print("| run, seed | " + " | ".join(f"pass@1 step {s}" for s in steps) + " | wall |")
    print("|---" * (len(steps) + 2) + "|")
    for r in rows:
        print(f"| {r['run']}, {r['seed']} | " + " | ".join(f"{r['pass'][s][0]:.3f}" if s in r["pass"] else "-"
                                                       for s in steps) + f" | {r['wall_s']} s |")


def memory(args):
    from megarl.config import load_config
    from megarl.models.memory import estimate, format_estimate
    from megarl.trainers.weights import needed_roles

    for name, extra in (("full", []), ("lora rank 16", LORA)):
        cfg = load_config(os.path.join(ROOT, "configs", "llama31_8b_grpo.yaml"), extra)
        e = estimate(cfg, 8, "rl", needed_roles(cfg))
        print(f"8B GRPO, {name}, roles {needed_roles(cfg)}:")
        print("\n".join(format_estimate(e)))
    if not args.run_dir:
        return
    for name, extra in (("full", []), ("lora", LORA)):
        run = os.path.join(os.path.abspath(args.run_dir), f"mem_{name}")
        os.makedirs(run, exist_ok=True)
        rss = _megarl(["rl", "--config", "configs/tiny_grpo.yaml", f"train.run_dir={run}", "roles.actor.init_from=random",
                 "rl.kl_coef=0.01", "train.steps=3", "train.eval_interval=0", "tracking.backend=none",
                 "rl.eval_before_train=false", *extra], run + ".log")
        with open(os.path.join(run, "rl", "metrics.jsonl")) as f:
            last = [json.loads(line) for line in f][-1]
        roles = {k: round(v * 2**10, 2) for k, v in last.items() if k.startswith("memory/") and k.endswith("/device_gib")}
        print(json.dumps({"run": name, "ledger_peak_mib": round(last["memory/peak_device_gib"] * 2**10, 2),
                          "roles_mib": roles, "max_rss_mib": round(rss / 2**10, 1)}))


def generation(args):
    import torch

    from megarl.config import ModelConfig, ParallelConfig, load_config
    from megarl.config.schema import LoRAConfig
    from megarl.data import load_tokenizer
    from megarl.models.layout import unwrap
    from megarl.models.lora import adapted_linears
    from megarl.roles.role import Role
    from megarl.runtime.distributed import init_distributed
    from megarl.trainers.evaluate import rl_sampling, rollout_engine

    torch.set_num_threads(args.threads)
    init_distributed(1, 1, seed=1)
    cfg = load_config(os.path.join(ROOT, "configs", "tiny_grpo.yaml"), [])
    mc = ModelConfig(**{**vars(cfg.model), "lora": LoRAConfig(rank=16, alpha=32)})
    actor = Role("actor", mc, ParallelConfig())
    with torch.no_grad():
        for m in adapted_linears(unwrap(actor.model)):
            m.lora_b.weight.normal_(0, 0.02)
    tok = load_tokenizer("byte", None)
    engine = rollout_engine(cfg, actor, tok)
    prompts = [tok.encode_chat([{"role": "user", "content": f"What is {i} + {2 * i}?"}], True)[0] for i in range(16)]
    params = rl_sampling(cfg.rl, tok.stop_ids, 8, 1.0)

    def merged_generate():
        mods = adapted_linears(unwrap(actor.model))
        saved = [m.weight.detach().clone() for m in mods]
        with torch.no_grad():
            for m in mods:  # local shards at TP 1: W += s B A
                m.weight.add_(m.lora_scale * (m.lora_b.weight @ m.lora_a.weight))
                m.lora_enabled = False
        try:
            return engine.generate(prompts, params, seed=0)
        finally:
            with torch.no_grad():
                for m, w in zip(mods, saved):
                    m.weight.copy_(w)
                    m.lora_enabled = True

    results = {"in_place": [], "merged": []}
    outs = {}
    for _ in range(args.reps):
        for name, fn in (("in_place", lambda: engine.generate(prompts, params, seed=0)), ("merged", merged_generate)):
            t0 = time.perf_counter()
            outs[name] = fn()
            results[name].append(time.perf_counter() - t0)
    tokens = int(outs["in_place"].response_lens.sum())
    same = outs["in_place"].responses() == outs["merged"].responses()
    print(json.dumps({"rows": len(prompts) * 8, "generated_tokens": tokens, "threads": args.threads,
                      "best_s": {k: round(min(v), 3) for k, v in results.items()},
                      "median_s": {k: round(sorted(v)[len(v) // 2], 3) for k, v in results.items()},
                      "same_responses": same}))


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="what", required=True)
    g = sub.add_parser("grpo")
    g.add_argument("--run-dir", required=True)
    g.add_argument("--seeds", type=int, nargs="+", default=[1234, 4321, 777])
    g.add_argument("--steps", type=int, default=60)
    g.add_argument("--eval-interval", type=int, default=20)
    g.add_argument("--eval-prompts", type=int, default=200)
    g.add_argument("--lora-lr", type=float, default=6e-4)
    m = sub.add_parser("memory")
    m.add_argument("--run-dir", default=None)
    r = sub.add_parser("generation")
    r.add_argument("--reps", type=int, default=3)
    r.add_argument("--threads", type=int, default=1)
    args = p.parse_args()
    {"grpo": grpo, "memory": memory, "generation": generation}[args.what](args)


if __name__ == "__main__":
    main()
