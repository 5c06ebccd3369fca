"""Direct preference optimisation losses over (chosen, rejected) pairs.

Inputs are summed (or, for IPO as its authors recommend, length-averaged) sequence
log-probabilities, shape `(B,)`, one entry per preference pair. The implicit reward of a
response is `beta * (log pi(y) - log pi_ref(y))` (Rafailov et al. 2023, eq. 5).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from raygraph.algos._registry import Registry

__all__ = ["dpo_loss", "names", "check", "register_dpo_loss", "DPO_KEYWORDS"]

Tensor = torch.Tensor
DPO_KEYWORDS = ("margin", "beta")   # every kind's arguments: (B,) log-ratio margins, and beta
_KINDS = Registry("DPO loss kind", keywords=DPO_KEYWORDS)


def names() -> tuple[str, ...]:
    """DPO loss kinds accepted by `dpo_loss(kind=...)`, sorted."""
    return _KINDS.names()


def check(kind: str) -> None:
    """Raise `ValueError` unless `kind` is a registered name or a `file.py:fn` reference to a
    function taking `DPO_KEYWORDS` (imported to check it)."""
    _KINDS.get(kind)


def register_dpo_loss(name: str, fn=None):
    """Register a user DPO loss kind as `name` (from a plugin, docs/custom-algorithm.md):
    `fn(margin=(B,), beta=float) -> (B,)` per-pair losses, averaged by `dpo_loss`. Use as a call
    or as a decorator.

    Raises:
        ValueError: the name is taken or `fn` does not take the keywords.
    """
    return _KINDS.register(name) if fn is None else _KINDS.register(name)(fn)


@_KINDS.register("sigmoid")
def _sigmoid(margin: Tensor, beta: float) -> Tensor:
    """DPO (Rafailov et al. 2023, "Direct Preference Optimization", eq. 7): `-log sigmoid(beta h)`."""
    return -F.logsigmoid(beta * margin)


@_KINDS.register("ipo")
def _ipo(margin: Tensor, beta: float) -> Tensor:
    """IPO (Azar et al. 2023, "A General Theoretical Paradigm to Understand Learning from Human
    Preferences", the IPO loss): `(h - 1/(2 beta))^2`, beta playing the role of the paper's tau."""
    return (margin - 1.0 / (2.0 * beta)) ** 2


def dpo_loss(
    *,
    chosen_logps: Tensor,
    rejected_logps: Tensor,
    ref_chosen_logps: Tensor,
    ref_rejected_logps: Tensor,
    beta: float = 0.1,
    kind: str = "sigmoid",
) -> tuple[Tensor, dict[str, Tensor]]:
    """Preference loss on the log-ratio margin
    `h = (log pi(y_w) - log pi_ref(y_w)) - (log pi(y_l) - log pi_ref(y_l))`, averaged over pairs.

    Args:
        chosen_logps: `(B,)` policy log-probs of the preferred responses (with gradient).
        rejected_logps: `(B,)` policy log-probs of the dispreferred responses.
        ref_chosen_logps: `(B,)` reference-model log-probs of the preferred responses.
        ref_rejected_logps: `(B,)` reference-model log-probs of the dispreferred responses.
        beta: KL-regularisation strength (sigmoid) or 1 / (2 * target margin) (ipo); > 0.
        kind: one of `names()`: sigmoid, ipo.

    Returns:
        `(loss, stats)`: loss a 0-dim float32 tensor; stats detached 0-dim float32 tensors
        `rewards/chosen`, `rewards/rejected` (mean implicit rewards), `rewards/accuracy`
        (fraction of pairs with chosen reward > rejected reward) and `rewards/margin`
        (mean chosen - rejected reward).
    """
    per_pair = _KINDS.get(kind)
    if beta <= 0:
        raise ValueError(f"beta must be > 0, got {beta}")
    shapes = {tuple(t.shape) for t in (chosen_logps, rejected_logps, ref_chosen_logps, ref_rejected_logps)}
    if len(shapes) != 1:
        raise ValueError(f"the four log-prob tensors must share one (B,) shape, got {sorted(shapes)}")
    chosen_logratio = chosen_logps.float() - ref_chosen_logps.detach().float()  # (B,)
    rejected_logratio = rejected_logps.float() - ref_rejected_logps.detach().float()
    loss = per_pair(margin=chosen_logratio - rejected_logratio, beta=float(beta)).mean()
    chosen_rewards = beta * chosen_logratio.detach()
    rejected_rewards = beta * rejected_logratio.detach()
    stats = {
        "rewards/chosen": chosen_rewards.mean(),
        "rewards/rejected": rejected_rewards.mean(),
        "rewards/accuracy": (chosen_rewards > rejected_rewards).float().mean(),
        "rewards/margin": (chosen_rewards - rejected_rewards).mean(),
    }
    return loss, stats
