"""The rows a rollout engine returns (both engines, so that their outputs cannot drift apart)."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from raygraph.batch import (
    RESPONSE_LENGTH,
    RESPONSE_MASK,
    RESPONSE_TEXT,
    RESPONSES,
    ROLLOUT_LOGPROBS,
    WEIGHT_VERSION,
    Batch,
)

__all__ = ["rollout_rows", "no_rollouts", "text_column"]


def text_column(texts: Sequence[str]) -> np.ndarray:
    """Strings as a Batch's non-tensor column (a 1-D object array, one cell a row)."""
    column = np.empty(len(texts), dtype=object)
    column[:] = list(texts)
    return column


def rollout_rows(rows: Batch, responses: torch.Tensor, response_mask: torch.Tensor, logprobs: torch.Tensor,
                 texts: Sequence[str], weight_version: int) -> Batch:
    """`rows` (the prompts, repeated n times) with the generated columns: `responses`,
    `response_mask`, `rollout_logprobs` (B, R), `response_length`, `response_text`, `weight_version`."""
    return rows.with_columns(**{
        RESPONSES: responses, RESPONSE_MASK: response_mask, RESPONSE_LENGTH: response_mask.sum(-1),
        ROLLOUT_LOGPROBS: logprobs, RESPONSE_TEXT: text_column(texts),
        WEIGHT_VERSION: torch.full((len(rows),), weight_version, dtype=torch.int64),
    })


def no_rollouts(rows: Batch, weight_version: int) -> Batch:
    """What generating from no prompts gives: the columns above with no rows (a DAPO refill
    round that was not needed sends an empty batch; nothing reaches the engine)."""
    empty = torch.zeros((0, 0), dtype=torch.int64)
    return rollout_rows(rows, empty, empty.clone(), torch.zeros((0, 0)), [], weight_version)
