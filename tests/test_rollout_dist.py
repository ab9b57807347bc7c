"""Rollout engine at TP2 and PP2: the same samples, log-probs and stops as the single process.

Same seed, same layout-invariant weights: every rank of the layout must return the very
Rollout the (1, 1) run returns (sampled tokens compared exactly; log-probs within fp noise).
"""
import pytest
import torch

from dist_helpers import run_distributed
from test_rollout import PAD, VOCAB, _model_cfg, _prompts

PARAMS = dict(n=3, temperature=0.8, top_k=30, top_p=0.95, max_new_tokens=9, stop_ids=(7, 11, 42, 90, 63))


def _layout_body(rank, world_size, tp, pp):
    from megarl.config import ParallelConfig
    from megarl.roles.role import Role
    from megarl.rollout.engine import MegatronRolloutEngine, SamplingParams
    from megarl.runtime.distributed import init_distributed, teardown

    init_distributed(tp, pp, seed=11)
    role = Role("actor", _model_cfg(), ParallelConfig(tp=tp, pp=pp), head="lm", seed=5)
    eng = MegatronRolloutEngine(role, vocab_size=VOCAB, pad_id=PAD, max_batch_size=8)
    r = eng.generate(_prompts(), SamplingParams(**PARAMS), seed=77)
    teardown()
    return r


@pytest.fixture(scope="module")
def reference():
    return run_distributed(_layout_body, 1, 1, 1)[0]


@pytest.mark.slow
@pytest.mark.parametrize("tp,pp", [(2, 1), (1, 2)])
def test_layouts_draw_the_same_samples(reference, tp, pp):
    ref = reference
    assert ref.stopped.any() and not ref.stopped.all(), "stops must end some rows and not others"
    assert ref.stats["compactions"] > 0, "finished rows must leave the cache in this test"
    for rank, r in enumerate(run_distributed(_layout_body, tp * pp, tp, pp)):
        assert torch.equal(r.tokens, ref.tokens), f"rank {rank} at tp={tp} pp={pp} drew other samples"
        assert torch.equal(r.response_lens, ref.response_lens) and torch.equal(r.stopped, ref.stopped)
        assert torch.equal(r.response_mask, ref.response_mask)
        err = (r.logprobs - ref.logprobs).abs().max().item()
        assert err < 1e-4, f"rank {rank} at tp={tp} pp={pp}: log-probs differ by {err:.2e} from one process"
