"""DAPO's batch shaping (Yu et al. 2025, "DAPO: An Open-Source LLM Reinforcement Learning System
at Scale"), as whole-batch functions a workflow places with `roles.apply(fn, batch, ...)`; the
maths (the penalty formula, which groups are informative) is `raygraph.algos.dapo`.

- `overlong_penalty`: soft overlong punishment (DAPO eq. 13), added to each row's score.
- `mask_truncated`: responses cut at the length limit leave the loss (overlong filtering).
- `filter_groups`: dynamic sampling's filter; groups whose accuracy (or score) is the same in
  every sample have zero group-relative advantage and only dilute the loss normaliser.
- `refill_prompts`, `add_round`: dynamic sampling's extra generation rounds. Round k generates
  from the step's k-th extra prompt batch (`raygraph.batch.extra_prompt_batch`, attached by the
  driver) only while fewer than `target` groups are kept (otherwise from an empty batch, which
  every role passes through at no cost), and `add_round` keeps the informative groups of each
  round until the batch is full. `meta[PROMPT_BATCHES_USED]` says how many prompt batches the
  step generated from; the driver puts the rest back in the data order.

After the filter the batch may be smaller than the step's, or empty: the policy update
splits whatever is left over the training ranks and skips an empty step.
Pure functions of a `Batch`: no Ray, no config.
"""

from __future__ import annotations

import torch

from raygraph.algos import dapo as dapo_maths
from raygraph.batch import (
    AGENT_TRUNCATION,
    PROMPT_BATCHES_USED,
    RESPONSE_LENGTH,
    RESPONSE_MASK,
    REWARD_EXTRA_PREFIX,
    TOKEN_LEVEL_SCORES,
    UID,
    Batch,
    extra_prompt_batch,
    last_valid_index,
)
from raygraph.errors import MissingColumn

__all__ = ["overlong_penalty", "mask_truncated", "filter_groups", "group_values", "refill_prompts", "add_round",
           "shaping_metrics"]


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
        max_len: the model tokens a row may hold (`fragments.response_budget`: the rollout's
            `max_new_tokens`, or for episodes `max_turns` x the tokens of a turn);
            buffer: L_cache >= 1; factor: the largest penalty.
    Returns:
        `batch` with the penalty added to `token_level_scores`; `meta["overlong_penalty"]` its mean.
    """
    lengths = _lengths(batch)
    penalty = dapo_maths.overlong_penalty(lengths, max_len=max_len, buffer=buffer, factor=factor)   # (B,)
    scores = batch[TOKEN_LEVEL_SCORES].float().clone()
    rows = torch.arange(len(batch))
    last = last_valid_index(batch[RESPONSE_MASK]) if RESPONSE_MASK in batch else (lengths - 1).clamp(min=0)
    scores[rows, last] += penalty
    out = batch.with_columns(**{TOKEN_LEVEL_SCORES: scores})
    out.meta["overlong_penalty"] = float(penalty.mean()) if len(batch) else 0.0
    return out


def mask_truncated(batch: Batch, *, max_len: int) -> Batch:
    """Zero the `response_mask` of rows that reached `max_len` tokens (cut, not finished):
    they still count in their group's reward statistics but give the loss no token.

    A row that emitted its stop token exactly at the limit counts as cut too (the batch does not
    say which token ended a row); DAPO's "overlong filtering" is defined on length the same way.
    A multi-turn episode says why it ended: it is cut unless it finished (`agent_truncation`
    "none"; a budget of turns, length or context, or a time-out, cuts it).
    """
    if AGENT_TRUNCATION in batch:
        cut = torch.tensor([str(reason) != "none" for reason in batch[AGENT_TRUNCATION]], dtype=torch.bool)
    else:
        cut = _lengths(batch) >= max_len                                         # (B,)
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
        raise MissingColumn(f"dynamic sampling filters on {metric!r}, but the reward gives no {column!r} "
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
    uids = list(batch[UID])
    informative = dapo_maths.informative_groups(group_values(batch, metric), uids)
    keep = set(informative[:max_groups] if max_groups is not None else informative)
    out = batch.select(torch.tensor([uid in keep for uid in uids], dtype=torch.bool))
    out.meta.update(groups_total=len(set(uids)), groups_kept=len(keep), **{PROMPT_BATCHES_USED: 1},
                    sampled_rows=len(batch), sampled_score=float(batch[TOKEN_LEVEL_SCORES].float().sum()))
    return out


def refill_prompts(prompts: Batch, kept: Batch, *, round: int, target: int) -> Batch:
    """The prompts extra round `round` (1, 2, ...) generates from: the step's round-th extra prompt
    batch while `kept` holds fewer than `target` groups, else none of it (an empty batch: nothing
    is generated).

    Args:
        prompts: the step's prompts, with the extra batches the driver attached.
        kept: the groups kept so far (`filter_groups` / `add_round` output).
    """
    extra = extra_prompt_batch(prompts, round)
    return extra if kept.meta["groups_kept"] < target else extra.select(slice(0, 0))


def add_round(kept: Batch, scored: Batch, *, metric: str = "acc", target: int) -> Batch:
    """`kept` plus the informative groups of one extra round's scored rollouts, at most `target`
    groups in all (DAPO keeps sampling until the batch is full, then trims it to the batch size).

    A round that was not needed (`scored` has no rows) changes nothing. The shaping counts in
    `meta` add up over the rounds (`shaping_metrics`).
    """
    if len(scored) == 0:
        return kept
    more = filter_groups(scored, metric=metric, max_groups=max(target - kept.meta["groups_kept"], 0))
    meta = dict(kept.meta)
    for key in ("groups_total", "groups_kept", PROMPT_BATCHES_USED, "sampled_rows", "sampled_score"):
        meta[key] = kept.meta[key] + more.meta[key]
    if "truncated_rows" in kept.meta:
        meta["truncated_rows"] = kept.meta["truncated_rows"] + scored.meta.get("truncated_rows", 0)
    if "overlong_penalty" in kept.meta:   # a mean over the rows sampled so far
        before = kept.meta["sampled_rows"]
        meta["overlong_penalty"] = ((kept.meta["overlong_penalty"] * before + scored.meta["overlong_penalty"]
                                     * len(scored)) / (before + len(scored)))
    rows = Batch.concat([kept, more])
    return Batch(dict(rows.tensors), dict(rows.non_tensors), meta)


def shaping_metrics(batch: Batch) -> dict[str, float]:
    """What the shaping did this step, from the `meta` the functions above leave on the batch:
    `rollout/groups_total`, `rollout/groups_kept`, `rollout/groups_filtered`,
    `rollout/truncated_rows`, `reward/overlong_penalty_mean` (each only when its step ran); with
    the filter also `rollout/gen_rounds` (prompt batches generated from) and `reward/sampled_mean` (the mean summed score of every
    row generated, kept or not: the kept rows' `reward/mean` leans towards the groups that vary)."""
    meta, out = batch.meta, {}
    if "groups_total" in meta:
        out.update({"rollout/groups_total": float(meta["groups_total"]),
                    "rollout/groups_kept": float(meta["groups_kept"]),
                    "rollout/groups_filtered": float(meta["groups_total"] - meta["groups_kept"]),
                    "rollout/gen_rounds": float(meta[PROMPT_BATCHES_USED]),
                    "reward/sampled_mean": meta["sampled_score"] / max(meta["sampled_rows"], 1)})
    if "truncated_rows" in meta:
        out["rollout/truncated_rows"] = float(meta["truncated_rows"])
    if "overlong_penalty" in meta:
        out["reward/overlong_penalty_mean"] = float(meta["overlong_penalty"])
    out["rollout/train_rows"] = float(len(batch))
    return out
