"""Frozen models: the reference policy (log-probs of rollouts for the KL penalty / KL loss), and
any extra frozen role a workflow declares (a distillation teacher, `extra_roles` in the config).

Never trained, so it holds no optimizer. By default every data-parallel rank keeps a full copy and
scores its own shard; with `shard=True` (and a torch.distributed group of several ranks) the model
is sharded with FSDP2 instead, so a teacher larger than one device fits: every rank then runs the
same number of forward passes (`lockstep`), since each pass all-gathers parameters. It loads no
tokenizer, so sharing the policy's process (colocation) costs only the weights.
"""

from __future__ import annotations

import torch

from raygraph.batch import REF_LOGPROBS, RESPONSES, SEQUENCE_COLUMNS, Batch, pad_right
from raygraph.models.loading import load_causal_lm
from raygraph.models.logprobs import forward_response, use_packed
from raygraph.workers.distributed import default_device, dummy_row, fsdp_wrap, is_distributed, lockstep

__all__ = ["ReferenceWorker"]


class ReferenceWorker:
    """Frozen causal LM returning the log-probs of each response token under it.

    Args:
        model_path: local directory or hub id (the reference: usually the policy's initial
            checkpoint; a teacher: any model with the policy's tokenizer).
        dtype, attn_impl: see `raygraph.models.loading`.
        micro_batch_size: rows per forward pass.
        max_tokens_per_micro_batch: also cap a forward pass at this many padded tokens (padding
            trimmed, `Batch.micro_batches`).
        temperature: the sampling temperature (so these and the policy's log-probs are comparable).
        column: the output column (`ref_logprobs` for the reference, `<role>_logprobs` for an
            extra role such as `teacher_logprobs`).
        shard: FSDP2-shard the model over the role's torch.distributed group (no effect on one rank).
        device: default: the current CUDA device, else CPU.
    """

    def __init__(self, *, model_path: str, dtype: str = "float32", attn_impl: str = "auto",
                 micro_batch_size: int = 16, max_tokens_per_micro_batch: int | None = None,
                 temperature: float = 1.0, column: str = REF_LOGPROBS, shard: bool = False,
                 device: str | None = None) -> None:
        self.device = default_device(device)
        self.model = load_causal_lm(model_path, dtype=dtype, attn_impl=attn_impl).to(self.device)
        self.model.requires_grad_(False)
        self.model.eval()
        self.sharded = shard and is_distributed()
        if self.sharded:
            fsdp_wrap(self.model)
        self.packed = use_packed(self.model, None)
        self.micro_batch_size, self.temperature, self.column = micro_batch_size, temperature, column
        self.max_tokens_per_micro_batch = max_tokens_per_micro_batch

    @torch.no_grad()
    def logprobs(self, batch: Batch) -> Batch:
        """`Batch[<column> (B, R)]`, float32 on CPU, 0 on padded positions."""
        columns = batch.select_columns(SEQUENCE_COLUMNS)
        micros = columns.micro_batches(self.micro_batch_size, self.max_tokens_per_micro_batch)
        steps = lockstep(micros, lambda: dummy_row(columns)) if self.sharded else \
            [(micro, False) for micro in micros]
        width, logprobs = columns[RESPONSES].shape[1], []
        for micro, is_dummy in steps:
            lp, _ = forward_response(self.model, micro.tensors, temperature=self.temperature, packed=self.packed)
            if not is_dummy:
                logprobs.append(pad_right(lp.float().cpu(), width))
        empty = torch.zeros(0, width)   # no rows here (an empty refill round, or a rank without a share)
        return Batch({self.column: torch.cat(logprobs) if logprobs else empty})
