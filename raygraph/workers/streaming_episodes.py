"""Streaming multi-turn episodes (issue 26): `rollout.streaming` with `rollout.agent`.

A rollout rank that streams episodes runs one agent loop (`raygraph.agents.loop.AgentLoop`) in a
background thread for as long as it has work. Prompt groups submitted by the driver join the
running loop as new episodes (its `more` hook), so episodes of several steps share the engine and
a long episode holds up no other one.

Model turns are generated in **chunks** (`StreamTurns`): every waiting turn gets at most
`WAVE_TOKENS` tokens per wave, through the engine's `continue_samples` (the single-turn streaming
wave), under the engine's weights lock. A weight update therefore lands between two waves: with
partial rollouts the next chunk of an unfinished turn continues **from its token ids** with the new
weights (its KV cache is recomputed; nothing is re-tokenized from text), and each token keeps the
version that sampled it (`Episode.versions`). Tool results and observations between turns get the
version of the model token before them; they are never trained (`response_mask` 0).

Without partial rollouts an update waits until every episode already started has ended, and no
episode starts while it waits: no episode mixes versions.

`StreamedEpisodes` is the bookkeeping, with the interface of
`raygraph.workers.streaming.StreamedSamples` (`submit`, `in_flight`, `wait_for`, `take`, ...), so
the driver's feed (`raygraph.run.streaming`) and the rank's `stream_*` methods serve both. A
group (the n episodes of a prompt) is handed out only when all n have ended.
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from collections.abc import Callable, Sequence

import torch

from raygraph.agents.episode import Episode
from raygraph.batch import (
    RESPONSES,
    STALENESS,
    TOKEN_WEIGHT_VERSION,
    WEIGHT_VERSION,
    Batch,
)
from raygraph.workers.agent_rollout import env_row, episode_rows
from raygraph.workers.streaming import (
    WAVE_TOKENS,
    ContinueSamples,
    Sample,
    new_groups,
    pop_whole,
    wait_whole,
    wave_gate,
)

__all__ = ["EpisodeStreamLoop", "StreamTurns", "StreamedEpisodes", "episode_stream"]

_STARTED = object()   # a group member handed to the loop, its Episode not yet seen


class _Stopped(Exception):
    """The stream was stopped: the running agent loop ends (its envs closed, nothing left in the engine)."""


class StreamTurns:
    """A `TurnEngine` (`raygraph.agents.loop`) that generates turns in chunk waves of at most
    `wave_tokens` tokens with whatever weights the engine holds; `poll` returns
    `(key, tokens, logprobs, versions)`. Not lock-step: each `poll` is one wave, so the loop starts
    new episodes and reacts to finished turns between any two waves (continuous batching of turns).

    Args:
        continue_samples: the engine's (`raygraph.workers.streaming.ContinueSamples`).
        version: the engine's current weight version.
        wave_rows: turns per wave at most (the engine's micro-batch).
        no_update: set while no weight update waits.
        partial: partial rollouts (a waiting update ends the running wave and holds the next one).
        stopped: true once the stream is stopped (`poll` then ends the agent loop).
        count_tokens: told `(version, tokens)` after each wave.
    """
    lock_step = False

    def __init__(self, continue_samples: ContinueSamples, version: Callable[[], int], wave_rows: int,
                 no_update: threading.Event, *, partial: bool, stopped: Callable[[], bool],
                 count_tokens: Callable[[int, int], None], wave_tokens: int = WAVE_TOKENS) -> None:
        self.continue_samples, self.version, self.wave_rows = continue_samples, version, wave_rows
        self.no_update, self.partial, self.stopped, self.count_tokens = no_update, partial, stopped, count_tokens
        self.wave_tokens = wave_tokens
        self.busy_s = 0.0   # seconds in waves (the rank's generation time)
        self._turns: dict[int, Sample] = {}   # key -> the turn so far, oldest first

    def submit(self, key: int, prompt: list[int], max_tokens: int, seed: int | None) -> None:
        self._turns[key] = Sample(list(prompt), max_tokens=max_tokens)

    def pending(self) -> int:
        return len(self._turns)

    def abort(self) -> None:
        self._turns.clear()

    def poll(self) -> list[tuple[int, list[int], list[float], list[int]]]:
        """One wave; the turns it finished."""
        if self.stopped():
            raise _Stopped()
        if self.partial and not self.no_update.is_set():
            self.no_update.wait(1.0)   # the update lands first; the turns continue with its weights
            return []
        keys = list(self._turns)[:self.wave_rows]
        wave = [self._turns[k] for k in keys]
        start, version = time.perf_counter(), self.version()
        more = self.continue_samples(wave, version, wave_gate(version, self.version, self.no_update,
                                                               partial=self.partial, stopped=self.stopped,
                                                               wave_tokens=self.wave_tokens))
        self.busy_s += time.perf_counter() - start
        finished = []
        for key, turn, add in zip(keys, wave, more, strict=True):
            turn.add(add, version)
            if turn.done:
                del self._turns[key]
                finished.append((key, turn.tokens, turn.logprobs, turn.versions))
        self.count_tokens(version, sum(len(add.tokens) for add in more))
        return finished


class StreamedEpisodes:
    """Groups of episodes submitted for streaming, by prompt uid, in submission order.

    Args:
        n: episodes per prompt (a group).
        tokenizer: the policy's (rows and texts in `take`).
        partial: partial rollouts (without them no episode starts while an update waits).
        no_update: set while no weight update waits.
    """

    def __init__(self, n: int, tokenizer, *, partial: bool, no_update: threading.Event) -> None:
        if n < 1:
            raise ValueError(f"n must be >= 1, got {n}")
        self.n, self.tokenizer, self.partial, self.no_update = n, tokenizer, partial, no_update
        self.groups: dict[str, tuple[Batch, list]] = {}   # uid -> (prompt row, n members: None | _STARTED | Episode)
        self.tokens_per_version: Counter[int] = Counter()
        self.changed = threading.Condition()
        self.stopped = False
        self._queue: list[tuple[str, int, list[int], dict]] = []   # (uid, member, prompt ids, env row), to start
        self._started: dict[int, tuple[str, int]] = {}   # episode index -> (uid, member): handed, not yet seen
        self._handed = 0   # episodes handed to the running loop so far

    # ------------------------------------------------------------------------------ in
    def submit(self, prompts: Batch) -> int:
        """Queue each prompt row of `prompts` as a group of n episodes; the groups queued."""
        with self.changed:
            rows = new_groups(self.groups, prompts)
            for i, uid, ids in rows:
                self.groups[uid] = (prompts.select([i]), [None] * self.n)
                self._queue += [(uid, j, ids, env_row(prompts, i)) for j in range(self.n)]
            self.changed.notify_all()
        return len(rows)

    def count_tokens(self, version: int, tokens: int) -> None:
        with self.changed:
            self.tokens_per_version[version] += tokens

    def more(self, episodes: list[Episode]):
        """The agent loop's `more` hook (a streaming run, `AgentLoop.run(streaming=True)`), asked
        between polls with the episodes not yet seen ended: note those it started since the last
        call, wake the waiters, and hand it the queued episodes (none once stopped, or while an
        update waits without partial rollouts). The loop numbers the episodes it starts 0, 1, ...
        in the order they are handed over, which is how each finds its group."""
        with self.changed:
            for ep in episodes:
                if (slot := self._started.pop(ep.index, None)) is not None:
                    uid, member = slot
                    self.groups[uid][1][member] = ep
            self.changed.notify_all()
            if self.stopped or not self._queue or (not self.partial and not self.no_update.is_set()):
                return None
            batch, self._queue = self._queue, []
            for uid, member, _, _ in batch:
                self.groups[uid][1][member] = _STARTED
                self._started[self._handed] = (uid, member)
                self._handed += 1
        return [ids for _, _, ids, _ in batch], [row for *_, row in batch], [None] * len(batch)

    def startable(self) -> bool:
        """Whether a loop started now would get episodes (queued, and no update holds them back)."""
        with self.changed:
            return bool(self._queue) and not self.stopped and (self.partial or self.no_update.is_set())

    def new_loop(self) -> None:
        """A new agent loop starts: its episodes are numbered from 0 again."""
        with self.changed:
            if self._started:   # the last loop ended without seeing every episode it started: a bug
                raise AssertionError(f"streamed episodes handed to an agent loop were never seen: {self._started}")
            self._handed = 0

    # ------------------------------------------------------------------------------ out
    @staticmethod
    def _done(member) -> bool:
        return isinstance(member, Episode) and member.done

    def in_flight(self) -> int:
        """Episodes not ended yet, queued ones included (the load of this rank)."""
        with self.changed:
            return sum(not self._done(m) for _, members in self.groups.values() for m in members)

    def drained(self, timeout_s: float) -> bool:
        """Wait up to `timeout_s` until every episode started has ended."""
        with self.changed:
            return self.changed.wait_for(
                lambda: all(m is None or self._done(m) for _, members in self.groups.values() for m in members),
                timeout=timeout_s)

    def wait_for(self, uids: Sequence[str], timeout_s: float) -> bool:
        """Block until every group of `uids` has ended or `timeout_s` passed; whether they all have.

        Raises:
            KeyError: a uid not submitted here.
        """
        return wait_whole(self.changed, self.groups, uids, timeout_s, self._done)

    def take(self, uids: Sequence[str], version: int) -> Batch:
        """Hand out these whole groups (and forget them) as episode rows
        (`raygraph.workers.agent_rollout.episode_rows`), n per prompt, in `uids` order, with
        `token_weight_version` (B, R) (0 on padding), `weight_version` = the version of the row's
        oldest model token and `staleness` = `version` minus it.

        Raises:
            KeyError: a uid not submitted; ValueError: a group not ended (groups never split).
        """
        picked = pop_whole(self.changed, self.groups, uids, self._done)
        episodes = [ep for _, members in picked for ep in members]
        rows = Batch.concat([prompt for prompt, _ in picked]).repeat_interleave(self.n)
        out = episode_rows(rows, episodes, self.tokenizer, version)
        versions = torch.zeros_like(out[RESPONSES])
        for i, ep in enumerate(episodes):
            versions[i, :len(ep.versions)] = torch.tensor(ep.versions, dtype=torch.int64)
        oldest = torch.tensor([min(ep.versions or [version]) for ep in episodes], dtype=torch.int64)
        return out.with_columns(**{TOKEN_WEIGHT_VERSION: versions, WEIGHT_VERSION: oldest, STALENESS: version - oldest})


class EpisodeStreamLoop:
    """A thread that runs the agent loop over `streamed` whenever episodes wait to start.

    Args:
        agent: the rank's `AgentLoop`.
        streamed: the rank's streamed groups.
        turns: the chunked turn engine (`StreamTurns`).
    """

    def __init__(self, agent, streamed: StreamedEpisodes, turns: StreamTurns) -> None:
        self.agent, self.streamed, self.turns = agent, streamed, turns
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="raygraph-stream-episodes", daemon=True)
        self._thread.start()

    @property
    def busy_s(self) -> float:
        return self.turns.busy_s

    def _run(self) -> None:
        try:
            while not self.streamed.stopped:
                with self.streamed.changed:
                    self.streamed.changed.wait_for(lambda: self.streamed.stopped or self.streamed.startable(),
                                                   timeout=0.25)
                if self.streamed.stopped:
                    return
                if not self.streamed.startable():
                    continue
                self.streamed.new_loop()
                with torch.no_grad():
                    self.agent.run(self.turns, [], [], [], more=self.streamed.more, streaming=True)
        except _Stopped:
            return
        except BaseException as exc:   # surfaced by `check()` in the caller's thread
            self.error = exc
            with self.streamed.changed:
                self.streamed.changed.notify_all()

    def check(self) -> None:
        """Raise the loop's error, if it died, in the caller's thread."""
        if self.error is not None:
            raise RuntimeError(f"the streaming episode loop failed: {self.error!r}") from self.error

    def stop(self, timeout_s: float = 30.0) -> None:
        with self.streamed.changed:
            self.streamed.stopped = True
            self.streamed.changed.notify_all()
        self._thread.join(timeout_s)


def episode_stream(engine) -> tuple[StreamedEpisodes, EpisodeStreamLoop]:
    """A rollout engine's streamed episodes and the loop that runs them (see the module docstring;
    the engine attributes are those `raygraph.workers.rollout_engine.stream_submit` lists)."""
    streamed = StreamedEpisodes(engine.n, engine.tokenizer, partial=engine.partial_rollouts,
                                no_update=engine._no_update)
    turns = StreamTurns(engine.continue_samples, lambda: engine._weight_version, engine.stream_wave_rows,
                        engine._no_update, partial=engine.partial_rollouts, stopped=lambda: streamed.stopped,
                        count_tokens=streamed.count_tokens)
    return streamed, EpisodeStreamLoop(engine.agent, streamed, turns)
