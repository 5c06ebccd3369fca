"""Episodes run by the user's own agent code through an OpenAI-compatible client
(`rollout.agent.program`, docs/agents.md "Agent programs").

    async def run(row: dict, client, **program_args) -> float | dict:
        reply = await client.chat.completions.create(model="policy", messages=row["prompt"])
        ...
        return reward            # or {"reward": reward, "any": extra, ...}

`client` is an `openai.AsyncOpenAI` whose `base_url` is this episode's address on the rank's
endpoint (`raygraph.agents.endpoint`; `client.base_url` and `client.api_key` serve plain HTTP
too). Every request is one model turn: its exact prompt ids, completion ids and log-probs are
recorded (`Call`), and when the program returns, the episode's calls become batch rows
(`calls_to_rows`):

* A call sent as text whose prompt text starts with the text of the episode's latest call (prompt
  and completion) is served with that call's own ids, then the rest of the text tokenized on its
  own (`_own_tokens`): the model's turns are never re-tokenized from their text.
* A call whose prompt starts with the whole previous row (its prompt, then every token after it)
  extends that row: the new part of the prompt is appended with mask 0, the completion with mask 1.
  The test is on token ids, never on text; so a chat template that rewrites history (drops past
  reasoning, re-tokenizes a turn differently) starts a new row instead of training on a context
  the model never saw.
* Otherwise the call starts a new row, whose prompt is the call's prompt.
* Every row of an episode carries the episode's reward (on its last model token) and the dataset
  row's uid, so a group-relative estimator sees all of a prompt's episodes in one group. An
  episode split into k rows counts k times in its group's mean and standard deviation.
* Budgets hold per call: `max_turns` calls per episode, `max_new_tokens` per call, and the prompt +
  completion within `max_total_tokens`, so no row can exceed it. A call past a budget is refused
  (the program gets a 400 and may still return a reward) and the episode's truncation says which.

`program_timeout_s` bounds an episode from its start: past it the program is cancelled, its reward
is 0, its truncation `env_timeout` and the calls it made are still rows. A program that raises
stops the step (`EnvFailed`, naming the episode). The programs of a rank share one asyncio event
loop: code that blocks (not `await`) holds up every episode of the rank, so run it with
`asyncio.to_thread`.
"""

from __future__ import annotations

import asyncio
import copy
import inspect
import logging
import math
import queue
import ssl
import threading
import time
from collections.abc import Mapping, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

from raygraph.agents.endpoint import Endpoint, RequestRefused
from raygraph.agents.env import EnvContractError
from raygraph.agents.episode import AgentBudgets, Episode
from raygraph.agents.loop import EnvFailed, TurnEngine
from raygraph.agents.openai_requests import TurnRequest, parse_request, response_body
from raygraph.agents.tools import tool_parser as tool_parser_fn
from raygraph.algos.user_code import load_attribute

__all__ = ["Call", "ProgramLoop", "calls_to_rows", "load_program", "program_problems"]

log = logging.getLogger("raygraph")

_SEED_STRIDE = 1_000_003   # a call's seed: the episode's + stride x the call's number (as `Episode.turn_seed`)


def load_program(ref: str):
    """The `async def run(row, client, **args)` function named by `file.py:fn` or `module:fn`."""
    return load_attribute(ref, inspect.iscoroutinefunction, "agent program (an async def function)",
                          EnvContractError)


def program_problems(fn, program_args: Mapping[str, Any]) -> list[str]:
    """What is wrong with calling `fn(row, client, **program_args)` (empty: nothing)."""
    try:
        inspect.signature(fn).bind(None, None, **program_args)
    except TypeError as exc:
        return [f"rollout.agent.program {fn.__name__}(row, client, **program_args) does not take "
                f"program_args {sorted(program_args)}: {exc}"]
    return []


@dataclass
class Call:
    """One model turn an episode asked for, as the engine saw and produced it."""
    prompt: list[int]
    tokens: list[int]
    logprobs: list[float]
    text: str


@dataclass
class _Run:
    """One episode while it runs."""
    index: int
    row: dict
    seed: int | None
    calls: list[Call] = field(default_factory=list)
    asked: int = 0                 # calls accepted (their turns may still be generating)
    in_engine: int = 0             # calls accepted and not answered yet
    last_ids: list[int] | None = None   # the latest answered call: its prompt and completion ids, and their text
    last_text: str = ""
    refused: bool = False          # a call was refused for a budget (the truncation says which)
    reward: float = 0.0
    extras: dict = field(default_factory=dict)
    truncation: str = "none"
    done: bool = False
    started: float = 0.0
    task: Future | None = None


@dataclass
class _Pending:
    """A request waiting for the driver (`ProgramLoop.run`'s thread)."""
    episode: tuple[int, int]       # (run, index)
    request: TurnRequest
    reply: Future = field(default_factory=Future)
    max_tokens: int = 0


def calls_to_rows(calls: Sequence[Call], first_prompt: list[int], uid: Any, reward: float, truncation: str,
                  tokenizer: Any) -> list[Episode]:
    """An episode's calls as batch rows (the module docstring's rule); no call: one empty row."""
    rows: list[Episode] = []
    for call in calls:
        row = rows[-1] if rows else None
        seen = row.prompt + row.tokens if row is not None else None
        if row is not None and call.prompt[:len(seen)] == seen:
            context = call.prompt[len(seen):]
            row.add_messages(context, [{"role": "context", "text": tokenizer.decode(context), "tokens": len(context),
                                        "reward": 0.0}] if context else [])
        else:
            row = Episode(len(rows), list(call.prompt), None, uid=uid)
            rows.append(row)
        row.add_model_turn(call.tokens, call.logprobs, call.text)
    if not rows:
        rows.append(Episode(0, list(first_prompt), None, uid=uid))
    for row in rows:
        if row.tokens:
            row.add_reward(reward)
        row.finish("none")
    rows[-1].finish(truncation)
    return rows


class ProgramLoop:
    """Runs an agent program per episode against the rank's engine (`AgentLoop.run`'s place).

    Args:
        tokenizer: the policy's tokenizer (chat template, decoding).
        stop_token_ids: ids that end a model turn.
        budgets: per-episode limits (`max_turns` = calls).
        program: `file.py:fn` / `module:fn` of an `async def run(row, client, **program_args)`.
        program_args: keyword arguments of every call of the program.
        program_timeout_s: one episode's limit (None: none).
        temperature, top_p: the run's sampling (requests may repeat them, not change them).
        tool_parser: how tool calls are read from a reply to a request that offered `tools`.
        chat_template_kwargs: extra variables of the chat template.
        host: the endpoint's address (None: the node's).
    """

    def __init__(self, *, tokenizer: Any, stop_token_ids: Sequence[int], budgets: AgentBudgets | Mapping[str, int],
                 program: str, program_args: Mapping[str, Any] | None = None, program_timeout_s: float | None = None,
                 temperature: float = 1.0, top_p: float = 1.0, chat_template_kwargs: dict | None = None,
                 host: str | None = None, tool_parser: str = "hermes", **_unused: Any) -> None:
        self.fn = load_program(program)
        self.program_args = dict(program_args or {})
        if problems := program_problems(self.fn, self.program_args):
            raise EnvContractError("; ".join(problems))
        self.tokenizer, self.stop_token_ids = tokenizer, set(stop_token_ids)
        self.budgets = budgets if isinstance(budgets, AgentBudgets) else AgentBudgets(**budgets)
        self.timeout_s, self.temperature, self.top_p = program_timeout_s, temperature, top_p
        self.kwargs = dict(chat_template_kwargs or {})
        self.host = host
        self.parse_tools = tool_parser_fn(tool_parser)
        self.endpoint: Endpoint | None = None
        self.events: asyncio.AbstractEventLoop | None = None
        self._tls = None                 # the TLS context every episode's client shares
        self.timed_out = 0               # episodes cut by program_timeout_s (all runs)
        self._episodes: list[_Run] = []
        self._queue: queue.Queue = queue.Queue()
        self._tokenizer_lock = threading.Lock()
        self._run_id = 0                 # which run's episodes the endpoint's URLs belong to

    # ------------------------------------------------------------------------------ serving
    def _start(self) -> None:
        if self.endpoint is None:
            self.events = asyncio.new_event_loop()
            threading.Thread(target=self.events.run_forever, name="raygraph-programs", daemon=True).start()
            self.endpoint = Endpoint(self._on_request, host=self.host)

    def _on_request(self, episode: tuple[int, int], kind: str, body: dict) -> dict:
        """An endpoint thread: parse, hand to the driver, wait for the turn. `episode` is
        (the run it belongs to, its index): a request of an earlier run is never served in a later one."""
        with self._tokenizer_lock:   # one user at a time: a fast tokenizer is not safe across threads
            request = parse_request(kind, body, self.tokenizer, self.kwargs, self.temperature, self.top_p)
        pending = _Pending(episode, request)
        self._queue.put(pending)
        call = pending.reply.result()
        stopped = bool(call.tokens) and call.tokens[-1] in self.stop_token_ids
        tool_calls = []
        with self._tokenizer_lock:
            if request.tools:   # read as the agent loop reads them: the text with special tokens, less the stop token
                found = self.parse_tools(self.tokenizer.decode(call.tokens[:-1] if stopped else call.tokens,
                                                               skip_special_tokens=False))
                tool_calls = [] if any(c.error for c in found) else found   # a malformed call stays text
            return response_body(request, call.prompt, call.tokens, call.logprobs, call.text,
                                 "stop" if stopped else "length", self.tokenizer, tool_calls)

    # ------------------------------------------------------------------------------ running
    def run(self, engine: TurnEngine, prompts: Sequence[list[int]], rows: Sequence[dict],
            seeds: Sequence[int | None], more=None) -> list[list[Episode]]:
        """One episode per prompt; each comes back as its rows (`calls_to_rows`), in order."""
        if more is not None:
            raise ValueError("rollout.agent.program runs with rollout.agent.dispatch=even")
        self._start()
        self._run_id += 1
        self._episodes = [_Run(i, copy.deepcopy(dict(row)), seed) for i, (row, seed) in enumerate(zip(rows, seeds, strict=True))]
        waiting: dict[int, _Pending] = {}   # engine key -> request
        finished = False
        try:
            for ep in self._episodes:
                self._launch(ep)
            while not all(ep.done for ep in self._episodes):
                ready = engine.pending() and (not engine.lock_step or self._wave_ready())
                self._take_requests(engine, waiting, block=not ready)
                if engine.pending() and (not engine.lock_step or self._wave_ready()):
                    for key, tokens, logprobs in engine.poll():
                        self._answer(waiting.pop(key), tokens, logprobs)
                self._check_episodes()
            finished = True
        finally:
            if engine.pending():
                engine.abort()   # turns of episodes already over (cut, or a program that did not await them)
            self.endpoint.close_episodes()
            for pending in [*waiting.values(), *self._drain()]:
                if not pending.reply.done():
                    pending.reply.set_exception(RequestRefused("the rollout is over", status=410))
            if not finished:
                for ep in self._episodes:
                    if ep.task is not None:
                        ep.task.cancel()
        idle = [ep for ep in self._episodes if not ep.calls]
        if idle:
            log.warning("agent program %s: %d of %d episodes made no model call (first: uid %r); their rows have no "
                        "token to train or to hold a reward, so they score 0", self.fn.__name__, len(idle),
                        len(self._episodes), idle[0].row.get("uid"))
        with self._tokenizer_lock:
            return [self._rows(ep, prompts[ep.index]) for ep in self._episodes]

    def _rows(self, ep: _Run, prompt: list[int]) -> list[Episode]:
        rows = calls_to_rows(ep.calls, list(prompt), ep.row.get("uid"), ep.reward, ep.truncation, self.tokenizer)
        shown = ", ".join(f"{k}={v!r}" for k, v in ep.extras.items())
        rows[-1].messages.append({"role": "program", "text": f"returned reward {ep.reward:g}" + (f"; {shown}" if shown
                                  else ""), "tokens": 0, "reward": ep.reward, **ep.extras})
        return rows

    def _launch(self, ep: _Run) -> None:
        url = self.endpoint.open_episode((self._run_id, ep.index))
        ep.started = time.monotonic()
        ep.task = asyncio.run_coroutine_threadsafe(self._episode(ep, url), self.events)
        ep.task.add_done_callback(lambda _: self._queue.put(None))   # wake the driver

    async def _episode(self, ep: _Run, url: str) -> Any:
        import httpx
        from openai import AsyncOpenAI  # the `agents` extra (config checks say so when it is missing)

        if self._tls is None:   # a client's default TLS context costs ~25 ms to build; the endpoint is plain HTTP
            self._tls = ssl.create_default_context()
        # one connection pool per episode: a shared one is searched per request (slow with hundreds of episodes)
        # no read timeout: a turn may wait behind a long wave; program_timeout_s bounds the episode
        async with httpx.AsyncClient(verify=self._tls, timeout=None) as http:
            client = AsyncOpenAI(base_url=url, api_key=self.endpoint.key, max_retries=0, http_client=http)
            return await self.fn(ep.row, client, **self.program_args)

    def _take_requests(self, engine: TurnEngine, waiting: dict, block: bool) -> None:
        """Submit the requests that came in; with `block`, wait for one (or an episode's end) first."""
        timeout = self._time_left() if block else None
        try:
            item = self._queue.get(timeout=timeout) if block else self._queue.get_nowait()
        except queue.Empty:
            return
        while True:
            if item is not None:
                self._submit(engine, waiting, item)
            try:
                item = self._queue.get_nowait()
            except queue.Empty:
                return

    def _drain(self) -> list[_Pending]:
        """The requests still queued (a cancelled program's last call, a call nothing awaited)."""
        left = []
        while True:
            try:
                item = self._queue.get_nowait()
            except queue.Empty:
                return left
            if item is not None:
                left.append(item)

    def _submit(self, engine: TurnEngine, waiting: dict, pending: _Pending) -> None:
        try:
            self._submit_one(engine, waiting, pending)
        except BaseException as exc:
            if not pending.reply.done():   # its handler thread must not wait forever
                pending.reply.set_exception(RequestRefused(f"{type(exc).__name__}: {exc}", status=500))
            raise

    def _submit_one(self, engine: TurnEngine, waiting: dict, pending: _Pending) -> None:
        run_id, index = pending.episode
        ep = self._episodes[index] if run_id == self._run_id else None
        if ep is None or ep.done:
            pending.reply.set_exception(RequestRefused("this episode is over", status=410))
            return
        with self._tokenizer_lock:
            self._own_tokens(ep, pending.request)
        refusal, room = self._room(ep, pending.request)
        if refusal is not None:
            pending.reply.set_exception(RequestRefused(refusal))
            return
        key = ep.index * self.budgets.max_turns + ep.asked   # the same whatever the arrival order (HF waves sort by it)
        seed = None if ep.seed is None else (ep.seed + _SEED_STRIDE * ep.asked) % (2**31 - 1)
        ep.asked += 1
        ep.in_engine += 1
        pending.max_tokens = room
        waiting[key] = pending
        engine.submit(key, pending.request.prompt, room, seed)

    def _own_tokens(self, ep: _Run, request: TurnRequest) -> None:
        """A text request whose prompt, as text, extends the episode's latest call (its prompt and
        completion) is served with that call's own ids, then the rest of the text tokenized on its
        own: a model turn tokenized otherwise than its text re-tokenizes still extends its row."""
        if request.text is None or ep.last_ids is None or request.prompt[:len(ep.last_ids)] == ep.last_ids:
            return
        text = request.text   # as rendered, not decoded back from ids (a decode may clean spaces up)
        if text.startswith(ep.last_text):
            rest = text[len(ep.last_text):]
            request.prompt = ep.last_ids + (self.tokenizer(rest, add_special_tokens=False)["input_ids"] if rest else [])

    def _room(self, ep: _Run, request: TurnRequest) -> tuple[str | None, int]:
        """Why the request is over a budget (and the truncation it sets), or the tokens it may take."""
        b = self.budgets
        if ep.asked >= b.max_turns:
            ep.truncation, ep.refused = "turns", True
            return f"this episode has made its rollout.agent.max_turns={b.max_turns} calls", 0
        room = min(b.max_new_tokens, b.max_total_tokens - len(request.prompt), request.max_tokens or b.max_new_tokens)
        if room < 1:
            ep.truncation, ep.refused = "context", True
            return (f"the prompt has {len(request.prompt)} tokens: no room for a completion within "
                    f"rollout.agent.max_total_tokens={b.max_total_tokens}"), 0
        return None, room

    def _answer(self, pending: _Pending, tokens: list[int], logprobs: list[float]) -> None:
        ep = self._episodes[pending.episode[1]]
        ep.in_engine -= 1
        body = tokens[:-1] if tokens and tokens[-1] in self.stop_token_ids else tokens
        with self._tokenizer_lock:
            call = Call(list(pending.request.prompt), list(tokens), list(logprobs),
                        self.tokenizer.decode(body, skip_special_tokens=True))
            last_text = self.tokenizer.decode(call.prompt + call.tokens, skip_special_tokens=False,
                                              clean_up_tokenization_spaces=False)
        if not ep.done:
            ep.calls.append(call)
            ep.last_ids, ep.last_text = call.prompt + call.tokens, last_text
            stopped = bool(tokens) and tokens[-1] in self.stop_token_ids
            if not stopped:   # the latest call was cut: by what was left of the context, or by its own budget
                ep.truncation = "context" if pending.max_tokens < self.budgets.max_new_tokens and \
                    pending.request.max_tokens is None else "length"
            elif ep.truncation in ("length", "context"):
                ep.truncation = "none"
        pending.reply.set_result(call)

    def _check_episodes(self) -> None:
        now = time.monotonic()
        for ep in self._episodes:
            if ep.done:
                continue
            late = self.timeout_s is not None and now - ep.started > self.timeout_s
            if ep.task.done() and not (late and (ep.task.cancelled() or ep.task.exception() is not None)):
                self._finish(ep)
            elif late:   # (a program that failed past its deadline, as its time ran out, is cut, not failed)
                ep.task.cancel()
                ep.done, ep.truncation, ep.reward = True, "env_timeout", 0.0
                self.timed_out += 1

    def _finish(self, ep: _Run) -> None:
        ep.done = True
        where = f"episode {ep.index} (uid {ep.row.get('uid')!r}) after {len(ep.calls)} calls"
        try:
            result = ep.task.result()
        except Exception as exc:  # noqa: BLE001 - the user's program: name it and the episode
            if ep.refused:   # it did not catch a budget's 400: the episode ends as truncated, not the step
                log.warning("agent program %s raised in %s after a call past its budget (%s): %s: %s; the episode "
                            "scores 0", self.fn.__name__, where, ep.truncation, type(exc).__name__, exc)
                ep.reward = 0.0
                return
            raise EnvFailed(f"agent program {self.fn.__name__} raised in {where}: {type(exc).__name__}: {exc}") from exc
        try:
            ep.reward, ep.extras = _reward_of(result, self.fn.__name__)
        except EnvContractError as exc:
            raise EnvContractError(f"{exc} (in {where})") from None

    def _wave_ready(self) -> bool:
        """A lock-step engine's wave starts when every running episode waits for a model turn."""
        return all(ep.done or ep.in_engine for ep in self._episodes)

    def _time_left(self) -> float:
        """How long the driver may wait for a request: until the first episode's deadline, at most 1 s."""
        if self.timeout_s is None:
            return 1.0
        deadlines = [ep.started + self.timeout_s for ep in self._episodes if not ep.done]
        return min(max(min(deadlines, default=0.0) - time.monotonic(), 0.0), 1.0)

    def shutdown(self) -> None:
        if self.endpoint is not None:
            self.endpoint.close()
            self.events.call_soon_threadsafe(self.events.stop)
            self.endpoint = None


def _reward_of(result: Any, name: str) -> tuple[float, dict]:
    """A program's return value as (reward, extras)."""
    extras = {}
    if isinstance(result, Mapping):
        if "reward" not in result:
            raise EnvContractError(f"agent program {name} returned a dict without 'reward': {sorted(result)}")
        extras = {k: v for k, v in result.items() if k != "reward"}
        result = result["reward"]
    if isinstance(result, bool) or not isinstance(result, (int, float)) or not math.isfinite(result):
        raise EnvContractError(f"agent program {name} must return a finite number (or {{'reward': number, ...}}), "
                               f"got {result!r}")
    return float(result), extras
