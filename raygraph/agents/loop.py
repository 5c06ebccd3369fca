"""Runs many episodes at once over a rollout engine: model turns, tools, environment steps.

The loop keeps every episode moving on its own. A model turn that finishes goes to a thread pool
(tool calls, then the environment's `step`) while the engine keeps decoding the other episodes'
turns; when the reaction is back the episode's next turn is submitted at once. So an episode that
waits for a slow environment holds up no other, and the engine's batch stays full (continuous
batching over episodes, the vLLM engine's `TurnEngine`).

An engine that cannot take requests one by one (the HF sampler) says `lock_step = True`: the loop
then runs in waves (every waiting episode's turn generated together, all reactions awaited before
the next wave), which is what a plain turn loop does; the results are the same, only slower.

Reproducibility: each turn's seed is a function of the episode's seed and the turn number
(`Episode.turn_seed`), and a vLLM sample depends on its seed, prompt and the weights only; so an
episode's tokens do not depend on timing or on the other episodes.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import threading
import time
from collections.abc import Mapping, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from typing import Any, Protocol

from raygraph.agents.env import EnvContractError, EnvStep, as_env_step, check_env_args, load_env
from raygraph.agents.episode import AgentBudgets, Episode
from raygraph.agents.tools import Toolbox
from raygraph.agents.tools import tool_parser as tool_parser_fn
from raygraph.agents.turns import TurnTemplate
from raygraph.errors import RaygraphError

__all__ = ["AgentLoop", "EnvFailed", "TurnEngine"]

log = logging.getLogger("raygraph")


class EnvFailed(RaygraphError, RuntimeError):
    """A user environment raised (its class, the episode and the turn are named)."""


class TurnEngine(Protocol):
    """What the loop needs of a rollout engine (`raygraph.workers.agent_rollout` adapts both)."""
    lock_step: bool   # True: the loop runs waves (every waiting turn, then every reaction)

    def submit(self, key: int, prompt: list[int], max_tokens: int, seed: int | None) -> None:
        """Queue one model turn: generate up to `max_tokens` after `prompt` (token ids)."""

    def pending(self) -> int:
        """Turns submitted and not yet returned by `poll`."""

    def poll(self) -> list[tuple[int, list[int], list[float]]]:
        """Advance the engine; the turns that finished: `(key, token ids, their log-probs)`."""


@dataclass
class _Reaction:
    """What followed a model turn: tool results and the environment's step."""
    messages: list[dict] = field(default_factory=list)   # role + content, in order
    tool_status: list[str] = field(default_factory=list)
    step: EnvStep | None = None
    tool_calls: int = 0
    seconds: float = 0.0


class AgentLoop:
    """Episodes of an environment and/or tools (`rollout.agent`).

    Args:
        tokenizer: the policy's tokenizer (chat template, decoding of turns).
        stop_token_ids: ids that end a model turn.
        budgets: per-episode limits (an `AgentBudgets` or its fields).
        env: environment reference (`raygraph.agents.env`); None = tools only (the episode ends
            when the model answers without a tool call).
        env_args: keyword arguments of the environment's constructor.
        tools: tool references (`raygraph.agents.tools.Toolbox`).
        tool_parser: how tool calls are found in a turn's text (a registered name or a reference).
        tool_timeout_s: one tool call's limit.
        env_timeout_s: one reaction's limit (tools + environment step); the episode ends with
            truncation "env_timeout" (a Python thread cannot be killed: it finishes in the background).
        env_workers: threads running reactions (environment steps, tools) at once.
        tool_role: the role of tool-result messages in the chat template ("tool").
        chat_template_kwargs: extra template variables (the data's; `tools=` is added here).
    """

    def __init__(self, *, tokenizer: Any, stop_token_ids: Sequence[int], budgets: AgentBudgets | Mapping[str, int],
                 env: str | None = None, env_args: Mapping[str, Any] | None = None, tools: Sequence[str] = (),
                 tool_parser: str = "hermes", tool_timeout_s: float = 10.0, env_timeout_s: float | None = None,
                 env_workers: int = 16, tool_role: str = "tool", chat_template_kwargs: dict | None = None) -> None:
        if env is None and not tools:
            raise ValueError("an agent needs an environment (rollout.agent.env) or tools (rollout.agent.tools)")
        self.env_cls = load_env(env) if env else None
        self.env_args = dict(env_args or {})
        if self.env_cls is not None and (problems := check_env_args(self.env_cls, self.env_args)):
            raise EnvContractError("; ".join(problems))
        self.toolbox = Toolbox(list(tools), timeout_s=tool_timeout_s) if tools else None
        self.parse = tool_parser_fn(tool_parser) if tools else None
        kwargs = dict(chat_template_kwargs or {})
        if self.toolbox is not None:
            kwargs["tools"] = self.toolbox.schemas
        budgets = budgets if isinstance(budgets, AgentBudgets) else AgentBudgets(**budgets)
        self.tokenizer, self.budgets, self.tool_role = tokenizer, budgets, tool_role
        self.template = TurnTemplate(tokenizer, kwargs, stop_token_ids)
        self.stop_token_ids = set(stop_token_ids)
        self.env_timeout_s = env_timeout_s
        self.pool = ThreadPoolExecutor(env_workers, thread_name_prefix="raygraph-env")
        self._loop: asyncio.AbstractEventLoop | None = None   # runs async environments' steps

    # ------------------------------------------------------------------------------ running
    def run(self, engine: TurnEngine, prompts: Sequence[list[int]], rows: Sequence[dict],
            seeds: Sequence[int | None]) -> list[Episode]:
        """Run one episode per prompt to its end; `rows[i]` is given to episode i's environment."""
        episodes = [Episode(i, list(p), s, uid=row.get("uid"))
                    for i, (p, s, row) in enumerate(zip(prompts, seeds, rows, strict=True))]
        envs: dict[int, Any] = {}
        waiting: dict[Future, tuple[Episode, float]] = {}
        try:
            for ep in episodes:
                self._ask(engine, ep)
            while not all(ep.done for ep in episodes):
                if engine.pending() and not (engine.lock_step and waiting):
                    for key, tokens, logprobs in self._finished_turns(engine):
                        ep = episodes[key]
                        ep.add_model_turn(tokens, logprobs, self.tokenizer.decode(tokens, skip_special_tokens=True))
                        future = self.pool.submit(self._react, ep, envs, rows[key], ep.messages[-1]["text"])
                        waiting[future] = (ep, time.monotonic() + (self.env_timeout_s or float("inf")))
                elif waiting:
                    nearest = min(deadline for _, deadline in waiting.values()) - time.monotonic()
                    wait(list(waiting), timeout=None if nearest == float("inf") else max(nearest, 0.0),
                         return_when="ALL_COMPLETED" if engine.lock_step else FIRST_COMPLETED)
                elif not all(ep.done for ep in episodes):
                    raise AssertionError("agent loop: episodes left with nothing submitted or running")
                self._collect(engine, waiting)
        finally:
            self._close(envs)
        for ep in episodes:
            ep.check()
        return episodes

    @staticmethod
    def _finished_turns(engine: TurnEngine) -> list[tuple[int, list[int], list[float]]]:
        """The turns a poll finished; for a lock-step engine, every turn of the wave (polled until
        none is pending), whatever its `poll` returns at a time."""
        finished = engine.poll()
        while engine.lock_step and engine.pending():
            finished += engine.poll()
        return finished

    def _collect(self, engine: TurnEngine, waiting: dict[Future, tuple[Episode, float]]) -> None:
        now = time.monotonic()
        for future in [f for f, (_, deadline) in waiting.items() if f.done() or deadline <= now]:
            ep, _ = waiting.pop(future)
            if not future.done():
                ep.finish("env_timeout")
                continue
            try:
                reaction = future.result()
            except EnvContractError:
                raise
            except Exception as exc:  # noqa: BLE001 - a user environment: name it and the episode
                name = self.env_cls.__name__ if self.env_cls else "a tool"
                raise EnvFailed(f"{name} raised in episode {ep.index} (uid {ep.uid!r}) after turn {ep.turns}: "
                                f"{type(exc).__name__}: {exc}") from exc
            self._advance(engine, ep, reaction)

    def _ask(self, engine: TurnEngine, ep: Episode) -> None:
        request = ep.next_request(self.budgets)
        if request is None:
            ep.finish("context")
        else:
            engine.submit(ep.index, request[0], request[1], ep.turn_seed())

    def _advance(self, engine: TurnEngine, ep: Episode, reaction: _Reaction) -> None:
        """Account for a reaction, then end the episode or submit its next turn."""
        ep.env_s += reaction.seconds
        ep.tool_status.update(reaction.tool_status)
        if reaction.step is not None:
            ep.add_reward(reaction.step.reward)
        last_token = ep.tokens[-1] if ep.tokens else None
        cut = last_token not in self.stop_token_ids
        done = reaction.step.done if reaction.step is not None else reaction.tool_calls == 0
        if done or ep.turns >= self.budgets.max_turns:
            ep.finish("length" if cut and done else "none" if done else "turns")
            return
        shown = [self._capped(m) for m in reaction.messages]
        tokens = self.template.appended_tokens([{"role": m["role"], "content": m["text"]} for m in shown], last_token)
        if len(ep.prompt) + len(ep.tokens) + len(tokens) >= self.budgets.max_total_tokens:
            ep.finish("context")
            return
        ep.add_messages(tokens, shown)
        self._ask(engine, ep)

    def _capped(self, message: dict) -> dict:
        """The message with its content cut to `max_message_tokens` tokens (saying so)."""
        ids = self.tokenizer(message["content"], add_special_tokens=False)["input_ids"]
        limit = self.budgets.max_message_tokens
        text = message["content"] if len(ids) <= limit else (
            self.tokenizer.decode(ids[:limit]) + f"\n[truncated: {len(ids) - limit} more tokens]")
        return {"role": message["role"], "text": text, "tokens": min(len(ids), limit), "reward": 0.0,
                "truncated": len(ids) > limit}

    # ------------------------------------------------------------------------------ reactions (pool threads)
    def _react(self, ep: Episode, envs: dict, row: dict, text: str) -> _Reaction:
        start, reaction = time.monotonic(), _Reaction()
        if self.toolbox is not None:
            calls = self.parse(text)
            reaction.tool_calls = len(calls)
            for call in calls:
                result = self.toolbox.call(call)
                reaction.tool_status.append(result.status)
                reaction.messages.append({"role": self.tool_role, "content": result.text})
        if self.env_cls is not None:
            env = envs.get(ep.index)
            if env is None:
                env = envs[ep.index] = self.env_cls(dict(row), **self.env_args)
            reaction.step = as_env_step(self._call_step(env, text), env)
            if reaction.step.observation is not None and not reaction.step.done:
                reaction.messages.append({"role": "user", "content": reaction.step.observation})
        reaction.seconds = time.monotonic() - start
        return reaction

    def _call_step(self, env: Any, text: str) -> Any:
        if not inspect.iscoroutinefunction(env.step):
            return env.step(text)
        return asyncio.run_coroutine_threadsafe(env.step(text), self._event_loop()).result()

    def _event_loop(self) -> asyncio.AbstractEventLoop:
        """One event loop thread for every async environment of this loop."""
        if self._loop is None:
            self._loop = asyncio.new_event_loop()
            threading.Thread(target=self._loop.run_forever, name="raygraph-env-async", daemon=True).start()
        return self._loop

    def _close(self, envs: dict) -> None:
        """`close()` every environment that has one (also after a failure); a failing close is logged."""
        for index, env in envs.items():
            close = getattr(env, "close", None)
            if close is None:
                continue
            try:
                result = close()
                if inspect.isawaitable(result):
                    asyncio.run_coroutine_threadsafe(result, self._event_loop()).result()
            except Exception as exc:  # noqa: BLE001 - user code; the episode's data is already kept
                log.warning("%s.close() raised in episode %d: %s: %s", type(env).__name__, index,
                            type(exc).__name__, exc)
        envs.clear()

    def shutdown(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self._loop.stop)



