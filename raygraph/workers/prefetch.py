"""Rollouts sampled one step ahead, and the rollout engines' checkpoint, shared by every engine.

Asynchronous pipelining (one-step off-policy, docs/async.md): a rollout worker samples the next
step's prompts with the weights it holds now (`prefetch_next`) and hands those rollouts over one
step later (`take_or_generate`), after the weight sync. `PrefetchedRollouts` is the buffer that
does this for every rollout engine: each owns one, and the methods every engine shares
(`raygraph.workers.rollout_engine`) delegate to it, passing the engine's `generate` and weight
version on every call (the buffer holds no reference to the worker, so it works with any engine
and is tested with a fake one).

The checkpoint of a rollout worker is the sampling generator's state, the weight version and the
kept rollouts, in safe formats only (nothing is unpickled on resume):

    rollout_state.safetensors   the generator's state; the weight version in the file's metadata
    prefetched.safetensors      tensor columns of the kept batches, named "<slot>/<column>"
    prefetched.json             per slot, oldest first: prompt uids, tensor column names, and the
                                non-tensor columns as JSON (numpy values become lists / Python
                                scalars; a value JSON cannot hold is a TypeError at save)

Batch `meta` is not kept: `take_or_generate` replaces it with the current batch's.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from raygraph.batch import NEXT_PROMPTS, SHARD, STALENESS, UID, WEIGHT_VERSION, Batch

__all__ = ["KEPT_COLUMNS", "KEPT_TENSORS", "STATE_FILE", "PrefetchedRollouts"]

STATE_FILE, KEPT_TENSORS, KEPT_COLUMNS = "rollout_state.safetensors", "prefetched.safetensors", "prefetched.json"

Generate = Callable[[Batch], Batch]  # prompts -> rollouts, as a rollout worker's `generate(batch)`


class PrefetchedRollouts:
    """Rollouts kept for a later step, keyed by the uids of the prompts they answer.

    Args:
        slots: batches kept at most; the oldest is dropped beyond it. 2 = the next step's, and the
            current step's if it was not taken yet (a step that failed before `take_or_generate`).

    Attributes:
        kept: `{prompt uids: rollouts}`, oldest first.
    """

    def __init__(self, slots: int = 2) -> None:
        if slots < 1:
            raise ValueError(f"slots must be >= 1, got {slots}")
        self.slots = slots
        self.kept: dict[tuple[str, ...], Batch] = {}

    def prefetch(self, prompts: Batch, generate: Generate) -> int:
        """Sample rollouts for `prompts` now with `generate` and keep them. Returns the rows kept."""
        key = tuple(prompts[UID])
        self.kept.pop(key, None)  # sampled again: it becomes the newest
        self.kept[key] = generate(prompts)
        while len(self.kept) > self.slots:
            self.kept.pop(next(iter(self.kept)))  # the oldest: it will not be asked for
        return len(self.kept[key])

    def prefetch_next(self, batch: Batch, generate: Generate) -> dict[str, float]:
        """`prefetch` the share of the next step's prompts attached to `batch` for this rank.

        Args:
            batch: this rank's share of the current step's prompts; `batch.meta[NEXT_PROMPTS]` is
                `{uids of a share now: the same rank's share next step}` (set by the driver).
            generate: the worker's sampler.

        Returns:
            `{"rollout/prefetched": rows sampled}` (0 when no next share is attached).
        """
        upcoming = (batch.meta.get(NEXT_PROMPTS) or {}).get(tuple(batch[UID]))
        if upcoming is not None and SHARD in batch.meta:   # the next shares form a dispatch round of their own
            tag = batch.meta[SHARD]
            upcoming = Batch(upcoming.tensors, upcoming.non_tensors,
                             {**upcoming.meta, SHARD: {**tag, "round": f"{tag['round']}/next"}})
        return {"rollout/prefetched": float(self.prefetch(upcoming, generate) if upcoming is not None else 0)}

    def take_or_generate(self, batch: Batch, generate: Generate, weight_version: int) -> Batch:
        """The rollouts kept for exactly the prompts of `batch` (handed over once), else `generate(batch)`.

        Args:
            batch: this step's prompts; its `meta` (less `NEXT_PROMPTS`) goes on the result.
            generate: the worker's sampler, used when nothing matching was kept.
            weight_version: the version of the weights the worker holds now.

        Returns:
            the rollouts plus `staleness` `(B*n,)` int64: `weight_version` minus each row's
            `weight_version` (0 for rows sampled now).
        """
        rollouts = self.kept.pop(tuple(batch[UID]), None)
        if rollouts is None:
            rollouts = generate(batch)
        out = rollouts.with_columns(**{STALENESS: weight_version - rollouts[WEIGHT_VERSION]})
        out.meta = {k: v for k, v in batch.meta.items() if k != NEXT_PROMPTS}
        return out

    # ------------------------------------------------------------------------------ checkpoints
    def save(self, path: str | Path, generator: torch.Generator, weight_version: int) -> None:
        """Write the generator's state, `weight_version` and the kept rollouts under `path`.

        Raises:
            TypeError: a non-tensor cell JSON cannot hold (named by its column).
        """
        from safetensors.torch import save_file

        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        tensors, slots = {}, []
        for slot, (uids, kept) in enumerate(self.kept.items()):  # checked before anything is written
            tensors.update({f"{slot}/{name}": t.detach().cpu().contiguous().clone() for name, t in kept.tensors.items()})
            slots.append({"uids": list(uids), "tensors": list(kept.tensors),
                          "non_tensors": {name: [_jsonable(v, name) for v in values]
                                          for name, values in kept.non_tensors.items()}})
        save_file({"generator": generator.get_state()}, path / STATE_FILE,
                  metadata={"weight_version": str(int(weight_version))})
        for stale in (KEPT_TENSORS, KEPT_COLUMNS):  # a directory written before may hold older ones
            (path / stale).unlink(missing_ok=True)
        if slots:
            save_file(tensors, path / KEPT_TENSORS)
            (path / KEPT_COLUMNS).write_text(json.dumps(slots))

    def load(self, path: str | Path, generator: torch.Generator) -> int:
        """Restore what `save` wrote: sets `generator`'s state, replaces `kept`; returns the weight
        version. Only safetensors and JSON are read (nothing is unpickled)."""
        from safetensors import safe_open
        from safetensors.torch import load_file

        path = Path(path)
        with safe_open(path / STATE_FILE, framework="pt") as f:
            generator.set_state(f.get_tensor("generator"))
            weight_version = int(f.metadata()["weight_version"])
        self.kept = {}
        if (path / KEPT_COLUMNS).is_file():
            tensors = load_file(path / KEPT_TENSORS)
            for slot, kept in enumerate(json.loads((path / KEPT_COLUMNS).read_text())):
                self.kept[tuple(kept["uids"])] = Batch(
                    {name: tensors[f"{slot}/{name}"] for name in kept["tensors"]},
                    {name: _object_array(values) for name, values in kept["non_tensors"].items()})
        return weight_version


def _object_array(values: Sequence) -> np.ndarray:
    out = np.empty(len(values), dtype=object)
    for i, value in enumerate(values):  # element-wise: lists of equal length stay lists
        out[i] = value
    return out


def _jsonable(value: Any, column: str) -> Any:
    """A JSON-safe copy of one non-tensor cell; numpy values become Python ones."""
    if isinstance(value, np.ndarray | np.generic):
        return _jsonable(value.tolist(), column)  # an object array may still hold anything
    if value is None or isinstance(value, str | bool | int | float):
        return value
    if isinstance(value, list | tuple):
        return [_jsonable(v, column) for v in value]
    if isinstance(value, dict) and all(isinstance(k, str) for k in value):
        return {k: _jsonable(v, column) for k, v in value.items()}
    raise TypeError(f"save_checkpoint: column {column!r} holds a {type(value).__name__}, which the "
                    f"checkpoint's JSON cannot hold; keep non-tensor columns to str/number/list/dict")
