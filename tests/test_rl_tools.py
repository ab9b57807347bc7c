"""Tool calls inside RL rollouts (issue 24): observation tokens carry no log-prob and no loss at any
aggregation, and an RL step with the calculator is the same at TP2, PP2, DP2 and TP2xPP2 as in
one process (tool outputs included).

The tiny random model knows nothing of tools: the forward hook of tests/test_rollout_tools.py
biases its output layer towards `<<...=` so that rows call the calculator.
"""
import os

import pytest
import torch

from dist_helpers import assert_same_figures, rl_stage_steps, run_distributed

from megarl.algorithms import AGG_MODES, ppo_policy_loss

HERE = os.path.dirname(__file__)
TOOLS_RL = ["model.num_layers=2", "model.hidden_size=64", "model.ffn_hidden_size=128", "model.num_attention_heads=4",
            "model.num_kv_heads=2", "tracking.backend=none", "roles.actor.init_from=random",
            "roles.reference.init_from=random", "rl.prompts_per_step=4", "rl.samples_per_prompt=2",
            "rl.max_new_tokens=20", "rl.micro_batch_size=4", "rl.mini_batches=2", "rl.kl_coef=0.05",
            "rl.reward_fn=rl_rewards:digits", "rl.tools=[calculator]", "rl.max_tool_calls=2", "optim.lr=1e-3",
            "lr_schedule.style=constant"]


@pytest.mark.parametrize("agg", AGG_MODES)
def test_observation_tokens_get_exactly_zero_gradient(agg):
    """Perturbing the log-probs of observation tokens (mask False) changes neither the loss nor any
    gradient; perturbing a sampled token's changes both. The loss counts sampled tokens only
    (float64 reference)."""
    g = torch.Generator().manual_seed(5)
    B, T = 4, 10
    mask = torch.ones(B, T, dtype=torch.bool)
    mask[:, 7:] = False
    mask[0, 2:4] = False  # an observation inside row 0
    mask[2, 5] = False
    old = torch.randn(B, T, generator=g, dtype=torch.float64) * 0.1 - 2
    adv = torch.randn(B, T, generator=g, dtype=torch.float64)
    base = old + torch.randn(B, T, generator=g, dtype=torch.float64) * 0.05

    def run(delta):
        logp = (base + delta).requires_grad_()
        loss, count, _ = ppo_policy_loss(logp, old, adv, mask, agg=agg, max_len=T)
        (loss / count).backward()
        return loss.detach(), logp.grad

    loss0, grad0 = run(torch.zeros(B, T, dtype=torch.float64))
    loss1, grad1 = run(torch.where(mask, 0.0, 5.0 * torch.randn(B, T, generator=g, dtype=torch.float64)))
    assert torch.equal(loss0, loss1) and torch.equal(grad0, grad1)
    assert (grad0[~mask] == 0).all()
    poke = torch.zeros(B, T, dtype=torch.float64)
    poke[1, 1] = 0.05
    assert not torch.equal(run(poke)[0], loss0)
    # float64 reference over sampled tokens only
    ratio = torch.exp(base - old)
    per = torch.maximum(-adv * ratio, -adv * ratio.clamp(0.8, 1.2))
    rows = [[per[b, t].item() for t in range(T) if mask[b, t]] for b in range(B)]
    want = {"token-mean": sum(sum(r) for r in rows),
            "seq-mean-token-sum": sum(sum(r) for r in rows),
            "seq-mean-token-mean": sum(sum(r) / len(r) for r in rows),
            "seq-mean-token-sum-norm": sum(sum(r) / T for r in rows)}[agg]
    count = sum(len(r) for r in rows) if agg == "token-mean" else B
    _, got_count, _ = ppo_policy_loss(base, old, adv, mask, agg=agg, max_len=T)
    assert loss0.item() == pytest.approx(want, rel=1e-12) and int(got_count) == count


def _bias_hook(role):
    """test_rollout_tools' logit offsets (towards `<<...=`) on this rank's output layer, on full
    (gathered: generation) or vocab-parallel (scoring, training) logits alike."""
    from megatron.core import parallel_state as ps
    from test_rollout_tools import BIAS, OTHERS, VOCAB

    from megarl.models.layout import unwrap

    gpt = unwrap(role.model)
    if not hasattr(gpt, "output_layer"):  # an earlier pipeline stage
        return
    padded = gpt.output_layer.weight.shape[0] * ps.get_tensor_model_parallel_world_size()
    offset = torch.zeros(padded)
    offset[:VOCAB] = OTHERS
    for ch, v in BIAS.items():
        offset[ord(ch)] = v
    offset[260] = -1.0  # <|im_end|>: some rows stop

    def hook(module, args, output):
        logits, b = output
        if logits.shape[-1] == padded:
            part = offset
        else:
            width = logits.shape[-1]
            start = ps.get_tensor_model_parallel_rank() * width
            part = offset[start:start + width]
        return logits + part.to(logits.dtype), b

    gpt.output_layer.register_forward_hook(hook)


def _rl_step_body(rank, world_size, overrides, run_dir):
    def hooks(stage):  # actor and reference: the same biased model, so KL starts at 0
        for role in stage.all_roles.values():
            _bias_hook(role)

    return rl_stage_steps([*TOOLS_RL, *overrides], run_dir, prepare=hooks)


@pytest.mark.slow
def test_an_rl_step_with_tools_is_the_same_at_every_layout(tmp_path, monkeypatch):
    monkeypatch.chdir(os.path.dirname(HERE))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([HERE, os.environ.get("PYTHONPATH", "")]))
    ref = run_distributed(_rl_step_body, 1, [], tmp_path / "one")[0]
    assert ref[0]["kl/mean"] == pytest.approx(0.0, abs=1e-6)
    assert ref[0]["tools/tool_calls_per_sample"] > 0 and ref[0]["tools/observation_tokens"] > 0, ref[0]
    for name, extra, world in (("tp2", ["parallel.tp=2"], 2), ("pp2", ["parallel.pp=2"], 2), ("dp2", [], 2),
                               ("tp2pp2", ["parallel.tp=2", "parallel.pp=2"], 4)):
        got = run_distributed(_rl_step_body, world, extra, tmp_path / name)[0]
        assert_same_figures(got, ref, name, clip_tol=2 / 40)


def test_tool_recipes_validate_and_share_their_task():
    """The tool task's SFT and GRPO recipes write and read the same synthetic task (a run dir
    holds one), and the recipes pass every rule (the 8B one at 8 GPUs)."""
    from megarl.config import check_config, load_config

    sft, rl = load_config("configs/tiny_sft_tools.yaml"), load_config("configs/tiny_grpo_tools.yaml")
    assert sft.data.synthetic == rl.data.synthetic and sft.data.seq_length == rl.data.seq_length
    assert rl.data.synthetic.calculator > 0 and "*" in rl.data.synthetic.ops and rl.rl.tools == ["calculator"]
    assert check_config(sft, 1) == [] and check_config(rl, 1, stage="rl") == []
    big = load_config("configs/llama31_8b_gsm8k_tools.yaml")
    assert big.rl.tools == ["calculator"] and big.roles.actor.init_from == "sft"
    assert check_config(big, 8, cuda=True, stage="rl") == []


def _run_stage_body(rank, world_size, run_dir, steps):
    """`megarl rl`'s own loop (session, checkpoints, resume) with the biased model in the stage."""
    import sys

    sys.path.insert(0, HERE)
    from megarl.config import load_config
    from megarl.trainers.loop import train_stage
    from megarl.trainers.rl import RLStage

    def build(cfg, stage_dir):
        stage = RLStage(cfg, stage_dir)
        for role in stage.all_roles.values():
            _bias_hook(role)
        return stage

    cfg = load_config("configs/tiny_grpo.yaml", [f"train.run_dir={run_dir}", *TOOLS_RL, f"train.steps={steps}",
                                                  "checkpoint.save_interval=1", "train.eval_interval=0",
                                                  "train.log_interval=1"])
    train_stage(cfg, "rl", build)


@pytest.mark.slow
def test_resume_with_tools_is_bit_exact(tmp_path, monkeypatch):
    """Stopped after step 2 (its checkpoint written) and resumed to step 4 through the loop, a run
    with tools repeats the uninterrupted run's figures and weights exactly (the tool outputs are
    functions of the text; the samples are keyed by step and row)."""
    from megarl_run import final_weights, metrics

    monkeypatch.chdir(os.path.dirname(HERE))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([HERE, os.environ.get("PYTHONPATH", "")]))
    run_distributed(_run_stage_body, 1, tmp_path / "full", 4, init_process_group=False)
    run_distributed(_run_stage_body, 1, tmp_path / "split", 2, init_process_group=False)
    run_distributed(_run_stage_body, 1, tmp_path / "split", 4, init_process_group=False)

    def figures(run):
        return [{k: v for k, v in r.items() if not k.startswith(("perf/", "memory/"))} for r in metrics(run / "rl")]

    full, split = figures(tmp_path / "full"), figures(tmp_path / "split")
    assert [r["step"] for r in split] == [1, 2, 3, 4] and split == full
    assert any(r["tools/tool_calls_per_sample"] > 0 for r in full)
    a, b = final_weights(tmp_path / "split" / "rl"), final_weights(tmp_path / "full" / "rl")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
