"""One prefill per prompt (issue 25): the n samples of a prompt share its prefill (its KV entries
copied to their rows) and are the same samples as when every row is prefilled on its own, at one
process and at PP2 (where the sampled rows are spread over pipeline micro-batches)."""
import pytest
import torch

from dist_helpers import run_distributed


def _body(rank, world_size, pp):
    import megarl.rollout.engine as E
    from megarl.config import ModelConfig, ParallelConfig
    from megarl.roles.role import Role
    from megarl.rollout.engine import MegatronRolloutEngine, SamplingParams
    from megarl.runtime.distributed import init_distributed, teardown

    init_distributed(1, pp, seed=3)
    mc = ModelConfig(num_layers=2, hidden_size=64, ffn_hidden_size=96, num_attention_heads=4, num_kv_heads=2,
                     vocab_size=100, max_position_embeddings=48, init_std=0.1)
    role = Role("actor", mc, ParallelConfig(pp=pp), head="lm", seed=9)
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(1, 100, (n,), generator=g).tolist() for n in (5, 9, 5, 3)]
    params = SamplingParams(n=4, temperature=1.0, max_new_tokens=10, stop_ids=(7,))
    engine = MegatronRolloutEngine(role, vocab_size=100, pad_id=0, max_batch_size=8)
    shared = engine.generate(prompts, params, seed=5, sample_offset=16)
    runs = E._prompt_runs
    E._prompt_runs = lambda p: (torch.arange(len(p)), torch.arange(len(p)))  # every row prefilled alone
    try:
        alone = engine.generate(prompts, params, seed=5, sample_offset=16)
    finally:
        E._prompt_runs = runs
    teardown()
    return shared, alone


@pytest.mark.parametrize("pp", [1, pytest.param(2, marks=pytest.mark.slow)])
def test_samples_of_a_shared_prefill_equal_separate_prefills(pp):
    shared, alone = run_distributed(_body, pp, pp)[-1]
    assert shared.stats["prefill_rows"] == 4 and alone.stats["prefill_rows"] == 16  # 4 prompts x 4 samples
    assert torch.equal(shared.tokens, alone.tokens) and torch.equal(shared.response_lens, alone.response_lens)
    torch.testing.assert_close(shared.logprobs, alone.logprobs, atol=1e-5, rtol=0)


def test_prompt_runs():
    from megarl.rollout.engine import _prompt_runs

    first, expand = _prompt_runs([[1, 2], [1, 2], [3], [1, 2], [1, 2], [1, 2]])
    assert first.tolist() == [0, 2, 3] and expand.tolist() == [0, 0, 1, 2, 2, 2]
