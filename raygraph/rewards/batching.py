"""Helpers shared by the reward workers: decode responses, place scores on the last token.

Placement rule (every reward worker follows it): a response of L >= 1 valid tokens gets its
scalar score at index ``L - 1`` of ``token_level_scores`` and zero elsewhere; a response of
length 0 gets the score nowhere (its row is all zeros), i.e. it counts as score 0.

Non-finite scores (NaN, +-Inf) are caught here, where every reward enters the batch, and follow
`reward.on_non_finite` (`NON_FINITE_POLICIES`): "fail" raises `NonFiniteRewardError` naming the
reward (function, model or service) and the sample's uid; "zero" scores such rows 0, marks them
in `reward_extra.non_finite` (so `reward/non_finite` is the share of rows it hit) and logs a
warning. A NaN would otherwise turn every loss NaN and skip every optimizer step.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from raygraph.batch import REWARD_EXTRA_PREFIX, TOKEN_LEVEL_SCORES, Batch, last_valid_index
from raygraph.errors import RewardFailed

__all__ = ["NON_FINITE_POLICIES", "NonFiniteRewardError", "as_score", "decode_responses",
           "place_on_last_token", "reward_batch"]

log = logging.getLogger("raygraph")

NON_FINITE_POLICIES = ("fail", "zero")
NON_FINITE_EXTRA = "non_finite"


class NonFiniteRewardError(RewardFailed, ValueError):
    """A reward returned NaN or Inf for a sample (under `reward.on_non_finite=fail`)."""


def decode_responses(tokenizer: Any, responses: torch.Tensor,
                     response_mask: torch.Tensor) -> list[str]:
    """Text of each response's valid tokens, special tokens (eos, pad) skipped.

    Args:
        responses: (B, R) int64 token ids; response_mask: (B, R) 0/1.
    """
    ids = [row[mask.bool()].tolist() for row, mask in zip(responses, response_mask)]
    return tokenizer.batch_decode(ids, skip_special_tokens=True)


def as_score(value: Any, source: str, row: int, uid: Any = None) -> float:
    """`value` as a float, or a `TypeError` naming the reward and the row (a string or null score)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) and not (
            isinstance(value, torch.Tensor) and value.numel() == 1):
        where = f"row {row}" + (f" (uid {uid!r})" if uid is not None else "")
        raise TypeError(f"{source} returned {value!r} ({type(value).__name__}) as the score of {where}; "
                        "a score must be a number")
    return float(value)


def place_on_last_token(scores: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """(B,) sequence scores -> (B, R) float32 with each score at its last valid response token
    (the last token the model generated; multi-turn masks have holes).

    Rows whose response_mask is all zero stay all zero.
    """
    out = torch.zeros(response_mask.shape, dtype=torch.float32)
    rows = torch.nonzero(response_mask.sum(dim=1) > 0).flatten()
    out[rows, last_valid_index(response_mask)[rows]] = scores.to(torch.float32)[rows]
    return out


def reward_batch(scores: Sequence[float], extras: Mapping[str, Sequence[float]],
                 response_mask: torch.Tensor, *, source: str = "reward",
                 uids: Sequence[Any] | None = None, on_non_finite: str = "fail") -> Batch:
    """The reward workers' output: `token_level_scores` (B, R) and `reward_extra.<name>` (B,).

    Scores of rows with an empty response are zeroed (see the module docstring); non-finite
    scores and extras follow `on_non_finite` ("fail" | "zero"), with `source` (e.g.
    "reward function 'math'") and `uids` naming the culprit.
    """
    if on_non_finite not in NON_FINITE_POLICIES:
        raise ValueError(f"on_non_finite={on_non_finite!r}; valid: {', '.join(NON_FINITE_POLICIES)}")
    scores, bad = _finite_or_zero(list(scores), "score", source, uids, on_non_finite)
    clean_extras = {}
    for name, values in extras.items():
        clean_extras[name], bad_extra = _finite_or_zero(list(values), f"extra {name!r}", source, uids,
                                                        on_non_finite)
        bad = [a or b for a, b in zip(bad, bad_extra)] if len(bad_extra) == len(bad) else bad
    if any(bad):
        clean_extras[NON_FINITE_EXTRA] = [float(b) for b in bad]
    mask = response_mask.cpu()
    empty = mask.sum(dim=1) == 0
    score_t = torch.as_tensor(scores, dtype=torch.float32).masked_fill(empty, 0.0)
    columns: dict[str, torch.Tensor] = {TOKEN_LEVEL_SCORES: place_on_last_token(score_t, mask)}
    for name, values in clean_extras.items():
        col = torch.as_tensor(list(values), dtype=torch.float32)
        if col.shape != score_t.shape:
            raise ValueError(f"extra {name!r} has {tuple(col.shape)} values for {len(score_t)} rows")
        columns[REWARD_EXTRA_PREFIX + name] = col
    return Batch(columns)


def _finite_or_zero(values: list[float], what: str, source: str, uids: Sequence[Any] | None,
                    policy: str) -> tuple[list[float], list[bool]]:
    """`values` with non-finite entries set to 0 (policy "zero") or an error (policy "fail")."""
    bad = [not math.isfinite(v) for v in values]
    if not any(bad):
        return values, bad
    rows = [i for i, b in enumerate(bad) if b]
    named = ", ".join(f"row {i} (uid {uids[i]!r}): {values[i]}" if uids is not None else f"row {i}: {values[i]}"
                      for i in rows[:3])
    message = (f"{source} returned a non-finite {what} for {len(rows)} of {len(values)} samples: {named}"
               + (" ..." if len(rows) > 3 else ""))
    if policy == "fail":
        raise NonFiniteRewardError(message + "; fix the reward, or set reward.on_non_finite=zero to score "
                                             "such samples 0 (counted in reward/non_finite)")
    log.warning("%s; scored 0 (reward.on_non_finite=zero)", message)
    return [0.0 if b else v for v, b in zip(values, bad)], bad
