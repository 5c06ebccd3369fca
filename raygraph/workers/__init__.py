"""Role workers in plain PyTorch (no Ray): policy, reference, critic, reward, rollout.

Classes are imported lazily so that `import raygraph.workers` stays cheap and a role's
dependencies load only when it is used.
"""

from __future__ import annotations

import importlib
from typing import Any

__all__ = [
    "CriticWorker", "HFRolloutWorker", "PolicyWorker", "ReferenceWorker", "RemoteRewardWorker",
    "EnvRewardWorker", "RewardModelWorker", "RuleRewardWorker", "VLLMRolloutWorker",
]

_MODULES = {
    "CriticWorker": "raygraph.workers.critic",
    "HFRolloutWorker": "raygraph.workers.rollout_hf",
    "PolicyWorker": "raygraph.workers.policy",
    "ReferenceWorker": "raygraph.workers.reference",
    "EnvRewardWorker": "raygraph.workers.reward_env",
    "RemoteRewardWorker": "raygraph.workers.reward_remote",
    "RewardModelWorker": "raygraph.workers.reward_model",
    "RuleRewardWorker": "raygraph.workers.reward_rule",
    "VLLMRolloutWorker": "raygraph.workers.rollout_vllm",
}


def __getattr__(name: str) -> Any:
    if name not in _MODULES:
        raise AttributeError(f"module 'raygraph.workers' has no attribute {name!r}")
    return getattr(importlib.import_module(_MODULES[name]), name)


def __dir__() -> list[str]:
    return sorted(__all__)
