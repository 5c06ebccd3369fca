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

from collections.abc import Iterable
from pathlib import Path
from typing import Protocol

import numpy as np
import torch

from raygraph.batch import RESPONSE_LENGTH, RESPONSE_TEXT, RESPONSES, Batch
from raygraph.models.lora import LoraSpec
from raygraph.workers.streaming import StreamedSamples, StreamLoop

__all__ = [
    "RolloutEngine", "load_checkpoint", "prefetch", "prefetch_next", "reseed", "save_checkpoint",
    "stream_ready", "stream_requeue", "stream_stop", "stream_submit", "stream_take", "take_or_generate",
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
# `micro_batch_size`, `tokenizer` and a `streamed` attribute (None until the first submit).


def stream_submit(self, prompts: Batch) -> dict[str, float]:
    """Queue the prompt rows of `prompts` as groups of n samples; a background loop generates
    them with whatever weights the engine holds at each moment (started by the first call)."""
    if self.streamed is None:
        self.streamed = StreamedSamples(self.n, self.tokenizer.pad_token_id)
        self._stream_loop = StreamLoop(self.streamed, self.continue_samples, lambda: self._weight_version,
                                       self.micro_batch_size)
    self._stream_loop.check()
    return {"rollout/stream_submitted": float(self.streamed.submit(prompts))}


def stream_ready(self, wait_groups: int = 0, timeout_s: float = 0.0) -> dict[str, int]:
    """`{uid: version of its oldest token}` of the finished groups, after waiting up to `timeout_s`
    for `wait_groups` of them. Raises the streaming loop's error if it died."""
    if self.streamed is None:
        return {}
    self._stream_loop.check()
    if wait_groups:
        self.streamed.wait_ready(wait_groups, timeout_s)
        self._stream_loop.check()
    return self.streamed.ready()


def stream_take(self, uids: list[str]) -> Batch:
    """These finished groups as rollout rows (`StreamedSamples.take`), with `response_text`;
    `staleness` counts versions behind the weights held now."""
    rows = self.streamed.take(uids, self._weight_version)
    texts = self.tokenizer.batch_decode([r[:k].tolist() for r, k in zip(rows[RESPONSES], rows[RESPONSE_LENGTH])],
                                        skip_special_tokens=True)
    column = np.empty(len(texts), dtype=object)
    column[:] = texts
    return rows.with_columns(**{RESPONSE_TEXT: column})


def stream_requeue(self, uids: list[str]) -> int:
    """Generate these finished groups again from their prompts (too stale); how many."""
    return self.streamed.requeue(uids)


def stream_stop(self) -> None:
    """Stop the streaming loop (the queued groups stay in `streamed`)."""
    loop = getattr(self, "_stream_loop", None)
    if loop is not None:
        loop.stop()
