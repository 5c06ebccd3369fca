"""Streaming rollouts (issue 26), the engine-independent part: samples that outlive a weight update.

A rollout rank that streams keeps generating while the trainer trains. Prompts are submitted as
groups (the n samples of a prompt); a background loop (`StreamLoop`) continues the unfinished
samples in waves through the engine's `continue_samples`; a weight update that lands between
two decode steps ends the wave, and the next wave continues every unfinished sample **from its
token ids** with the new weights (the engine recomputes their KV cache; nothing is re-tokenized
from text). Each generated token keeps the log-prob it was sampled with and the version of the
weights that sampled it, so a sample that straddles updates is corrected token by token
(`raygraph.graph.corrections`).

`StreamedSamples` is the bookkeeping: which samples are unfinished, which groups are complete,
how old each group's oldest token is. A group is handed out only whole (`take`), never split:
GRPO and RLOO normalise over all n samples of a prompt. How far behind a group may be is the
driver's to bound (`raygraph.run.streaming`: by when it submits, so nothing is ever dropped).

Nothing here imports Ray; the engines (`raygraph.workers.rollout_hf`) own a `StreamedSamples`
and a `StreamLoop`, and tests drive both with a real engine and no Ray.
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from raygraph.batch import (
    PROMPT_IDS,
    PROMPT_MASK,
    RESPONSE_LENGTH,
    RESPONSE_MASK,
    RESPONSES,
    ROLLOUT_LOGPROBS,
    STALENESS,
    TOKEN_WEIGHT_VERSION,
    UID,
    WEIGHT_VERSION,
    Batch,
)

__all__ = ["Continuation", "Sample", "StreamLoop", "StreamedSamples", "WAVE_TOKENS", "new_groups", "pop_whole",
           "wait_whole", "wave_gate"]

WAVE_TOKENS = 16   # tokens a wave decodes at most before the next wave is formed (continuous batching)


@dataclass
class Sample:
    """One response being generated: its prompt's token ids and what was generated so far."""

    prompt_ids: list[int]
    max_tokens: int | None = None   # tokens it may have at most (None: the engine's max_new_tokens)
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)   # as sampled, one a token
    versions: list[int] = field(default_factory=list)     # weight version that sampled each token
    done: bool = False
    in_wave: bool = False   # being continued by a wave (its tokens arrive when the wave ends)

    def add(self, more: Continuation, version: int) -> None:
        """Append what a wave with the weights of `version` generated."""
        self.tokens += more.tokens
        self.logprobs += more.logprobs
        self.versions += [version] * len(more.tokens)
        self.done = more.done


@dataclass
class Continuation:
    """What a wave added to one sample: new tokens with their log-probs, and whether it finished."""

    tokens: list[int]
    logprobs: list[float]
    done: bool


# An engine's `continue_samples(samples, version, keep_going) -> [Continuation]`: continue each
# sample from its token ids with the weights of `version`, stopping early when `keep_going()`
# turns false (checked before each model call, under the engine's weights lock).
ContinueSamples = Callable[[Sequence[Sample], int, Callable[[], bool]], list[Continuation]]


def wave_gate(version: int, current: Callable[[], int], no_update: threading.Event, *, partial: bool,
              stopped: Callable[[], bool], wave_tokens: int = WAVE_TOKENS) -> Callable[[], bool]:
    """A wave's `keep_going`, asked before each model call: at most `wave_tokens` calls, none once
    stopped, and with partial rollouts none once an update waits or has landed (`current()` is no
    longer the wave's `version`)."""
    calls = iter(range(wave_tokens))
    if partial:
        return lambda: (next(calls, None) is not None and not stopped() and no_update.is_set()
                        and current() == version)
    return lambda: next(calls, None) is not None and not stopped()


# ------------------------------------------------------------------------------ groups by uid
# A rank's streamed groups: `{uid: (prompt row, its n members)}` in submission order, guarded by a
# `threading.Condition`; a member is anything `done` says has ended (a `Sample`, an episode).


def new_groups(held: dict, prompts: Batch) -> list[tuple[int, str, list[int]]]:
    """`(row, uid, prompt token ids)` of each prompt row of `prompts`, checked first: a uid held
    already or repeated (it would be trained twice) and an empty prompt are errors."""
    uids = list(prompts[UID])
    taken = [u for u in uids if u in held]
    if taken or len(set(uids)) != len(uids):
        raise ValueError(f"prompts submitted twice for streaming (uids {sorted(set(taken))[:5] or uids[:5]}); "
                         "a group is submitted once and taken once")
    rows = [(i, uid, prompts[PROMPT_IDS][i][prompts[PROMPT_MASK][i].bool()].tolist()) for i, uid in enumerate(uids)]
    empty = [uid for _, uid, ids in rows if not ids]
    if empty:
        raise ValueError(f"prompts {empty[:5]} are empty: nothing to generate from")
    return rows


def _unknown(groups: dict, uids: Sequence[str]) -> None:
    unknown = [u for u in uids if u not in groups]
    if unknown:
        raise KeyError(f"no streamed group for uids {unknown[:5]}")


def wait_whole(changed: threading.Condition, groups: dict, uids: Sequence[str], timeout_s: float,
               done: Callable[[object], bool]) -> bool:
    """Block until every member of the groups `uids` is done or `timeout_s` passed; whether they all are.

    Raises:
        KeyError: a uid not held.
    """
    _unknown(groups, uids)
    with changed:
        return changed.wait_for(lambda: all(done(m) for u in uids for m in groups[u][1]), timeout=timeout_s)


def pop_whole(changed: threading.Condition, groups: dict, uids: Sequence[str],
              done: Callable[[object], bool]) -> list[tuple[Batch, list]]:
    """Remove and return the groups `uids`, in that order, every member of them done.

    Raises:
        KeyError: a uid not held; ValueError: a group with a member not done (groups never split).
    """
    with changed:
        _unknown(groups, uids)
        open_ = [u for u in uids if not all(done(m) for m in groups[u][1])]
        if open_:
            raise ValueError(f"groups {open_[:5]} are still generating; a group is taken only whole")
        return [groups.pop(u) for u in uids]


def _sample_done(sample: Sample) -> bool:
    return sample.done


class StreamedSamples:
    """Groups of samples submitted for streaming, by prompt uid, in submission order.

    Args:
        n: samples per prompt (a group).
        pad_id: right-padding of `responses` in `take`.
    """

    def __init__(self, n: int, pad_id: int) -> None:
        if n < 1:
            raise ValueError(f"n must be >= 1, got {n}")
        self.n, self.pad_id = n, pad_id
        self.groups: dict[str, tuple[Batch, list[Sample]]] = {}   # uid -> (prompt row, its n samples)
        self.tokens_per_version: Counter[int] = Counter()
        self.changed = threading.Condition()

    # ------------------------------------------------------------------------------ in
    def submit(self, prompts: Batch) -> int:
        """Queue each prompt row of `prompts` (`uid`, `prompt_ids`, `prompt_mask`) as a group of n
        samples. Returns the groups queued. A uid already queued is an error: it would be trained twice."""
        with self.changed:
            rows = new_groups(self.groups, prompts)
            for i, uid, ids in rows:
                self.groups[uid] = (prompts.select([i]), [Sample(ids) for _ in range(self.n)])
            self.changed.notify_all()
        return len(rows)

    def unfinished(self, limit: int, *, started: bool = False) -> list[Sample]:
        """Up to `limit` unfinished samples, oldest group first (a group's samples together);
        with `started`, only those that have tokens already."""
        with self.changed:
            out = [s for _, samples in self.groups.values() for s in samples
                   if not s.done and (s.tokens or not started)]
        return out[:limit]

    def claim(self, limit: int, *, started: bool = False) -> list[Sample]:
        """`unfinished(limit, started=...)`, marked as in a wave until `extend` (see `drained`)."""
        with self.changed:
            wave = self.unfinished(limit, started=started)
            for sample in wave:
                sample.in_wave = True
        return wave

    def drained(self, timeout_s: float) -> bool:
        """Wait up to `timeout_s` until no sample is half generated (in a wave, or started and not
        finished)."""
        with self.changed:
            return self.changed.wait_for(
                lambda: not any((s.tokens or s.in_wave) and not s.done
                                for _, samples in self.groups.values() for s in samples),
                timeout=timeout_s)

    def extend(self, samples: Sequence[Sample], continuations: Sequence[Continuation], version: int) -> None:
        """Append what a wave with the weights of `version` generated to each sample."""
        with self.changed:
            for sample, more in zip(samples, continuations, strict=True):
                sample.add(more, version)
                sample.in_wave = False
                self.tokens_per_version[version] += len(more.tokens)
            self.changed.notify_all()

    # ------------------------------------------------------------------------------ out
    def ready(self) -> dict[str, int]:
        """`{uid: version of its oldest token}` of every group whose n samples have finished."""
        with self.changed:
            return {uid: min(s.versions[0] for s in samples)   # versions only grow along a sample
                    for uid, (_, samples) in self.groups.items() if all(s.done for s in samples)}

    def in_flight(self) -> int:
        """Samples not finished yet (the load of this rank)."""
        with self.changed:
            return sum(not s.done for _, samples in self.groups.values() for s in samples)

    def wait_for(self, uids: Sequence[str], timeout_s: float) -> bool:
        """Block until every group of `uids` has finished or `timeout_s` passed; whether they all have.

        Raises:
            KeyError: a uid not submitted here.
        """
        return wait_whole(self.changed, self.groups, uids, timeout_s, _sample_done)

    def take(self, uids: Sequence[str], version: int) -> Batch:
        """Hand out these whole groups (and forget them) as rollout rows, n per prompt, in `uids` order.

        Returns:
            the prompt rows repeated n times with `responses`, `response_mask`, `rollout_logprobs`,
            `token_weight_version` (B, R) (0 on padding), `response_length`, `weight_version`
            (B,) = the version of the row's oldest token, and `staleness` = `version` minus it.

        Raises:
            KeyError: a uid not submitted; ValueError: a group not finished (groups never split).
        """
        picked = pop_whole(self.changed, self.groups, uids, _sample_done)
        samples = [s for _, group in picked for s in group]
        width = max([len(s.tokens) for s in samples] or [0])

        def column(values, fill, dtype):
            return torch.tensor([v + [fill] * (width - len(v)) for v in values], dtype=dtype).reshape(len(samples), width)

        mask = column([[1] * len(s.tokens) for s in samples], 0, torch.int64)
        versions = column([s.versions for s in samples], 0, torch.int64)
        oldest = torch.tensor([min(s.versions or [version]) for s in samples], dtype=torch.int64)
        rows = Batch.concat([prompt for prompt, _ in picked]).repeat_interleave(self.n) if picked else Batch()
        return rows.with_columns(**{
            RESPONSES: column([s.tokens for s in samples], self.pad_id, torch.int64), RESPONSE_MASK: mask,
            RESPONSE_LENGTH: mask.sum(-1), ROLLOUT_LOGPROBS: column([s.logprobs for s in samples], 0.0, torch.float32),
            TOKEN_WEIGHT_VERSION: versions, WEIGHT_VERSION: oldest, STALENESS: version - oldest})


class StreamLoop:
    """A thread that keeps continuing the unfinished samples of `samples` in waves.

    A wave takes up to `wave_rows` unfinished samples (oldest groups first) and decodes at most
    `wave_tokens` tokens; then the next wave is formed again, so finished samples make room for
    new ones (continuous batching, at the cost of one prefill of each continued sample a wave).

    A weight update (the engine's `load_weights`) clears `no_update` while it waits and loads:

    * partial rollouts: the running wave ends at its next model call and no wave starts until the
      update has landed; unfinished samples then continue with the new weights.
    * without (`partial=False`): waves go on with the samples already started, and no new sample
      starts, until every started sample has finished (`StreamedSamples.drained`, which the
      engine waits for before it loads); no sample mixes versions.

    Args:
        samples: the rank's streamed groups.
        continue_samples: the engine's (see `ContinueSamples`).
        version: the engine's current weight version.
        wave_rows: samples per wave (the engine's micro-batch).
        no_update: set while no weight update waits (see above).
        partial: partial rollouts.
        wave_tokens: tokens a wave decodes at most.
    """

    def __init__(self, samples: StreamedSamples, continue_samples: ContinueSamples, version: Callable[[], int],
                 wave_rows: int, no_update: threading.Event, *, partial: bool = True,
                 wave_tokens: int = WAVE_TOKENS) -> None:
        self.samples, self.continue_samples, self.version, self.wave_rows = samples, continue_samples, version, wave_rows
        self.no_update, self.partial, self.wave_tokens = no_update, partial, wave_tokens
        self.error: BaseException | None = None
        self.waves = 0
        self.busy_s = 0.0   # seconds spent in waves (the rank's generation time)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="raygraph-stream", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                with self.samples.changed:
                    self.samples.changed.wait_for(lambda: self._stop.is_set() or self.samples.in_flight() > 0,
                                                  timeout=1.0)
                updating = not self.no_update.is_set()
                wave = [] if updating and self.partial else self.samples.claim(self.wave_rows, started=updating)
                if not wave:
                    if updating:
                        self.no_update.wait(1.0)
                    continue
                start = time.perf_counter()
                version = self.version()
                more = self.continue_samples(wave, version, wave_gate(
                    version, self.version, self.no_update, partial=self.partial, stopped=self._stop.is_set,
                    wave_tokens=self.wave_tokens))
                self.samples.extend(wave, more, version)
                self.waves += 1
                self.busy_s += time.perf_counter() - start
        except BaseException as exc:   # surfaced by `check()` in the caller's thread
            self.error = exc
            with self.samples.changed:
                self.samples.changed.notify_all()

    def check(self) -> None:
        """Raise the loop's error, if it died, in the caller's thread."""
        if self.error is not None:
            raise RuntimeError(f"the streaming rollout loop failed: {self.error!r}") from self.error

    def stop(self, timeout_s: float = 30.0) -> None:
        self._stop.set()
        with self.samples.changed:
            self.samples.changed.notify_all()
        self._thread.join(timeout_s)
