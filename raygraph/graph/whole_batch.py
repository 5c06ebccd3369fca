"""The advantage step that workflows place in their graph with `roles.apply(fn, batch, ...)`.

They see the WHOLE batch (every rank's rows), so advantage normalisation is global by
construction. Pure functions of a `Batch`: no Ray, no config objects; workflows pass the numbers.
Per-step inputs chosen by the driver (the step number, the current KL coefficient) travel in the
prompts batch's `meta`. The corrections of the rollouts are `raygraph.graph.corrections`, what a
step reports for people `raygraph.graph.step_metrics`.
"""

from __future__ import annotations

import torch

from raygraph.algos import advantages, kl
from raygraph.batch import (
    ADVANTAGES,
    OLD_LOGPROBS,
    REF_LOGPROBS,
    RESPONSE_MASK,
    RETURNS,
    REWARD_BASELINES,
    ROLLOUT_LOGPROBS,
    TOKEN_LEVEL_REWARDS,
    TOKEN_LEVEL_SCORES,
    UID,
    VALUES,
    Batch,
)

__all__ = ["compute_advantages", "sequence_scores", "attach_reward_baselines", "use_rollout_logprobs",
           "masked_mean_value"]


def masked_mean_value(x: torch.Tensor, mask: torch.Tensor) -> float:
    mask = mask.float()
    return float((x.float() * mask).sum() / mask.sum().clamp_min(1.0))


def sequence_scores(batch: Batch) -> torch.Tensor:
    """(B,) score of each row: the sum of its token-level scores."""
    return batch[TOKEN_LEVEL_SCORES].float().sum(-1)


def compute_advantages(batch: Batch, prompts: Batch, *, estimator: str, gamma: float, lam: float, eps: float,
                       kl_kind: str, old_from_rollout: bool) -> Batch:
    """Rewards (minus the in-reward KL penalty) → advantages and returns, over the whole batch.

    Args:
        batch: rollouts with `token_level_scores`, `response_mask`, `uid` (group-based
            estimators), `values` (GAE), `reward_baselines` (ReMax), `old_logprobs` and
            `ref_logprobs` when a KL penalty is applied.
        prompts: the step's input batch; `prompts.meta["kl_coef"]` (default 0) is the KL-in-reward
            coefficient chosen by the driver's KL controller for this step.
        estimator: a name from `raygraph.algos.advantages.names()`.
        gamma, lam, eps: the estimator's discount, GAE lambda and normalisation epsilon.
        kl_kind: the KL estimator of the in-reward penalty (`raygraph.algos.kl.names()`).
        old_from_rollout: take `old_logprobs` from `rollout_logprobs` (`use_rollout_logprobs`)
            first, for a workflow that skips the `policy.logprobs` pass (`actor.old_logprobs=rollout`).
    Returns:
        `batch` plus `token_level_rewards`, `advantages`, `returns`; `meta["kl_in_reward"]` holds
        the batch's mean KL (for the adaptive controller).
    """
    if old_from_rollout:
        batch = use_rollout_logprobs(batch)
    mask = batch[RESPONSE_MASK]
    rewards = batch[TOKEN_LEVEL_SCORES].float()
    kl_coef = float(prompts.meta.get("kl_coef", 0.0))
    kl_mean = 0.0
    # without old_logprobs (the update computes its own) the rollout's stand in for the metric;
    # a KL penalty in the reward always comes with old_logprobs (RaygraphConfig.old_logprobs_source)
    old = batch[OLD_LOGPROBS] if OLD_LOGPROBS in batch else batch.tensors.get(ROLLOUT_LOGPROBS)
    if REF_LOGPROBS in batch and old is not None:
        kl_tokens = kl.estimate(old, batch[REF_LOGPROBS], kl_kind) * mask
        kl_mean = masked_mean_value(kl_tokens, mask)
        if kl_coef > 0:
            rewards = rewards - kl_coef * kl_tokens
    adv, ret = advantages.compute(
        estimator, token_rewards=rewards, response_mask=mask,
        group_ids=batch[UID] if UID in batch else None,
        values=batch[VALUES] if VALUES in batch else None,
        reward_baselines=batch[REWARD_BASELINES] if REWARD_BASELINES in batch else None,
        gamma=gamma, lam=lam, eps=eps,
    )
    out = batch.with_columns(**{TOKEN_LEVEL_REWARDS: rewards, ADVANTAGES: adv, RETURNS: ret})
    out.meta.update(kl_in_reward=kl_mean, kl_coef=kl_coef)
    return out


def use_rollout_logprobs(batch: Batch) -> Batch:
    """Take the rollout engine's log-probs as `old_logprobs` (skips a policy forward pass).

    Exact only when the rollout samples with the policy's current weights in the same precision
    (synchronous, fp32, no top-p/top-k): then the PPO ratio starts at 1, as it would anyway.
    """
    return batch.with_columns(**{OLD_LOGPROBS: batch[ROLLOUT_LOGPROBS]})


def attach_reward_baselines(batch: Batch, baseline_batch: Batch) -> Batch:
    """ReMax: give each sampled row the score of its prompt's greedy rollout as `reward_baselines`."""
    greedy = dict(zip(baseline_batch[UID], sequence_scores(baseline_batch).tolist()))
    baselines = torch.tensor([greedy[uid] for uid in batch[UID]], dtype=torch.float32)
    return batch.with_columns(**{REWARD_BASELINES: baselines})
