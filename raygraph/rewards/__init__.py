"""Rule rewards (exact-match math, GSM8K, the toy task) behind one signature, by name and by
`data_source`; see `raygraph.rewards.rules` for the table of built-in rules.

    from raygraph.rewards import score_for_source
    result = score_for_source("openai/gsm8k")(response_text, "42", None)
    result.score, result.extras["acc"], result.extras["format_ok"]
"""

from __future__ import annotations

from raygraph.rewards.registry import RewardFn, RewardRegistry, RewardResult, as_reward_result
from raygraph.rewards.rules import REWARDS

__all__ = ["RewardResult", "RewardFn", "RewardRegistry", "REWARDS", "names", "get",
           "score_for_source", "register_reward"]


def register_reward(name: str, fn=None, *, sources: tuple[str, ...] = ()):
    """Register a user reward function as `name` (call it from a plugin, see
    docs/custom-algorithm.md), and as the reward of every data source in `sources`.

    `fn(response_text, ground_truth, extra_info)` returns a number or a `RewardResult`. Use as a
    call or as the decorator `@register_reward("x")`.

    Raises:
        ValueError: the name or a data source is taken, or `fn` does not take the three arguments.
    """
    if fn is None:
        return lambda f: register_reward(name, f, sources=sources)
    REWARDS.register(name, sources=tuple(sources))(as_reward_result(fn))
    return fn


def names() -> tuple[str, ...]:
    """Names of the registered reward functions (valid values of a config's reward function,
    besides `file.py:fn` references)."""
    return REWARDS.names()


def get(name: str) -> RewardFn:
    """The reward function `name` (or `file.py:fn`); ValueError listing valid names otherwise."""
    return REWARDS.get(name)


def score_for_source(data_source: str) -> RewardFn:
    """The reward for rows of `data_source`; ValueError listing the known data sources."""
    return REWARDS.score_for_source(data_source)
