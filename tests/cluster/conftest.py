"""Fixtures for the Ray-layer tests: dummy workers shipped to actors by value."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
import _dummies  # noqa: E402


@pytest.fixture(scope="session")
def dummies(ray_local):
    """The dummy worker module, pickled by value so that actors need not import the tests."""
    ray_local.cloudpickle.register_pickle_by_value(_dummies)
    return _dummies
