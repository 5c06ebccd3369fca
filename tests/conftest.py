"""Shared fixtures: one tiny model per session and one local Ray instance per session."""

from __future__ import annotations

import os

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("RAY_DEDUP_LOGS", "0")
torch.set_num_threads(2)


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


@pytest.fixture(scope="session")
def tiny_model_path(tmp_path_factory) -> str:
    """A random-init tiny Qwen2 causal LM + char tokenizer saved with save_pretrained."""
    from raygraph.models.tiny import build_tiny_lm

    return str(build_tiny_lm(tmp_path_factory.mktemp("tiny_lm"), seed=0))


@pytest.fixture(scope="session")
def tiny_rm_path(tmp_path_factory) -> str:
    """A random-init tiny one-label sequence classifier (reward model)."""
    from raygraph.models.tiny import build_tiny_reward_model

    return str(build_tiny_reward_model(tmp_path_factory.mktemp("tiny_rm"), seed=0))


@pytest.fixture(scope="session")
def ray_local():
    """One local Ray instance for the whole test session (8 logical CPUs on 2 real cores)."""
    import ray

    if not ray.is_initialized():
        ray.init(num_cpus=8, include_dashboard=False, log_to_driver=True,
                 runtime_env={"env_vars": {"TOKENIZERS_PARALLELISM": "false", "OMP_NUM_THREADS": "1",
                                           "HF_HUB_OFFLINE": "1"}})
    yield ray
    # Ray is shut down at interpreter exit; tests that need a fresh cluster start their own.
