"""What follows a model turn, run on a thread of the agent loop's pool: the turn's tool calls,
then the environment's `step` (`raygraph.agents.loop`).

`Reactor` holds what is the same for every episode (the environment class and its arguments, the
tools and their parser); `EpisodeEnvs` holds one `AgentLoop.run`'s environments: created by the
first reaction of their episode, all closed when the run ends, also after a failure. A reaction
still running when the run was closed (an abort) closes the environment it creates itself.
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

__all__ = ["EpisodeEnvs", "Reaction", "Reactor", "RunClosed"]

log = logging.getLogger("raygraph")


class RunClosed(RaygraphError, RuntimeError):
    """A reaction started after its run was closed (the run failed or was aborted)."""


@dataclass
class Reaction:
    """What followed a model turn: tool results and the environment's step."""
    messages: list[dict] = field(default_factory=list)   # role + content, in order
    tool_status: list[str] = field(default_factory=list)
    step: EnvStep | None = None
    tool_calls: int = 0
    seconds: float = 0.0


class _EventLoop:
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


class EpisodeEnvs:
    """The environments of one run, by episode index; thread-safe."""

    def __init__(self, events: _EventLoop) -> None:
        self._lock, self._envs, self._closed, self._events = threading.Lock(), {}, False, events

    def get_or_open(self, index: int, open_env: Callable[[], Any]) -> Any:
        with self._lock:
            if self._closed:
                raise RunClosed("the run was closed")
            env = self._envs.get(index)
        if env is not None:
            return env
        env = open_env()   # outside the lock: a slow constructor holds up no other episode
        with self._lock:
            if not self._closed:
                self._envs[index] = env
                return env
        self._close_one(index, env)
        raise RunClosed("the run was closed while this environment was being created")

    def close_all(self) -> None:
        """Close every environment (each once); later reactions close their own."""
        with self._lock:
            self._closed = True
            envs, self._envs = list(self._envs.items()), {}
        for index, env in envs:
            self._close_one(index, env)

    def _close_one(self, index: int, env: Any) -> None:
        close = getattr(env, "close", None)
        if close is None:
            return
        try:
            result = close()
            if inspect.isawaitable(result):
                self._events.run(result)
        except Exception as exc:  # noqa: BLE001 - user code; the episode's data is already kept
            log.warning("%s.close() raised in episode %d: %s: %s", type(env).__name__, index, type(exc).__name__, exc)


class Reactor:
    """Runs the reaction to a model turn: tool calls first, then the environment's step."""

    def __init__(self, env_cls: type | None, env_args: Mapping[str, Any], toolbox: Toolbox | None,
                 parse: Callable[[str], list[ToolCall]] | None, tool_role: str) -> None:
        self.env_cls, self.env_args, self.toolbox, self.parse = env_cls, dict(env_args), toolbox, parse
        self.tool_role = tool_role
        self.events = _EventLoop()
        self._takes_calls = env_cls is not None and "tool_calls" in inspect.signature(env_cls.step).parameters

    def react(self, index: int, envs: EpisodeEnvs, row: dict, text: str, raw_text: str) -> Reaction:
        """`text`: the turn without special tokens (what the environment reads); `raw_text`: with
        them (what the tool parser reads: some tokenizers make `<tool_call>` a special token)."""
        start, reaction = time.monotonic(), Reaction()
        calls = self.parse(raw_text) if self.toolbox is not None else []
        reaction.tool_calls = len(calls)
        for call in calls:
            result = self.toolbox.call(call)
            reaction.tool_status.append(result.status)
            reaction.messages.append({"role": self.tool_role, "content": result.text})
        if self.env_cls is not None:
            env = envs.get_or_open(index, lambda: self.env_cls(dict(row), **self.env_args))
            reaction.step = as_env_step(self._step(env, text, calls), env)
            if reaction.step.observation is not None and not reaction.step.done:
                reaction.messages.append({"role": "user", "content": reaction.step.observation})
        reaction.seconds = time.monotonic() - start
        return reaction

    def _step(self, env: Any, text: str, calls: list[ToolCall]) -> Any:
        kwargs = {"tool_calls": calls} if self._takes_calls else {}
        if inspect.iscoroutinefunction(env.step):
            return self.events.run(env.step(text, **kwargs))
        return env.step(text, **kwargs)
