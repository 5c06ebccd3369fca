"""The rollout engines by name (`rollout.engine`): the one table the role builders and the tests
read. Each entry satisfies `raygraph.workers.rollout_engine.RolloutEngine` (tests/test_layers.py)."""

from __future__ import annotations

from raygraph.workers.rollout_engine import RolloutEngine
from raygraph.workers.rollout_hf import HFRolloutWorker
from raygraph.workers.rollout_vllm import VLLMRolloutWorker

__all__ = ["ROLLOUT_ENGINES"]

ROLLOUT_ENGINES: dict[str, type[RolloutEngine]] = {"hf": HFRolloutWorker, "vllm": VLLMRolloutWorker}
