"""Where a role's parameters and micro-batches live: on the rank's device. Data is built on the
host and moves to the device micro-batch by micro-batch, inside the schedule's forward step
(roles/role.py); a model is moved to the GPU once it is built (models/gpt.py), as Megatron-LM's
get_model does. The CPU test checks the move itself on the meta device; the GPU tests run a
stage end to end (both found missing on the first GPU machine this project was lent: megatron-core
builds norms and megarl's scalar head on the host, and every batch stayed there)."""
import os

import pytest
import torch

from megarl_run import TINY, megarl, train_losses


def test_micro_batch_tensors_move_and_everything_else_passes_through():
    from megarl.roles.microbatch import MicroBatch

    batch = MicroBatch.of({
        "tokens": torch.arange(14).view(2, 7), "position_ids": torch.arange(7).expand(2, 7),
        "last": torch.tensor([2, 6]), "attention_mask": None, "return_hidden": True, "output_from": 3})
    assert set(batch.data) == {"last"}, "model keys are fields, the rest is the loss's data"
    moved = batch.to(torch.device("meta"))
    assert moved.tokens.device.type == "meta" and moved["last"].device.type == "meta"
    assert moved.attention_mask is None and moved.return_hidden is True and moved.output_from == 3
    assert batch.tokens.device.type == "cpu", "the host batch is left as it was"
    same = batch.to(torch.device("cpu"))
    assert same.tokens is batch.tokens, "on the device already: no copy"
    assert moved.model_kwargs() == {"output_from": 3, "return_hidden": True}


@pytest.mark.gpu
def test_role_parameters_are_on_the_gpu(monkeypatch):
    from megarl.config.schema import ModelConfig, OptimConfig, ParallelConfig
    from megarl.roles.role import Role
    from megarl.runtime.distributed import init_distributed, teardown

    for name in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.setenv(name, os.environ.get(name, ""))  # restored after: later CLI runs start clean
        monkeypatch.delenv(name)
    init_distributed(1, 1, seed=1)
    try:
        mc = ModelConfig(num_layers=2, hidden_size=64, ffn_hidden_size=128, num_attention_heads=4, num_kv_heads=4,
                         vocab_size=256, max_position_embeddings=64)
        for head in ("lm", "scalar"):
            role = Role("actor", mc, ParallelConfig(), head=head, precision="bf16", seed=1, optim=OptimConfig())
            assert {p.device.type for c in role.chunks for p in c.parameters()} == {"cuda"}, head
    finally:
        teardown()


@pytest.mark.gpu
def test_sft_trains_in_bf16_on_the_gpu(tmp_path):
    run = tmp_path / "run"
    megarl(["sft", "--config", "configs/tiny_sft.yaml", f"train.run_dir={run}", *TINY, "train.steps=20",
            "train.precision=bf16", "train.eval_interval=20", "optim.lr=3e-3"])
    losses = train_losses(run / "sft")
    assert len(losses) == 20 and sum(losses[-5:]) / 5 < losses[0], losses
