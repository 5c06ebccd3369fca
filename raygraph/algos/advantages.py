"""Advantage estimators: one registry, one signature, `(advantages, returns)` out.

Every estimator is called through `compute(name, ...)` with the same keyword arguments, so the
trainer never branches on the algorithm name; an estimator that needs an input the caller did
not give (`values` for GAE, `group_ids` for the group baselines, `reward_baselines` for ReMax)
raises `ValueError` naming it.

Conventions (shapes: B rows, T response tokens):
    token_rewards   (B, T)  per-token rewards; the sequence score is the row sum.
    response_mask   (B, T)  1 = response token that is trained on (bool, int or float).
    group_ids       (B,)    hashable id per row; rows sharing an id answer the same prompt.
    values          (B, T)  critic values V(s_t).
    reward_baselines (B,)   score of a baseline rollout (ReMax: the greedy response).
Outputs are float32, zero outside `response_mask`, and carry no autograd history. Token-level
recursions (GAE, return-to-go) skip masked positions: the running quantity passes through
them unchanged, and rewards placed on masked positions are ignored.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from raygraph.algos._registry import Registry
from raygraph.algos.masked import as_float_mask, masked_whiten

__all__ = ["compute", "names", "requires", "is_builtin", "register_advantage", "INPUTS", "ESTIMATOR_KEYWORDS"]

# The keyword arguments every estimator is called with (the module docstring gives their shapes).
ESTIMATOR_KEYWORDS = ("token_rewards", "response_mask", "group_ids", "values", "reward_baselines", "gamma", "lam",
                      "eps")
_ESTIMATORS = Registry("advantage estimator", keywords=ESTIMATOR_KEYWORDS)
Tensor = torch.Tensor


# The optional inputs an estimator may declare it needs (`register(..., needs=...)`).
INPUTS = ("group_ids", "values", "reward_baselines")


def names() -> tuple[str, ...]:
    """Names accepted by `compute`, sorted (besides `file.py:fn` references)."""
    return _ESTIMATORS.names()


def is_builtin(name: str) -> bool:
    """Whether `name` is one of raygraph's own estimators (not registered by a plugin nor a reference)."""
    return name in _ESTIMATORS and not _ESTIMATORS.info(name).get("user", False)


def register_advantage(name: str, fn=None, *, needs: tuple[str, ...] = ()):
    """Register a user advantage estimator as `name` (call it from a plugin, see
    docs/custom-algorithm.md).

    `fn` takes the keyword arguments `ESTIMATOR_KEYWORDS` (float32 tensors, `group_ids` a dense
    `(B,)` int64 index, an input not available None) and returns `(advantages, returns)`, both
    `(B, T)`. `needs` lists the inputs of `INPUTS` it cannot do without (checked against the
    workflow by the config, and before each call). Use as a call or as a decorator.

    Raises:
        ValueError: the name is taken, `fn` does not take the keywords, or `needs` is unknown.
    """
    unknown = sorted(set(needs) - set(INPUTS))
    if unknown or isinstance(needs, str):
        raise ValueError(f"needs={needs!r}: each must be one of {', '.join(INPUTS)}")
    register = _ESTIMATORS.register(name, needs=tuple(needs), user=True)
    return register if fn is None else register(fn)


def requires(name: str) -> frozenset[str]:
    """The optional inputs (of `INPUTS`) that estimator `name` needs, as declared where it is
    registered: "group_ids" (several samples per prompt), "values" (a critic), "reward_baselines".
    A `file.py:fn` reference declares nothing (register it from a plugin to declare `needs`)."""
    return frozenset(_ESTIMATORS.info(name).get("needs", ()))


def compute(
    name: str,
    *,
    token_rewards: Tensor,
    response_mask: Tensor,
    group_ids: Sequence[Any] | Tensor | None = None,
    values: Tensor | None = None,
    reward_baselines: Tensor | None = None,
    gamma: float = 1.0,
    lam: float = 1.0,
    eps: float = 1e-6,
) -> tuple[Tensor, Tensor]:
    """Compute advantages and returns with the estimator registered as `name`.

    Args:
        name: one of `names()`: gae, grpo, dr_grpo, rloo, reinforce_pp, reinforce_pp_baseline, remax.
        token_rewards: `(B, T)` rewards.
        response_mask: `(B, T)` valid-token mask.
        group_ids: `(B,)` hashables (list, numpy array or integer tensor); needed by grpo,
            dr_grpo, rloo and reinforce_pp_baseline.
        values: `(B, T)` critic values; needed by gae.
        reward_baselines: `(B,)` baseline scores; needed by remax.
        gamma: discount factor (gae, reinforce_pp, remax).
        lam: GAE lambda.
        eps: added to the group std in grpo.

    Returns:
        `(advantages, returns)`, both `(B, T)` float32, zero outside `response_mask`.

    Raises:
        ValueError: unknown `name`, a missing input, or mismatched shapes.
    """
    estimator = _ESTIMATORS.get(name)
    mask, inputs = _prepare(token_rewards, response_mask, group_ids, values, reward_baselines)
    for arg in sorted(requires(name)):
        if inputs[arg] is None:
            raise ValueError(f"advantage estimator {name!r} needs `{arg}`, which was not given")
    with torch.no_grad():
        adv, ret = estimator(**inputs, response_mask=mask, gamma=float(gamma), lam=float(lam), eps=float(eps))
        valid = mask > 0
        if adv is ret:  # outcome-only estimators: advantage and return are one tensor
            adv = ret = torch.where(valid, adv, 0.0)
            return adv, ret
        return torch.where(valid, adv, 0.0), torch.where(valid, ret, 0.0)


# --------------------------------------------------------------------------- helpers


def _prepare(token_rewards, response_mask, group_ids, values, reward_baselines) -> tuple[Tensor, dict]:
    """Check shapes and cast: float32 detached tensors, `group_ids` as a dense `(B,)` index."""
    if token_rewards.dim() != 2 or token_rewards.shape != response_mask.shape:
        raise ValueError(
            f"token_rewards {tuple(token_rewards.shape)} and response_mask "
            f"{tuple(response_mask.shape)} must both be (B, T)"
        )
    batch = token_rewards.shape[0]
    mask = as_float_mask(response_mask)
    if values is not None:
        if values.shape != token_rewards.shape:
            raise ValueError(f"values {tuple(values.shape)} must match token_rewards {tuple(token_rewards.shape)}")
        values = values.detach().float()
    if reward_baselines is not None:
        reward_baselines = torch.as_tensor(reward_baselines, device=mask.device).detach().float().reshape(-1)
        if reward_baselines.shape[0] != batch:
            raise ValueError(f"reward_baselines has {reward_baselines.shape[0]} entries, expected B={batch}")
    inputs = {
        "token_rewards": token_rewards.detach().float(),
        "group_ids": None if group_ids is None else _group_index(group_ids, batch, mask.device),
        "values": values,
        "reward_baselines": reward_baselines,
    }
    return mask, inputs


def _group_index(group_ids: Sequence[Any] | Tensor, batch: int, device: torch.device) -> Tensor:
    """Map arbitrary hashable ids to dense group indices `(B,)` int64, in order of appearance."""
    keys = group_ids.tolist() if hasattr(group_ids, "tolist") else list(group_ids)
    if len(keys) != batch:
        raise ValueError(f"group_ids has {len(keys)} entries, expected B={batch}")
    dense: dict[Any, int] = {}
    index = [dense.setdefault(key, len(dense)) for key in keys]
    return torch.tensor(index, dtype=torch.long, device=device)


def _group_mean_std(scores: Tensor, index: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Per-row statistics of the row's group: mean, unbiased std and size, each `(B,)`.

    A single-member group gets mean 0 and std 1, so its score passes through unchanged.
    """
    n_groups = int(index.max()) + 1 if index.numel() else 0
    zeros = scores.new_zeros(n_groups)
    count = zeros.index_add(0, index, torch.ones_like(scores))
    mean = zeros.index_add(0, index, scores) / count
    sq_dev = zeros.index_add(0, index, (scores - mean[index]) ** 2)
    std = (sq_dev / (count - 1).clamp(min=1)).sqrt()
    singleton = count == 1
    mean = torch.where(singleton, torch.zeros_like(mean), mean)
    std = torch.where(singleton, torch.ones_like(std), std)
    return mean[index], std[index], count[index]


def _return_to_go(rewards: Tensor, mask: Tensor, gamma: float) -> Tensor:
    """`G_t = r_t + gamma * G_{t+1}` over valid tokens, `(B, T)`; masked tokens carry G through."""
    running = rewards.new_zeros(rewards.shape[0])
    out = torch.zeros_like(rewards)
    for t in reversed(range(rewards.shape[1])):
        valid = mask[:, t] > 0
        running = torch.where(valid, rewards[:, t] + gamma * running, running)
        out[:, t] = running
    return out


# --------------------------------------------------------------------------- estimators
# Every estimator has exactly this keyword signature; `group_ids` arrives as a dense (B,)
# int64 index and all tensors as float32.


@_ESTIMATORS.register("gae", needs=("values",))
def _gae(*, token_rewards, response_mask, group_ids, values, reward_baselines, gamma, lam, eps):
    """Generalised advantage estimation (Schulman et al. 2016, "High-Dimensional Continuous
    Control Using GAE", eq. 16): `delta_t = r_t + gamma V_{t+1} - V_t`,
    `A_t = delta_t + gamma lam A_{t+1}`, bootstrapping with V = 0 after the last valid token.
    Returns `R_t = A_t + V_t` (before whitening); advantages are then whitened over valid tokens.
    """
    batch, length = token_rewards.shape
    next_value = token_rewards.new_zeros(batch)
    last_adv = token_rewards.new_zeros(batch)
    adv = torch.zeros_like(token_rewards)
    for t in reversed(range(length)):
        delta = token_rewards[:, t] + gamma * next_value - values[:, t]
        valid = response_mask[:, t] > 0
        next_value = torch.where(valid, values[:, t], next_value)
        last_adv = torch.where(valid, delta + gamma * lam * last_adv, last_adv)
        adv[:, t] = last_adv
    returns = adv + values
    return masked_whiten(adv, response_mask), returns


def _grpo_like(token_rewards, response_mask, group_ids, eps, divide_by_std):
    scores = token_rewards.sum(dim=-1)  # (B,)
    mean, std, _ = _group_mean_std(scores, group_ids)
    adv = scores - mean
    if divide_by_std:
        adv = adv / (std + eps)
    adv = adv.unsqueeze(-1) * response_mask  # (B, T), the same value on every valid token
    return adv, adv


@_ESTIMATORS.register("grpo", needs=("group_ids",))
def _grpo(*, token_rewards, response_mask, group_ids, values, reward_baselines, gamma, lam, eps):
    """Group-relative advantage (Shao et al. 2024, DeepSeekMath, sec. 4.1.2):
    `A_i = (s_i - mean(s_group)) / (std(s_group) + eps)`, unbiased std, broadcast over tokens."""
    return _grpo_like(token_rewards, response_mask, group_ids, eps, divide_by_std=True)


@_ESTIMATORS.register("dr_grpo", needs=("group_ids",))
def _dr_grpo(*, token_rewards, response_mask, group_ids, values, reward_baselines, gamma, lam, eps):
    """GRPO without the std division (Liu et al. 2025, "Understanding R1-Zero-Like Training",
    Dr. GRPO): `A_i = s_i - mean(s_group)`."""
    return _grpo_like(token_rewards, response_mask, group_ids, eps, divide_by_std=False)


@_ESTIMATORS.register("rloo", needs=("group_ids",))
def _rloo(*, token_rewards, response_mask, group_ids, values, reward_baselines, gamma, lam, eps):
    """REINFORCE leave-one-out (Kool et al. 2019; Ahmadian et al. 2024): baseline is the mean of
    the other n-1 members, `A_i = s_i - mean_{j!=i} s_j = (n s_i - n mean) / (n - 1)`.
    Singleton groups keep their raw score."""
    scores = token_rewards.sum(dim=-1)
    mean, _, count = _group_mean_std(scores, group_ids)
    scale = count / (count - 1).clamp(min=1)
    adv = torch.where(count > 1, scores * scale - mean * scale, scores)
    adv = adv.unsqueeze(-1) * response_mask
    return adv, adv


@_ESTIMATORS.register("reinforce_pp")
def _reinforce_pp(*, token_rewards, response_mask, group_ids, values, reward_baselines, gamma, lam, eps):
    """REINFORCE++ (Hu 2025, arXiv:2501.03262): discounted return-to-go `G_t`, whitened over all
    valid tokens of the batch. Returns are the un-whitened `G_t`."""
    returns = _return_to_go(token_rewards, response_mask, gamma)
    return masked_whiten(returns, response_mask), returns


@_ESTIMATORS.register("reinforce_pp_baseline", needs=("group_ids",))
def _reinforce_pp_baseline(*, token_rewards, response_mask, group_ids, values, reward_baselines, gamma, lam, eps):
    """REINFORCE++-baseline (Hu 2025, arXiv:2501.03262), for groups of samples per prompt:
    `s_i - mean(s_group)` broadcast over tokens, then whitened over the batch's valid tokens."""
    scores = token_rewards.sum(dim=-1)
    mean, _, _ = _group_mean_std(scores, group_ids)
    centred = (scores - mean).unsqueeze(-1) * response_mask
    adv = masked_whiten(centred, response_mask) * response_mask
    return adv, adv


@_ESTIMATORS.register("remax", needs=("reward_baselines",))
def _remax(*, token_rewards, response_mask, group_ids, values, reward_baselines, gamma, lam, eps):
    """ReMax (Li et al. 2024, arXiv:2310.10505): return-to-go minus the score of the greedy
    response, `A_t = G_t - b`. Returns are `G_t`."""
    returns = _return_to_go(token_rewards, response_mask, gamma)
    return returns - reward_baselines.unsqueeze(-1), returns
