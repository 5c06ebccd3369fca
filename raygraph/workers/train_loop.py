"""The update loop of the policy and critic workers: epochs x mini-batches x micro-batches.

The one subtle part is loss scaling. A mini-batch is cut into micro-batches (gradient
accumulation) on each of `world` data-parallel ranks, and the result must equal one backward
pass over the whole mini-batch. Each micro-batch computes its loss with the configured
aggregation (`token-mean`, `seq-mean-*`, `token-sum`), i.e. normalised by its *own* token (or
sequence) count n_i (`raygraph.algos.losses.normaliser`, declared with the aggregation modes).
Multiplying it by `n_i / N` (N = that count over all micro-batches of all ranks, from one
all-reduce) turns the sum of micro-batch losses into the mini-batch loss; the extra factor
`world` undoes FSDP's averaging of gradients over ranks. `token-sum` needs no normalisation
(weight 1).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from raygraph.algos import losses
from raygraph.batch import Batch
from raygraph.workers.distributed import all_reduce, dummy_row, full_tensor, lockstep, world_size
from raygraph.workers.optim import step_scheduler

__all__ = ["MicroResult", "run_minibatches"]


@dataclass
class MicroResult:
    """What a role's loss function returns for one micro-batch.

    loss: the micro-batch loss aggregated with the role's `loss_agg` (with gradient).
    loss_terms: scalars aggregated like `loss` (e.g. pg_loss, kl_loss): reported as their
        exact mini-batch values.
    token_stats: masked token means (e.g. clipfrac, entropy): reported as token-weighted means.
    """

    loss: torch.Tensor
    loss_terms: dict[str, torch.Tensor]
    token_stats: dict[str, torch.Tensor]


def run_minibatches(
    batch: Batch,
    *,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler,
    loss_fn: Callable[[Batch], MicroResult],
    mask_key: str,
    loss_agg: str,
    epochs: int,
    mini_batch_size: int | None,
    micro_batch_size: int,
    max_tokens_per_micro_batch: int | None = None,
    grad_clip: float | None,
) -> dict[str, float]:
    """`epochs` x mini-batches (one optimizer step each) x micro-batches (accumulated).

    `mini_batch_size` is per-rank rows per optimizer step (None: the whole shard). The lr
    scheduler advances once per optimizer step (warmup/total steps count optimizer steps). Ranks run
    the same number of steps and micro-batches (`lockstep`); a rank short of data runs a
    zero-weight dummy micro-batch so that FSDP's collectives still match, also a rank with no rows
    at all (a filtered batch split over more ranks than it has groups). A call with no rows on any
    rank does nothing: no optimizer step, no scheduler step, `empty_updates` 1.

    Returns:
        Means over the non-skipped optimizer steps of every loss term and token stat (global
        over ranks), plus `grad_norm`, `skipped_steps`, `optimizer_steps` (attempted, skipped
        ones included), `lr` (of the last step) and `empty_updates` (1 when no rank had a row).
    """
    if epochs < 1:
        raise ValueError(f"need epochs >= 1, got {epochs}")
    lr = optimizer.param_groups[0]["lr"]
    if all_reduce(torch.tensor([len(batch)]), "sum").item() == 0:
        # every row was filtered out (e.g. DAPO dynamic sampling): no optimizer step on nothing,
        # and the lr schedule stays where it is; the caller counts and logs it
        return {"empty_updates": 1.0, "optimizer_steps": 0.0, "skipped_steps": 0.0, "lr": lr}
    mini_size = mini_batch_size or max(len(batch), 1)
    world = world_size()
    step_values, norms, skipped = [], [], []
    for _ in range(epochs):
        for mini, _dummy in lockstep(batch.split(mini_size), lambda: batch.select(slice(0, 0))):
            micros = lockstep(mini.micro_batches(micro_batch_size, max_tokens_per_micro_batch), lambda: dummy_row(batch))
            masks = [m[mask_key] for m, is_dummy in micros if not is_dummy]
            totals = all_reduce(torch.tensor([sum(losses.normaliser(loss_agg, m) or 0.0 for m in masks),
                                              sum(float(m.sum()) for m in masks)], dtype=torch.float64))
            values: dict[str, torch.Tensor] = {}
            loss_finite = True
            for micro, is_dummy in micros:
                result = loss_fn(micro)
                mask = micro[mask_key]
                count = losses.normaliser(loss_agg, mask)
                weight = 0.0 if is_dummy else (1.0 if count is None else count / max(float(totals[0]), 1e-8))
                token_weight = 0.0 if is_dummy else float(mask.sum()) / max(float(totals[1]), 1e-8)
                (result.loss * (weight * world)).backward()
                loss_finite = loss_finite and (is_dummy or bool(torch.isfinite(result.loss.detach())))
                for name, v in result.loss_terms.items():
                    values[name] = values.get(name, 0.0) + float(v) * weight
                for name, v in result.token_stats.items():
                    values[name] = values.get(name, 0.0) + float(v) * token_weight
            lr = optimizer.param_groups[0]["lr"]
            norm, was_skipped = _clip_and_step(model, optimizer, grad_clip, loss_finite)
            step_scheduler(scheduler)
            step_values.append(values)
            norms.append(norm)
            skipped.append(was_skipped)
    return _summarise(step_values, norms, skipped) | {"lr": lr, "empty_updates": 0.0}


def _summarise(step_values: list[dict[str, float]], norms: list[float], skipped: list[bool]) -> dict[str, float]:
    names = sorted({k for v in step_values for k in v})
    table = torch.tensor([[v.get(k, 0.0) for k in names] for v in step_values], dtype=torch.float64)
    table = all_reduce(table.reshape(len(step_values), len(names)))  # (steps, names), summed over ranks
    keep = torch.tensor([not s for s in skipped])
    if not keep.any():
        keep = torch.ones_like(keep)  # all skipped: report the (non-finite) values anyway
    out = {name: float(table[keep, i].mean()) for i, name in enumerate(names)}
    out["grad_norm"] = float(torch.tensor(norms)[keep].mean())
    out["skipped_steps"] = float(sum(skipped))
    out["optimizer_steps"] = float(len(skipped))
    return out


def _clip_and_step(model: nn.Module, optimizer: torch.optim.Optimizer, grad_clip: float | None,
                   loss_finite: bool) -> tuple[float, bool]:
    """Global grad norm, clip, step. A non-finite loss (on any rank) or norm skips the step.

    Returns `(grad_norm, skipped)`; on a skip the gradients are dropped and neither the weights
    nor the optimizer state change.
    """
    params = [p for p in model.parameters() if p.grad is not None]
    norm = full_tensor(torch.nn.utils.get_total_norm([p.grad for p in params], 2.0))
    finite = all_reduce(torch.tensor([float(loss_finite)]), "min").item() > 0 and bool(torch.isfinite(norm))
    if finite:
        if grad_clip:
            torch.nn.utils.clip_grads_with_norm_(params, grad_clip, norm)
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return float(norm), not finite
