"""Offload/onload of roles: bit-exact moves, training unchanged, guards, checkpoints, peak memory.

The reference for "training is unchanged" is a twin role (same seed, same batches) trained in
the same process without any offload; every storage of the role (params, fp32 main params,
grads, optimizer state) is compared bit for bit through a digest of clones.
"""
import hashlib

import pytest
import torch

from dist_helpers import run_distributed

VOCAB, SEQ, GBS, MBS = 100, 8, 4, 2
KINDS = ("params", "grads", "optimizer")


def _model():
    from megarl.config import ModelConfig

    return ModelConfig(num_layers=2, hidden_size=32, ffn_hidden_size=48, num_attention_heads=4,
                       num_kv_heads=2, vocab_size=VOCAB, max_position_embeddings=32)


def _role(name, tp=1, pp=1, head="lm", precision="fp32", distopt=False, trained=True, seed=5):
    from megarl.config import OptimConfig, ParallelConfig
    from megarl.roles.role import Role

    optim = OptimConfig(lr=1e-2, weight_decay=0.1, clip_grad=1.0) if trained else None
    return Role(name, _model(), ParallelConfig(tp=tp, pp=pp, distributed_optimizer=distopt), head=head,
                precision=precision, optim=optim, seed=seed)


def _batch(step):
    g = torch.Generator().manual_seed(1000 + step)
    seq = torch.randint(0, VOCAB, (GBS, SEQ + 1), generator=g)
    return {"tokens": seq[:, :-1], "labels": seq[:, 1:], "position_ids": torch.arange(SEQ).expand(GBS, SEQ),
            "loss_mask": (torch.rand(GBS, SEQ, generator=g) > 0.3).float(),
            "value_targets": torch.randn(GBS, SEQ, generator=g)}


def _mbs(step):
    from dist_helpers import dp_microbatches

    return dp_microbatches(_batch(step), MBS)


def _lm_loss(batch, logits):
    from megarl.algorithms.losses import masked_nll
    from megarl.trainers.common import token_logprobs

    return masked_nll(token_logprobs(logits, batch["labels"], VOCAB), batch["loss_mask"])


def _value_loss(batch, values):
    from dist_helpers import masked_mse

    return masked_mse(values.squeeze(-1).float(), batch["value_targets"], batch["loss_mask"])


def _digest(role, kinds=KINDS):
    """kind -> sha256 over the role's storages in collection order (clones: `.numpy()` on a live
    tensor would pin its storage)."""
    from megarl.roles.offload import role_storages

    out = {}
    for kind, storages in role_storages(role).items():
        if kind not in kinds:
            continue
        h = hashlib.sha256()
        for s in storages.values():
            assert s.nbytes() > 0, f"{role.name}: digest of an offloaded {kind} storage"
            h.update(torch.empty(0, dtype=torch.uint8).set_(s, 0, (s.nbytes(),), (1,)).clone().numpy().tobytes())
        out[kind] = (h.hexdigest(), len(storages))
    return out


def _all_offloaded(role):
    """Ledger device bytes 0 and every storage of size 0."""
    from megarl.roles.offload import residency, role_storages

    res = residency(role)
    sizes = [s.nbytes() for st in role_storages(role).values() for s in st.values()]
    return all(res[k]["device"] == 0 for k in KINDS) and all(n == 0 for n in sizes) and len(sizes) > 0


def _cycle_checks(role, out, tag):
    """Offload everything, check it is gone, onload, check it is back bit for bit."""
    from megarl.roles.offload import residency

    before = _digest(role)
    full = residency(role)
    role.offload()
    out.setdefault("offloaded_zero", []).append((tag, _all_offloaded(role)))
    after_off = residency(role)
    out.setdefault("host_equals_device", []).append(
        (tag, all(after_off[k]["host"] == full[k]["device"] for k in KINDS)))
    role.onload()
    out.setdefault("restored", []).append((tag, _digest(role) == before))


# ------------------------------------------------------------------------------------------
# Training with offload cycles == training without (SFT- and RL-shaped), at a layout


def _layout_body(rank, world, tp, pp, ckpt_root):
    from megarl.runtime.distributed import init_distributed, teardown

    init_distributed(tp, pp, seed=11)
    out = {"sft": [], "rl": []}
    for precision in ("fp32", "bf16"):
        for distopt in (False, True):
            tag = f"{precision} distopt={distopt}"
            # SFT-shaped: one role, full offload/onload between steps.
            a, ref = _role("a", tp, pp, precision=precision, distopt=distopt), _role("a_ref", tp, pp, precision=precision, distopt=distopt)
            for step in range(2):
                a.train_step(_mbs(step), _lm_loss)
                ref.train_step(_mbs(step), _lm_loss)
                _cycle_checks(a, out, f"sft {tag} step {step}")
            out["sft"].append((tag, _digest(a) == _digest(ref), _digest(a)["optimizer"][1] > 0))
            # RL-shaped: actor (lm) and critic (scalar) take turns; each offloaded while the other trains.
            actor, critic = _role("actor", tp, pp, precision=precision, distopt=distopt), \
                _role("critic", tp, pp, head="scalar", precision=precision, distopt=distopt, seed=6)
            actor_ref, critic_ref = _role("actor_ref", tp, pp, precision=precision, distopt=distopt), \
                _role("critic_ref", tp, pp, head="scalar", precision=precision, distopt=distopt, seed=6)
            critic.offload()
            for step in range(2):
                actor.onload()
                actor.train_step(_mbs(step), _lm_loss)
                actor.offload()
                critic.onload()
                critic.train_step(_mbs(step), _value_loss)
                critic.offload()
                actor_ref.train_step(_mbs(step), _lm_loss)
                critic_ref.train_step(_mbs(step), _value_loss)
            actor.onload()
            critic.onload()
            out["rl"].append((tag, _digest(actor) == _digest(actor_ref), _digest(critic) == _digest(critic_ref)))
    out["ckpt"] = _checkpoint_checks(tp, pp, ckpt_root)
    teardown()
    return out


def _checkpoint_checks(tp, pp, root):
    """Save and load with offloaded roles: bit-exact, and residency as it was."""
    from megarl.checkpoint.distributed import load_checkpoint, save_checkpoint
    from megarl.roles.offload import residency

    actor, critic = _role("actor", tp, pp, precision="bf16"), _role("critic", tp, pp, head="scalar", seed=6)
    actor.train_step(_mbs(0), _lm_loss)
    critic.train_step(_mbs(0), _value_loss)
    saved = {"actor": _digest(actor, ("params", "optimizer")), "critic": _digest(critic, ("params", "optimizer"))}
    actor.offload()
    critic.offload(params=False, grads=False, optimizer=True)
    before = {"actor": residency(actor), "critic": residency(critic)}
    path = save_checkpoint(root, 1, {"actor": actor, "critic": critic}, {"x": 1})
    out = {"save_residency": {"actor": residency(actor), "critic": residency(critic)} == before}
    actor.onload()
    critic.onload()
    out["save_untouched"] = saved == {"actor": _digest(actor, ("params", "optimizer")),
                                      "critic": _digest(critic, ("params", "optimizer"))}
    actor.train_step(_mbs(1), _lm_loss)  # move away from the saved state
    critic.train_step(_mbs(1), _value_loss)
    out["moved"] = saved["actor"] != _digest(actor, ("params", "optimizer"))
    actor.offload()
    critic.offload(params=False, grads=False, optimizer=True)
    before = {"actor": residency(actor), "critic": residency(critic)}
    load_checkpoint(path, {"actor": actor, "critic": critic})
    out["load_residency"] = {"actor": residency(actor), "critic": residency(critic)} == before
    actor.onload()
    critic.onload()
    out["load_exact"] = saved == {"actor": _digest(actor, ("params", "optimizer")),
                                  "critic": _digest(critic, ("params", "optimizer"))}
    return out


def _check_layout(results, tp, pp):
    for rank, out in enumerate(results):
        where = f"tp={tp} pp={pp} rank {rank}"
        for key in ("offloaded_zero", "host_equals_device", "restored"):
            bad = [tag for tag, ok in out[key] if not ok]
            assert not bad, f"{where}: {key} failed for {bad}"
        for tag, same, has_state in out["sft"]:
            assert same and has_state, f"{where}: SFT with offload cycles differs from without ({tag})"
        for tag, same_actor, same_critic in out["rl"]:
            assert same_actor and same_critic, f"{where}: RL with offload differs (actor {same_actor}, critic {same_critic}, {tag})"
        assert out["ckpt"] == {"save_residency": True, "save_untouched": True, "moved": True,
                               "load_residency": True, "load_exact": True}, f"{where}: {out['ckpt']}"


@pytest.mark.parametrize("tp,pp", [(1, 1), pytest.param(2, 1, marks=pytest.mark.slow), pytest.param(1, 2, marks=pytest.mark.slow)])
def test_training_with_offload_cycles_is_bit_identical(tmp_path, tp, pp):
    _check_layout(run_distributed(_layout_body, tp * pp, tp, pp, str(tmp_path / "ckpt")), tp, pp)


# ------------------------------------------------------------------------------------------
# Guards, frozen roles, fp16, the ledger's peak over an RL-like sequence of phases


def _misc_body(rank, world):
    from megarl.roles.offload import OffloadedError, residency
    from megarl.roles.phases import PhaseScheduler
    from megarl.runtime.distributed import init_distributed, teardown

    init_distributed(1, 1, seed=11)
    out = {}

    def raises(fn):
        try:
            fn()
        except OffloadedError as e:
            return str(e)
        return None

    # Mid-accumulation: gradients cannot leave; params/optimizer may.
    a = _role("a")
    a.train_step(_mbs(0), _lm_loss)
    a.forward_backward(_mbs(1), _lm_loss)
    out["mid_accumulation"] = raises(lambda: a.offload())
    out["mid_accumulation_state_kept"] = residency(a)["grads"]["host"] == 0 and residency(a)["params"]["host"] == 0
    # Forward on an offloaded role; a training forward when only the grads are away.
    b = _role("b")
    b.train_step(_mbs(0), _lm_loss)
    b.offload()
    out["forward_offloaded"] = raises(lambda: b.evaluate(_mbs(1), _lm_loss))
    out["train_offloaded"] = raises(lambda: b.train_step(_mbs(1), _lm_loss))
    b.onload()
    b.offload(params=False, grads=True, optimizer=False)
    out["eval_without_grads"] = b.evaluate(_mbs(1), _lm_loss)["loss"]  # allowed: no gradient is written
    out["train_without_grads"] = raises(lambda: b.forward_backward(_mbs(1), _lm_loss))
    b.offload(params=False, grads=False, optimizer=True)
    b.onload(params=False, grads=True, optimizer=False)
    out["step_without_optimizer_state"] = raises(lambda: b.train_step(_mbs(1), _lm_loss))
    b.onload()
    out["guards_removed"] = b.train_step(_mbs(1), _lm_loss).metrics["loss"]
    # Frozen role (no optimizer, no DDP) and fp16 (loss scaler) restore bit-exactly.
    checks = {}
    frozen = _role("frozen", 1, 1, trained=False)
    _cycle_checks(frozen, checks, "frozen")
    out["frozen_kinds"] = {k: v["host"] for k, v in frozen.offload().items()}
    out["frozen_eval_raises"] = raises(lambda: frozen.evaluate(_mbs(0), _lm_loss))
    frozen.onload()
    h16, ref16 = _role("h16", precision="fp16"), _role("h16ref", precision="fp16")
    for step in range(2):
        h16.train_step(_mbs(step), _lm_loss)
        ref16.train_step(_mbs(step), _lm_loss)
        _cycle_checks(h16, checks, f"fp16 step {step}")
    checks["fp16_same"] = [("fp16", _digest(h16) == _digest(ref16))]
    out["cycle_checks"] = checks

    # Peak: four roles, each resident only in its phases.
    roles = {"actor": _role("actor", seed=1), "critic": _role("critic", head="scalar", seed=2),
             "reference": _role("reference", trained=False, seed=1),
             "reward": _role("reward", head="scalar", trained=False, seed=3)}
    roles["actor"].train_step(_mbs(0), _lm_loss)  # materialise Adam's state
    roles["critic"].train_step(_mbs(0), _value_loss)
    full = {n: {k: v["device"] for k, v in residency(r).items()} for n, r in roles.items()}
    actor_params = [p for p in roles["actor"].model.parameters()]
    out["independent_actor_bytes"] = (
        sum(p.numel() * p.element_size() for p in actor_params),
        sum(b.grad_data.numel() * b.grad_data.element_size() for b in roles["actor"].model.buffers),
        2 * sum(p.numel() * 4 for p in actor_params) + 4 * len(actor_params))  # exp_avg, exp_avg_sq, fp32 step
    out["ledger_actor_bytes"] = (full["actor"]["params"], full["actor"]["grads"], full["actor"]["optimizer"])
    sched = PhaseScheduler(roles, {
        "generate": {"actor": ["params"]},
        "score": {"reference": ["params"], "reward": ["params"], "critic": ["params"]},
        "train": {"actor": "all", "critic": "all"},
    })
    for r in roles.values():
        r.offload()
    sched.ledger.reset_peak()
    moves, phases = [], []
    for step in range(1, 3):
        sched.enter("generate")
        phases.append(("generate", sched.ledger.device_bytes()))
        roles["actor"].forward_collect(_mbs(step), lambda b, logits: logits.argmax(-1))
        sched.enter("score")
        phases.append(("score", sched.ledger.device_bytes()))
        for n in ("reference", "reward", "critic"):
            roles[n].forward_collect(_mbs(step), lambda b, out_: out_.float().sum())
        n_events = len(sched.ledger.events)
        sched.enter("train")
        moves.append([e[2] for e in sched.ledger.events[n_events:] if e[2] != "refresh"])
        phases.append(("train", sched.ledger.device_bytes()))
        roles["actor"].train_step(_mbs(step), _lm_loss)
        roles["critic"].train_step(_mbs(step), _value_loss)
    out["peak"] = sched.ledger.peak_device_bytes
    out["phase_peaks"] = dict(sched.ledger.phase_peak_bytes)
    out["needs"] = {p: sched.need_bytes(p, full) for p in sched.phases}
    out["sum_all"] = sum(sum(v.values()) for v in full.values())
    out["phases"] = phases
    out["moves_into_train"] = moves
    teardown()
    return out


def test_guards_frozen_fp16_and_peak():
    out = run_distributed(_misc_body, 1)[0]
    assert out["mid_accumulation"] and "gradient accumulation" in out["mid_accumulation"]
    assert out["mid_accumulation_state_kept"]
    for key in ("forward_offloaded", "train_offloaded", "train_without_grads", "step_without_optimizer_state",
                "frozen_eval_raises"):
        assert out[key] and "offloaded" in out[key] and "onload" in out[key], (key, out[key])
    assert out["eval_without_grads"] > 0 and out["guards_removed"] > 0
    for key, results in out["cycle_checks"].items():
        assert all(ok for _, ok in results), (key, results)
    assert out["frozen_kinds"]["params"] > 0 and out["frozen_kinds"]["grads"] == out["frozen_kinds"]["optimizer"] == 0
    assert out["ledger_actor_bytes"] == out["independent_actor_bytes"]
    needs = out["needs"]
    print(f"\npeak device bytes {out['peak']} = largest phase {max(needs.values())} "
          f"(phases {needs}); sum of the roles {out['sum_all']}")
    assert out["peak"] == max(needs.values()) < out["sum_all"]
    for phase, got in out["phases"]:
        assert got == needs[phase], (phase, got, needs[phase])
    assert out["phase_peaks"] == needs
    # score -> train moves only what changes: critic keeps its params and gains grads+optimizer.
    for moves in out["moves_into_train"]:
        assert "onload grads,optimizer" in moves and "onload params,grads,optimizer" in moves, moves


# ------------------------------------------------------------------------------------------
# CUDA: the same storage path with pinned buffers and the side stream (no megatron-core needed)


class _BareRole:
    """What offload needs from a role: a name, model chunks, and a megatron-like optimizer
    (an object whose `.optimizer` is a torch optimizer)."""

    def __init__(self, module, optimizer):
        self.name, self.chunks = "bare", [module]
        self.optimizer = type("Opt", (), {})()
        self.optimizer.optimizer = optimizer


@pytest.mark.gpu
def test_cuda_offload_is_bit_exact_and_frees_device_memory():
    from megarl.roles import offload

    torch.manual_seed(0)
    module = torch.nn.Sequential(torch.nn.Linear(256, 1024), torch.nn.GELU(), torch.nn.Linear(1024, 256)).cuda()
    opt = torch.optim.AdamW(module.parameters(), lr=1e-3)
    module(torch.randn(8, 256, device="cuda")).square().sum().backward()
    opt.step()
    role = _BareRole(module, opt)
    before = {k: [_clone_bytes(s) for s in v.values()] for k, v in offload.role_storages(role).items()}
    allocated = torch.cuda.memory_allocated()
    res = offload.offload(role)
    assert all(v["device"] == 0 and v["host"] > 0 for v in res.values()), res
    freed = allocated - torch.cuda.memory_allocated()
    assert freed >= sum(v["host"] for v in res.values()), (freed, res)
    with pytest.raises(offload.OffloadedError):
        module(torch.randn(8, 256, device="cuda"))
    offload.onload(role, wait=False)
    offload.wait_onload(role)
    after = {k: [_clone_bytes(s) for s in v.values()] for k, v in offload.role_storages(role).items()}
    assert all(torch.equal(a, b) for k in before for a, b in zip(before[k], after[k]))
    module(torch.randn(8, 256, device="cuda")).square().sum().backward()
    opt.step()  # trains on after the move


def _clone_bytes(s):
    return torch.empty(0, dtype=torch.uint8, device=s.device).set_(s, 0, (s.nbytes(),), (1,)).clone().cpu()
