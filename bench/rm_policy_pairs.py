"""Pairs from a policy's own samples, to measure (or train) a reward model on the mistakes the
policy makes rather than the ones a pair file was written with.

    python bench/rm_policy_pairs.py CHECKPOINT PROMPTS OUT [--config configs/tiny_grpo.yaml]
                                    [--samples 4] [--seed 4242] [key=value ...]
    python bench/bench_rm_quality.py RM_RUN_DIR --pairs OUT

CHECKPOINT is an SFT or RL checkpoint (a step dir or a root with `latest`; RL: the actor), PROMPTS
an RL prompt file with answers (e.g. <run_dir>/data/test_prompts.jsonl). Every prompt is sampled
`--samples` times at temperature 1 (rl.max_new_tokens, the tokenizer's stop ids) and graded with
the `final_answer` rule; for each prompt with right and wrong samples, every distinct wrong sample
is paired with a right one of the same prompt (chosen at random, seeded). OUT is a
chosen/rejected JSONL file like the synthetic task's pairs. Run on one process (CPU is fine).
"""
import argparse
import json
import os
import random
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("checkpoint")
    ap.add_argument("prompts")
    ap.add_argument("out")
    ap.add_argument("overrides", nargs="*")
    ap.add_argument("--config", default=os.path.join(ROOT, "configs", "tiny_grpo.yaml"))
    ap.add_argument("--samples", type=int, default=4)
    ap.add_argument("--seed", type=int, default=4242)
    args = ap.parse_args()
    sys.path.insert(0, ROOT)
    import tempfile

    from megarl.config import load_config
    from megarl.rewards import load_reward_fn
    from megarl.roles.role import Role
    from megarl.rollout.engine import SamplingParams
    from megarl.runtime.distributed import init_distributed
    from megarl.trainers import data_setup
    from megarl.trainers.evaluate import rollout_engine, sample_and_grade
    from megarl.trainers.weights import load_role_weights

    with tempfile.TemporaryDirectory() as run_dir:
        cfg = load_config(args.config, [f"train.run_dir={run_dir}", "tracking.backend=none",
                                        f"rl.prompts_path={args.prompts}", *args.overrides])
        init_distributed(1, 1, seed=cfg.train.seed)
        tok = data_setup.tokenizer(cfg)
        ds = data_setup.prompt_dataset(cfg, args.prompts)
        role = Role("actor", cfg.model, cfg.parallel, head="lm", precision=cfg.train.precision, seed=cfg.train.seed)
        load_role_weights(cfg, role, args.checkpoint, "checkpoint")
        engine = rollout_engine(cfg, role, tok)
        k = args.samples
        params = SamplingParams(n=k, temperature=1.0, max_new_tokens=cfg.rl.max_new_tokens,
                                stop_ids=tuple(tok.stop_ids))
        items = [ds[i] for i in range(len(ds))]
        _, prompts, texts, _, scores = sample_and_grade(engine, items, tok, params, args.seed, 0,
                                                        load_reward_fn("final_answer"))
    rng = random.Random(0)  # which right sample each wrong one is paired with
    pairs, mixed = [], 0
    for i in range(len(items)):
        group = list(zip(texts[i * k:(i + 1) * k], scores[i * k:(i + 1) * k]))
        right = sorted({t for t, s in group if s > 0})
        wrong = sorted({t for t, s in group if s <= 0})
        if right and wrong:
            mixed += 1
            pairs += [{"prompt": prompts[i * k], "chosen": rng.choice(right), "rejected": w} for w in wrong]
    tmp = args.out + ".tmp"
    with open(tmp, "w") as f:
        f.writelines(json.dumps(p) + "\n" for p in pairs)
    os.replace(tmp, args.out)
    print(f"{len(items)} prompts x {k} samples: pass@1 {sum(s > 0 for s in scores) / len(scores):.3f}; "
          f"{mixed} prompts with right and wrong samples -> {len(pairs)} pairs in {args.out}")


if __name__ == "__main__":
    main()
