"""Rule rewards (exact-match math, GSM8K, the toy task) behind one signature, by name and by
`data_source`; see `raygraph.rewards.rules` for the table of built-in rules.

    from raygraph.rewards import score_for_source
    result = score_for_source("openai/gsm8k")(response_text, "42", None)
    result.score, result.extras["acc"], result.extras["format_ok"]
"""

from __future__ import annotations

from raygraph.rewards.registry import RewardFn, RewardRegistry, RewardResult
from raygraph.rewards.rules import REWARDS

__all__ = ["RewardResult", "RewardFn", "RewardRegistry", "REWARDS", "names", "get",
           "score_for_source"]


def names() -> tuple[str, ...]:
    """Names of the built-in reward functions (valid values of a config's reward function)."""
    return REWARDS.names()


def get(name: str) -> RewardFn:
    """The built-in reward function `name`; ValueError listing valid names otherwise."""
    return REWARDS.get(name)


def score_for_source(data_source: str) -> RewardFn:
    """The reward for rows of `data_source`; ValueError listing the known data sources."""
    return REWARDS.score_for_source(data_source)
