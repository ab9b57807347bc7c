"""GRPO with a tiny MoE model on the synthetic task: does it learn, and does training route as the rollout did?

    python bench/bench_moe.py [--run-dir runs/bench_moe] [--seeds 1234 4321 777] [--sft-steps 600]
                              [--steps 60] [--eval-interval 30] [--eval-prompts 200] [--replay rollout none]

The MoE recipe's pipeline (`configs/tiny_moe_grpo.yaml`, expert parallel over --nproc ranks): one
MoE SFT model (`configs/tiny_sft.yaml`'s recipe with that config's `model.moe` and `parallel.ep`;
the RL config's own optimizer is GRPO's, too gentle for SFT), then for each routing-replay mode and
seed a GRPO run from it in a run dir of its own linking R's `sft/` and `data/`. Held-out sampled
pass@1 at step 0 (the SFT start) and every --eval-interval steps. With `rl.routing_replay=none` the
trainer logs `moe/routing_agreement` each step (the share of (token, layer) routings the actor's
scoring forward shares with the rollout); with `rollout` the rollout's experts are forced and
nothing is logged, so the table says so rather than printing a 1, and the agreement with replay on
is measured by the replay test's body on a small model, routers perturbed and not. A finished run (its `done`
marker) is not run again, so an interrupted bench continues. One JSON line per run, then a
markdown table and the seeds' spread; <run-dir>/summary.json.
"""
import argparse
import json
import os
import statistics
import sys
import time

import yaml

from bench_dpo import megarl

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RL_CONFIG = "configs/tiny_moe_grpo.yaml"


def moe_overrides() -> list[str]:
    """The MoE recipe's model.moe and parallel.ep, as overrides for the SFT recipe."""
    with open(os.path.join(ROOT, RL_CONFIG)) as f:
        c = yaml.safe_load(f)
    return [f"model.moe.{k}={v}" for k, v in c["model"]["moe"].items()] + [f"parallel.ep={c['parallel']['ep']}"]


def read_run(stage_dir: str) -> dict:
    evals, agreement = {}, []
    with open(os.path.join(stage_dir, "metrics.jsonl")) as f:
        for r in map(json.loads, f):
            if "eval/pass_at_1" in r:
                evals[int(r.get("step", 0))] = (r["eval/pass_at_1"], r.get("eval/pass_at_4"))
            if "moe/routing_agreement" in r:
                agreement.append(r["moe/routing_agreement"])
    return {"pass": evals, "agreement": agreement}


def run(args, base: str, replay: str, seed: int) -> dict:
    rd = os.path.join(base, f"{replay}_{seed}")
    os.makedirs(rd, exist_ok=True)
    for link in ("sft", "data"):
        if not os.path.lexists(os.path.join(rd, link)):
            os.symlink(os.path.join(base, link), os.path.join(rd, link))
    done = os.path.join(rd, "done")
    if not os.path.exists(done):
        t0 = time.time()
        megarl(["rl", "--config", RL_CONFIG, f"train.run_dir={rd}", f"train.seed={seed}", "data.seed=1234",
                f"train.steps={args.steps}", f"train.eval_interval={args.eval_interval}",
                f"rl.eval_prompts={args.eval_prompts}", f"rl.routing_replay={replay}", "tracking.backend=none",
                "checkpoint.save_interval=0"], os.path.join(rd, "rl.log"), args.nproc)
        with open(done, "w") as f:
            f.write(f"{time.time() - t0:.0f}\n")
    with open(done) as f:
        wall = float(f.read())
    return {"replay": replay, "seed": seed, "wall_s": wall, **read_run(os.path.join(rd, "rl"))}


def replay_check() -> str:
    """Agreement with replay on, measured: `tests/test_moe_rl.py`'s replay body (a 2-layer, 8-expert
    model's rollout, then the training forward with and without the rollout's experts forced, at
    the rollout's weights and after noise on the routers as an update would move them)."""
    sys.path.insert(0, os.path.join(ROOT, "tests"))
    from dist_helpers import run_distributed
    from test_moe_rl import _replay_body

    r = run_distributed(_replay_body, 1)[0]
    out = []
    for name in ("unperturbed", "perturbed"):
        (nat, n), (rep, _) = r[name][:2]
        out.append(f"{name} routers: agreement replay off {nat / n:.4f}, replay on {rep / n:.4f} of {n} (token, layer)")
    return "replay check (tests/test_moe_rl.py's body): " + "; ".join(out)


def spread(xs, fmt=".3f") -> str:
    return f"mean {statistics.mean(xs):{fmt}} (min {min(xs):{fmt}}, max {max(xs):{fmt}})"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--run-dir", default="runs/bench_moe")
    ap.add_argument("--seeds", type=int, nargs="+", default=[1234, 4321, 777])
    ap.add_argument("--sft-steps", type=int, default=600)
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--eval-interval", type=int, default=30)
    ap.add_argument("--eval-prompts", type=int, default=200)
    ap.add_argument("--replay", nargs="+", default=["rollout", "none"], choices=["rollout", "none"])
    ap.add_argument("--nproc", type=int, default=2, help="ranks (the recipe's expert parallelism)")
    args = ap.parse_args()
    base = os.path.abspath(args.run_dir)
    os.makedirs(base, exist_ok=True)
    if not os.path.isfile(os.path.join(base, "sft", "checkpoints", "latest")):
        megarl(["sft", "--config", "configs/tiny_sft.yaml", f"train.run_dir={base}", "tracking.backend=none",
                f"train.steps={args.sft_steps}", "train.eval_interval=0", *moe_overrides()], base + ".sft.log", args.nproc)
    rows = []
    for replay in args.replay:
        for seed in args.seeds:
            rows.append(run(args, base, replay, seed))
            print(json.dumps(rows[-1]), flush=True)
    last = max(s for r in rows for s in r["pass"])
    lines = [f"| replay, seed | pass@1 step 0 | pass@1 step {last} | gain | pass@4 step {last} | "
             "routing agreement mean (min) | wall |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        p0, pn = r["pass"][0], r["pass"].get(last, (float("nan"), float("nan")))
        a = r["agreement"]
        agree = (f"{statistics.mean(a):.5f} ({min(a):.5f}), {len(a)} steps" if a
                 else "not logged (replayed)" if r["replay"] == "rollout" else "-")
        lines.append(f"| {r['replay']}, {r['seed']} | {p0[0]:.3f} | {pn[0]:.3f} | {100 * (pn[0] - p0[0]):+.1f} | "
                     f"{pn[1]:.3f} | {agree} | {r['wall_s']:.0f} s |")
    for replay in args.replay:
        rs = [r for r in rows if r["replay"] == replay and last in r["pass"]]
        if rs:
            gains = [100 * (r["pass"][last][0] - r["pass"][0][0]) for r in rs]
            lines.append(f"\n{replay}: pass@1 step 0 {spread([r['pass'][0][0] for r in rs])}, step {last} "
                         f"{spread([r['pass'][last][0] for r in rs])}, gain {spread(gains, '+.1f')} points, "
                         f"{len(rs)} seeds")
    lines.append("\n" + replay_check())
    print("\n".join(lines))
    with open(os.path.join(base, "summary.json"), "w") as f:
        json.dump({"rows": rows, "table": lines}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
