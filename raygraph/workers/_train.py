"""Training machinery shared by the policy and critic workers (private to `raygraph.workers`).

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

import contextlib
import json
import math
import random
import warnings
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch import nn

from raygraph.algos import losses
from raygraph.batch import Batch
from raygraph.workers.distributed import all_reduce, dummy_row, full_tensor, lockstep, rank, world_size
from raygraph.workers.safe_load import CheckpointError, dcp_load

__all__ = [
    "MicroResult", "build_optimizer", "build_scheduler", "iter_weight_buckets", "load_train_state",
    "lr_factor", "run_minibatches", "save_train_state", "train_state_dict",
]

LR_SCHEDULES = ("constant", "cosine", "linear")


# --------------------------------------------------------------------------- optimizer, schedule


def build_optimizer(model: nn.Module, *, lr: float, weight_decay: float,
                    betas: tuple[float, float]) -> torch.optim.AdamW:
    """AdamW; weight decay on matrices only (biases and norm scales are not decayed)."""
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [{"params": [p for p in params if p.dim() >= 2], "weight_decay": weight_decay},
              {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]
    return torch.optim.AdamW([g for g in groups if g["params"]], lr=lr, betas=tuple(betas))


def lr_factor(step: int, *, warmup_steps: int, total_steps: int | None, lr_schedule: str,
              min_lr_ratio: float) -> float:
    """Multiplier of the peak lr at scheduler step `step` (0-based).

    Linear warmup `(step + 1) / warmup_steps` (the first step already learns), then
    constant, or a cosine / linear decay from 1 to `min_lr_ratio` at `total_steps`.
    """
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    if lr_schedule == "constant":
        return 1.0
    progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
    decay = 0.5 * (1.0 + math.cos(math.pi * progress)) if lr_schedule == "cosine" else 1.0 - progress
    return min_lr_ratio + (1.0 - min_lr_ratio) * decay


def _step_scheduler(scheduler: torch.optim.lr_scheduler.LRScheduler) -> None:
    """Advance the schedule by one optimizer step (skipped steps count too: the schedule
    follows training progress, and `total_steps` stays aligned with the trainer)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*lr_scheduler.step.*before.*optimizer.step", category=UserWarning)
        scheduler.step()


def build_scheduler(optimizer: torch.optim.Optimizer, *, warmup_steps: int, total_steps: int | None,
                    lr_schedule: str, min_lr_ratio: float) -> torch.optim.lr_scheduler.LambdaLR:
    if lr_schedule not in LR_SCHEDULES:
        raise ValueError(f"unknown lr_schedule {lr_schedule!r}; valid: {', '.join(LR_SCHEDULES)}")
    if lr_schedule != "constant" and not total_steps:
        raise ValueError(f"lr_schedule={lr_schedule!r} needs total_steps")

    def factor(step: int) -> float:
        return lr_factor(step, warmup_steps=warmup_steps, total_steps=total_steps,
                         lr_schedule=lr_schedule, min_lr_ratio=min_lr_ratio)

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


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


# --------------------------------------------------------------------------- the update loop


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
            _step_scheduler(scheduler)
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


# --------------------------------------------------------------------------- weights and checkpoints


def _named_tensors(model: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """Parameters (tied ones once, under their first name) and persistent buffers."""
    persistent = set(model.state_dict().keys())
    yield from model.named_parameters()
    yield from ((n, b) for n, b in model.named_buffers() if n in persistent)


def iter_weight_buckets(model: nn.Module, bucket_bytes: int, dtype: torch.dtype | None = None, *,
                        copy: bool = True) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """Full tensors in state-dict names, grouped in buckets of about `bucket_bytes`.

    Under FSDP2 each tensor is all-gathered as it is reached, so every rank must drain the
    iterator in lockstep; at most one bucket of full tensors is alive per rank at a time.
    Gathered or cast tensors are new; an unsharded model's own tensors are cloned when `copy`
    (safe to keep while training goes on), else handed out as detached views of the live
    weights (no copy: consume each bucket before the next optimizer step).
    """
    def full_tensors() -> Iterator[tuple[str, torch.Tensor]]:
        for name, tensor in _named_tensors(model):
            live = tensor.detach()
            full = full_tensor(live)
            if dtype is not None and full.is_floating_point() and full.dtype != dtype:
                full = full.to(dtype)
            elif copy and full is live:
                full = full.clone()
            yield name, full

    yield from group_in_buckets(full_tensors(), bucket_bytes)


def group_in_buckets(named: Iterable[tuple[str, torch.Tensor]],
                     bucket_bytes: int) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """Consecutive `(name, tensor)` pairs grouped into lists of about `bucket_bytes` (a tensor
    larger than that gets a bucket of its own); tensors are drawn lazily, one bucket at a time."""
    bucket, size = [], 0
    for name, tensor in named:
        nbytes = tensor.numel() * tensor.element_size()
        if bucket and size + nbytes > bucket_bytes:
            yield bucket
            bucket, size = [], 0
        bucket.append((name, tensor))
        size += nbytes
    if bucket:
        yield bucket


def _rng_state() -> dict:
    state = {"torch": torch.get_rng_state(), "python": random.getstate(), "numpy": np.random.get_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _extra_to_file(scheduler_state: dict, rng: dict) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """This rank's scheduler and RNG state as safetensors tensors + string metadata (JSON)."""
    version, mt, gauss = rng["python"]
    kind, keys, pos, has_gauss, cached = rng["numpy"]
    tensors = {"rng/torch": rng["torch"], "rng/numpy": torch.from_numpy(np.asarray(keys, dtype=np.uint32).copy()),
               **{f"rng/cuda/{i}": t for i, t in enumerate(rng.get("cuda", []))}}
    try:
        scheduler_json = json.dumps(scheduler_state)
    except TypeError as exc:
        raise TypeError(f"save_train_state: the lr scheduler's state must be plain JSON data ({exc})") from exc
    meta = {"scheduler": scheduler_json,
            "python_rng": json.dumps([version, list(mt), gauss]),
            "numpy_rng": json.dumps([kind, int(pos), int(has_gauss), float(cached)]),
            "cuda_devices": str(len(rng.get("cuda", [])))}
    return tensors, meta


def _extra_from_file(tensors: dict[str, torch.Tensor], meta: dict[str, str]) -> tuple[dict, dict]:
    """Inverse of `_extra_to_file`: (scheduler state, RNG state)."""
    version, mt, gauss = json.loads(meta["python_rng"])
    kind, pos, has_gauss, cached = json.loads(meta["numpy_rng"])
    rng = {"torch": tensors["rng/torch"], "python": (version, tuple(mt), gauss),
           "numpy": (kind, tensors["rng/numpy"].numpy(), pos, has_gauss, cached)}
    if int(meta["cuda_devices"]):
        rng["cuda"] = [tensors[f"rng/cuda/{i}"] for i in range(int(meta["cuda_devices"]))]
    return json.loads(meta["scheduler"]), rng


def train_state_dict(model: nn.Module, optimizer: torch.optim.Optimizer, scheduler) -> dict:
    """`{"model", "optimizer"}` (sharded under FSDP2, for torch.distributed.checkpoint) plus
    this rank's `{"scheduler", "rng"}`."""
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_sd, optim_sd = get_state_dict(model, optimizer)
    return {"model": model_sd, "optimizer": optim_sd, "scheduler": scheduler.state_dict(), "rng": _rng_state()}


@contextlib.contextmanager
def _quiet_single_process() -> Iterator[None]:
    """Silence DCP's "assuming the intent is to save in a single process" (it is)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*single process", category=UserWarning)
        yield


def save_train_state(path: str | Path, model: nn.Module, optimizer: torch.optim.Optimizer, scheduler) -> None:
    """`path/dcp/` (model + optimizer, each rank writes its shards) and `path/extra_rank{r}.safetensors`
    (this rank's lr-scheduler and RNG state: tensors, and JSON in the file's metadata; no pickle)."""
    import torch.distributed.checkpoint as dcp
    from safetensors.torch import save_file

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    state = train_state_dict(model, optimizer, scheduler)
    with _quiet_single_process():
        dcp.save({"model": state["model"], "optimizer": state["optimizer"]}, checkpoint_id=str(path / "dcp"))
    tensors, meta = _extra_to_file(state["scheduler"], state["rng"])
    save_file(tensors, path / f"extra_rank{rank()}.safetensors", metadata=meta)


def load_train_state(path: str | Path, model: nn.Module, optimizer: torch.optim.Optimizer, scheduler) -> None:
    """Inverse of `save_train_state` (same world size). Nothing is unpickled: the sharded state is
    read by `safe_load.dcp_load`, the rest from safetensors + JSON.

    Raises:
        CheckpointError: a file is missing, truncated or unsafe, or the checkpoint was written in
            the old pickled format (`extra_rank{r}.pt`), which is never loaded.
    """
    from safetensors import safe_open
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    path = Path(path)
    extra = path / f"extra_rank{rank()}.safetensors"
    if not extra.is_file():
        old = path / f"extra_rank{rank()}.pt"
        reason = (f"{old.name} is the old pickled format, which raygraph no longer loads (unpickling can "
                  f"run code)" if old.is_file() else f"{extra.name} is missing")
        raise CheckpointError(f"cannot load the training state in {path}: {reason}; resume from a "
                              f"checkpoint written by this version, or start a new run from its weights")
    model_sd, optim_sd = get_state_dict(model, optimizer)
    state = {"model": model_sd, "optimizer": optim_sd}
    with _quiet_single_process():
        dcp_load(state, path / "dcp")
    try:
        with safe_open(extra, framework="pt") as f:
            tensors = {name: f.get_tensor(name) for name in f.keys()}
            scheduler_state, rng = _extra_from_file(tensors, f.metadata())
    except Exception as exc:
        raise CheckpointError(f"cannot read {extra}: {type(exc).__name__}: {exc}") from exc
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"])
    scheduler.load_state_dict(scheduler_state)
    _set_rng_state(rng)
