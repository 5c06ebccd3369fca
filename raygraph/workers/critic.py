"""The critic (PPO): a value head over a causal-LM body, trained with the clipped value loss.

`values[:, t]` is the value of the state in which response token t is chosen, read at the
same column (`P - 1 + t`) as the policy's log-prob of that token. Precision, data parallelism
(FSDP2), loss scaling over micro-batches and ranks, and the per-optimizer-step lr schedule
are as in `raygraph.workers.policy`.
"""

from __future__ import annotations

from pathlib import Path

import torch

from raygraph.algos import losses
from raygraph.batch import (
    PROMPT_IDS,
    PROMPT_MASK,
    RESPONSE_ATTENTION,
    RESPONSE_MASK,
    RESPONSES,
    RETURNS,
    SEQUENCE_COLUMNS,
    VALUES,
    Batch,
    pad_right,
    response_attention,
)
from raygraph.errors import MissingColumn
from raygraph.models.logprobs import sequence_inputs
from raygraph.models.value_head import ValueModel
from raygraph.workers.distributed import dummy_row, lockstep, rank
from raygraph.workers.train_loop import MicroResult
from raygraph.workers.trained_model import TrainedModel
from raygraph.workers.weight_buckets import iter_weight_buckets

__all__ = ["CriticWorker"]


class CriticWorker:
    """The value function of one data-parallel rank.

    Args:
        model_path: a causal-LM checkpoint (the head is initialised) or a saved critic.
        value_clip: the clip range c of the value loss.
        The others are as for `PolicyWorker`.
    """

    def __init__(self, *, model_path: str, dtype: str = "float32", attn_impl: str = "auto",
                 gradient_checkpointing: bool = False, lr: float, weight_decay: float = 0.0,
                 betas: tuple[float, float] = (0.9, 0.999), warmup_steps: int = 0, total_steps: int | None = None,
                 lr_schedule: str = "constant", min_lr_ratio: float = 0.0, grad_clip: float | None = 1.0,
                 value_clip: float = 0.5, loss_agg: str = "token-mean", ppo_epochs: int = 1,
                 mini_batch_size: int | None = None, micro_batch_size: int = 16,
                 max_tokens_per_micro_batch: int | None = None, seed: int = 0,
                 device: str | None = None) -> None:
        if loss_agg not in losses.AGG_MODES:
            raise ValueError(f"unknown loss_agg {loss_agg!r}; valid: {', '.join(losses.AGG_MODES)}")
        torch.manual_seed(seed)
        model = ValueModel.from_pretrained(model_path, dtype="float32", attn_impl=attn_impl,
                                           gradient_checkpointing=gradient_checkpointing, seed=seed)
        self.trained = TrainedModel(
            model, dtype=dtype, device=device, lr=lr, weight_decay=weight_decay, betas=betas,
            warmup_steps=warmup_steps, total_steps=total_steps, lr_schedule=lr_schedule,
            min_lr_ratio=min_lr_ratio, grad_clip=grad_clip, ppo_epochs=ppo_epochs,
            mini_batch_size=mini_batch_size, micro_batch_size=micro_batch_size,
            max_tokens_per_micro_batch=max_tokens_per_micro_batch)
        self.model, self.device = self.trained.model, self.trained.device
        self.value_clip, self.loss_agg, self.micro_batch_size = value_clip, loss_agg, micro_batch_size

    def _forward(self, micro: Batch) -> torch.Tensor:
        """`(b, R)` float32 values, 0 on padded response positions."""
        prompt_ids, responses = micro[PROMPT_IDS].to(self.device), micro[RESPONSES].to(self.device)
        response_mask = micro[RESPONSE_MASK].to(self.device)
        input_ids, attention_mask, position_ids = sequence_inputs(
            prompt_ids, micro[PROMPT_MASK].to(self.device), responses, response_attention(micro).to(self.device))
        P, R = prompt_ids.shape[1], responses.shape[1]
        with self.trained.compute():
            values = self.model(input_ids, attention_mask, position_ids)[:, P - 1:P - 1 + R]
        return values * response_mask

    @torch.no_grad()
    def values(self, batch: Batch) -> Batch:
        """`Batch[values (B, R)]`, float32 on CPU."""
        self.model.eval()
        columns = batch.select_columns(SEQUENCE_COLUMNS)
        micros = columns.micro_batches(self.micro_batch_size, self.trained.max_tokens_per_micro_batch)
        width = columns[RESPONSES].shape[1]
        out = [pad_right(self._forward(micro).cpu(), width) for micro, is_dummy in
               lockstep(micros, lambda: dummy_row(columns)) if not is_dummy]
        return Batch({VALUES: torch.cat(out) if out else torch.zeros(0, width)})

    def _value_loss(self, micro: Batch) -> MicroResult:
        values = self._forward(micro)
        loss, stats = losses.value_loss(values=values, old_values=micro[VALUES].to(self.device),
                                        returns=micro[RETURNS].to(self.device),
                                        response_mask=micro[RESPONSE_MASK].to(self.device),
                                        clip=self.value_clip, agg=self.loss_agg)
        return MicroResult(loss=loss, loss_terms={"vf_loss": loss.detach()}, token_stats=stats)

    def update(self, batch: Batch) -> dict[str, float]:
        """Clipped value-loss epochs on this rank's shard (needs `values` and `returns`).

        Returns:
            `critic/vf_loss`, `critic/vf_clipfrac`, `critic/grad_norm`, `critic/lr`,
            `critic/skipped_steps` (global over ranks), `critic/empty_updates` (1: no rank had a
            row, so no optimizer step was made).
        """
        needed = [*SEQUENCE_COLUMNS, VALUES, RETURNS]
        missing = [c for c in needed if c not in batch and c != RESPONSE_ATTENTION]
        if missing:
            raise MissingColumn(f"CriticWorker.update needs columns {missing}; the batch has {batch.columns()}")
        metrics = self.trained.train(batch.select_columns(needed), self._value_loss, mask_key=RESPONSE_MASK,
                                     loss_agg=self.loss_agg)
        return {f"critic/{k}": v for k, v in metrics.items()}

    def save_checkpoint(self, path: str | Path) -> None:
        self.trained.save(path)

    def load_checkpoint(self, path: str | Path) -> None:
        self.trained.load(path)

    def save_pretrained(self, path: str | Path) -> None:
        """Body in HF format + `value_head.safetensors` (rank 0 writes; all ranks must call)."""
        keep = rank() == 0  # other ranks only take part in the all-gathers
        buckets = iter_weight_buckets(self.model, 64 << 20)
        state = {name: t.cpu() for bucket in buckets for name, t in bucket if keep}
        if keep:
            self.model.save_pretrained(path, state_dict=state)
