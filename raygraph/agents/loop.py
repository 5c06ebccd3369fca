"""Runs many episodes at once over a rollout engine: model turns, tools, environment steps.

The loop keeps every episode moving on its own. A model turn that finishes goes to a thread pool
(`raygraph.agents.reactions`: tool calls, then the environment's `step`) while the engine keeps
decoding the other episodes' turns; when the reaction is back the episode's next turn is submitted
at once. So an episode that waits for a slow environment holds up no other, and the engine's batch
stays full (continuous batching over episodes, the vLLM engine's `TurnEngine`).

An engine that cannot take requests one by one (the HF sampler) says `lock_step = True`: the loop
then runs in waves (every waiting episode's turn generated together, all reactions awaited before
the next wave), which is what a plain turn loop does.

`env_timeout_s` bounds one reaction from when it starts running (time queued for a pool thread
does not count). A reaction past it ends its episode ("env_timeout"); its thread cannot be killed
and keeps running in the background. When as many reactions hang as the pool has threads, the
run stops with `EnvFailed` instead of timing out every later episode.

If a run fails (an environment raises, the engine dies), its requests still in the engine are
aborted and every environment it opened is closed before the error propagates.

Reproducibility: each turn's seed is a function of the episode's seed and the turn number
(`Episode.turn_seed`); on vLLM's CPU build a sample depends on its seed, prompt and the weights
only, so an episode's tokens do not depend on timing or on the other episodes (docs/agents.md has
the caveats: GPU batch invariance, the HF sampler's shared generator).
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from typing import Any, Protocol

from raygraph.agents.env import EnvContractError, check_env_args, load_env
from raygraph.agents.episode import AgentBudgets, Episode
from raygraph.agents.reactions import EnvHostDied, EpisodeEnvs, LocalEnvs, Reaction, Reactor, RunClosed
from raygraph.agents.tools import Toolbox
from raygraph.agents.tools import tool_parser as tool_parser_fn
from raygraph.agents.turns import TurnTemplate
from raygraph.errors import RaygraphError

__all__ = ["AgentLoop", "EnvFailed", "TurnEngine"]

log = logging.getLogger("raygraph")

HOSTED_MARGIN_S = 5.0   # a hosted reaction's thread is hung only this long past env_timeout_s
STREAMING_POLL_S = 0.1  # a streaming run asks `more` at least this often


class EnvFailed(RaygraphError, RuntimeError):
    """A user environment or tool failed (its class, the episode and the turn are named)."""


class TurnEngine(Protocol):
    """What the loop needs of a rollout engine (`raygraph.workers.agent_rollout` adapts both)."""
    lock_step: bool   # True: the loop runs waves (every waiting turn, then every reaction)

    def submit(self, key: int, prompt: list[int], max_tokens: int, seed: int | None) -> None:
        """Queue one model turn: generate up to `max_tokens` after `prompt` (token ids)."""

    def pending(self) -> int:
        """Turns submitted and not yet returned by `poll`."""

    def poll(self) -> list[tuple[int, list[int], list[float]]]:
        """Advance the engine; the turns that finished: `(key, token ids, their log-probs)`, and
        from a streaming engine also the weight version of each token."""

    def abort(self) -> None:
        """Drop every pending turn (a failed run leaves nothing in the engine)."""


# `more(episodes so far) -> (prompts, rows, seeds) | None`: episodes to start as well (`AgentLoop.run`)
MoreEpisodes = Callable[[list[Episode]], "tuple[Sequence[list[int]], Sequence[dict], Sequence[int | None]] | None"]


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
        env_timeout_s: one reaction's limit (tools + environment step), from when it starts.
        env_workers: threads running reactions (environment steps, tools) at once (and, with
            `env_hosts`, steps one host runs at once).
        env_hosts: Ray actors hosting the environments (`raygraph.agents.env_hosts`); 0: in
            this process, on the pool's threads.
        env_host_cpus: CPUs of each host (a Ray actor owned by the rollout rank).
        plugins: the run's plugins, imported in each host.
        tool_role: the role of tool-result messages in the chat template ("tool").
        chat_template_kwargs: extra template variables (the data's; `tools=` is added here).
    """

    def __init__(self, *, tokenizer: Any, stop_token_ids: Sequence[int], budgets: AgentBudgets | Mapping[str, int],
                 env: str | None = None, env_args: Mapping[str, Any] | None = None, tools: Sequence[str] = (),
                 tool_parser: str = "hermes", tool_timeout_s: float = 10.0, env_timeout_s: float | None = None,
                 env_workers: int = 16, tool_role: str = "tool", chat_template_kwargs: dict | None = None,
                 env_hosts: int = 0, env_host_cpus: float = 1.0, plugins: Sequence[str] = ()) -> None:
        if env is None and not tools:
            raise ValueError("an agent needs an environment (rollout.agent.env) or tools (rollout.agent.tools)")
        env_cls = load_env(env) if env else None
        if env_cls is not None and (problems := check_env_args(env_cls, dict(env_args or {}))):
            raise EnvContractError("; ".join(problems))
        toolbox = Toolbox(list(tools), timeout_s=tool_timeout_s) if tools else None
        self.reactor = Reactor(_env_runner(env, env_cls, env_args or {}, env_hosts, env_host_cpus, env_workers, plugins),
                               env_cls.__name__ if env_cls else None, toolbox,
                               tool_parser_fn(tool_parser) if tools else None, tool_role)
        kwargs = dict(chat_template_kwargs or {})
        if toolbox is not None:
            kwargs["tools"] = toolbox.schemas
        self.tokenizer = tokenizer
        self.budgets = budgets if isinstance(budgets, AgentBudgets) else AgentBudgets(**budgets)
        self.template = TurnTemplate(tokenizer, kwargs, stop_token_ids)
        self.stop_token_ids = set(stop_token_ids)
        self.env_timeout_s, self.env_workers = env_timeout_s, env_workers
        # when a thread counts as hung: hosted steps return at env_timeout_s themselves (their
        # host restarts later), so only what runs in the thread past that and a margin is hung
        self._deadline_s = None if env_timeout_s is None else \
            env_timeout_s + (HOSTED_MARGIN_S if getattr(self.reactor.envs, "hosted", False) else 0.0)
        self.pool = ThreadPoolExecutor(env_workers, thread_name_prefix="raygraph-env")
        self.hung = 0   # reactions past env_timeout_s still holding a pool thread

    # ------------------------------------------------------------------------------ running
    def run(self, engine: TurnEngine, prompts: Sequence[list[int]], rows: Sequence[dict],
            seeds: Sequence[int | None], more: MoreEpisodes | None = None, *,
            streaming: bool = False) -> list[Episode]:
        """Run one episode per prompt to its end; `rows[i]` is given to episode i's environment.

        `more(episodes)`, when given, is asked between engine polls for episodes to start as well
        (`(prompts, rows, seeds)`, or None/empty for none now); the run ends when every episode
        started is done and `more` has none (having seen every episode started). The episodes
        come back in the order they started.

        `streaming` is for a run that may last as long as training (a rank's streaming loop,
        `raygraph.workers.streaming_episodes`): an episode `more` has seen ended is forgotten and
        its environment closed at once (nothing comes back), and `more` is asked at least every
        `STREAMING_POLL_S` seconds, also while every episode waits for its environment.
        """
        episodes: list[Episode] = []   # in start order (streaming: those not yet seen ended)
        running: dict[int, tuple[Episode, dict]] = {}   # index -> episode and its row (streaming: not ended)
        envs = EpisodeEnvs(self.reactor.envs)
        waiting: dict[Future, Episode] = {}
        started: dict[int, float] = {}   # episode index -> when its reaction began running
        finished, indices = False, itertools.count()

        def start(new_prompts, new_rows, new_seeds) -> None:
            for p, s, row in zip(new_prompts, new_seeds, new_rows, strict=True):
                ep = Episode(next(indices), list(p), s, uid=row.get("uid"))
                episodes.append(ep)
                running[ep.index] = (ep, row)
                self._ask(engine, ep)

        try:
            start(prompts, rows, seeds)
            while True:
                fresh = more is not None and bool(extra := more(episodes))
                if streaming:   # `more` has seen these end
                    for ep in [ep for ep in episodes if ep.done]:
                        ep.check()
                        del running[ep.index]
                    episodes[:] = [ep for ep in episodes if not ep.done]
                if fresh:
                    start(*extra)
                if all(ep.done for ep in episodes):
                    if fresh:   # episodes that ended as they started: `more` sees them before the run ends
                        continue
                    break
                if engine.pending() and not (engine.lock_step and waiting):
                    for key, tokens, logprobs, *versions in self._finished_turns(engine):
                        ep, row = running[key]
                        text, raw = self._texts(tokens)
                        ep.add_model_turn(tokens, logprobs, text, *versions)
                        waiting[self.pool.submit(self._react, ep, envs, row, text, raw, started)] = ep
                elif waiting:
                    timeout = self._time_left(waiting, started)
                    if streaming:   # new groups may come while every episode waits for its environment
                        timeout = STREAMING_POLL_S if timeout is None else min(timeout, STREAMING_POLL_S)
                    wait(list(waiting), timeout=timeout,
                         return_when="ALL_COMPLETED" if engine.lock_step else FIRST_COMPLETED)
                else:
                    raise AssertionError("agent loop: episodes left with nothing submitted or running")
                self._collect(engine, waiting, started, envs if streaming else None)
            finished = True
        finally:
            if not finished:
                engine.abort()
            for future in waiting:
                future.cancel()
            envs.close_all()
            if self.reactor.envs is not None:
                self.reactor.envs.after_run()
        for ep in episodes:
            ep.check()
        return episodes

    def _texts(self, tokens: list[int]) -> tuple[str, str]:
        """A turn's text without special tokens (the environment's) and with them, less its stop
        token (the tool parser's)."""
        body = tokens[:-1] if tokens and tokens[-1] in self.stop_token_ids else tokens
        return (self.tokenizer.decode(tokens, skip_special_tokens=True),
                self.tokenizer.decode(body, skip_special_tokens=False))

    def _react(self, ep: Episode, envs: EpisodeEnvs, row: dict, text: str, raw: str,
               started: dict[int, float]) -> Reaction:
        started[ep.index] = time.monotonic()
        return self.reactor.react(ep.index, envs, row, text, raw, self.env_timeout_s)

    def _time_left(self, waiting: dict[Future, Episode], started: dict[int, float]) -> float | None:
        """Seconds until the first running reaction's deadline (None: no deadline)."""
        if self._deadline_s is None:
            return None
        begun = [started[ep.index] for ep in waiting.values() if ep.index in started]
        # none begun: they wait for a thread, which a hung reaction may hold without waking `wait`;
        # look again shortly to start their clocks
        return max(min(begun) + self._deadline_s - time.monotonic(), 0.0) if begun else 0.05

    @staticmethod
    def _finished_turns(engine: TurnEngine) -> list[tuple[int, list[int], list[float]]]:
        """The turns a poll finished; for a lock-step engine, every turn of the wave (polled until
        none is pending), whatever its `poll` returns at a time."""
        finished = engine.poll()
        while engine.lock_step and engine.pending():
            finished += engine.poll()
        return finished

    def _collect(self, engine: TurnEngine, waiting: dict[Future, Episode], started: dict[int, float],
                 closing: EpisodeEnvs | None = None) -> None:
        """Advance the episodes whose reactions are back; `closing`: close the environments of
        those that ended."""
        now = time.monotonic()
        for future, ep in list(waiting.items()):
            if not future.done():
                if self._deadline_s is not None and ep.index in started \
                        and now - started[ep.index] > self._deadline_s:
                    del waiting[future]
                    started.pop(ep.index)
                    self._hung(ep)
                continue
            del waiting[future]
            started.pop(ep.index, None)
            try:
                reaction = future.result()
            except (EnvContractError, RunClosed, EnvHostDied):
                raise
            except Exception as exc:  # noqa: BLE001 - a user environment: name it and the episode
                raise EnvFailed(f"{self.reactor.env_name or 'a tool'} raised in episode {ep.index} (uid {ep.uid!r}) "
                                f"after turn {ep.turns}: {type(exc).__name__}: {exc}") from exc
            self._advance(engine, ep, reaction)
            if closing is not None and ep.done:
                closing.close(ep.index)

    def _hung(self, ep: Episode) -> None:
        """A reaction ran past `env_timeout_s`: its episode ends; its thread stays taken."""
        ep.finish("env_timeout")
        self.hung += 1
        if self.hung >= self.env_workers:
            raise EnvFailed(f"{self.hung} environment steps or tool calls ran past rollout.agent.env_timeout_s="
                            f"{self.env_timeout_s} and still hold every one of the {self.env_workers} env_workers "
                            "threads (a Python thread cannot be killed): fix the environment, or run what may "
                            "hang in a subprocess with its own limit")

    def _ask(self, engine: TurnEngine, ep: Episode) -> None:
        request = ep.next_request(self.budgets)
        if request is None:
            ep.finish("context")
        else:
            engine.submit(ep.index, request[0], request[1], ep.turn_seed())

    def _advance(self, engine: TurnEngine, ep: Episode, reaction: Reaction) -> None:
        """Account for a reaction, then end the episode or submit its next turn."""
        ep.env_s += reaction.seconds
        ep.tool_status.update(reaction.tool_status)
        if reaction.timed_out:   # a hosted step past env_timeout_s: its host restarts after the run
            ep.finish("env_timeout")
            return
        if reaction.step is not None:
            ep.add_reward(reaction.step.reward)
        last_token = ep.tokens[-1] if ep.tokens else None
        # a turn without its stop token was cut: by the context when it was given less than a turn's budget
        cut = None if last_token in self.stop_token_ids else \
            "context" if ep.last_room < self.budgets.max_new_tokens else "length"
        done = reaction.step.done if reaction.step is not None else reaction.tool_calls == 0
        if done or ep.turns >= self.budgets.max_turns:
            ep.finish(cut or ("none" if done else "turns"))
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

    def shutdown(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)
        self.reactor.shutdown()


def _env_runner(env: str | None, env_cls: type | None, env_args: Mapping[str, Any], hosts: int, cpus: float,
                concurrency: int, plugins: Sequence[str]):
    """Where the environments live: in Ray actors of their own (`hosts` > 0), else in this process."""
    if env_cls is None:
        return None
    if hosts > 0:
        from raygraph.agents.env_hosts import EnvHosts  # Ray, only when asked for: the loop runs without it

        return EnvHosts(env, env_args, count=hosts, cpus=cpus, concurrency=concurrency, plugins=tuple(plugins))
    return LocalEnvs(env_cls, env_args)
