"""What follows a model turn, run on a thread of the agent loop's pool: the turn's tool calls,
then the environment's `step` (`raygraph.agents.loop`).

`Reactor` holds what is the same for every episode (the environments' runner, the tools and their
parser); `EpisodeEnvs` holds one `AgentLoop.run`'s environments: created by the first reaction of
their episode, all closed when the run ends, also after a failure. A reaction still running when
the run was closed (an abort) closes the environment it creates itself.

Where environments live is the runner's business: `LocalEnvs` keeps them in this process (steps on
the pool's threads), `raygraph.agents.env_hosts.EnvHosts` in Ray actors of their own
(`rollout.agent.env_hosts`). Both make (`open`), step and close them alike.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from raygraph.agents.env import EnvStep, as_env_step
from raygraph.agents.tools import Toolbox, ToolCall
from raygraph.errors import RaygraphError

__all__ = ["EnvHostDied", "EnvStepTimeout", "EpisodeEnvs", "EventLoop", "LocalEnvs", "Reaction", "Reactor", "RunClosed",
           "call_step", "close_env"]

log = logging.getLogger("raygraph")


class RunClosed(RaygraphError, RuntimeError):
    """A reaction started after its run was closed (the run failed or was aborted)."""


class EnvHostDied(RaygraphError, RuntimeError):
    """An environment host process died during a step (its environment crashed it, or its node
    was lost; `raygraph.agents.env_hosts`). Recovered like a dead rollout engine."""


class EnvStepTimeout(RaygraphError, TimeoutError):
    """An environment step ran past its reaction's `env_timeout_s` (raised by a runner that can
    stop waiting for it: `EnvHosts`)."""


@dataclass
class Reaction:
    """What followed a model turn: tool results and the environment's step."""
    messages: list[dict] = field(default_factory=list)   # role + content, in order
    tool_status: list[str] = field(default_factory=list)
    step: EnvStep | None = None
    tool_calls: int = 0
    seconds: float = 0.0
    timed_out: bool = False   # the environment's step ran past the time left (its episode ends)


class EventLoop:
    """One event loop thread for the async environments of a loop, started on first use."""

    def __init__(self) -> None:
        self._loop: asyncio.AbstractEventLoop | None = None
        self._lock = threading.Lock()

    def run(self, awaitable) -> Any:
        with self._lock:
            if self._loop is None:
                self._loop = asyncio.new_event_loop()
                threading.Thread(target=self._loop.run_forever, name="raygraph-env-async", daemon=True).start()
        return asyncio.run_coroutine_threadsafe(awaitable, self._loop).result()

    def stop(self) -> None:
        with self._lock:
            if self._loop is not None:
                self._loop.call_soon_threadsafe(self._loop.stop)
                self._loop = None


class LocalEnvs:
    """Environments in the rollout rank's own process (the default): one instance per episode,
    each `step` run on the pool thread of its reaction (async ones on one event loop)."""
    hosted = False

    def __init__(self, env_cls: type, env_args: Mapping[str, Any]) -> None:
        self.env_cls, self.env_args, self.events = env_cls, dict(env_args), EventLoop()

    def open(self, row: dict) -> Any:
        return self.env_cls(dict(row), **self.env_args)

    def step(self, env: Any, text: str, calls: list[ToolCall], timeout_s: float | None) -> EnvStep:
        """`timeout_s` is the loop's to enforce here: a Python thread cannot be interrupted."""
        return as_env_step(call_step(env, text, calls, self.events), env)

    def close_all(self, envs: list[tuple[int, Any]]) -> None:
        for index, env in envs:
            close_env(env, self.events, f"episode {index}")

    def after_run(self) -> None:
        """Nothing outlives a run in process (a hung thread is the loop's to count)."""

    def shutdown(self) -> None:
        self.events.stop()


def call_step(env: Any, text: str, calls: list[ToolCall], events: EventLoop) -> Any:
    """`env.step(text)` (with `tool_calls=calls` when its signature takes them; an async step run
    on `events`), its result as returned."""
    kwargs = {"tool_calls": calls} if "tool_calls" in inspect.signature(env.step).parameters else {}
    if inspect.iscoroutinefunction(env.step):
        return events.run(env.step(text, **kwargs))
    return env.step(text, **kwargs)


def close_env(env: Any, events: EventLoop, where: str) -> None:
    """`env.close()` when it has one; an exception in it is logged, never raised (the episode's
    data is already kept)."""
    close = getattr(env, "close", None)
    if close is None:
        return
    try:
        result = close()
        if inspect.isawaitable(result):
            events.run(result)
    except Exception as exc:  # noqa: BLE001 - user code
        log.warning("%s.close() raised in %s: %s: %s", type(env).__name__, where, type(exc).__name__, exc)


class EpisodeEnvs:
    """The environments of one run, by episode index; thread-safe. `runner` makes, steps and
    closes them (`LocalEnvs`, or `raygraph.agents.env_hosts.EnvHosts`)."""

    def __init__(self, runner) -> None:
        self._lock, self._envs, self._closed, self.runner = threading.Lock(), {}, False, runner

    def get_or_open(self, index: int, row: dict) -> Any:
        with self._lock:
            if self._closed:
                raise RunClosed("the run was closed")
            env = self._envs.get(index)
        if env is not None:
            return env
        env = self.runner.open(row)   # outside the lock: a slow constructor holds up no other episode
        with self._lock:
            if not self._closed:
                self._envs[index] = env
                return env
        self.runner.close_all([(index, env)])
        raise RunClosed("the run was closed while this environment was being created")

    def close(self, index: int) -> None:
        """Close episode `index`'s environment, if it has one open."""
        with self._lock:
            env = self._envs.pop(index, None)
        if env is not None:
            self.runner.close_all([(index, env)])

    def close_all(self) -> None:
        """Close every environment (each once); later reactions close their own."""
        with self._lock:
            self._closed = True
            envs, self._envs = list(self._envs.items()), {}
        if envs:
            self.runner.close_all(envs)


class Reactor:
    """Runs the reaction to a model turn: tool calls first, then the environment's step.

    Args:
        envs: the environments' runner (`LocalEnvs`, `EnvHosts`); None: tools only.
        toolbox, parse: the tools and their parser; None: an environment only.
        tool_role: the chat role of tool results.
    """

    def __init__(self, envs, env_name: str | None, toolbox: Toolbox | None,
                 parse: Callable[[str], list[ToolCall]] | None, tool_role: str) -> None:
        self.envs, self.env_name, self.toolbox, self.parse, self.tool_role = envs, env_name, toolbox, parse, tool_role

    def react(self, index: int, envs: EpisodeEnvs, row: dict, text: str, raw_text: str,
              timeout_s: float | None = None) -> Reaction:
        """`text`: the turn without special tokens (what the environment reads); `raw_text`: with
        them (what the tool parser reads: some tokenizers make `<tool_call>` a special token).
        `timeout_s`: the reaction's limit, which a runner that can enforce it (`hosted`) applies."""
        start, reaction = time.monotonic(), Reaction()
        calls = self.parse(raw_text) if self.toolbox is not None else []
        reaction.tool_calls = len(calls)
        for call in calls:
            result = self.toolbox.call(call)
            reaction.tool_status.append(result.status)
            reaction.messages.append({"role": self.tool_role, "content": result.text})
        if self.envs is not None:
            env = envs.get_or_open(index, row)
            left = None if timeout_s is None else max(timeout_s - (time.monotonic() - start), 0.0)
            try:
                reaction.step = self.envs.step(env, text, calls, left)
            except EnvStepTimeout:
                reaction.timed_out = True
            else:
                if reaction.step.observation is not None and not reaction.step.done:
                    reaction.messages.append({"role": "user", "content": reaction.step.observation})
        reaction.seconds = time.monotonic() - start
        return reaction

    def shutdown(self) -> None:
        if self.envs is not None:
            self.envs.shutdown()
