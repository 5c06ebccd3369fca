"""The environment contract: what a user's environment class is, and how raygraph calls it.

    class MyEnv:
        def __init__(self, row: dict, **env_args): ...        # one instance per episode
        def step(self, response: str):                          # or `async def step`
            return observation, reward, done                    # or {"observation": ..., "reward": ..., "done": ...}
        def close(self): ...                                    # optional; always called, also on failure

* `row` is the episode's data row: `prompt` (the chat messages), `reward_model` (with
  `ground_truth`), `extra_info`, `data_source`, as in the dataset.
* `step` is called after every model turn with the text of that turn (special tokens removed;
  a `step` that also takes a `tool_calls` keyword gets the turn's parsed `ToolCall`s);
  `observation` (a string, or None for no message) becomes the next user message; `reward`
  (a number) may come at any turn and is placed on the last token of the turn it follows;
  `done=True` ends the episode.
* `env_args` come from `rollout.agent.env_args`, checked against the class's keyword arguments
  when the config is read (`check_env_args`).

An environment is named by reference (`my_env.py:MyEnv`, `package.module:MyEnv`) or by a name in
`ENVIRONMENTS` (built-ins, or ones a plugin adds with `register_env`).
"""

from __future__ import annotations

import difflib
import importlib
import inspect
import math
import numbers
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from raygraph.algos.user_code import UserCodeError, is_code_ref, load_attribute

__all__ = ["ENVIRONMENTS", "EnvContractError", "EnvStep", "as_env_step", "check_env_args", "load_env",
           "register_env"]

# name -> "module:Class" (imported on first use) or the class itself
ENVIRONMENTS: dict[str, Any] = {
    "reveal_then_answer": "raygraph.agents.builtin_envs:RevealThenAnswerEnv",
    "retry_with_feedback": "raygraph.agents.builtin_envs:RetryWithFeedbackEnv",
    "tool_answer": "raygraph.agents.builtin_envs:ToolAnswerEnv",
}


class EnvContractError(UserCodeError):
    """An environment that does not keep the contract (a bad `step` result, a class that cannot
    be built with the configured `env_args`)."""


@dataclass(frozen=True)
class EnvStep:
    """What one `step` returned, checked."""
    observation: str | None
    reward: float
    done: bool


def register_env(name: str, cls: type) -> type:
    """Make `cls` available as `rollout.agent.env: <name>` (a plugin calls this at import)."""
    if name in ENVIRONMENTS and ENVIRONMENTS[name] is not cls:
        raise EnvContractError(f"environment {name!r} is already registered")
    ENVIRONMENTS[name] = cls
    return cls


def load_env(ref: str) -> type:
    """The environment class named by `ref` (a registered name, `file.py:Class` or `module:Class`)."""
    if not is_code_ref(ref):
        if ref not in ENVIRONMENTS:
            close = difflib.get_close_matches(ref, list(ENVIRONMENTS), n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise EnvContractError(f"unknown environment {ref!r}{hint}; registered: {', '.join(sorted(ENVIRONMENTS))}, "
                                   "or reference your class as my_env.py:MyEnv")
        entry = ENVIRONMENTS[ref]
        if isinstance(entry, str):
            module, _, attr = entry.partition(":")
            entry = getattr(importlib.import_module(module), attr)
        return entry
    return load_attribute(ref, _is_env_class, "environment class with a step(response) method", EnvContractError)


def _is_env_class(value: object) -> bool:
    return inspect.isclass(value) and callable(getattr(value, "step", None))


def check_env_args(cls: type, env_args: Mapping[str, Any]) -> list[str]:
    """Problems of `env_args` for `cls(row, **env_args)`: unknown keys (with a did-you-mean) and
    required keyword arguments not given; one line each, empty when they fit."""
    params = list(inspect.signature(cls).parameters.values())[1:]   # after `row`
    if any(p.kind is p.VAR_KEYWORD for p in params):
        return []
    names = [p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
    problems = []
    for key in env_args:
        if key not in names:
            close = difflib.get_close_matches(key, names, n=1, cutoff=0.6)
            hint = f" (did you mean rollout.agent.env_args.{close[0]}?)" if close else ""
            problems.append(f"rollout.agent.env_args.{key} is not an argument of {cls.__name__}{hint}; "
                            f"it takes: {', '.join(names) or 'none'}")
    for p in params:
        if p.default is p.empty and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY) and p.name not in env_args:
            problems.append(f"rollout.agent.env_args.{p.name} is required by {cls.__name__}")
    return problems


def as_env_step(value: Any, env: object) -> EnvStep:
    """`value` (a 3-tuple or a dict with `observation`, `reward`, `done`) as an `EnvStep`, or an
    `EnvContractError` naming the environment and what is wrong."""
    name = type(env).__name__
    if isinstance(value, Mapping):
        missing = [k for k in ("observation", "reward", "done") if k not in value]
        if missing:
            raise EnvContractError(f"{name}.step returned a dict without {', '.join(missing)}")
        observation, reward, done = value["observation"], value["reward"], value["done"]
    elif isinstance(value, tuple) and len(value) == 3:
        observation, reward, done = value
    else:
        raise EnvContractError(f"{name}.step must return (observation, reward, done) or a dict with those keys; "
                               f"it returned {type(value).__name__}")
    if observation is not None and not isinstance(observation, str):
        raise EnvContractError(f"{name}.step returned an observation of type {type(observation).__name__}; "
                               "it must be a string or None")
    if isinstance(reward, bool) or not isinstance(reward, numbers.Real) or not math.isfinite(reward):
        raise EnvContractError(f"{name}.step returned reward {reward!r}; it must be a finite number")
    return EnvStep(observation, float(reward), bool(done))
