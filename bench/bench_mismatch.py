"""CPU benchmark: the rollout-training mismatch of a bf16 rollout engine against fp32 training.

    python bench/bench_mismatch.py [--steps 3] [--corrections none,tis,mis] [--init-std 0.02]
                                   [--layers 4] [--hidden 128] [--prompts 8] [--samples 4]
                                   [--new-tokens 24] [--threads 2]

megarl's engine samples with the actor's own model, so it generates in the actor's precision.
Here the RL stage's actor trains in fp32, and its engine is replaced by a MegatronRolloutEngine on
a frozen bf16 copy of the actor (megatron-core's Float16Module, bf16 weights, KV cache and
GEMMs; the copy takes the actor's weights before every step, as a separate inference engine
would): the samples and their log-probs come from bf16, the old log-probs from the fp32 actor
(rl.old_logprobs=recompute). The model is the tiny recipe's (configs/tiny_grpo.yaml) from
random init; the larger --init-std, the more peaked its next-token distributions (as a trained
model's are) and the larger its logits. Prompts: the synthetic task's; reward: the fraction of
digits in a response (a random policy's groups differ, so the advantages are not all 0). One run
per --corrections entry, from the same seed; prints each step's mismatch/* metrics, the actor's
loss, the reward and the sampled tokens' mean log-prob.
"""
import argparse
import json
import os
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def reward(prompts, responses, answers):
    return [sum(c.isdigit() for c in r) / max(len(r), 1) for r in responses]


def bf16_engine(stage):
    """A rollout engine on a bf16 copy of the stage's fp32 actor, and the function that copies
    the actor's current weights into it."""
    import torch

    from megarl.config.schema import role_config
    from megarl.models.layout import unwrap
    from megarl.roles.role import Role
    from megarl.rollout.engine import MegatronRolloutEngine

    cfg, r = stage.cfg, stage.cfg.rl
    rollout = Role("rollout", role_config(cfg, "actor").model, cfg.parallel, precision="bf16", seed=cfg.train.seed)
    src, dst = unwrap(stage.actor.model), unwrap(rollout.model)

    def sync():
        with torch.no_grad():
            theirs = dict(src.named_parameters())
            for name, p in dst.named_parameters():
                p.copy_(theirs[name])  # cast to bf16

    engine = MegatronRolloutEngine(rollout, vocab_size=cfg.model.vocab_size, pad_id=stage.tok.pad_id,
                                   decode=stage.tok.decode, encode=stage.tok.encode,
                                   max_batch_size=r.rollout_batch_size)
    return engine, sync


def run(args, correction: str, work: str) -> list[dict]:
    from megarl.config import load_config
    from megarl.runtime.distributed import init_distributed
    from megarl.trainers.rl import RLStage

    overrides = [
        f"train.run_dir={work}", "tracking.backend=none", "checkpoint.save_interval=0", "train.seed=1",
        f"model.num_layers={args.layers}", f"model.hidden_size={args.hidden}", f"model.ffn_hidden_size={args.hidden * 3}",
        f"model.init_std={args.init_std}",
        "roles.actor.init_from=random", "rl.eval_prompts=0", "rl.eval_before_train=false",
        f"rl.prompts_per_step={args.prompts}", f"rl.samples_per_prompt={args.samples}",
        f"rl.max_new_tokens={args.new_tokens}", f"rl.micro_batch_size={args.prompts * args.samples}",
        f"rl.reward_fn={os.path.abspath(__file__)}:reward", "rl.old_logprobs=recompute",
        f"rl.rollout_correction={correction}", "optim.lr=1e-4"]
    cfg = load_config(os.path.join(ROOT, "configs", "tiny_grpo.yaml"), overrides)
    init_distributed(1, 1, seed=cfg.train.seed)
    stage = RLStage(cfg, os.path.join(work, "rl"))
    engine, sync = bf16_engine(stage)
    sampled_logp, inner = [], engine.generate

    def generate(*a, **kw):  # the mean log-prob of the sampled tokens: how peaked the policy is
        rollout = inner(*a, **kw)
        sampled_logp.append(float(rollout.logprobs[rollout.sampled_mask].double().mean()))
        return rollout

    engine.generate = generate
    stage.engine = engine
    out = []
    for step in range(args.steps):
        sync()
        m = stage.step(step)
        out.append({k: v for k, v in m.items() if k.startswith("mismatch/")}
                   | {"actor/loss": m["actor/loss"], "reward/mean": m["reward/mean"],
                      "rollout/sampled_logp_mean": sampled_logp[-1]})
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--corrections", default="none,tis,mis")
    ap.add_argument("--init-std", type=float, default=0.02)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--samples", type=int, default=4)
    ap.add_argument("--new-tokens", type=int, default=24)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    os.environ["OMP_NUM_THREADS"] = str(args.threads)  # read by init_distributed
    t0 = time.time()
    results = {}
    for corr in args.corrections.split(","):
        with tempfile.TemporaryDirectory() as work:
            results[corr] = run(args, corr, work)
        for i, m in enumerate(results[corr]):
            print(json.dumps({"correction": corr, "step": i, **{k: round(v, 6) for k, v in sorted(m.items())}}))
    print(f"# {time.time() - t0:.0f} s", file=sys.stderr)


if __name__ == "__main__":
    main()
