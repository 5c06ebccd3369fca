"""The frozen reference policy: log-probs of rollouts for the KL penalty / KL loss.

Never trained, so it holds no optimizer and is not sharded: every data-parallel rank keeps a
full copy and scores its own shard. It loads no tokenizer, so sharing the policy's process
(colocation) costs only the weights.
"""

from __future__ import annotations

import torch

from raygraph.batch import REF_LOGPROBS, Batch
from raygraph.models.loading import load_causal_lm
from raygraph.models.logprobs import response_logprobs
from raygraph.workers.distributed import default_device

__all__ = ["ReferenceWorker"]


class ReferenceWorker:
    """Frozen causal LM returning `ref_logprobs`.

    Args:
        model_path: local directory or hub id (usually the policy's initial checkpoint).
        dtype, attn_impl: see `raygraph.models.loading`.
        micro_batch_size: rows per forward pass.
        max_tokens_per_micro_batch: also cap a forward pass at this many padded tokens (padding
            trimmed, `Batch.micro_batches`).
        temperature: the sampling temperature (so ref and policy log-probs are comparable).
        device: default: the current CUDA device, else CPU.
    """

    def __init__(self, *, model_path: str, dtype: str = "float32", attn_impl: str = "auto",
                 micro_batch_size: int = 16, max_tokens_per_micro_batch: int | None = None,
                 temperature: float = 1.0, device: str | None = None) -> None:
        self.device = default_device(device)
        self.model = load_causal_lm(model_path, dtype=dtype, attn_impl=attn_impl).to(self.device)
        self.model.requires_grad_(False)
        self.micro_batch_size, self.temperature = micro_batch_size, temperature
        self.max_tokens_per_micro_batch = max_tokens_per_micro_batch

    @torch.no_grad()
    def logprobs(self, batch: Batch) -> Batch:
        """`Batch[ref_logprobs (B, R)]`, float32 on CPU, 0 on padded positions."""
        logprobs, _ = response_logprobs(self.model, batch, temperature=self.temperature,
                                        micro_batch_size=self.micro_batch_size,
                                        max_tokens_per_micro_batch=self.max_tokens_per_micro_batch)
        return Batch({REF_LOGPROBS: logprobs})
