"""Fixtures shared across test modules."""

from __future__ import annotations

import pytest

from tests.corpus import prepare_corpus


@pytest.fixture(scope="session")
def tiny_corpus(tmp_path_factory):
    """A prepared corpus at sequence length 64 (generated text, a 70-token vocabulary)."""
    return prepare_corpus(tmp_path_factory.mktemp("tiny_corpus"))
