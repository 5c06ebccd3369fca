"""Entropy of the policy's next-token distribution, computed from logits.

`H(p) = -sum_v p_v log p_v = logsumexp(z) - sum_v softmax(z)_v z_v`, which needs no explicit
`log p` and is stable for large logits. Vocabularies of 100k+ entries make a full
`(B, T, V)` float32 copy expensive, so the rows are processed in chunks; with autograd on,
each chunk is recomputed in the backward pass (activation checkpointing) instead of being kept.
"""

from __future__ import annotations

import torch
from torch.utils.checkpoint import checkpoint

__all__ = ["entropy_from_logits"]

Tensor = torch.Tensor


def _entropy_rows(logits: Tensor) -> Tensor:
    """`(N, V)` logits of any float dtype -> `(N,)` float32 entropies."""
    # -inf (e.g. banned tokens) becomes the most negative float: softmax gives exactly 0 there and
    # 0 * finite = 0, where 0 * -inf would be NaN. clamp() has zero gradient at those entries.
    z = logits.float().clamp(min=torch.finfo(torch.float32).min)
    return torch.logsumexp(z, dim=-1) - (torch.softmax(z, dim=-1) * z).sum(dim=-1)


def entropy_from_logits(logits: Tensor, chunk_size: int = 1024) -> Tensor:
    """Per-position entropy of `softmax(logits)` in nats.

    Args:
        logits: `(..., V)` unnormalised log-probabilities, e.g. `(B, T, V)`; any float dtype.
        chunk_size: number of positions (rows of the flattened `(N, V)` view) processed at a
            time; bounds the float32 working memory to about `chunk_size * V * 4` bytes x a few.

    Returns:
        `(...)` float32 entropies, e.g. `(B, T)`; differentiable w.r.t. `logits`.
    """
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    lead_shape, vocab = logits.shape[:-1], logits.shape[-1]
    rows = logits.reshape(-1, vocab)  # (N, V)
    if rows.shape[0] == 0:
        return torch.zeros(lead_shape, dtype=torch.float32, device=logits.device)
    recompute = torch.is_grad_enabled() and logits.requires_grad and rows.shape[0] > chunk_size
    pieces = [
        checkpoint(_entropy_rows, chunk, use_reentrant=False) if recompute else _entropy_rows(chunk)
        for chunk in rows.split(chunk_size)
    ]
    return torch.cat(pieces).reshape(lead_shape)
