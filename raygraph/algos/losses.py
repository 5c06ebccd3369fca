"""Policy losses, the value loss and loss aggregation.

Every policy loss is registered with one signature and called through `policy_loss(name, ...)`,
so the trainer never branches on the loss name. All losses return `(loss, stats)`:
    loss   0-dim float32 tensor carrying gradient to `logprobs` / `values`.
    stats  dict of **detached 0-dim float32 tensors** (call `float()` when logging; keeping
           tensors avoids a device sync inside the loss). Every policy loss reports the same
           keys: `clipfrac`, `clipfrac_lower`, `approx_kl`; the value loss reports `vf_clipfrac`.
`old_logprobs`, `advantages`, `old_values` and `returns` are treated as constants (detached).
Masks may be bool, int or float; inputs of any float dtype are computed in float32.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from raygraph.algos._registry import Registry
from raygraph.algos.dpo import dpo_loss
from raygraph.algos.masked import as_float_mask, masked_mean

__all__ = ["AGG_MODES", "POLICY_LOSS_KEYWORDS", "aggregate", "normaliser", "dpo_loss", "policy_loss", "policy_loss_fn",
           "policy_loss_names", "register_policy_loss", "value_loss"]

Tensor = torch.Tensor
Stats = dict[str, Tensor]
LOG_RATIO_CLAMP = 20.0  # |log pi/pi_old| is clamped before exp() so the ratio never overflows


# --------------------------------------------------------------------------- aggregation


def _row_mean(per_row: Tensor, mask: Tensor) -> Tensor:
    """Mean of `per_row` (B,) over rows that have at least one valid token."""
    has_tokens = (mask.sum(dim=-1) > 0).float()
    return (per_row * has_tokens).sum() / has_tokens.sum().clamp(min=1)


def _rows_with_tokens(mask: Tensor) -> float:
    return float((mask.sum(-1) > 0).sum())


@dataclass(frozen=True)
class _Aggregation:
    """A loss-aggregation mode: how token losses become a scalar, and what that scalar is
    normalised by (`count(mask)`; None for a plain sum), which micro-batching must respect."""

    reduce: Callable[[Tensor, Tensor], Tensor]
    count: Callable[[Tensor], float] | None


_AGGREGATORS: dict[str, _Aggregation] = {
    # mean over every valid token of the batch (long answers weigh more)
    "token-mean": _Aggregation(lambda loss, mask: (loss * mask).sum() / mask.sum().clamp(min=1e-8),
                               lambda mask: float(mask.sum())),
    # plain sum over valid tokens
    "token-sum": _Aggregation(lambda loss, mask: (loss * mask).sum(), None),
    # sum within a sequence, mean over sequences
    "seq-mean-token-sum": _Aggregation(lambda loss, mask: _row_mean((loss * mask).sum(-1), mask),
                                       _rows_with_tokens),
    # mean within a sequence, mean over sequences (the original GRPO objective)
    "seq-mean-token-mean": _Aggregation(
        lambda loss, mask: _row_mean((loss * mask).sum(-1) / mask.sum(-1).clamp(min=1e-8), mask), _rows_with_tokens),
    # seq-mean-token-sum / T with T the constant padded length (Dr. GRPO, Liu et al. 2025)
    "seq-mean-token-sum-norm": _Aggregation(
        lambda loss, mask: _row_mean((loss * mask).sum(-1), mask) / mask.shape[-1], _rows_with_tokens),
}
AGG_MODES: tuple[str, ...] = tuple(_AGGREGATORS)


def aggregate(loss_mat: Tensor, mask: Tensor, mode: str) -> Tensor:
    """Reduce a per-token loss matrix to a scalar.

    Args:
        loss_mat: `(B, T)` per-token losses.
        mask: `(B, T)` valid-token mask (bool, int or float).
        mode: one of `AGG_MODES`: token-mean, token-sum, seq-mean-token-sum,
            seq-mean-token-mean, seq-mean-token-sum-norm. Rows without valid tokens are
            excluded from the sequence means; an all-masked batch gives 0.

    Returns:
        0-dim float32 tensor.
    """
    if mode not in _AGGREGATORS:
        raise ValueError(f"unknown aggregation mode {mode!r}; valid modes: {', '.join(AGG_MODES)}")
    if loss_mat.dim() != 2 or loss_mat.shape != mask.shape:
        raise ValueError(f"loss_mat {tuple(loss_mat.shape)} and mask {tuple(mask.shape)} must both be (B, T)")
    return _AGGREGATORS[mode].reduce(loss_mat.float(), as_float_mask(mask))


def normaliser(mode: str, mask: Tensor) -> float | None:
    """What `aggregate(..., mode)` divides a batch's summed loss by: its valid tokens (token-mean)
    or its rows with tokens (seq-mean-*); None for token-sum, which is not normalised.

    Gradient accumulation uses it: a micro-batch's aggregated loss times `normaliser(micro) /
    normaliser(whole mini-batch)` sums to the mini-batch's aggregated loss.
    """
    if mode not in _AGGREGATORS:
        raise ValueError(f"unknown aggregation mode {mode!r}; valid modes: {', '.join(AGG_MODES)}")
    count = _AGGREGATORS[mode].count
    return None if count is None else count(as_float_mask(mask))


# --------------------------------------------------------------------------- policy losses

# The keyword arguments every policy loss is called with (see `policy_loss` for their meaning).
POLICY_LOSS_KEYWORDS = ("logprobs", "old_logprobs", "advantages", "response_mask", "clip_low", "clip_high",
                        "dual_clip", "agg")
_POLICY_LOSSES = Registry("policy loss", keywords=POLICY_LOSS_KEYWORDS)


def policy_loss_names() -> tuple[str, ...]:
    """Names accepted by `policy_loss`, sorted (besides `file.py:fn` references)."""
    return _POLICY_LOSSES.names()


def policy_loss_fn(name: str) -> Callable:
    """The loss registered as `name` or referenced as `file.py:fn` (ValueError listing valid names)."""
    return _POLICY_LOSSES.get(name)


def register_policy_loss(name: str, fn: Callable | None = None):
    """Register a user policy loss as `name` (call it from a plugin, see docs/custom-algorithm.md).

    `fn` takes the keyword arguments `POLICY_LOSS_KEYWORDS` (tensors already float32, `old_logprobs`
    and `advantages` detached) and returns `(loss, stats)`: a 0-dim loss aggregated with
    `aggregate(loss_mat, response_mask, agg)`, and a dict of 0-dim tensors or floats, each a masked
    token mean (every key becomes an `actor/<key>` metric). Use as `register_policy_loss("x", fn)`
    or as the decorator `@register_policy_loss("x")`.

    Raises:
        ValueError: the name is taken or `fn` does not take the keywords.
    """
    return _POLICY_LOSSES.register(name) if fn is None else _POLICY_LOSSES.register(name)(fn)


def policy_loss(
    name: str,
    *,
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    response_mask: Tensor,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    dual_clip: float = 3.0,
    agg: str = "token-mean",
) -> tuple[Tensor, Stats]:
    """Compute the policy loss registered as `name` (one of `policy_loss_names()`).

    Args:
        name: cispo, gspo, ppo, reinforce, a registered user loss or `file.py:fn`.
        logprobs: `(B, T)` log pi_theta(y_t) of the current policy (with gradient).
        old_logprobs: `(B, T)` log-probs of the policy that sampled the batch.
        advantages: `(B, T)` advantages.
        response_mask: `(B, T)` valid-token mask.
        clip_low, clip_high: the ratio is clipped to `[1 - clip_low, 1 + clip_high]`
            (asymmetric "clip-higher", Yu et al. 2025, DAPO).
        dual_clip: bound `c > 1` of dual-clip PPO (Ye et al. 2020), ppo only.
        agg: aggregation mode, one of `AGG_MODES`.

    Returns:
        `(loss, stats)`; built-in losses report `clipfrac`, `clipfrac_lower`, `approx_kl`; a user
        loss reports what it returns.
    """
    fn = _POLICY_LOSSES.get(name)
    if agg not in _AGGREGATORS:
        raise ValueError(f"unknown aggregation mode {agg!r}; valid modes: {', '.join(AGG_MODES)}")
    shapes = {tuple(t.shape) for t in (logprobs, old_logprobs, advantages, response_mask)}
    if len(shapes) != 1 or logprobs.dim() != 2:
        raise ValueError(
            "logprobs, old_logprobs, advantages and response_mask must share one (B, T) shape, "
            f"got {sorted(shapes)}"
        )
    if not 0.0 <= clip_low < 1.0 or clip_high < 0.0:
        raise ValueError(f"need 0 <= clip_low < 1 and clip_high >= 0, got {clip_low}, {clip_high}")
    return fn(
        logprobs=logprobs.float(),
        old_logprobs=old_logprobs.detach().float(),
        advantages=advantages.detach().float(),
        response_mask=as_float_mask(response_mask),
        clip_low=float(clip_low),
        clip_high=float(clip_high),
        dual_clip=float(dual_clip),
        agg=agg,
    )


def _policy_stats(clipped: Tensor, clipped_lower: Tensor, log_ratio: Tensor, mask: Tensor) -> Stats:
    """The three stats every policy loss reports, detached 0-dim float32 tensors."""
    return {
        "clipfrac": masked_mean(clipped.float(), mask).detach(),
        "clipfrac_lower": masked_mean(clipped_lower.float(), mask).detach(),
        # k1 estimate of KL(pi_old || pi) on the sampled tokens: mean of log pi_old - log pi
        "approx_kl": masked_mean(-log_ratio, mask).detach(),
    }


@_POLICY_LOSSES.register("ppo")
def _ppo(*, logprobs, old_logprobs, advantages, response_mask, clip_low, clip_high, dual_clip, agg):
    """Clipped surrogate (Schulman et al. 2017, PPO, eq. 7) with dual clip (Ye et al. 2020,
    "Mastering Complex Control in MOBA Games with Deep Reinforcement Learning"):
    `L = max(-A r, -A clip(r, 1-eps_low, 1+eps_high))`, and for `A < 0` also `min(L, -c A)`."""
    if dual_clip <= 1.0:
        raise ValueError(f"dual_clip must be > 1, got {dual_clip}")
    log_ratio = (logprobs - old_logprobs).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    ratio = torch.exp(log_ratio)  # (B, T)
    loss_unclipped = -advantages * ratio
    loss_clipped = -advantages * ratio.clamp(1.0 - clip_low, 1.0 + clip_high)
    loss_pessimistic = torch.maximum(loss_unclipped, loss_clipped)
    loss_dual_bound = -advantages * dual_clip  # only a bound when A < 0 (then it is positive)
    negative = advantages < 0
    loss_mat = torch.where(negative, torch.minimum(loss_pessimistic, loss_dual_bound), loss_pessimistic)
    stats = _policy_stats(
        clipped=loss_clipped > loss_unclipped,
        clipped_lower=negative & (loss_pessimistic > loss_dual_bound),
        log_ratio=log_ratio,
        mask=response_mask,
    )
    return aggregate(loss_mat, response_mask, agg), stats


@_POLICY_LOSSES.register("gspo")
def _gspo(*, logprobs, old_logprobs, advantages, response_mask, clip_low, clip_high, dual_clip, agg):
    """Group Sequence Policy Optimisation (Zheng et al. 2025, arXiv:2507.18071, "GSPO-token"):
    the sequence ratio `s_i = exp(mean_t log(pi/pi_old))` (a geometric mean) replaces the token
    ratio, `s_{i,t} = sg[s_i] * pi(y_t) / sg[pi(y_t)]` so each token's gradient is scaled by s_i.
    The paper's objective is `agg="seq-mean-token-mean"`; `agg` is honoured as given."""
    token_log_ratio = logprobs - old_logprobs
    seq_log_ratio = masked_mean(token_log_ratio, response_mask, dim=-1)  # (B,)
    log_ratio = logprobs - logprobs.detach() + seq_log_ratio.detach().unsqueeze(-1)
    ratio = torch.exp(log_ratio.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))  # (B, T), s_i on each token
    loss_unclipped = -advantages * ratio
    loss_clipped = -advantages * ratio.clamp(1.0 - clip_low, 1.0 + clip_high)
    loss_mat = torch.maximum(loss_unclipped, loss_clipped)
    stats = _policy_stats(
        clipped=loss_clipped > loss_unclipped,
        clipped_lower=torch.zeros_like(loss_mat, dtype=torch.bool),
        log_ratio=token_log_ratio.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP),
        mask=response_mask,
    )
    return aggregate(loss_mat, response_mask, agg), stats


@_POLICY_LOSSES.register("reinforce")
def _reinforce(*, logprobs, old_logprobs, advantages, response_mask, clip_low, clip_high, dual_clip, agg):
    """Vanilla policy gradient (Williams 1992, REINFORCE): `L = -A log pi(y_t)`, no ratio and no
    clipping (on-policy); `clipfrac`s are 0 and `approx_kl` still measures off-policyness."""
    loss_mat = -advantages * logprobs
    never = torch.zeros_like(loss_mat, dtype=torch.bool)
    log_ratio = (logprobs - old_logprobs).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    stats = _policy_stats(clipped=never, clipped_lower=never, log_ratio=log_ratio, mask=response_mask)
    return aggregate(loss_mat, response_mask, agg), stats


@_POLICY_LOSSES.register("cispo")
def _cispo(*, logprobs, old_logprobs, advantages, response_mask, clip_low, clip_high, dual_clip, agg):
    """Clipped IS-weight policy optimisation (MiniMax 2025, MiniMax-M1, arXiv:2506.13585, sec. 3.1,
    eq. 4 with the weight of eq. 5): `L = -sg(clip(r, 1 - eps_low, 1 + eps_high)) A log pi(y_t)`.
    Unlike PPO no token loses its gradient: the clipped ratio only scales it (stop-gradient). The
    paper uses `agg="token-mean"` and no lower bound (its eps_low is large: `clip_low` near 1 here);
    `clipfrac` / `clipfrac_lower` are the shares of tokens whose weight hit the upper / lower bound."""
    log_ratio = (logprobs - old_logprobs).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    ratio = torch.exp(log_ratio.detach())  # (B, T), no gradient through the weight
    weight = ratio.clamp(1.0 - clip_low, 1.0 + clip_high)
    loss_mat = -weight * advantages * logprobs
    stats = _policy_stats(clipped=ratio > 1.0 + clip_high, clipped_lower=ratio < 1.0 - clip_low,
                          log_ratio=log_ratio, mask=response_mask)
    return aggregate(loss_mat, response_mask, agg), stats


# --------------------------------------------------------------------------- value loss


def value_loss(
    *,
    values: Tensor,
    old_values: Tensor,
    returns: Tensor,
    response_mask: Tensor,
    clip: float = 0.5,
    agg: str = "token-mean",
) -> tuple[Tensor, Stats]:
    """Clipped value loss (the value clipping of OpenAI Baselines' PPO2, kept by Ziegler et al. 2019):
    `0.5 * aggregate(max((v - R)^2, (clip(v, v_old - c, v_old + c) - R)^2))`.

    Args:
        values: `(B, T)` current critic predictions (with gradient).
        old_values: `(B, T)` predictions at rollout time.
        returns: `(B, T)` targets R.
        response_mask: `(B, T)` valid-token mask.
        clip: c, the largest move of v away from v_old that still gets gradient.
        agg: aggregation mode, one of `AGG_MODES`.

    Returns:
        `(loss, stats)`; stats `vf_clipfrac`: fraction of valid tokens where the clipped term wins.
    """
    if clip < 0:
        raise ValueError(f"value clip must be >= 0, got {clip}")
    if not values.shape == old_values.shape == returns.shape == response_mask.shape:
        raise ValueError("values, old_values, returns and response_mask must share one (B, T) shape")
    mask = as_float_mask(response_mask)
    v, v_old, target = values.float(), old_values.detach().float(), returns.detach().float()
    v_clipped = torch.clamp(v, v_old - clip, v_old + clip)
    loss_unclipped = (v - target) ** 2
    loss_clipped = (v_clipped - target) ** 2
    loss = 0.5 * aggregate(torch.maximum(loss_unclipped, loss_clipped), mask, agg)
    return loss, {"vf_clipfrac": masked_mean((loss_clipped > loss_unclipped).float(), mask).detach()}
