"""SFT vs SFT -> DPO on the synthetic task: held-out preference accuracy and pass@1, over seeds.

    python bench/bench_dpo.py [--out runs/bench_dpo] [--seeds 1234 2 3] [--config configs/tiny_dpo_pipeline.yaml]
                              [--eval-config configs/tiny_grpo.yaml] [--prompts 200] [--samples 4] [KEY=VALUE ...]

For each seed (train.seed; the synthetic task keeps data.seed 1234, so every seed learns the same
pairs): `megarl pipeline --stages sft,dpo` in <out>/seed_<S> (a finished stage is skipped, so an
interrupted bench continues), then `megarl eval` of the SFT checkpoint and of the DPO one on the
held-out prompts (pass@1 over --samples samples each, at rl.eval_temperature). Preference accuracy
on the held-out pairs comes from the DPO stage's evaluations: at step 0 (the SFT model, which is
also the reference) and after the last step. Two figures: likelihood accuracy (the model gives the
chosen response the higher summed log-prob; comparable between SFT and DPO) and DPO's reward
accuracy (beta * log-ratio to the reference; 0 for the SFT model, which is its own reference).
Extra KEY=VALUE overrides go to the pipeline (e.g. stages.dpo.dpo.beta=0.3). Prints a markdown
table and writes <out>/summary.json.
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def megarl(args: list[str], log: str, nproc: int = 1) -> None:
    """Run the CLI (on nproc ranks through torch.distributed.run when nproc > 1), its output appended to log."""
    ranks = ["-m", "torch.distributed.run", "--nproc_per_node", str(nproc)] if nproc > 1 else []
    cmd = [sys.executable, *ranks, "-m", "megarl.cli.main", *args]
    with open(log, "a") as f:
        f.write(f"$ {' '.join(cmd)}\n")
        f.flush()
        code = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, cwd=ROOT).returncode
    if code:
        raise SystemExit(f"megarl {' '.join(args)} exited {code}; see {log}")


def evaluations(stage_dir: str) -> list[dict]:
    with open(os.path.join(stage_dir, "metrics.jsonl")) as f:
        return [r for r in map(json.loads, f) if "eval/loss" in r]


def run_seed(args, seed: int) -> dict:
    run_dir = os.path.abspath(os.path.join(args.out, f"seed_{seed}"))
    log = os.path.join(os.path.abspath(args.out), f"seed_{seed}.log")
    common = [f"train.run_dir={run_dir}", f"train.seed={seed}", "data.seed=1234", "tracking.backend=none"]
    start = time.time()
    megarl(["pipeline", "--config", args.config, "--stages", "sft,dpo", *common, *args.overrides], log)
    out = {"seed": seed, "train_s": time.time() - start}
    for which in ("sft", "dpo"):
        megarl(["eval", "--config", args.eval_config, "--checkpoint", which, *common, f"rl.eval_prompts={args.prompts}",
                f"rl.eval_samples={args.samples}"], log)
        with open(os.path.join(run_dir, "eval", "results.json")) as f:
            out[f"{which}_pass_at_1"] = json.load(f)["eval/pass_at_1"]
    evals = evaluations(os.path.join(run_dir, "dpo"))
    first, last = evals[0], evals[-1]
    assert first["step"] == 0, "the DPO stage evaluates before its first step (the SFT model)"
    out.update({"sft_likelihood_accuracy": first["eval/likelihood_accuracy"],
                "dpo_likelihood_accuracy": last["eval/likelihood_accuracy"],
                "dpo_reward_accuracy": last["eval/reward_accuracy"], "dpo_steps": last["step"],
                "held_out_pairs": None})
    with open(os.path.join(run_dir, "dpo", "config.yaml")) as f:
        import yaml

        c = yaml.safe_load(f)
    out["held_out_pairs"] = c["train"]["eval_batches"] * c["data"]["global_batch_size"]
    out["dpo"] = c["dpo"]
    out["wall_s"] = time.time() - start
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="runs/bench_dpo")
    ap.add_argument("--seeds", type=int, nargs="+", default=[1234, 2, 3])
    ap.add_argument("--config", default="configs/tiny_dpo_pipeline.yaml")
    ap.add_argument("--eval-config", default="configs/tiny_grpo.yaml",
                    help="`megarl eval`'s config: its rl section's prompt and response lengths, as the quickstart's RL")
    ap.add_argument("--prompts", type=int, default=200, help="held-out prompts (the synthetic test split has 200)")
    ap.add_argument("--samples", type=int, default=4, help="samples per prompt for pass@1")
    ap.add_argument("overrides", nargs="*", metavar="KEY=VALUE")
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    rows = []
    for seed in args.seeds:
        rows.append(run_seed(args, seed))
        print(json.dumps(rows[-1]), flush=True)
    keys = ("sft_likelihood_accuracy", "dpo_likelihood_accuracy", "dpo_reward_accuracy", "sft_pass_at_1", "dpo_pass_at_1")
    lines = ["| seed | likelihood acc. SFT | likelihood acc. DPO | reward acc. DPO | pass@1 SFT | pass@1 DPO |",
             "|---|---|---|---|---|---|"]
    lines += [f"| {r['seed']} | " + " | ".join(f"{r[k]:.3f}" for k in keys) + " |" for r in rows]
    lines.append("| mean | " + " | ".join(f"{statistics.mean(r[k] for r in rows):.3f}" for k in keys) + " |")
    print("\n".join(lines))
    with open(os.path.join(args.out, "summary.json"), "w") as f:
        json.dump({"rows": rows, "table": lines}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
