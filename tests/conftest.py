import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))  # tests/dist_helpers.py importable everywhere


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU; none on this machine")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


@pytest.fixture(params=["cpu-kernel", "torch"])
def row_path(request, monkeypatch):
    """The log-prob row passes on fp32 CPU logits both ways: megarl._cpu's logprob_stats /
    logprob_grad (where built) and the torch path. Tests in spawned processes (slow) run the
    default path only: a monkeypatch here does not reach them."""
    from megarl.ops import logprobs

    if request.param == "torch":
        if "slow" in request.node.keywords:
            pytest.skip("spawned processes run the default row path")
        monkeypatch.setattr(logprobs, "_cpu_kernels", lambda x: None)
    elif logprobs._cpu_kernels(torch.zeros(1, 1)) is None:
        pytest.skip("megarl._cpu is not built here")
    return request.param
