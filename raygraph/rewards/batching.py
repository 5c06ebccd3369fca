"""Helpers shared by the reward workers: decode responses, place scores on the last token.

Placement rule (every reward worker follows it): a response of L >= 1 valid tokens gets its
scalar score at index ``L - 1`` of ``token_level_scores`` and zero elsewhere; a response of
length 0 gets the score nowhere (its row is all zeros), i.e. it counts as score 0.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from raygraph.batch import REWARD_EXTRA_PREFIX, TOKEN_LEVEL_SCORES, Batch

__all__ = ["decode_responses", "place_on_last_token", "reward_batch"]


def decode_responses(tokenizer: Any, responses: torch.Tensor,
                     response_mask: torch.Tensor) -> list[str]:
    """Text of each response's valid tokens, special tokens (eos, pad) skipped.

    Args:
        responses: (B, R) int64 token ids; response_mask: (B, R) 0/1.
    """
    ids = [row[mask.bool()].tolist() for row, mask in zip(responses, response_mask)]
    return tokenizer.batch_decode(ids, skip_special_tokens=True)


def place_on_last_token(scores: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """(B,) sequence scores -> (B, R) float32 with each score at its last valid response token.

    Rows whose response_mask is all zero stay all zero.
    """
    lengths = response_mask.sum(dim=1).long()                         # (B,)
    out = torch.zeros(response_mask.shape, dtype=torch.float32)
    rows = torch.nonzero(lengths > 0).flatten()
    out[rows, lengths[rows] - 1] = scores.to(torch.float32)[rows]
    return out


def reward_batch(scores: Sequence[float], extras: Mapping[str, Sequence[float]],
                 response_mask: torch.Tensor) -> Batch:
    """The reward workers' output: `token_level_scores` (B, R) and `reward_extra.<name>` (B,).

    Scores of rows with an empty response are zeroed (see the module docstring).
    """
    mask = response_mask.cpu()
    empty = mask.sum(dim=1) == 0
    score_t = torch.as_tensor(list(scores), dtype=torch.float32).masked_fill(empty, 0.0)
    columns: dict[str, torch.Tensor] = {TOKEN_LEVEL_SCORES: place_on_last_token(score_t, mask)}
    for name, values in extras.items():
        col = torch.as_tensor(list(values), dtype=torch.float32)
        if col.shape != score_t.shape:
            raise ValueError(f"extra {name!r} has {tuple(col.shape)} values for {len(score_t)} rows")
        columns[REWARD_EXTRA_PREFIX + name] = col
    return Batch(columns)
