"""Held-out pair accuracy of a reward-model checkpoint, broken down by where the rejected answer
goes wrong (the synthetic task: one or two lines of arithmetic, then `#### answer`).

    python bench/bench_rm_quality.py RUN_DIR [--config configs/tiny_rm.yaml] [--pairs FILE] [key=value ...]

Scores every pair of the held-out file once (RUN_DIR/data/test_prefs.jsonl by default; the
stage's own evaluation draws `eval_batches` x `global_batch_size` pairs and wraps around the
file), reading the model the way it was trained (`reward_model.pooling`, recorded in the
checkpoint). Overrides are for the model section when RUN_DIR used other sizes.
"""
import argparse
import collections
import json
import os
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("run_dir")
    ap.add_argument("--config", default=os.path.join(ROOT, "configs", "tiny_rm.yaml"))
    ap.add_argument("--pairs", help="a chosen/rejected JSONL file (default: RUN_DIR/data/test_prefs.jsonl)")
    ap.add_argument("overrides", nargs="*")
    a = ap.parse_args()
    sys.path.insert(0, ROOT)
    torch.set_num_threads(1)
    from megarl.algorithms import sequence_reward
    from megarl.checkpoint.distributed import load_weights, resolve_checkpoint, saved_reward_pooling
    from megarl.config import load_config
    from megarl.roles.role import Role
    from megarl.runtime.distributed import init_distributed
    from megarl.trainers import data_setup

    cfg = load_config(a.config, [f"train.run_dir={a.run_dir}", "tracking.backend=none", *a.overrides])
    init_distributed(1, 1, seed=cfg.train.seed)
    path = resolve_checkpoint(os.path.join(a.run_dir, "reward_model", "checkpoints"))
    role = Role("reward_model", cfg.model, cfg.parallel, head="scalar", precision=cfg.train.precision)
    load_weights(path, role)
    pooling = saved_reward_pooling(path, "reward_model")
    tok = data_setup.tokenizer(cfg)

    def reward(prompt: str, response: str, first: int) -> float:
        """first: the column of the response's first token (the rendered prompt's length)."""
        ids, _ = tok.encode_chat([{"role": "user", "content": prompt}, {"role": "assistant", "content": response}])
        with torch.no_grad():
            values = role.model(torch.tensor([ids]), torch.arange(len(ids))[None], None)[..., 0]  # [1, s]
        return sequence_reward(values, torch.tensor([first]), torch.tensor([len(ids) - 1]), pooling).item()

    pairs_path = a.pairs or os.path.join(a.run_dir, "data", "test_prefs.jsonl")
    right = collections.Counter()
    total = collections.Counter()
    with open(pairs_path) as f:
        for line in f:
            rec = json.loads(line)
            chosen, rejected = rec["chosen"].split("\n"), rec["rejected"].split("\n")
            wrong = next((i for i, (c, r) in enumerate(zip(chosen, rejected)) if c != r), len(chosen) - 1)
            kind = f"{len(chosen) - 1} line(s) of arithmetic, wrong from line {wrong + 1}"
            first = len(tok.encode_chat([{"role": "user", "content": rec["prompt"]}], add_generation_prompt=True)[0])
            ok = reward(rec["prompt"], rec["chosen"], first) > reward(rec["prompt"], rec["rejected"], first)
            for key in (kind, "all"):
                right[key] += ok
                total[key] += 1
    print(f"{path} (pooling {pooling}) on {pairs_path}\n")
    print("| pairs | held-out pair accuracy |")
    print("|---|---|")
    for key in sorted(total, key=lambda k: (k == "all", k)):
        print(f"| {key} ({total[key]}) | {right[key] / total[key]:.3f} |")


if __name__ == "__main__":
    main()
