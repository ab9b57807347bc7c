"""LoRA adapters (megarl/models/lora.py): the maths against the merged dense model, only the
adapters train, and every (TP, PP, DP) layout trains like the single process (fp32, 1e-5)."""
import pytest
import torch

from dist_helpers import run_distributed

VOCAB, SEQ, GBS, MBS = 100, 16, 8, 2


def _configs(tp=1, pp=1, targets=("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2"), lora=True):
    from megarl.config import LRScheduleConfig, ModelConfig, OptimConfig, ParallelConfig
    from megarl.config.schema import LoRAConfig

    model = ModelConfig(num_layers=2, hidden_size=64, ffn_hidden_size=96, num_attention_heads=4, num_kv_heads=2,
                        head_dim=24, vocab_size=VOCAB, max_position_embeddings=64, qkv_bias=True,
                        lora=LoRAConfig(rank=4, alpha=8.0, targets=list(targets)) if lora else None)
    optim = OptimConfig(lr=3e-3, weight_decay=0.1, clip_grad=0.5, eps=1e-4)
    return model, ParallelConfig(tp=tp, pp=pp), optim, LRScheduleConfig(style="cosine", warmup_steps=1)


def _global_batch(step):
    g = torch.Generator().manual_seed(300 + step)
    seq = torch.randint(0, VOCAB, (GBS, SEQ + 1), generator=g)
    return {"tokens": seq[:, :-1], "labels": seq[:, 1:], "position_ids": torch.arange(SEQ).expand(GBS, SEQ),
            "loss_mask": (torch.rand(GBS, SEQ, generator=g) > 0.3).float()}


@torch.no_grad()
def randomise_adapters(model, seed=7):
    """Non-zero B (the init's zero B would hide any error in B's maths), the same canonical
    values at every layout."""
    from megarl.models.layout import _tp, canonical_name, full_shape, shard, split_kind, unwrap

    model = unwrap(model)
    tp_rank, tp = _tp()
    for name, p in model.named_parameters():
        if ".lora_b." in name:
            kind, dim = split_kind(name, p)
            g = torch.Generator().manual_seed(seed + sum(map(ord, canonical_name(model, name))))
            full = torch.randn(full_shape(p.shape, kind, dim, tp, VOCAB), generator=g) * 0.05
            p.copy_(shard(full, kind, dim, tp_rank, tp, p.shape))


def _logits(role, tokens):
    from megarl.models.layout import unwrap

    m = unwrap(role.model)
    m.eval()
    with torch.no_grad():
        return m(tokens, torch.arange(tokens.shape[1]).expand_as(tokens), None)[..., :VOCAB]


def _maths_body(rank, world_size):
    from megarl.models import lora
    from megarl.models.layout import gather_full_state_dict, load_full_state_dict
    from megarl.roles.role import Role
    from megarl.runtime.distributed import init_distributed, teardown

    init_distributed(1, 1, seed=3)
    model, parallel, _, _ = _configs(targets=("linear_qkv", "linear_fc2"))
    dense = _configs(lora=False)[0]
    adapted, base = Role("sft", model, parallel, seed=3), Role("sft", dense, parallel, seed=3)
    tokens = torch.randint(0, VOCAB, (3, 12), generator=torch.Generator().manual_seed(1))
    out = {"zero_b": (_logits(adapted, tokens), _logits(base, tokens))}
    randomise_adapters(adapted.model)
    canonical = gather_full_state_dict(adapted.model, VOCAB)
    out["adapter_keys"] = sorted(k for k in canonical if lora.is_adapter(k))
    load_full_state_dict(base.model, lora.merge(canonical, model.lora), VOCAB)
    out["merged"] = (_logits(adapted, tokens), _logits(base, tokens))
    with lora.adapters_disabled(adapted.model):  # the RL reference: the base weights
        out["disabled"] = (_logits(adapted, tokens), _logits(Role("sft", dense, parallel, seed=3), tokens))
    teardown()
    return out


def test_adapters_match_the_merged_dense_model():
    """W x + (alpha/r) B A x with random A and B equals the dense model whose weights are
    W + (alpha/r) B A (merged in float64); B at its zero init, or the adapters disabled, give
    the base model exactly."""
    out = run_distributed(_maths_body, 1)[0]
    assert torch.equal(*out["zero_b"])
    assert len(out["adapter_keys"]) == 2 * 2 * 2  # layers x targets x (A, B)
    got, want = out["merged"]
    assert (got - want).abs().max() < 1e-5 * want.abs().max()
    assert (got - out["zero_b"][1]).abs().max() > 1e-3  # the adapters change the logits
    assert torch.equal(*out["disabled"])


def _body(rank, world_size, tp, pp, distributed_optimizer):
    from megarl.algorithms.losses import masked_nll
    from megarl.models.layout import gather_full_state_dict, unwrap
    from megarl.roles.role import Role
    from megarl.runtime.distributed import init_distributed, teardown
    from megarl.trainers.common import token_logprobs
    from dist_helpers import dp_microbatches

    init_distributed(tp, pp, seed=11)
    model, parallel, optim, sched = _configs(tp, pp)
    parallel.distributed_optimizer = distributed_optimizer
    lm = Role("sft", model, parallel, head="lm", optim=optim, schedule=sched, train_steps=4, seed=5)
    randomise_adapters(lm.model)

    def loss(batch, logits):
        return masked_nll(token_logprobs(logits, batch["labels"], VOCAB), batch["loss_mask"])

    for c in lm.chunks:
        c.zero_grad_buffer()
    lm.forward_backward(dp_microbatches(_global_batch(0), MBS), loss)
    params = [p for p in unwrap(lm.model).parameters() if p.requires_grad]
    saved = [p.detach().clone() for p in params]
    for p in params:
        p.data.copy_(p.main_grad)
    grads = {k: v for k, v in (gather_full_state_dict(lm.model, VOCAB) or {}).items() if ".lora_" in k}
    for p, v in zip(params, saved):
        p.data.copy_(v)
    out = {"loss": [], "grad_norm": [], "grads": grads,
           "optimized": sum(len(g["params"]) for g in lm.optimizer.param_groups)}
    for step in range(2):
        r = lm.train_step(dp_microbatches(_global_batch(step), MBS), loss)
        out["loss"].append(r.metrics["loss"])
        out["grad_norm"].append(r.grad_norm)
    out["loss_after"] = lm.evaluate(dp_microbatches(_global_batch(0), MBS), loss)["loss"]
    out["params"] = gather_full_state_dict(lm.model, VOCAB)
    teardown()
    return out


def _run(tp, pp, dp, distributed_optimizer=False):
    return run_distributed(_body, tp * pp * dp, tp, pp, distributed_optimizer)[0]


@pytest.fixture(scope="module")
def reference():
    return _run(1, 1, 1)


def _close(a, b, what):
    a, b = torch.as_tensor(a, dtype=torch.float64), torch.as_tensor(b, dtype=torch.float64)
    err, scale = (a - b).abs().max().item(), b.abs().max().item()
    assert err <= 1e-5 * scale, f"{what}: max abs diff {err:.3g} exceeds 1e-5 x {scale:.3g}"


def test_only_adapters_train(reference):
    """The optimizer holds the 16 adapter factors (2 layers x 4 targets x A, B); the base
    weights end bit-identical to their init, the adapters moved, and the loss fell."""
    from megarl.models.layout import init_full

    assert reference["optimized"] == 16
    assert reference["loss_after"] < reference["loss"][0] - 0.01
    for name, value in reference["params"].items():
        if ".lora_" in name:
            continue
        init = init_full(name, value.shape, seed=5, std=0.02, num_layers=2)
        assert torch.equal(value, init), f"frozen {name} changed"
    moved = [name for name, v in reference["params"].items() if ".lora_" in name and
             (v - init_full(name, v.shape, seed=5, std=0.02, num_layers=2)).abs().max() > 1e-4]
    assert len(moved) == 16


@pytest.mark.slow
@pytest.mark.parametrize("tp,pp,dp,dist_opt", [(2, 1, 1, False), (1, 2, 1, False), (1, 1, 2, True), (2, 2, 1, False)])
def test_layout_matches_single_process(reference, tp, pp, dp, dist_opt):
    got = _run(tp, pp, dp, dist_opt)
    for key in ("loss", "grad_norm", "loss_after"):
        _close(got[key], reference[key], f"{key} at tp={tp} pp={pp} dp={dp}")
    # the distributed optimizer reduce-scatters: each rank's buffer holds its shard's gradients only
    for which in ("params",) if dist_opt else ("grads", "params"):
        assert got[which].keys() == reference[which].keys()
        for name, ref in reference[which].items():
            _close(got[which][name], ref, f"{which}[{name}] at tp={tp} pp={pp} dp={dp}")


def test_lora_config_errors_are_one_line():
    from megarl.config import load_config
    from megarl.config.validate import check_config

    cfg = load_config(None, ["model.lora.rank=0", "model.lora.targets=[linear_qkv,q_proj]", "model.lora.dropout=1.5"])
    errs = [e for e in check_config(cfg, 1, cuda=False) if ".lora." in e]
    assert len(errs) == 3 and all("\n" not in e for e in errs), errs
    assert "q_proj" in errs[2] and "linear_fc2" in errs[2]
    assert not [e for e in check_config(load_config(None, ["model.lora.rank=4"]), 1, cuda=False) if "lora" in e]


def _resume_body(rank, world_size, root, base_dir):
    """Train 4 steps straight, and 2 + save + (fresh role on the base, load) + 2: the same bits."""
    import os

    from megarl.algorithms.losses import masked_nll
    from megarl.checkpoint.distributed import load_checkpoint, save_checkpoint
    from megarl.models.layout import gather_full_state_dict
    from megarl.roles.role import Role
    from megarl.runtime.distributed import init_distributed, teardown
    from megarl.trainers.common import token_logprobs
    from megarl.trainers.weights import init_weights, load_role_weights
    from megarl.config import Config
    from dist_helpers import dp_microbatches

    init_distributed(1, 1, seed=11)
    model, parallel, optim, sched = _configs()
    model.lora.dropout = 0.2  # the dropout masks come from the RNG state the checkpoint restores
    model.init_from = base_dir  # a dense megarl checkpoint: the base the adapters load onto
    cfg = Config(model=model)

    def role():
        torch.manual_seed(0)  # the uninterrupted and the interrupted run draw the same dropout masks
        r = Role("sft", model, parallel, optim=optim, schedule=sched, train_steps=4, seed=9)
        init_weights(cfg, r)
        return r

    def loss(batch, logits):
        return masked_nll(token_logprobs(logits, batch["labels"], VOCAB), batch["loss_mask"])

    def train(r, steps):
        return [r.train_step(dp_microbatches(_global_batch(s), MBS), loss).metrics["loss"] for s in steps]

    straight = role()
    losses = train(straight, range(4))
    first = role()
    train(first, range(2))
    path = save_checkpoint(root, 2, {"sft": first}, {"note": "lora"})
    saved = gather_full_state_dict(first.model, VOCAB)
    del first
    # an RL actor started from these adapters (roles.actor.init_from): base from model.init_from, then them
    started = Role("sft", model, parallel, seed=9)
    load_role_weights(cfg, started, path, "roles.actor.init_from")
    started = gather_full_state_dict(started.model, VOCAB)
    resumed = role()
    state = load_checkpoint(path, {"sft": resumed})
    out = {"losses": losses, "resumed_losses": train(resumed, range(2, 4)), "state": state,
           "straight": gather_full_state_dict(straight.model, VOCAB),
           "resumed": gather_full_state_dict(resumed.model, VOCAB),
           "files": sorted(os.listdir(path)), "saved": saved, "path": path, "started": started}
    from megatron.core import dist_checkpointing

    out["saved_keys"] = sorted(dist_checkpointing.load_tensors_metadata(path))
    teardown()
    return out


def _reshard_body(rank, world_size, path, base_dir):
    from megarl.checkpoint.distributed import load_checkpoint
    from megarl.config import Config
    from megarl.models.layout import gather_full_state_dict
    from megarl.roles.role import Role
    from megarl.runtime.distributed import init_distributed, teardown
    from megarl.trainers.weights import init_weights

    init_distributed(2, 1, seed=11)
    model, parallel, optim, sched = _configs(tp=2)
    model.lora.dropout, model.init_from = 0.2, base_dir
    r = Role("sft", model, parallel, optim=optim, schedule=sched, train_steps=4, seed=9)
    init_weights(Config(model=model, parallel=parallel), r)
    load_checkpoint(path, {"sft": r})
    out = gather_full_state_dict(r.model, VOCAB)
    teardown()
    return out


def _dense_base_body(rank, world_size, root):
    from megarl.checkpoint.distributed import save_checkpoint
    from megarl.roles.role import Role
    from megarl.runtime.distributed import init_distributed, teardown

    init_distributed(1, 1, seed=1)
    model, parallel, _, _ = _configs(lora=False)
    save_checkpoint(root, 0, {"sft": Role("sft", model, parallel, seed=21)}, {})
    teardown()


@pytest.mark.slow
def test_checkpoint_holds_the_adapters_alone_and_resumes_bit_exactly(tmp_path):
    run_distributed(_dense_base_body, 1, str(tmp_path / "base"))
    out = run_distributed(_resume_body, 1, str(tmp_path / "lora"), str(tmp_path / "base" / "step_00000000"))[0]
    weights = [k for k in out["saved_keys"] if k.startswith("sft.model.")]
    assert weights and all(".lora_" in k for k in weights), weights  # no base tensor saved
    moments = [k for k in out["saved_keys"] if k.startswith("optimizer.state.exp_avg.")]
    assert moments and all(".lora_" in k for k in moments), moments  # Adam's state: the adapters' only
    assert out["state"]["step"] == 2 and out["state"]["note"] == "lora"
    assert out["resumed_losses"] == out["losses"][2:]
    for name, value in out["straight"].items():
        assert torch.equal(value, out["resumed"][name]), name
    for name, value in out["saved"].items():
        assert torch.equal(value, out["started"][name]), name
    from megarl.models.layout import init_full

    # the base came from the dense checkpoint (seed 21), not the role's own init (seed 9)
    w = "decoder.layers.0.mlp.linear_fc2.weight"
    assert torch.equal(out["resumed"][w], init_full(w, out["resumed"][w].shape, seed=21, std=0.02, num_layers=2))

    # the adapters reshard: TP2 loads the TP1 save (fc1's B split per SwiGLU half, as fc1's weight)
    got = run_distributed(_reshard_body, 2, out["path"], str(tmp_path / "base" / "step_00000000"))[0]
    assert got.keys() == out["saved"].keys()
    for name, value in out["saved"].items():
        assert torch.equal(got[name], value), name
