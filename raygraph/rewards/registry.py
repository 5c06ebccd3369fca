"""Rule rewards share ONE signature and live in a registry keyed by name and data_source.

    fn(response_text: str, ground_truth: str, extra_info: dict | None) -> RewardResult

`RewardResult.score` is the scalar reward of the whole response; `extras` are per-response
metrics (e.g. ``acc``, ``format_ok``) that the reward workers expose as ``reward_extra.<name>``
columns. Built-in entries are registered at import time, user entries when a plugin is imported
(`raygraph.register_reward`), and a name is never rebound, so lookups are pure; a name may also
be a `file.py:fn` reference, looked up without registering it. A user function may return a
plain number (it becomes `RewardResult(score)`). Tests that need other entries build their own
`RewardRegistry`.
"""

from __future__ import annotations

import functools
import inspect
import numbers
from collections.abc import Callable
from dataclasses import dataclass, field

from raygraph.algos.user_code import UserCodeError, is_code_ref, load_function

__all__ = ["RewardResult", "RewardFn", "RewardRegistry", "as_reward_result"]


@dataclass(frozen=True)
class RewardResult:
    """Score of one response and its extra metrics (all floats)."""

    score: float
    extras: dict[str, float] = field(default_factory=dict)


RewardFn = Callable[[str, str, "dict | None"], RewardResult]


class RewardRegistry:
    """Reward functions by name, and the data sources each one scores."""

    def __init__(self) -> None:
        self._fns: dict[str, RewardFn] = {}
        self._by_source: dict[str, str] = {}

    def register(self, name: str, *, sources: tuple[str, ...] = ()) -> Callable[[RewardFn], RewardFn]:
        """Decorator registering `fn` as `name`, the reward for every data source in `sources`.

        Raises:
            ValueError: when the name or a data source is already taken.
        """

        def decorator(fn: RewardFn) -> RewardFn:
            if name in self._fns:
                raise ValueError(f"reward function {name!r} is already registered")
            if not isinstance(name, str) or not name or is_code_ref(name):
                raise ValueError(f"reward function name {name!r} must be a non-empty string without ':'")
            _check_signature(fn, name)
            taken = [s for s in sources if s in self._by_source]
            if taken:
                raise ValueError(f"data sources {taken} already have a reward function")
            self._fns[name] = fn
            self._by_source.update({s: name for s in sources})
            return fn

        return decorator

    def names(self) -> tuple[str, ...]:
        """All registered reward names, sorted."""
        return tuple(sorted(self._fns))

    def sources(self) -> tuple[str, ...]:
        """All data sources that have a reward, sorted."""
        return tuple(sorted(self._by_source))

    def get(self, name: str) -> RewardFn:
        """The reward function registered as `name` or referenced as `file.py:fn` (its result made a
        `RewardResult`); ValueError listing valid names otherwise."""
        if name in self._fns:
            return self._fns[name]
        if is_code_ref(name):
            fn = load_function(name)
            _check_signature(fn, name)
            return as_reward_result(fn)
        raise ValueError(f"unknown reward function {name!r}; valid names: "
                         f"{', '.join(self.names())} (or a reference to your own: file.py:function)")

    def score_for_source(self, data_source: str) -> RewardFn:
        """The reward function for `data_source`; ValueError listing known sources otherwise."""
        if data_source not in self._by_source:
            raise ValueError(f"no rule reward for data_source {data_source!r}; known data sources: "
                             f"{', '.join(self.sources())} (or name a function explicitly)")
        return self._fns[self._by_source[data_source]]

    def __contains__(self, name: object) -> bool:
        return name in self._fns


def _check_signature(fn: Callable, name: str) -> None:
    try:
        inspect.signature(fn).bind("response", "ground truth", None)
    except TypeError as exc:
        raise UserCodeError(f"reward function {name!r} must take (response_text, ground_truth, extra_info): "
                            f"{exc}") from None
    except ValueError:   # no signature to inspect (a builtin): trust it
        pass


def as_reward_result(fn: Callable) -> RewardFn:
    """`fn` with a plain-number result turned into `RewardResult(score)` (a `RewardResult` passes)."""

    @functools.wraps(fn)
    def scored(response_text: str, ground_truth: str, extra_info: dict | None) -> RewardResult:
        result = fn(response_text, ground_truth, extra_info)
        if isinstance(result, RewardResult):
            return result
        if isinstance(result, numbers.Real):
            return RewardResult(float(result))
        raise TypeError(f"reward function {fn.__name__!r} returned {type(result).__name__}; "
                        "return a number or a RewardResult")

    return scored
