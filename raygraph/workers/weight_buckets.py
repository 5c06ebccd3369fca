"""A model's full weights as buckets of named tensors, the unit of a weight sync."""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch
from torch import nn

from raygraph.workers.distributed import full_tensor

__all__ = ["group_in_buckets", "iter_weight_buckets"]


def _named_tensors(model: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """Parameters (tied ones once, under their first name) and persistent buffers."""
    persistent = set(model.state_dict().keys())
    yield from model.named_parameters()
    yield from ((n, b) for n, b in model.named_buffers() if n in persistent)


def iter_weight_buckets(model: nn.Module, bucket_bytes: int, dtype: torch.dtype | None = None, *,
                        copy: bool = True) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """Full tensors in state-dict names, grouped in buckets of about `bucket_bytes`.

    Under FSDP2 each tensor is all-gathered as it is reached, so every rank must drain the
    iterator in lockstep; at most one bucket of full tensors is alive per rank at a time.
    Gathered or cast tensors are new; an unsharded model's own tensors are cloned when `copy`
    (safe to keep while training goes on), else handed out as detached views of the live
    weights (no copy: consume each bucket before the next optimizer step).
    """
    def full_tensors() -> Iterator[tuple[str, torch.Tensor]]:
        for name, tensor in _named_tensors(model):
            live = tensor.detach()
            full = full_tensor(live)
            if dtype is not None and full.is_floating_point() and full.dtype != dtype:
                full = full.to(dtype)
            elif copy and full is live:
                full = full.clone()
            yield name, full

    yield from group_in_buckets(full_tensors(), bucket_bytes)


def group_in_buckets(named: Iterable[tuple[str, torch.Tensor]],
                     bucket_bytes: int) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """Consecutive `(name, tensor)` pairs grouped into lists of about `bucket_bytes` (a tensor
    larger than that gets a bucket of its own); tensors are drawn lazily, one bucket at a time."""
    bucket, size = [], 0
    for name, tensor in named:
        nbytes = tensor.numel() * tensor.element_size()
        if bucket and size + nbytes > bucket_bytes:
            yield bucket
            bucket, size = [], 0
        bucket.append((name, tensor))
        size += nbytes
    if bucket:
        yield bucket
