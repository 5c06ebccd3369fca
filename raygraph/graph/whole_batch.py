"""Whole-batch functions that workflows place in their graph with `roles.apply(fn, batch, ...)`.

They see the WHOLE batch (every rank's rows), so advantage normalisation is global by
construction. Pure functions of a `Batch`: no Ray, no config objects; workflows pass the numbers.
Per-step inputs chosen by the driver (the step number, the current KL coefficient) travel in the
prompts batch's `meta`.
"""

from __future__ import annotations

import collections
import math

import numpy as np
import torch

from raygraph.algos import advantages, kl
from raygraph.batch import (
    ADVANTAGES,
    DATA_SOURCE,
    GROUND_TRUTH,
    OLD_LOGPROBS,
    PROMPT_TEXT,
    REF_LOGPROBS,
    RESPONSE_LENGTH,
    RESPONSE_MASK,
    RESPONSE_TEXT,
    RETURNS,
    REWARD_BASELINES,
    REWARD_EXTRA_PREFIX,
    ROLLOUT_LOGPROBS,
    STALENESS,
    TOKEN_LEVEL_REWARDS,
    TOKEN_LEVEL_SCORES,
    UID,
    VALUES,
    WEIGHT_VERSION,
    Batch,
)

__all__ = ["compute_advantages", "rollout_metrics", "validation_metrics", "sequence_scores",
           "attach_reward_baselines", "use_rollout_logprobs", "truncated_importance_weights",
           "off_policy_metrics", "sample_records", "sampled_validation_metrics", "pass_at_k",
           "correct_rollouts", "rollout_correction_metrics", "CORRECTIONS", "DUMP_ROWS"]

# The driver asks for a step's samples as text with `meta[DUMP_ROWS]` (rows wanted, -1 = all) in
# the step's prompts batch; they come back in the step's report (`raygraph.graph.report`).
DUMP_ROWS = "dump_rows"
VAL_CONSOLE_ROWS = 3   # validation always returns a few samples, for the console


def _masked_mean(x: torch.Tensor, mask: torch.Tensor) -> float:
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
        kl_mean = _masked_mean(kl_tokens, mask)
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


def _behaviour_ratios(batch: Batch, *, stale_only: bool = True) -> torch.Tensor:
    """(B, R) `pi_old / pi_rollout` per token; exactly 1 on padding, and with `stale_only` on rows
    of staleness 0 too."""
    rows = batch[RESPONSE_MASK].bool()
    if stale_only:
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
        "rollout/mismatch_kl": _masked_mean(mismatch, mask.long()),
        "rollout/correction_weight_mean": _masked_mean(weight, mask.long()),
        "rollout/correction_capped_frac": _masked_mean(outside.float(), mask.long()),
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
        "rollout/is_clipfrac": _masked_mean((ratio > cap).float(), mask.long()),
    }


def attach_reward_baselines(batch: Batch, baseline_batch: Batch) -> Batch:
    """ReMax: give each sampled row the score of its prompt's greedy rollout as `reward_baselines`."""
    greedy = dict(zip(baseline_batch[UID], sequence_scores(baseline_batch).tolist()))
    baselines = torch.tensor([greedy[uid] for uid in batch[UID]], dtype=torch.float32)
    return batch.with_columns(**{REWARD_BASELINES: baselines})


def _reward_summary(batch: Batch, prefix: str) -> dict[str, float]:
    scores = sequence_scores(batch)
    out = {f"{prefix}/mean": float(scores.mean()), f"{prefix}/std": float(scores.std(unbiased=False))}
    for name, column in batch.tensors.items():
        if name.startswith(REWARD_EXTRA_PREFIX):
            out[f"{prefix}/{name[len(REWARD_EXTRA_PREFIX):]}"] = float(column.float().mean())
    return out


def rollout_metrics(batch: Batch) -> dict[str, float]:
    """Per-step numbers about the batch: reward, lengths, advantage range, weight versions.

    (`rollout/logprob_diff_max`, the rollout engine's log-probs against the policy's, comes from
    `PolicyWorker.update`, which computes the policy's anyway.)"""
    if len(batch) == 0:   # every group filtered out (DAPO dynamic sampling): nothing to describe
        return {"rollout/samples": 0.0, "rollout/tokens": 0.0}
    mask = batch[RESPONSE_MASK]
    lengths = batch[RESPONSE_LENGTH].float() if RESPONSE_LENGTH in batch else mask.sum(-1).float()
    out = _reward_summary(batch, "reward")
    out.update({
        "rollout/response_length_mean": float(lengths.mean()),
        "rollout/response_length_max": float(lengths.max()),
        "rollout/response_length_min": float(lengths.min()),
        "rollout/clip_ratio": float((lengths >= mask.shape[1]).float().mean()),
        "rollout/tokens": float(mask.sum()),
        "rollout/samples": float(len(batch)),
    })
    if ADVANTAGES in batch:
        valid = batch[ADVANTAGES][mask.bool()]
        out["actor/advantage_mean"] = float(valid.mean()) if valid.numel() else 0.0
        out["actor/advantage_abs_max"] = float(valid.abs().max()) if valid.numel() else 0.0
    if WEIGHT_VERSION in batch:
        out["weights/rollout_version_min"] = float(batch[WEIGHT_VERSION].min())
    if "kl_in_reward" in batch.meta:   # set by compute_advantages, with the coefficient it used
        out["actor/kl_in_reward"] = float(batch.meta["kl_in_reward"])
        out["actor/kl_coef"] = float(batch.meta["kl_coef"])
    return out


def validation_metrics(batch: Batch) -> dict[str, float]:
    """Greedy validation: `val/accuracy` (mean of the reward's `acc`, else score > 0) and reward.

    Accuracy is also broken down by `data_source` when the batch mixes several.
    """
    correct = _correct(batch)
    out = {"val/accuracy": float(correct.mean()), "val/samples": float(len(batch))}
    out.update(_reward_summary(batch, "val/reward"))
    if "data_source" in batch:
        sources = np.asarray(batch["data_source"])
        if len(set(sources)) > 1:
            for source in sorted(set(sources)):
                rows = torch.as_tensor(sources == source)
                out[f"val/accuracy@{source}"] = float(correct[rows].mean())
    return out


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k from n samples of which c are correct: `1 - C(n-c, k) / C(n, k)`
    (Chen et al. 2021, "Evaluating Large Language Models Trained on Code", eq. 1)."""
    if n - c < k:
        return 1.0
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def _correct(batch: Batch) -> torch.Tensor:
    acc_col = f"{REWARD_EXTRA_PREFIX}acc"
    return batch[acc_col].float() if acc_col in batch else (sequence_scores(batch) > 0).float()


def sampled_validation_metrics(batch: Batch, *, n: int) -> dict[str, float]:
    """Sampled validation: `n` scored samples per prompt (rows of one prompt share a `uid`).

    Returns `val/pass@k` for k in 1, 2, 4, ... up to n (unbiased, `pass_at_k`, averaged over
    prompts) and `val/maj@n` (the most frequent answer, compared as stripped response text, is
    correct; ties go to the first sampled). With several data sources, each also per source
    (`val/pass@k@<source>`, `val/maj@n@<source>`).
    """
    correct, uids = _correct(batch).tolist(), list(batch[UID])
    answers = [" ".join(str(t).split()) for t in batch[RESPONSE_TEXT]] if RESPONSE_TEXT in batch else uids
    sources = list(batch[DATA_SOURCE]) if DATA_SOURCE in batch else ["all"] * len(uids)
    groups: dict = {}
    for i, uid in enumerate(uids):
        groups.setdefault(uid, []).append(i)
    ks = sorted({1, n, *(2 ** j for j in range(1, n.bit_length()) if 2 ** j <= n)})
    per_prompt = []   # (source, {metric: value})
    for rows in groups.values():
        c = int(sum(correct[i] for i in rows))
        votes = collections.Counter(answers[i] for i in rows)
        top = max(votes.values())
        majority = next(answers[i] for i in rows if votes[answers[i]] == top)
        values = {f"pass@{k}": pass_at_k(len(rows), c, k) for k in ks}
        values[f"maj@{n}"] = float(any(correct[i] for i in rows if answers[i] == majority))
        per_prompt.append((sources[rows[0]], values))
    out = {f"val/{name}": float(np.mean([v[name] for _, v in per_prompt])) for name in per_prompt[0][1]}
    if len({source for source, _ in per_prompt}) > 1:
        for source in sorted({source for source, _ in per_prompt}):
            mine = [v for s, v in per_prompt if s == source]
            out.update({f"val/{name}@{source}": float(np.mean([v[name] for v in mine])) for name in mine[0]})
    return out


def sample_records(batch: Batch, rows: int = -1) -> list[dict]:
    """The first `rows` rows (-1: all) as plain records for a JSONL dump or the console.

    Each record: `uid`, `prompt`, `response`, `score` (the row's summed token scores), the
    reward's extras (`acc`, ...), and where present `advantage` (mean over the response tokens),
    `weight_version`, `response_length`, `data_source`, `ground_truth`.
    """
    n = len(batch) if rows < 0 else min(rows, len(batch))
    scores = sequence_scores(batch)[:n].tolist() if TOKEN_LEVEL_SCORES in batch else [None] * n
    extras = {name[len(REWARD_EXTRA_PREFIX):]: batch[name][:n].float().tolist()
              for name in batch.tensors if name.startswith(REWARD_EXTRA_PREFIX)}
    mask = batch[RESPONSE_MASK][:n].float()
    columns: dict[str, list] = {}
    if ADVANTAGES in batch:
        adv = (batch[ADVANTAGES][:n].float() * mask).sum(-1) / mask.sum(-1).clamp_min(1.0)
        columns["advantage"] = adv.tolist()
    for key, name in ((WEIGHT_VERSION, "weight_version"), (RESPONSE_LENGTH, "response_length")):
        if key in batch:
            columns[name] = batch[key][:n].tolist()
    for key, name in ((PROMPT_TEXT, "prompt"), (RESPONSE_TEXT, "response"), (DATA_SOURCE, "data_source"),
                      (GROUND_TRUTH, "ground_truth")):
        if key in batch:
            columns[name] = [_plain(v) for v in batch[key][:n]]
    uids = [_plain(u) for u in batch[UID][:n]] if UID in batch else list(range(n))
    return [{"uid": uids[i], "score": scores[i], **{k: v[i] for k, v in extras.items()},
             **{k: v[i] for k, v in columns.items()}} for i in range(n)]


def _plain(value):
    """numpy scalars and strings -> JSON-friendly Python values."""
    return value.item() if isinstance(value, np.generic) else value
