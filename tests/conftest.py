"""Fixtures shared across test modules."""

from __future__ import annotations

import pytest
import torch

from tests.helpers.corpus import prepare_corpus

# The CPU tier runs the same on a machine with a GPU: neither its tests nor the worker
# processes they start see the GPU (so they pick gloo and the CPU, as everywhere else), while
# the tests marked `cuda` keep it. Asking once here, before any test hides the GPU, fixes
# what this process's CUDA runtime sees.
CUDA_IN_THIS_PROCESS = torch.cuda.is_available()


@pytest.fixture(autouse=True)
def _cpu_tier_sees_no_gpu(request, monkeypatch):
    if request.node.get_closest_marker("cuda") is None:
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
        monkeypatch.setattr(torch.cuda, "is_available", lambda: False)


@pytest.fixture(scope="session")
def tiny_corpus(tmp_path_factory):
    """A prepared corpus at sequence length 64 (generated text, a 70-token vocabulary)."""
    return prepare_corpus(tmp_path_factory.mktemp("tiny_corpus"))
