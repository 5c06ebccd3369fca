"""Masked reductions shared by the estimators and losses.

All functions take a `mask` of the same shape as the values (bool, integer or float 0/1) and
ignore the masked-out entries entirely. They never divide by zero: an empty mask gives a mean
of 0 and a variance of 0.
"""

from __future__ import annotations

import torch

__all__ = ["as_float_mask", "masked_mean", "masked_var", "masked_whiten"]

WHITEN_EPS = 1e-8  # added to the variance before rsqrt, as in the PPO reference implementations


def as_float_mask(mask: torch.Tensor) -> torch.Tensor:
    """Cast a bool / int / float mask to float32 (1.0 = valid). Shape unchanged."""
    return mask.to(torch.float32)


def masked_mean(values: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Mean of `values` over entries where `mask` is set.

    Args:
        values: any shape, e.g. `(B, T)`.
        mask: same shape as `values`.
        dim: reduce over this dim only; `None` reduces over everything.

    Returns:
        The masked mean, float32; 0 where the mask is empty.
    """
    mask = as_float_mask(mask)
    total = (values.float() * mask).sum() if dim is None else (values.float() * mask).sum(dim)
    count = mask.sum() if dim is None else mask.sum(dim)
    return total / count.clamp(min=1e-8)


def masked_var(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Unbiased (Bessel-corrected) variance of the valid entries, a 0-dim float32 tensor.

    With n valid entries: `sum((x - mean)^2) / (n - 1)`; for n <= 1 the variance is 0
    (a single value has no spread), rather than an error.
    """
    mask = as_float_mask(mask)
    mean = masked_mean(values, mask)
    sq_dev = ((values.float() - mean) ** 2 * mask).sum()
    n = mask.sum()
    return sq_dev / (n - 1).clamp(min=1.0)


def masked_whiten(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Normalise to zero mean and unit variance over the valid entries.

    `(x - mean) * rsqrt(var + 1e-8)` with masked mean and unbiased masked variance (the
    normalisation used by PPO implementations since Ziegler et al. 2019). Masked entries are
    transformed too; callers multiply by the mask afterwards.

    Args:
        values: `(B, T)` (any shape).
        mask: same shape.

    Returns:
        float32 tensor shaped like `values`.
    """
    mean = masked_mean(values, mask)
    var = masked_var(values, mask)
    return (values.float() - mean) * torch.rsqrt(var + WHITEN_EPS)
