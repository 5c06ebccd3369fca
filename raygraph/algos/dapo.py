"""DAPO's shaping maths (Yu et al. 2025, "DAPO: An Open-Source LLM Reinforcement Learning System at
Scale"): the soft overlong penalty and dynamic sampling's test of a group. Pure torch; the
whole-batch functions that apply them to a `Batch` are `raygraph.graph.dapo`."""

from __future__ import annotations

from collections.abc import Hashable, Sequence

import torch

__all__ = ["overlong_penalty", "informative_groups"]


def overlong_penalty(lengths: torch.Tensor, *, max_len: int, buffer: int, factor: float) -> torch.Tensor:
    """(B,) DAPO's soft overlong punishment (eq. 13) of responses of `lengths` (B,) tokens.

    With L the length, L_max = `max_len` and L_cache = `buffer` (>= 1)::

        penalty = 0                                          L <= L_max - L_cache
                = factor * ((L_max - L_cache) - L) / L_cache  otherwise (down to -factor at L_max)
    """
    exceed = (lengths - (max_len - buffer)).clamp(min=0).float()
    return -factor * exceed.clamp(max=buffer) / buffer


def informative_groups(values: torch.Tensor, group_ids: Sequence[Hashable]) -> list:
    """The groups whose rows' `values` (B,) are not all equal, in order of first appearance.

    A group whose samples all score the same has zero group-relative advantage (DAPO sec. 3.2,
    dynamic sampling): it gives no gradient and only dilutes the loss normaliser.
    """
    spread: dict = {}
    for value, gid in zip(values.tolist(), group_ids):
        lo, hi = spread.get(gid, (float("inf"), float("-inf")))
        spread[gid] = (min(lo, value), max(hi, value))
    return [gid for gid, (lo, hi) in spread.items() if hi > lo]
