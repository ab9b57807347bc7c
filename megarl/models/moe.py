"""Mixture-of-experts models on megatron-core's MoE layer (router, token dispatcher, experts).

megarl adds no MoE maths: `gpt.moe_fields` maps `model.moe` onto TransformerConfig and the
layer spec, `layout.py` gives experts canonical (global) names, and this module holds what
megarl needs around megatron-core's layer.
"""
from __future__ import annotations

import contextlib
import functools

import torch


def patch_megatron() -> None:
    """megatron-core 0.16's router GEMM reads `te_general_gemm`, which its moe_utils defines only
    when Transformer Engine imports: without TE every router forward raises NameError. Defining it
    as None selects the torch GEMM that follows, as intended. Idempotent."""
    from megatron.core.transformer.moe import moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None


# ------------------------------------------------------------------ routing replay
# Routing replay (R3): the experts the rollout chose for each token are forced in the training
# forward, through megatron-core's own hook (`TopKRouter.router_replay`, a RouterReplay): the
# router still computes its scores, and the combine weights are its probabilities at the forced
# experts, so gradients reach the router weights of those experts as megatron-core defines them.
# A routing tensor is [b, s, layers, k] (this pipeline stage's MoE layers), -1 where a token's
# routing is unknown (a row's last token, which generation never feeds back; padding): there the
# router keeps its own choice.


def routers(model) -> list:
    """This stage's TopKRouters in layer order, each with megarl's replay hook attached."""
    from megatron.core.transformer.moe.router import TopKRouter

    from megarl.models.layout import unwrap

    out = [m for m in unwrap(model).modules() if isinstance(m, TopKRouter)]
    for r in out:
        if not isinstance(r.router_replay, _replay_class()):
            r.router_replay = _replay_class()()
    return out


@functools.cache
def _replay_class():
    from megatron.core.transformer.moe.router_replay import RouterReplay, RouterReplayAction

    class Replay(RouterReplay):
        """megatron-core's RouterReplay without its process-wide registry (each model holds its
        own), recording every forward's indices (not only the last), and replaying per token:
        a token whose target is -1 keeps the router's own top-k."""

        def __init__(self):  # no super().__init__: it appends to RouterReplay's global list
            self.target_topk_idx = self.recorded_topk_idx = self.router_replay_action = None
            self.replay_backward_list, self.recorded, self.record = [], [], False

        def record_indices(self, topk_indices):
            self.recorded.append(topk_indices.detach())

        def get_replay_topk(self, scores, topk, num_groups=None, group_topk=None, default_compute_topk=None):
            if self.router_replay_action is not RouterReplayAction.REPLAY_FORWARD:
                return super().get_replay_topk(scores, topk, num_groups, group_topk, default_compute_topk)
            own = default_compute_topk(scores, topk, num_groups=num_groups, group_topk=group_topk)[1]
            target = self.target_topk_idx.to(scores.device)
            if target.shape != own.shape:
                raise ValueError(f"routing replay: {tuple(target.shape)} recorded experts for a forward of "
                                 f"{tuple(own.shape)} (tokens, top-k)")
            idx = torch.where(target >= 0, target.long(), own)
            if self.record:  # the experts this forward used
                self.recorded.append(idx.detach())
            return scores.gather(1, idx), idx

    return Replay


@contextlib.contextmanager
def recording(model):
    """Within the block every router records the experts of each forward (its top-k, or the
    replayed ones); yields the routers, whose `router_replay.recorded` lists hold [tokens, k]
    per forward ([s, b] order)."""
    from megatron.core.transformer.moe.router_replay import RouterReplayAction

    rs = routers(model)
    for r in rs:
        r.router_replay.recorded, r.router_replay.record = [], True
        r.router_replay.router_replay_action = RouterReplayAction.RECORD
    try:
        yield rs
    finally:
        for r in rs:
            r.router_replay.router_replay_action, r.router_replay.record = None, False


def recorded(rs, call: int = -1) -> torch.Tensor:
    """Forward `call`'s top-k of every router as [tokens, layers, k] ([s, b] token order)."""
    return torch.stack([r.router_replay.recorded[call] for r in rs], 1)


@contextlib.contextmanager
def replaying(model, routing: torch.Tensor):
    """Within the block (one forward) every router takes the experts of `routing` [b, s, layers, k]
    (-1: its own choice). Under sequence parallelism the router sees this TP rank's share of s."""
    from megatron.core import parallel_state as ps
    from megatron.core.transformer.moe.router_replay import RouterReplayAction

    rs = routers(model)
    if routing.shape[2] != len(rs):
        raise ValueError(f"routing replay: routing for {routing.shape[2]} MoE layers, the model has {len(rs)} here")
    target = routing.transpose(0, 1)  # [s, b, layers, k]
    if rs and rs[0].config.sequence_parallel:
        target = target.chunk(ps.get_tensor_model_parallel_world_size())[ps.get_tensor_model_parallel_rank()]
    target = target.reshape(-1, *target.shape[2:])  # [s * b, layers, k]
    for i, r in enumerate(rs):
        r.router_replay.target_topk_idx = target[:, i]
        r.router_replay.router_replay_action = RouterReplayAction.REPLAY_FORWARD
    try:
        yield
    finally:
        for r in rs:
            r.router_replay.target_topk_idx = None
            r.router_replay.router_replay_action = RouterReplayAction.RECORD if r.router_replay.record else None


def agreement(a: torch.Tensor, b: torch.Tensor) -> tuple[float, int]:
    """(tokens x layers whose expert sets are equal, tokens x layers compared) of two routings
    [..., k], over the entries both know (>= 0)."""
    known = (a >= 0).all(-1) & (b >= 0).all(-1)
    same = (a.sort(-1).values == b.sort(-1).values).all(-1) & known
    return float(same.sum()), int(known.sum())
