"""A seeded, resumable sampler of batch indices.

The order of epoch `e` is a pure function of `(seed, e)`: ``permutation(n_items)`` from a
generator seeded with ``[seed, e]``. The state is therefore just ``(epoch, position)``, and a
checkpoint taken mid-epoch resumes with exactly the indices an uninterrupted run would see.
Each epoch yields ``n_items // batch_size`` full batches; the few items left over are skipped
for that epoch only (the next epoch is reshuffled), so every batch has the same size.

`MixedSampler` draws from several sources (training files) in fixed proportions
(`data.train_weights`), each source with a `ResumableSampler` of its own.
"""

from __future__ import annotations

from typing import Any

import numpy as np

__all__ = ["ResumableSampler", "MixedSampler"]


class ResumableSampler:
    """Deterministic batches of dataset indices with a resumable position.

    Args:
        n_items: dataset length.
        batch_size: indices per `next_indices()` call (<= n_items).
        seed: shuffle seed.
        shuffle: when False every epoch is ``0 .. n_items-1`` in order.

    Attributes:
        epoch: epoch of the batch most recently returned (0 before the first call).
        position: number of indices of `epoch` already returned.
    """

    def __init__(self, n_items: int, batch_size: int, seed: int, shuffle: bool = True) -> None:
        if n_items < 1:
            raise ValueError(f"n_items must be >= 1, got {n_items}")
        if not 1 <= batch_size <= n_items:
            raise ValueError(f"batch_size must be in [1, n_items={n_items}], got {batch_size}")
        self.n_items, self.batch_size, self.seed, self.shuffle = n_items, batch_size, seed, shuffle
        self.epoch, self.position = 0, 0
        self._order_epoch, self._order = -1, np.arange(0)

    @property
    def steps_per_epoch(self) -> int:
        return self.n_items // self.batch_size

    def _epoch_order(self, epoch: int) -> np.ndarray:
        if self._order_epoch != epoch:
            self._order = (np.random.default_rng([self.seed, epoch]).permutation(self.n_items)
                           if self.shuffle else np.arange(self.n_items))
            self._order_epoch = epoch
        return self._order

    def next_indices(self) -> list[int]:
        """The next `batch_size` indices; moves to the next epoch when this one is used up."""
        if self.position + self.batch_size > self.n_items:
            self.epoch, self.position = self.epoch + 1, 0
        order = self._epoch_order(self.epoch)
        out = order[self.position:self.position + self.batch_size]
        self.position += self.batch_size
        return [int(i) for i in out]

    def state_dict(self) -> dict[str, Any]:
        return {"epoch": self.epoch, "position": self.position, "seed": self.seed,
                "n_items": self.n_items, "batch_size": self.batch_size, "shuffle": self.shuffle}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume from `state_dict()`. The dataset size, seed and shuffle flag must match."""
        for key in ("n_items", "seed", "shuffle"):
            if state[key] != getattr(self, key):
                raise ValueError(f"sampler state has {key}={state[key]!r} but this sampler has "
                                 f"{getattr(self, key)!r}; resuming would change the data order")
        if state["batch_size"] != self.batch_size:
            raise ValueError(f"sampler state has batch_size={state['batch_size']} but this "
                             f"sampler has {self.batch_size}")
        self.epoch, self.position = int(state["epoch"]), int(state["position"])


class MixedSampler:
    """Batches drawn from several sources (e.g. training files) in fixed proportions.

    Each source has its own `ResumableSampler` (its own epochs, reshuffled with its own seed);
    the `batch_size` slots of a batch go one by one to the source furthest behind its share,
    `argmax_i(weight_i * (drawn + 1) - drawn_i)` (ties to the lower index), so after any number
    of batches every source's count is within one item of `weight_i x items drawn`.

    Args:
        sizes: items per source; source i holds the indices `offset_i .. offset_i + sizes[i] - 1`
            of the combined dataset (sources concatenated in order).
        weights: one positive weight per source (normalised here).
        batch_size, seed, shuffle: as `ResumableSampler`.

    Attributes:
        epochs: after `next_indices`, each returned index's epoch within its own source (uids
            built from it differ whenever a prompt comes round again).
    """

    def __init__(self, sizes: list[int], weights: list[float], batch_size: int, seed: int,
                 shuffle: bool = True) -> None:
        if len(sizes) != len(weights) or not sizes:
            raise ValueError(f"need one weight per source, got {len(weights)} weights for {len(sizes)} sources")
        if any(w <= 0 for w in weights) or any(n < 1 for n in sizes):
            raise ValueError(f"every source needs a weight > 0 and at least one item, got weights {weights}, "
                             f"sizes {sizes}")
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        total = float(sum(weights))
        self.weights = [w / total for w in weights]
        self.sizes, self.batch_size, self.seed, self.shuffle = list(sizes), batch_size, seed, shuffle
        self.offsets = [sum(sizes[:i]) for i in range(len(sizes))]
        self._sources = [ResumableSampler(n, 1, seed=seed + 1_000_003 * (i + 1), shuffle=shuffle)
                         for i, n in enumerate(sizes)]
        self.drawn = [0] * len(sizes)
        self.epochs: list[int] = []

    def next_indices(self) -> list[int]:
        """The next `batch_size` combined-dataset indices (see the class docstring)."""
        out, self.epochs = [], []
        for _ in range(self.batch_size):
            total = sum(self.drawn) + 1
            i = max(range(len(self.sizes)), key=lambda s: (self.weights[s] * total - self.drawn[s], -s))
            self.drawn[i] += 1
            out.append(self.offsets[i] + self._sources[i].next_indices()[0])
            self.epochs.append(self._sources[i].epoch)
        return out

    def state_dict(self) -> dict[str, Any]:
        return {"drawn": list(self.drawn), "sources": [s.state_dict() for s in self._sources],
                "weights": list(self.weights), "batch_size": self.batch_size}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume from `state_dict()`; sources, weights and batch size must match."""
        if "sources" not in state or len(state["sources"]) != len(self._sources):
            raise ValueError("sampler state is not that of a mix of the same number of training files; "
                             "resuming would change the data order")
        if [round(w, 12) for w in state["weights"]] != [round(w, 12) for w in self.weights] \
                or state["batch_size"] != self.batch_size:
            raise ValueError(f"sampler state has weights {state['weights']} and batch size {state['batch_size']}, "
                             f"this run {self.weights} and {self.batch_size}; resuming would change the data order")
        for source, sub in zip(self._sources, state["sources"]):
            source.load_state_dict(sub)
        self.drawn = [int(n) for n in state["drawn"]]
