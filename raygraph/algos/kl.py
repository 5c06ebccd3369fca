"""Per-token estimators of KL(pi || pi_ref) from sampled-token log-probs.

With `d = log pi(y_t) - log pi_ref(y_t)` for a token sampled from pi (Schulman 2020,
"Approximating KL Divergence", http://joschu.net/blog/kl-approx.html):
    k1  (alias kl)          d                                unbiased, high variance, can be < 0
    abs                     |d|
    k2  (alias mse)         0.5 d^2                          biased, low variance; its gradient
                                                             is the true KL gradient in expectation
    k3  (alias low_var_kl)  exp(-d) + d - 1                  unbiased, >= 0, low variance;
                                                             -d clamped to +-20 before exp,
                                                             result clamped to +-10
A trailing `+` (e.g. `k3+`) gives the named estimator's *value* with k2's *gradient*
(straight-through: `k2 - sg[k2] + sg[value]`), the unbiased gradient when the KL is used as a
loss term (Tang & Munos 2025, "On a few pitfalls in KL divergence gradient estimation for RL").
"""

from __future__ import annotations

import torch

from raygraph.algos._registry import Registry
from raygraph.algos.user_code import is_code_ref

__all__ = ["estimate", "names", "check", "register_kl_estimator", "KL_KEYWORDS"]

Tensor = torch.Tensor
KL_KEYWORDS = ("logprobs", "ref_logprobs")   # every estimator's arguments: (B, T) float32 tensors
_ESTIMATORS = Registry("KL estimator", keywords=KL_KEYWORDS)
STRAIGHT_THROUGH = "+"
_K3_EXP_CLAMP = 20.0
_K3_VALUE_CLAMP = 10.0


@_ESTIMATORS.register("k1", "kl")
def _k1(logprobs: Tensor, ref_logprobs: Tensor) -> Tensor:
    return logprobs - ref_logprobs


@_ESTIMATORS.register("abs")
def _abs(logprobs: Tensor, ref_logprobs: Tensor) -> Tensor:
    return (logprobs - ref_logprobs).abs()


@_ESTIMATORS.register("k2", "mse")
def _k2(logprobs: Tensor, ref_logprobs: Tensor) -> Tensor:
    return 0.5 * (logprobs - ref_logprobs) ** 2


@_ESTIMATORS.register("k3", "low_var_kl")
def _k3(logprobs: Tensor, ref_logprobs: Tensor) -> Tensor:
    # r = pi_ref / pi; k3 = r - 1 - log r, with log r = -d
    log_r = (ref_logprobs - logprobs).clamp(-_K3_EXP_CLAMP, _K3_EXP_CLAMP)
    return (torch.exp(log_r) - 1.0 - log_r).clamp(-_K3_VALUE_CLAMP, _K3_VALUE_CLAMP)


def names() -> tuple[str, ...]:
    """Every accepted `kind`: base names, aliases and their `+` (straight-through) forms, sorted."""
    base = _ESTIMATORS.names()
    return tuple(sorted(base + tuple(name + STRAIGHT_THROUGH for name in base)))


def register_kl_estimator(name: str, fn=None):
    """Register a user per-token KL estimator as `name` (from a plugin, docs/custom-algorithm.md):
    `fn(logprobs=(B, T), ref_logprobs=(B, T)) -> (B, T)`; `name+` is then its straight-through form.
    Use as a call or as a decorator.

    Raises:
        ValueError: the name is taken or `fn` does not take the keywords.
    """
    return _ESTIMATORS.register(name) if fn is None else _ESTIMATORS.register(name)(fn)


def check(kind: str) -> None:
    """Raise `ValueError` unless `kind` is a registered name (maybe with `+`) or a `file.py:fn`
    reference to an estimator that takes `KL_KEYWORDS` (imported to check it)."""
    base = kind.removesuffix(STRAIGHT_THROUGH) if isinstance(kind, str) else None
    if base in _ESTIMATORS:
        return
    if base is None or not is_code_ref(base):
        raise ValueError(f"unknown KL estimator {kind!r}; valid names: {', '.join(names())} "
                         "(or a reference to your own: file.py:function)")
    _ESTIMATORS.get(base)   # imported and its keywords checked


def estimate(logprobs: Tensor, ref_logprobs: Tensor, kind: str) -> Tensor:
    """Per-token KL estimate.

    Args:
        logprobs: `(B, T)` log pi(y_t) of the policy (may carry gradient).
        ref_logprobs: `(B, T)` log pi_ref(y_t) (treated as a constant).
        kind: one of `names()`, e.g. "k1", "low_var_kl", "k3+".

    Returns:
        `(B, T)` float32 estimate, unmasked (callers mask/aggregate, e.g. `losses.aggregate`).

    Raises:
        ValueError: unknown `kind` (the message lists the valid kinds) or mismatched shapes.
    """
    check(kind)
    if logprobs.shape != ref_logprobs.shape:
        raise ValueError(f"logprobs {tuple(logprobs.shape)} and ref_logprobs {tuple(ref_logprobs.shape)} differ")
    logprobs, ref_logprobs = logprobs.float(), ref_logprobs.detach().float()
    straight_through = kind.endswith(STRAIGHT_THROUGH)
    value = _ESTIMATORS.get(kind.removesuffix(STRAIGHT_THROUGH))(logprobs=logprobs, ref_logprobs=ref_logprobs)
    if not straight_through:
        return value
    k2 = _k2(logprobs, ref_logprobs)
    return k2 - k2.detach() + value.detach()
