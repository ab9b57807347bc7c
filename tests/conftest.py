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
