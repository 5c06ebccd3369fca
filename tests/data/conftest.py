"""Fixtures for data tests: the tiny character tokenizer (built in code, nothing loaded)."""

from __future__ import annotations

import pytest

from raygraph.models.tiny import build_tiny_tokenizer


@pytest.fixture(scope="session")
def char_tokenizer():
    return build_tiny_tokenizer()
