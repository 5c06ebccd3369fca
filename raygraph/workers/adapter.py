"""The LoRA side of the policy worker: adapters on the model, what a weight sync sends, the export.

    adapter = PolicyAdapter(LoraSpec(rank=8), sync="adapter", dtype="bfloat16")
    model = adapter.wrap(model)               # peft model; base frozen in the compute dtype
    with adapter.reference(model): ...        # adapter disabled: the frozen base = the RL reference
    adapter.weight_buckets(model, 64 << 20)   # adapter tensors only (or merged weights, see `sync`)
    adapter.save_pretrained(model, "…/hf", tokenizer)   # merged HF model + `…/hf_adapter` (PEFT)

Memory: only the adapters have float32 master weights, gradients and AdamW moments; the frozen
base is stored in the compute dtype (float32 on CPU, bfloat16 on GPUs). FSDP2 with LoRA runs in
float32 only: with bf16 mixed precision, torch 2.13's FSDP2 reduces the adapters' gradients in
bf16 and refuses to assign them to the fp32 adapters (measured on CPU). Under FSDP2 every walk
over the tensors (`weight_buckets`, `save_pretrained`) gathers each one on every rank, so all
ranks must drain it in lockstep (as for full weights).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterable, Iterator
from pathlib import Path

import torch
from torch import nn

from raygraph.models.loading import resolve_dtype
from raygraph.models.lora import (
    LoraSpec,
    adapter_tensors,
    apply_lora,
    is_adapter_name,
    merged_tensors,
    save_adapter,
)
from raygraph.workers.distributed import full_tensor, is_distributed, rank
from raygraph.workers.weight_buckets import group_in_buckets

__all__ = ["LORA_SYNCS", "PolicyAdapter", "adapter_dir"]

log = logging.getLogger(__name__)

# What a weight sync sends: "adapter" (the receiver holds the same adapters and loads them, e.g.
# HFRolloutWorker(lora=spec)) or "merged" (full weights with the adapters merged, for an engine that
# runs none). Each rollout worker class declares which one it takes (`lora_sync`).
LORA_SYNCS = ("adapter", "merged")

Bucket = list[tuple[str, torch.Tensor]]


def adapter_dir(hf_dir: str | Path) -> Path:
    """Where `save_pretrained(…/hf)` puts the PEFT adapter: the sibling `…/hf_adapter`."""
    hf_dir = Path(hf_dir)
    return hf_dir.with_name(f"{hf_dir.name}_adapter")


class PolicyAdapter:
    """LoRA adapters of one policy rank.

    Args:
        spec: rank, alpha, dropout, target modules (`raygraph.models.lora.LoraSpec`).
        sync: what `weight_buckets` yields, one of `LORA_SYNCS`.
        dtype: the compute dtype; the frozen base is stored in it.
    """

    def __init__(self, spec: LoraSpec, *, sync: str = "adapter", dtype: str = "float32") -> None:
        if sync not in LORA_SYNCS:
            raise ValueError(f"unknown lora_sync {sync!r}; valid: {', '.join(LORA_SYNCS)}")
        self.spec, self.sync, self.dtype = spec, sync, resolve_dtype(dtype)
        if is_distributed() and self.dtype != torch.float32:
            raise ValueError(f"LoRA with several FSDP2 ranks needs dtype float32, got {dtype} (see "
                             "raygraph.workers.adapter: bf16 mixed precision fails in FSDP2's gradient reduce)")
        self.adapter_bytes = self.full_bytes = 0

    def wrap(self, model: nn.Module) -> nn.Module:
        """Adapters on `model` (float32), every other parameter frozen and cast to the compute dtype."""
        model = apply_lora(model, self.spec)
        for name, param in model.named_parameters():
            if not is_adapter_name(name):
                param.data = param.data.to(self.dtype)
        self.adapter_bytes = sum(p.numel() * p.element_size() for n, p in model.named_parameters()
                                 if is_adapter_name(n))
        self.full_bytes = sum(t.numel() * t.element_size() for _, t in merged_tensors(model, _shapes_only))
        trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
        total = sum(p.numel() for p in model.parameters())
        log.info("LoRA rank %d on %s: %d trainable of %d parameters (%.2f%%); weight sync: %s (%d bytes; "
                 "full weights: %d bytes)", self.spec.rank, self.spec.target_modules, trainable, total,
                 100 * trainable / max(total, 1), self._sync_words(), self.sync_bytes, self.full_bytes)
        return model

    def _sync_words(self) -> str:
        if self.sync == "adapter":
            return "adapter only (the rollout engine holds the same adapters)"
        return "merged weights (the rollout engine runs no adapters)"

    @property
    def sync_bytes(self) -> int:
        """Bytes one weight sync moves (before any cast)."""
        return self.adapter_bytes if self.sync == "adapter" else self.full_bytes

    def metrics(self) -> dict[str, float]:
        """`weights/lora_sync_bytes` (what each sync moves) and `weights/full_bytes` (all weights)."""
        return {"weights/lora_sync_bytes": float(self.sync_bytes), "weights/full_bytes": float(self.full_bytes)}

    @staticmethod
    def reference(model: nn.Module) -> contextlib.AbstractContextManager:
        """The frozen base model: every adapter disabled inside the block."""
        return model.disable_adapter()

    def weight_buckets(self, model: nn.Module, bucket_bytes: int,
                       dtype: torch.dtype | None = None) -> Iterator[Bucket]:
        """What a sync sends (`sync`), in buckets of about `bucket_bytes`. Adapter tensors are the
        live ones when unsharded (consume each bucket before the next optimizer step)."""
        named = adapter_tensors(model, full_tensor) if self.sync == "adapter" else merged_tensors(model, full_tensor)
        return _buckets(named, bucket_bytes, dtype)

    def save_pretrained(self, model: nn.Module, path: str | Path, tokenizer) -> None:
        """The merged model in HF format at `path` (plain `from_pretrained` loads it) and the adapter
        in PEFT format at `adapter_dir(path)`; rank 0 writes, every rank must call."""
        keep = rank() == 0
        merged = {n: t.cpu() for n, t in merged_tensors(model, full_tensor) if keep}
        adapter = {n: t.cpu() for n, t in adapter_tensors(model, full_tensor) if keep}
        if not keep:
            return
        base = model.get_base_model()
        base.save_pretrained(str(path), state_dict=merged)
        tokenizer.save_pretrained(str(path))
        save_adapter(model, adapter_dir(path), adapter)


def _shapes_only(t: torch.Tensor) -> torch.Tensor:
    """A stand-in for `full_tensor` that only needs sizes (no collective): an empty tensor of the
    global shape (DTensors report it)."""
    return torch.empty(t.shape, dtype=t.dtype, device="meta")


def _buckets(named: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int,
             dtype: torch.dtype | None) -> Iterator[Bucket]:
    cast = ((n, t.to(dtype) if dtype is not None and t.is_floating_point() and t.dtype != dtype else t)
            for n, t in named)
    return group_in_buckets(cast, bucket_bytes)
