"""The contract of a rollout engine, and the methods every engine shares.

`RolloutEngine` lists what the layers above call on a rollout worker: the workflows bind
`generate`, `take_or_generate` and `prefetch_next`; weight sync calls `load_weights`; the
checkpoint and recovery paths call `save_checkpoint`, `load_checkpoint` and `reseed`; the role
builders ask the class `lora_sync_for`. Every engine in `raygraph.workers.engines.ROLLOUT_ENGINES`
satisfies it, signatures included (`tests/test_layers.py`).

An engine implements its own sampling (`generate`), weight loading (`load_weights`) and
`lora_sync_for`. Everything else is the same for every engine and is written once here, as plain
functions an engine class takes as its methods (`prefetch = rollout_engine.prefetch`), so there is
no base class. They read three attributes the engine sets up in `__init__`:

    generator        torch.Generator   the engine's sampling RNG (`reseed`, the checkpoint)
    _weight_version  int               version of the weights in use (0 = as loaded)
    prefetched       PrefetchedRollouts  rollouts sampled one step ahead (`raygraph.workers.prefetch`)
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Protocol

import torch

from raygraph.batch import (
    RESPONSE_LENGTH,
    RESPONSE_TEXT,
    RESPONSES,
    SHARD,
    STALENESS,
    STREAM_TAKE,
    TOKEN_WEIGHT_VERSION,
    Batch,
)
from raygraph.models.lora import LoraSpec
from raygraph.workers.agent_rollout import no_episodes
from raygraph.workers.rollout_output import no_rollouts, text_column
from raygraph.workers.streaming import WAVE_TOKENS, Continuation, Sample, StreamedSamples, StreamLoop
from raygraph.workers.streaming_episodes import episode_stream

__all__ = [
    "RolloutEngine", "load_checkpoint", "prefetch", "prefetch_next", "reseed", "save_checkpoint",
    "drain_stream", "stream_load", "stream_stop", "stream_submit", "stream_take", "stream_wait", "take_or_generate",
    "weight_version",
]

Tensor = torch.Tensor


class RolloutEngine(Protocol):
    """What a rollout worker offers the run; see `HFRolloutWorker` for the sampling conventions."""

    @staticmethod
    def lora_sync_for(model_path: str, lora: LoraSpec) -> tuple[str, str]:
        """What the policy's weight syncs send to this engine with LoRA ("adapter" | "merged"), and a
        line for the log."""

    @property
    def weight_version(self) -> int:
        """Version of the weights in use (0 = as loaded; set by `load_weights`)."""

    def generate(self, batch: Batch, greedy: bool = False, n: int | None = None,
                 temperature: float | None = None) -> Batch:
        """`B * n` rows with `responses`, `response_mask`, `response_length`, `rollout_logprobs`,
        `weight_version`, `response_text` (the n samples of a prompt contiguous)."""

    def prefetch(self, prompts: Batch) -> int:
        """Sample rollouts for `prompts` now and keep them for `take_or_generate`; rows kept."""

    def prefetch_next(self, batch: Batch) -> dict[str, float]:
        """`prefetch` this rank's share of the next step's prompts (`batch.meta[NEXT_PROMPTS]`)."""

    def take_or_generate(self, batch: Batch) -> Batch:
        """The rollouts prefetched for exactly these prompts, else `generate(batch)`; plus `staleness`."""

    def load_weights(self, buckets: Iterable[list[tuple[str, Tensor]]], version: int) -> dict:
        """Load new weights bucket by bucket; `{"loaded", "bytes", "version"}`."""

    def reseed(self, seed: int) -> None:
        """Restart the sampling RNG from `seed`."""

    def save_checkpoint(self, path: str | Path) -> None:
        """Write the sampling RNG, the weight version and the prefetched rollouts under `path`."""

    def load_checkpoint(self, path: str | Path) -> None:
        """Restore what `save_checkpoint` wrote (the weights come back from the policy)."""

    def continue_samples(self, samples: Sequence[Sample], version: int,
                         keep_going: Callable[[], bool]) -> list[Continuation]:
        """Streaming: one wave, each sample continued from its token ids (`raygraph.workers.streaming`)."""

    def stream_submit(self, prompts: Batch) -> dict[str, float]:
        """Streaming: queue prompt groups; a background loop generates them."""

    def stream_load(self) -> int:
        """Streaming: samples submitted here and not finished."""

    def stream_wait(self, uids: list[str], timeout_s: float) -> dict[str, float]:
        """Streaming: wait for these groups to finish; this rank's streaming figures."""

    def stream_take(self, batch: Batch) -> Batch:
        """Streaming: the finished groups the driver assigned to this rank, as rollout rows."""

    def stream_stop(self) -> None:
        """Streaming: stop the background loop."""


# ------------------------------------------------------------------------------ shared methods
# Each takes the engine as `self`: an engine class binds them as methods (see the module docstring).


def _read_weight_version(self) -> int:
    """Version of the weights in use (0 = as loaded; set by `load_weights`)."""
    return self._weight_version


weight_version = property(_read_weight_version)


def reseed(self, seed: int) -> None:
    """Restart the sampling generator from `seed` (the trainer gives each rank its own)."""
    self.generator.manual_seed(seed)


def prefetch(self, prompts: Batch) -> int:
    """Sample rollouts for `prompts` now, with the weights held now, and keep them for
    `take_or_generate`. Returns the number of rows kept."""
    return self.prefetched.prefetch(prompts, self.generate)


def prefetch_next(self, batch: Batch) -> dict[str, float]:
    """`prefetch` the share of the NEXT step's prompts that this rank will receive.

    Args:
        batch: this rank's share of the current step's prompts; the driver put the next step's
            shares in `batch.meta[NEXT_PROMPTS]` as `{uids of a share now: the same rank's
            share next step}` (see `raygraph.run.feed.StepData.next_prompts`).

    Returns:
        `{"rollout/prefetched": rows sampled}` (0 when no next share is attached).
    """
    return self.prefetched.prefetch_next(batch, self.generate)


def take_or_generate(self, batch: Batch) -> Batch:
    """This step's rollouts: the ones prefetched for exactly these prompts, else sampled now.

    Returns:
        what `generate(batch)` returns (with `batch.meta`, less `NEXT_PROMPTS`), plus
        `staleness` `(B*n,)`: how many versions the weights that sampled each row lag the
        weights held now, which are the policy's (every step ends with a weight sync).
    """
    return self.prefetched.take_or_generate(batch, self.generate, self._weight_version)


def save_checkpoint(self, path: str | Path) -> None:
    """The sampling generator's state, the weight version and any prefetched rollouts
    (safetensors + JSON, see `raygraph.workers.prefetch`; their `meta` is not kept:
    `take_or_generate` replaces it); the weights come back from the policy on resume."""
    self.prefetched.save(path, self.generator, self._weight_version)


def load_checkpoint(self, path: str | Path) -> None:
    """Restore what `save_checkpoint` wrote under `path`."""
    self._weight_version = self.prefetched.load(path, self.generator)


# ------------------------------------------------------------------------------ streaming (issue 26)
# For an engine with `continue_samples` (`raygraph.workers.streaming.ContinueSamples`), `n`,
# `stream_wave_rows` (samples a wave takes at most), `tokenizer`, `partial_rollouts`, `agent` (the
# agent loop of multi-turn episodes, or None), a `streamed` attribute (None until the first
# submit), and `_no_update`, a threading.Event its `load_weights` clears while it waits
# (`drain_stream`) and loads.


def stream_submit(self, prompts: Batch) -> dict[str, float]:
    """Queue the prompt rows of `prompts` as groups of n samples (with an agent: n episodes); a
    background loop generates them with whatever weights the engine holds at each moment (started
    by the first call)."""
    if self.streamed is None:
        if self.agent is not None:
            self.streamed, self._stream_loop = episode_stream(self)
        else:
            self.streamed = StreamedSamples(self.n, self.tokenizer.pad_token_id)
            self._stream_loop = StreamLoop(self.streamed, self.continue_samples, lambda: self._weight_version,
                                           self.stream_wave_rows, self._no_update, partial=self.partial_rollouts,
                                           wave_tokens=WAVE_TOKENS)
        self._stream_clock = (time.perf_counter(), 0.0)
    self._stream_loop.check()
    return {"rollout/stream_submitted": float(self.streamed.submit(prompts))}


def stream_load(self) -> int:
    """Samples submitted here and not finished: what least-loaded dispatch compares."""
    return 0 if self.streamed is None else self.streamed.in_flight()


def stream_wait(self, uids: list[str], timeout_s: float) -> dict[str, float]:
    """Wait up to `timeout_s` for these groups to finish.

    Returns:
        `{"ready": 1.0 | 0.0}` and this rank's streaming figures since the last wait:
        `busy_s` / `wall_s` (generation time and wall time), `in_flight` (unfinished samples),
        `queued` (groups held, finished or not), and `tokens_v<version>` per weight version.
    Raises:
        the streaming loop's error, if it died.
    """
    if self.streamed is None:   # nothing was ever submitted here
        return {"ready": 1.0}
    self._stream_loop.check()
    ready = self.streamed.wait_for(uids, timeout_s) if uids else True
    self._stream_loop.check()
    now, busy = time.perf_counter(), self._stream_loop.busy_s
    since, busy_before = self._stream_clock
    self._stream_clock = (now, busy)
    with self.streamed.changed:   # the loop counts under it
        tokens, self.streamed.tokens_per_version = dict(self.streamed.tokens_per_version), Counter()
    return {"ready": float(ready), "busy_s": busy - busy_before, "wall_s": now - since,
            "in_flight": float(self.streamed.in_flight()), "queued": float(len(self.streamed.groups)),
            **{f"tokens_v{v}": float(k) for v, k in tokens.items()}}


def stream_take(self, batch: Batch) -> Batch:
    """The finished groups the driver assigned to this rank (`batch.meta[STREAM_TAKE][rank]`,
    rank from the scatter's `SHARD` tag; this rank's share of `batch` is not read) as rollout rows
    (`StreamedSamples.take`, or with an agent `StreamedEpisodes.take`) with `response_text`;
    `staleness` counts versions behind the weights held now, which are the policy's."""
    rank = batch.meta.get(SHARD, {}).get("rank", 0)
    uids = list(batch.meta[STREAM_TAKE].get(rank, ()))
    if not uids:
        empty = (no_rollouts if self.agent is None else no_episodes)(batch.select([]), self._weight_version)
        return empty.with_columns(**{TOKEN_WEIGHT_VERSION: empty[RESPONSES].clone(),
                                     STALENESS: torch.zeros(0, dtype=torch.int64)})
    out = self.streamed.take(uids, self._weight_version)
    if RESPONSE_TEXT not in out:   # single-turn samples (episode rows have their texts)
        texts = self.tokenizer.batch_decode([r[:k].tolist() for r, k in zip(out[RESPONSES], out[RESPONSE_LENGTH])],
                                            skip_special_tokens=True)
        out = out.with_columns(**{RESPONSE_TEXT: text_column(texts)})
    out.meta = {k: v for k, v in batch.meta.items() if k not in (STREAM_TAKE, SHARD)}
    return out


def drain_stream(self) -> None:
    """Before a weight update without partial rollouts: wait until every started sample (or
    episode) has finished with the weights it started with; nothing to wait for otherwise."""
    if self.streamed is None or self.partial_rollouts:
        return
    while not self.streamed.drained(1.0):
        self._stream_loop.check()


def stream_stop(self) -> None:
    """Stop the streaming loop (the queued groups stay in `streamed`)."""
    loop = getattr(self, "_stream_loop", None)
    if loop is not None:
        loop.stop()
