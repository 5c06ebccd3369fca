"""DAPO's batch shaping (Yu et al. 2025, "DAPO: An Open-Source LLM Reinforcement Learning System
at Scale"), as whole-batch functions a workflow places with `roles.apply(fn, batch, ...)`.

- `overlong_penalty`: soft overlong punishment (DAPO eq. 13), added to each row's score.
- `mask_truncated`: responses cut at the length limit leave the loss (overlong filtering).
- `filter_groups`: dynamic sampling's filter; groups whose accuracy (or score) is the same in
  every sample have zero group-relative advantage and only dilute the loss normaliser.

After `filter_groups` the batch may be smaller than the step's, or empty: the policy update
splits whatever is left over the training ranks and skips an empty step (`_train.run_minibatches`).
Pure functions of a `Batch`: no Ray, no config.
"""

from __future__ import annotations

import torch

from raygraph.batch import (
    RESPONSE_LENGTH,
    RESPONSE_MASK,
    REWARD_EXTRA_PREFIX,
    TOKEN_LEVEL_SCORES,
    UID,
    Batch,
)

__all__ = ["overlong_penalty", "mask_truncated", "filter_groups", "group_values", "shaping_metrics"]


def _lengths(batch: Batch) -> torch.Tensor:
    """(B,) generated tokens per row."""
    return batch[RESPONSE_LENGTH].long() if RESPONSE_LENGTH in batch else batch[RESPONSE_MASK].sum(-1).long()


def overlong_penalty(batch: Batch, *, max_len: int, buffer: int, factor: float) -> Batch:
    """Add DAPO's soft overlong punishment to each row's score (on its last response token).

    With L the response length, L_max = `max_len` and L_cache = `buffer` (DAPO eq. 13)::

        penalty = 0                                     L <= L_max - L_cache
                = factor * ((L_max - L_cache) - L) / L_cache   otherwise (down to -factor at L_max)

    Args:
        batch: `token_level_scores` (B, R), `response_mask` or `response_length`.
        max_len: the rollout's `max_new_tokens`; buffer: L_cache >= 1; factor: the largest penalty.
    Returns:
        `batch` with the penalty added to `token_level_scores`; `meta["overlong_penalty"]` its mean.
    """
    lengths = _lengths(batch)
    exceed = (lengths - (max_len - buffer)).clamp(min=0).float()
    penalty = -factor * exceed.clamp(max=buffer) / buffer                       # (B,)
    scores = batch[TOKEN_LEVEL_SCORES].float().clone()
    rows = torch.arange(len(batch))
    last = (lengths - 1).clamp(min=0)
    scores[rows, last] += penalty
    out = batch.with_columns(**{TOKEN_LEVEL_SCORES: scores})
    out.meta["overlong_penalty"] = float(penalty.mean()) if len(batch) else 0.0
    return out


def mask_truncated(batch: Batch, *, max_len: int) -> Batch:
    """Zero the `response_mask` of rows that reached `max_len` tokens (cut, not finished):
    they still count in their group's reward statistics but give the loss no token.

    A row that emitted its stop token exactly at the limit counts as cut too (the batch does not
    say which token ended a row); DAPO's "overlong filtering" is defined on length the same way.
    """
    cut = _lengths(batch) >= max_len                                             # (B,)
    mask = batch[RESPONSE_MASK] * (~cut).to(batch[RESPONSE_MASK].dtype)[:, None]
    out = batch.with_columns(**{RESPONSE_MASK: mask})
    out.meta["truncated_rows"] = int(cut.sum())
    return out


def group_values(batch: Batch, metric: str) -> torch.Tensor:
    """(B,) the per-row value dynamic sampling looks at: `acc` -> the reward's `acc` extra
    (raw accuracy, before any penalty), `score` -> the summed token-level scores."""
    if metric == "score":
        return batch[TOKEN_LEVEL_SCORES].float().sum(-1)
    column = f"{REWARD_EXTRA_PREFIX}{metric}"
    if column not in batch:
        raise KeyError(f"dynamic sampling filters on {metric!r}, but the reward gives no {column!r} "
                       f"(columns: {batch.columns()}); use metric 'score'")
    return batch[column].float()


def filter_groups(batch: Batch, *, metric: str = "acc", max_groups: int | None = None) -> Batch:
    """Keep the groups (rows sharing a `uid`) whose `metric` differs between their samples.

    Args:
        batch: scored rollouts, groups contiguous, `uid`.
        metric: see `group_values`.
        max_groups: keep at most this many of the informative groups, the first ones (DAPO trims
            an oversampled batch to the batch size); None keeps all.
    Returns:
        the kept rows in their order (possibly none); `meta["groups_total"]`, `meta["groups_kept"]`.
    """
    values, uids = group_values(batch, metric), list(batch[UID])
    spread: dict = {}
    for i, uid in enumerate(uids):
        lo, hi = spread.get(uid, (float("inf"), float("-inf")))
        spread[uid] = (min(lo, float(values[i])), max(hi, float(values[i])))
    informative = [uid for uid, (lo, hi) in spread.items() if hi > lo]
    keep = set(informative[:max_groups] if max_groups is not None else informative)
    out = batch.select(torch.tensor([uid in keep for uid in uids], dtype=torch.bool))
    out.meta.update(groups_total=len(spread), groups_kept=len(keep))
    return out


def shaping_metrics(batch: Batch) -> dict[str, float]:
    """What the shaping did this step, from the `meta` the functions above leave on the batch:
    `rollout/groups_total`, `rollout/groups_kept`, `rollout/groups_filtered`,
    `rollout/truncated_rows`, `reward/overlong_penalty_mean` (each only when its step ran)."""
    meta, out = batch.meta, {}
    if "groups_total" in meta:
        out.update({"rollout/groups_total": float(meta["groups_total"]),
                    "rollout/groups_kept": float(meta["groups_kept"]),
                    "rollout/groups_filtered": float(meta["groups_total"] - meta["groups_kept"])})
    if "truncated_rows" in meta:
        out["rollout/truncated_rows"] = float(meta["truncated_rows"])
    if "overlong_penalty" in meta:
        out["reward/overlong_penalty_mean"] = float(meta["overlong_penalty"])
    out["rollout/train_rows"] = float(len(batch))
    return out
