"""New weights for weight-update tests: a model's own tensors, moved by seeded noise."""

from __future__ import annotations

import torch


def perturbed(model: torch.nn.Module, seed: int) -> list[tuple[str, torch.Tensor]]:
    """`model`'s state dict plus 0.2 x N(0, 1) noise drawn from `seed`, as one weight bucket."""
    gen = torch.Generator().manual_seed(seed)
    return [(k, v + 0.2 * torch.randn(v.shape, generator=gen)) for k, v in model.state_dict().items()]
