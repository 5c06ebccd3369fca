"""A seeded, resumable sampler of batch indices.

The order of epoch `e` is a pure function of `(seed, e)`: ``permutation(n_items)`` from a
generator seeded with ``[seed, e]``. The state is therefore just ``(epoch, position)``, and a
checkpoint taken mid-epoch resumes with exactly the indices an uninterrupted run would see.
Each epoch yields ``n_items // batch_size`` full batches; the few items left over are skipped
for that epoch only (the next epoch is reshuffled), so every batch has the same size.
"""

from __future__ import annotations

from typing import Any

import numpy as np

__all__ = ["ResumableSampler"]


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
