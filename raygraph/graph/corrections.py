"""Importance corrections of the rollouts placed in a step's graph (`roles.apply(fn, batch, ...)`):
the rollout engine's mismatch with the trainer (`correct_rollouts`, truncated or masked IS on
`pi_old / pi_rollout`) and asynchronous pipelining's stale rows (`truncated_importance_weights`),
with the metrics that describe them. Pure functions of a whole `Batch`; no Ray."""

from __future__ import annotations

import torch

from raygraph.algos import kl
from raygraph.batch import (
    ADVANTAGES,
    OLD_LOGPROBS,
    RESPONSE_MASK,
    ROLLOUT_LOGPROBS,
    STALENESS,
    TOKEN_WEIGHT_VERSION,
    WEIGHT_VERSION,
    Batch,
)
from raygraph.graph.whole_batch import masked_mean_value

__all__ = ["CORRECTIONS", "correct_rollouts", "rollout_correction_metrics", "truncated_importance_weights",
           "off_policy_metrics"]


def _behaviour_ratios(batch: Batch, *, stale_only: bool = True) -> torch.Tensor:
    """(B, R) `pi_old / pi_rollout` per token; exactly 1 on padding, and with `stale_only` on tokens
    sampled with the current weights too: a row of staleness 0, or with `token_weight_version`
    (streamed rows, whose tokens may come from several versions) a token of the current version."""
    rows = batch[RESPONSE_MASK].bool()
    if stale_only and TOKEN_WEIGHT_VERSION in batch:
        current = batch[WEIGHT_VERSION] + batch[STALENESS]   # (B,) the weights held when the row was taken
        rows = rows & (batch[TOKEN_WEIGHT_VERSION] < current[:, None])
    elif stale_only:
        rows = rows & (batch[STALENESS] > 0)[:, None]
    log_ratio = (batch[OLD_LOGPROBS] - batch[ROLLOUT_LOGPROBS]).float().clamp(max=20.0)  # exp stays finite
    return torch.where(rows, log_ratio.exp(), torch.ones_like(log_ratio))


CORRECTIONS = ("truncated_is", "masked_is")


def correct_rollouts(batch: Batch, *, mode: str, cap: float) -> Batch:
    """Correct the mismatch between the rollout engine and the trainer, token by token.

    The rollout engine (vLLM in bf16, a different kernel, older weights) does not sample from
    exactly the policy the trainer differentiates; with `old_logprobs` recomputed by the trainer,
    each token's behaviour ratio `r_t = pi_old / pi_rollout` says how far apart they are (Yao et
    al. 2025, "Your efficient RL framework secretly brings you off-policy RL training"). Unlike
    `truncated_importance_weights` (stale rows only), this applies to every row:

        truncated_is: advantages_t <- min(r_t, cap) * advantages_t
        masked_is:    tokens with r_t outside [1/cap, cap] leave the loss (response_mask 0);
                      the others keep weight 1

    Args:
        batch: `advantages`, `old_logprobs` (the trainer's), `rollout_logprobs`, `response_mask`.
        mode: one of `CORRECTIONS`.
        cap: > 1.
    """
    ratio = _behaviour_ratios(batch, stale_only=False)
    if mode == "truncated_is":
        return batch.with_columns(**{ADVANTAGES: batch[ADVANTAGES] * ratio.clamp(max=cap)})
    if mode == "masked_is":
        keep = ((ratio <= cap) & (ratio >= 1.0 / cap)).to(batch[RESPONSE_MASK].dtype)
        return batch.with_columns(**{RESPONSE_MASK: batch[RESPONSE_MASK] * keep,
                                     ADVANTAGES: batch[ADVANTAGES] * keep})
    raise ValueError(f"unknown rollout correction {mode!r}; valid: {', '.join(CORRECTIONS)}")


def rollout_correction_metrics(batch: Batch, *, mode: str, cap: float) -> dict[str, float]:
    """How far the rollout engine is from the trainer (before `correct_rollouts`).

    Returns:
        `rollout/mismatch_kl`: k3 estimate of KL(pi_rollout || pi_old) per token (samples are the
        rollout's); `rollout/correction_weight_mean`: mean weight a token gets (truncated_is:
        min(r, cap); masked_is: the share of tokens kept); `rollout/correction_capped_frac`: share of
        tokens truncated (r > cap) or masked (r outside [1/cap, cap]).
    """
    mask = batch[RESPONSE_MASK].bool()
    ratio = _behaviour_ratios(batch, stale_only=False)
    outside = (ratio > cap) if mode == "truncated_is" else (ratio > cap) | (ratio < 1.0 / cap)
    weight = ratio.clamp(max=cap) if mode == "truncated_is" else (~outside).float()
    mismatch = kl.estimate(batch[ROLLOUT_LOGPROBS].float(), batch[OLD_LOGPROBS].float(), "k3")
    return {
        "rollout/mismatch_kl": masked_mean_value(mismatch, mask.long()),
        "rollout/correction_weight_mean": masked_mean_value(weight, mask.long()),
        "rollout/correction_capped_frac": masked_mean_value(outside.float(), mask.long()),
    }


def truncated_importance_weights(batch: Batch, *, cap: float) -> Batch:
    """Correct rollouts sampled with older weights (asynchronous pipelining) by truncated IS.

    The decoupled PPO objective (Hilton et al. 2022, "Batch size-invariance for policy
    optimization"), as used for asynchronous LLM RL (Fu et al. 2025, AReaL): the policy loss
    keeps its ratio `pi / pi_old`, `pi_old` (`old_logprobs`) being the policy before this update,
    and each token is weighted by the behaviour ratio `pi_old / pi_rollout`, truncated at `cap`
    (truncated importance sampling, Espeholt et al. 2018, IMPALA; Yao et al. 2025 for LLM
    rollouts)::

        w_t = min(exp(old_logprobs_t - rollout_logprobs_t), cap)     advantages_t <- w_t * advantages_t

    With w >= 0, scaling a token's advantage scales its policy-loss term (ppo, with dual clip;
    reinforce; gspo per token). Rows with `staleness` 0 were sampled with the current weights: their
    w is exactly 1 (the two engines' log-probs differ only by numerics, which this does not correct).

    Args:
        batch: `advantages`, `old_logprobs`, `rollout_logprobs`, `response_mask` (B, R) and
            `staleness` (B,).
        cap: truncation (>= 1).
    Returns:
        `batch` with the weighted `advantages`.
    """
    ratio = _behaviour_ratios(batch)
    return batch.with_columns(**{ADVANTAGES: batch[ADVANTAGES] * ratio.clamp(max=cap)})


def off_policy_metrics(batch: Batch, *, cap: float) -> dict[str, float]:
    """Staleness and importance weights of a step's rollouts (see `truncated_importance_weights`).

    Returns:
        `rollout/staleness` (mean over rows), `rollout/staleness_max`, and over all response
        tokens (fresh rows count with weight 1) `rollout/is_weight_mean`, `rollout/is_weight_max`,
        `rollout/is_clipfrac` (share of tokens whose ratio exceeded `cap`).
    """
    mask = batch[RESPONSE_MASK].bool()
    ratio = _behaviour_ratios(batch)
    weights = ratio.clamp(max=cap)[mask]
    staleness = batch[STALENESS].float()
    return {
        "rollout/staleness": float(staleness.mean()),
        "rollout/staleness_max": float(staleness.max()),
        "rollout/is_weight_mean": float(weights.mean()) if weights.numel() else 1.0,
        "rollout/is_weight_max": float(weights.max()) if weights.numel() else 1.0,
        "rollout/is_clipfrac": masked_mean_value((ratio > cap).float(), mask.long()),
    }
