"""CUDA-only checks (marker ``gpu``): skipped cleanly without a CUDA GPU.

Run them on a lent GPU machine first, before any measurement:
    python3 -m pytest tests/gpu -m gpu -q
Each uses the tiny built-in model and is meant to finish in well under a minute on an H100.
"""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.gpu.scenarios import CUDA


def pytest_collection_modifyitems(config, items):
    here = Path(__file__).parent
    for item in items:
        if here in Path(str(item.fspath)).parents:
            item.add_marker(pytest.mark.gpu)
            if not torch.cuda.is_available():
                item.add_marker(pytest.mark.skip(reason="needs a CUDA GPU"))


@pytest.fixture
def cuda_config(tiny_config):
    """The tiny model trained on the GPU, in float32 with the cheap defaults of tiny_config."""
    def make(*overrides: str):
        return tiny_config(*CUDA, *overrides)
    return make


@pytest.fixture(autouse=True)
def fresh_dynamo():
    import torch._dynamo

    torch._dynamo.reset()
    yield
    torch._dynamo.reset()
