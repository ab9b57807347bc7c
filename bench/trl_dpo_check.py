"""megarl's DPO losses against TRL's on the same batch and weights.

    python bench/trl_dpo_check.py [--trl-python PATH] [--pairs 6] [--json OUT]

This process builds two tiny random Llamas as megarl Roles (the policy, seed 1; the reference,
seed 2), a batch of random preference pairs (prompts and responses of varied lengths, right-padded)
and, for each case below, the loss and metrics of megarl's DPO stage on it: `pair_microbatch`, the
reference's forward through `with_reference`, `dpo_loss` under the policy's forward. Both models
are then written as Hugging Face checkpoints and TRL, in its own venv (--trl-python, default
bench/.venv-trl/bin/python, which bench_rl_step.py creates), loads them and computes on the same
token ids:
  sigmoid, ipo   DPOTrainer._compute_loss (its loss, log-probs and metrics) with the reference model;
  simpo          CPOTrainer.cpo_loss (loss_type=simpo, cpo_alpha 0) on the length-averaged
                 log-probs of DPOTrainer's own policy forward (DPOTrainer has no SimPO).
TRL 1.16's DPOTrainer has no label smoothing for `sigmoid` (its label_smoothing is robust DPO's and
EXO's), so conservative DPO is checked against the float64 reference in tests/test_dpo.py only.
Prints each figure of both and exits 1 when one differs by more than 1e-4 (relative, or absolute
below 1e-3).
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
VOCAB = 64
CASES = [("sigmoid", 0.1, 0.0), ("sigmoid", 0.5, 0.0), ("ipo", 0.1, 0.0), ("ipo", 1.0, 0.0), ("simpo", 2.0, 0.5)]
# megarl metric -> TRL's name for it
NAMES = {"loss": "loss", "reward_chosen": "rewards/chosen", "reward_rejected": "rewards/rejected",
         "reward_margin": "rewards/margins", "reward_accuracy": "rewards/accuracies",
         "logp_chosen": "logps/chosen", "logp_rejected": "logps/rejected"}


def pairs(n: int, seed: int = 0) -> list[dict]:
    import random

    rng = random.Random(seed)

    def ids(k):
        return [rng.randrange(3, VOCAB) for _ in range(k)]

    return [{"prompt_ids": ids(rng.randint(3, 9)), "chosen_ids": ids(rng.randint(2, 12)),
             "rejected_ids": ids(rng.randint(2, 12))} for _ in range(n)]


# --------------------------------------------------------------------------- megarl (this process)


def megarl_side(examples: list[dict], out: str) -> tuple[dict, str, str]:
    """{case: metrics} of megarl's DPO stage, and the two models as HF directories under out."""
    import numpy as np

    from megarl.checkpoint.hf import save_hf_checkpoint
    from megarl.config import ModelConfig, OptimConfig, ParallelConfig
    from megarl.config.schema import DPOConfig
    from megarl.data.batching import Collator
    from megarl.models.layout import gather_full_state_dict
    from megarl.roles.role import Role
    from megarl.runtime.distributed import init_distributed, teardown
    from megarl.trainers.dpo import dpo_loss, pair_microbatch, with_reference

    init_distributed(1, 1, 1, seed=0)
    try:
        mc = ModelConfig(num_layers=2, hidden_size=64, ffn_hidden_size=128, num_attention_heads=4, num_kv_heads=2,
                         vocab_size=VOCAB, max_position_embeddings=64, transformer_impl="local")
        policy = Role("actor", mc, ParallelConfig(), seed=1, optim=OptimConfig())
        reference = Role("reference", mc, ParallelConfig(), seed=2)
        items = []
        for e in examples:
            row = {}
            for side in ("chosen", "rejected"):
                toks = e["prompt_ids"] + e[f"{side}_ids"]
                row[f"{side}_tokens"] = np.asarray(toks, np.int32)
                row[f"{side}_target_mask"] = np.asarray([0] * len(e["prompt_ids"]) + [1] * len(e[f"{side}_ids"]), np.uint8)
                row[f"{side}_segment_ids"] = np.zeros(len(toks), np.int32)
            items.append(row)
        batch = Collator("preferences", seq_len=32, pad_id=0)(items)
        results = {}
        for kind, beta, gamma in CASES:
            mbs = with_reference(None if kind == "simpo" else reference, [pair_microbatch(batch)])
            d = DPOConfig(loss=kind, beta=beta, simpo_gamma=gamma)
            results[f"{kind} beta={beta}"] = policy.evaluate(mbs, dpo_loss(d))
        dirs = []
        for name, role in (("policy", policy), ("reference", reference)):
            path = os.path.join(out, name)
            save_hf_checkpoint(path, mc, gather_full_state_dict(role.model, VOCAB), "LlamaForCausalLM",
                               extra_config={"eos_token_id": 1, "pad_token_id": 0})
            dirs.append(path)
        return results, dirs[0], dirs[1]
    finally:
        teardown()


# --------------------------------------------------------------------------- TRL (its own venv)


def trl_side(spec: dict) -> dict:
    import types

    import torch
    import transformers
    from datasets import Dataset
    from tokenizers import Tokenizer, models, pre_tokenizers
    from trl import DPOConfig, DPOTrainer
    from trl.experimental.cpo import CPOTrainer
    from trl.trainer.dpo_trainer import DataCollatorForPreference

    words = {"<pad>": 0, "<eos>": 1, "<unk>": 2, **{f"w{i}": i for i in range(3, VOCAB)}}
    tk = Tokenizer(models.WordLevel(words, unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok = transformers.PreTrainedTokenizerFast(tokenizer_object=tk, eos_token="<eos>", pad_token="<pad>",
                                               unk_token="<unk>")
    inputs = DataCollatorForPreference(pad_token_id=0)(spec["examples"])
    out = {}
    for kind, beta, gamma in CASES:
        load = transformers.AutoModelForCausalLM.from_pretrained
        model, ref = load(spec["policy"], dtype=torch.float32), load(spec["reference"], dtype=torch.float32)
        args = DPOConfig(output_dir=os.path.join(spec["work"], "trl"), beta=beta,
                         loss_type=["sigmoid" if kind == "simpo" else kind], report_to="none",
                         per_device_train_batch_size=len(spec["examples"]), use_cpu=True, bf16=False)
        trainer = DPOTrainer(model=model, ref_model=ref, args=args, processing_class=tok,
                             train_dataset=Dataset.from_list([{"prompt": "w3", "chosen": "w4", "rejected": "w5"}]))
        trainer.model.train()
        with torch.no_grad():
            loss = trainer._compute_loss(trainer.model, inputs, return_outputs=False)
        metrics = {k: v[-1] for k, v in trainer._metrics["train"].items()}
        if kind == "simpo":  # CPOTrainer's loss on DPOTrainer's policy log-probs, averaged per token
            mask = inputs["completion_mask"][:, 1:]
            labels = inputs["input_ids"].masked_fill(inputs["completion_mask"] == 0, -100)
            with torch.no_grad():
                kw = {k: v for k, v in inputs.items() if k != "completion_mask"}
                logp = trainer.model(**kw, labels=labels, use_cache=False, fused_lm_head=True).log_probs
            avg = (logp[:, -mask.size(1):] * mask).sum(1) / mask.sum(1)
            c, r = avg.chunk(2)
            ns = types.SimpleNamespace(alpha=0.0, loss_type="simpo", simpo_gamma=gamma, beta=beta, label_smoothing=0.0,
                                       accelerator=types.SimpleNamespace(device="cpu"))
            losses, rc, rr = CPOTrainer.cpo_loss(ns, c, r)
            loss = losses.mean()
            metrics.update({"rewards/chosen": rc.mean().item(), "rewards/rejected": rr.mean().item(),
                            "rewards/margins": (rc - rr).mean().item(),
                            "rewards/accuracies": (rc > rr).float().mean().item()})
        metrics["loss"] = float(loss)
        out[f"{kind} beta={beta}"] = metrics
    return out


# --------------------------------------------------------------------------- main


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trl-python", default=os.path.join(ROOT, "bench", ".venv-trl", "bin", "python"))
    ap.add_argument("--pairs", type=int, default=6)
    ap.add_argument("--json", default=None, help="write both sides' figures here")
    ap.add_argument("--trl-worker", default=None, help=argparse.SUPPRESS)  # internal: the spec file
    args = ap.parse_args()
    if args.trl_worker:
        with open(args.trl_worker) as f:
            spec = json.load(f)
        print("TRL_RESULT " + json.dumps(trl_side(spec)), flush=True)
        return 0
    if not os.path.exists(args.trl_python):
        print(f"no TRL venv at {args.trl_python}: run bench/bench_rl_step.py once, or give --trl-python", file=sys.stderr)
        return 2
    examples = pairs(args.pairs)
    with tempfile.TemporaryDirectory() as work:
        ours, policy, reference = megarl_side(examples, work)
        spec_path = os.path.join(work, "spec.json")
        with open(spec_path, "w") as f:
            json.dump({"examples": examples, "policy": policy, "reference": reference, "work": work}, f)
        env = dict(os.environ, PYTHONWARNINGS="ignore", TRL_EXPERIMENTAL_SILENCE="1", HF_HUB_OFFLINE="1",
                   TRANSFORMERS_VERBOSITY="error", PYTHONPATH="")
        proc = subprocess.run([args.trl_python, os.path.abspath(__file__), "--trl-worker", spec_path],
                              capture_output=True, text=True, env=env)
        line = next((x for x in proc.stdout.splitlines() if x.startswith("TRL_RESULT ")), None)
        if proc.returncode or line is None:
            print(f"TRL worker exited {proc.returncode}:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}", file=sys.stderr)
            return 2
        theirs = json.loads(line[len("TRL_RESULT "):])
    worst, rows = 0.0, []
    for case, m in ours.items():
        for name, trl_name in NAMES.items():
            if name.startswith("logp") and case.startswith("simpo"):
                continue  # the reference-free case takes TRL's log-probs from the forward above, not its metrics
            a, b = m[name], theirs[case][trl_name]
            err = abs(a - b) / max(abs(b), 1e-3)
            worst = max(worst, err)
            rows.append(f"{case:17s} {name:16s} megarl {a: .7f}  TRL {b: .7f}  rel {err:.1e}")
    print("\n".join(rows))
    print(f"largest difference: {worst:.2e} over {len(rows)} figures, {args.pairs} pairs")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"megarl": ours, "trl": theirs, "largest_relative_difference": worst}, f, indent=1)
    return 0 if worst <= 1e-4 else 1


if __name__ == "__main__":
    sys.exit(main())
