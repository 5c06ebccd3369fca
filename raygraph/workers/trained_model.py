"""One rank's model under training: what the policy and critic workers share, by composition.

    trained = TrainedModel(model, dtype="bfloat16", lr=1e-6, ...)
    with trained.compute():                       # autocast when unsharded and low precision
        loss = ...
    metrics = trained.train(batch, loss_fn, mask_key=RESPONSE_MASK, loss_agg="token-mean")
    trained.save(path); trained.load(path)

It places the model on the device, shards it with FSDP2 when `torch.distributed` runs (mixed
precision there, autocast otherwise; master weights and optimizer state stay float32), builds
AdamW and the lr schedule (`raygraph.workers.optim`), runs epochs x mini-batches x micro-batches
(`raygraph.workers.train_loop.run_minibatches`) and saves/loads model + optimizer + schedule + RNG
(`raygraph.workers.train_state`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

from raygraph.batch import Batch
from raygraph.models.loading import resolve_dtype
from raygraph.workers import optim
from raygraph.workers.distributed import default_device, fsdp_wrap, is_distributed
from raygraph.workers.train_loop import MicroResult, run_minibatches
from raygraph.workers.train_state import load_train_state, save_train_state

__all__ = ["TrainedModel"]


class TrainedModel:
    """A float32 model being trained on one data-parallel rank.

    Args:
        model: the float32 module (on CPU); moved to `device` and sharded when distributed.
        dtype: compute dtype ("float32", "bfloat16", "float16").
        device: None = CUDA when available, else CPU.
        lr, weight_decay, betas: AdamW (no decay on biases and norm scales).
        warmup_steps, total_steps, lr_schedule, min_lr_ratio: the lr schedule, per optimizer step.
        grad_clip: global gradient-norm clip (None: off).
        ppo_epochs, mini_batch_size, micro_batch_size: the default shape of `train` (per-rank rows
            per optimizer step, None = the whole shard; rows per forward/backward).
        max_tokens_per_micro_batch: also cap each micro-batch at this many padded tokens, padding
            trimmed (`Batch.micro_batches`); the gradient is the same as with fixed-size ones.
    """

    def __init__(self, model: nn.Module, *, dtype: str = "float32", device: str | None = None, lr: float,
                 weight_decay: float = 0.0, betas: tuple[float, float] = (0.9, 0.999), warmup_steps: int = 0,
                 total_steps: int | None = None, lr_schedule: str = "constant", min_lr_ratio: float = 0.0,
                 grad_clip: float | None = 1.0, ppo_epochs: int = 1, mini_batch_size: int | None = None,
                 micro_batch_size: int = 16, max_tokens_per_micro_batch: int | None = None) -> None:
        self.device = default_device(device)
        self.compute_dtype = resolve_dtype(dtype)
        model = model.to(self.device)
        low_precision = self.compute_dtype != torch.float32
        if is_distributed():
            model = fsdp_wrap(model, param_dtype=self.compute_dtype if low_precision else None)
        self._autocast = low_precision and not is_distributed()
        self.model = model
        self.optimizer = optim.build_optimizer(model, lr=lr, weight_decay=weight_decay, betas=betas)
        self.scheduler = optim.build_scheduler(self.optimizer, warmup_steps=warmup_steps, total_steps=total_steps,
                                               lr_schedule=lr_schedule, min_lr_ratio=min_lr_ratio)
        self._stage: tuple[float, torch.optim.Optimizer, torch.optim.lr_scheduler.LRScheduler] | None = None
        self.grad_clip, self.ppo_epochs = grad_clip, ppo_epochs
        self.mini_batch_size, self.micro_batch_size = mini_batch_size, micro_batch_size
        self.max_tokens_per_micro_batch = max_tokens_per_micro_batch

    def compute(self) -> contextlib.AbstractContextManager:
        """The context a forward pass runs in (autocast to the compute dtype when unsharded)."""
        if self._autocast:
            return torch.autocast(self.device.type, dtype=self.compute_dtype)
        return contextlib.nullcontext()

    def train(self, batch: Batch, loss_fn: Callable[[Batch], MicroResult], *, mask_key: str,
              loss_agg: str, epochs: int | None = None, stage_lr: float | None = None) -> dict[str, float]:
        """Epochs x mini-batches (one optimizer step each) x micro-batches of `loss_fn`.

        Args:
            epochs: None = `ppo_epochs`.
            stage_lr: step a separate AdamW at this constant lr (no weight decay, default betas),
                built on first use and kept while `stage_lr` stays the same, and leave the model's
                own optimizer and schedule untouched: a stage before the main training (the SFT
                warm start), after which the main training starts from a fresh optimizer state.
        Returns:
            `run_minibatches`' metrics (loss terms, token stats, grad_norm, skipped_steps, lr).
        """
        optimizer, scheduler = (self.optimizer, self.scheduler) if stage_lr is None else self._stage_optim(stage_lr)
        self.model.train()
        return run_minibatches(
            batch, model=self.model, optimizer=optimizer, scheduler=scheduler, loss_fn=loss_fn,
            mask_key=mask_key, loss_agg=loss_agg,
            epochs=self.ppo_epochs if epochs is None else epochs, mini_batch_size=self.mini_batch_size,
            micro_batch_size=self.micro_batch_size, max_tokens_per_micro_batch=self.max_tokens_per_micro_batch,
            grad_clip=self.grad_clip)

    def save(self, path: str | Path) -> None:
        """Model, optimizer, scheduler and RNG state (all ranks call; sharded under FSDP2)."""
        save_train_state(path, self.model, self.optimizer, self.scheduler)

    def load(self, path: str | Path) -> None:
        """Inverse of `save` (same world size); the lr schedule continues with this model's
        `total_steps` from the loaded step."""
        load_train_state(path, self.model, self.optimizer, self.scheduler)
        optim.resume_schedule(self.optimizer, self.scheduler)

    def _stage_optim(self, lr: float) -> tuple[torch.optim.Optimizer, torch.optim.lr_scheduler.LRScheduler]:
        if self._stage is None or self._stage[0] != lr:
            stage = optim.build_optimizer(self.model, lr=lr, weight_decay=0.0, betas=(0.9, 0.999))
            self._stage = (lr, stage, optim.build_scheduler(stage, warmup_steps=0, total_steps=None,
                                                            lr_schedule="constant", min_lr_ratio=0.0))
        return self._stage[1], self._stage[2]
