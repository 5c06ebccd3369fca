"""The vLLM rollout engine's side of adapter-only LoRA syncs: check what arrives, write it as a
PEFT adapter directory the engine loads (vLLM 0.32 loads adapters from a path only).

    slot = AdapterSlot(model_path, LoraSpec(rank=8))
    loaded, nbytes = slot.receive(buckets)       # peft names and shapes checked, every tensor required
    path = slot.write(lora_id)                   # <tmp>/<lora_id>/adapter_{config.json,model.safetensors}
    slot.drop(old_lora_id)                       # once the engine no longer serves it

The expected tensors come from the same `apply_lora` the policy uses, on a weightless
(meta-device) copy of the model: the names the policy sends (`adapter_tensors`), their shapes,
and the resolved target modules written to `adapter_config.json`.
"""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Iterable
from pathlib import Path

import torch

from raygraph.models.lora import LoraSpec, adapter_tensors, apply_lora, save_adapter

__all__ = ["AdapterSlot"]

Tensor = torch.Tensor


class AdapterSlot:
    """Receives adapter tensors and materialises them as PEFT adapter directories.

    Args:
        model_path: the base model (its HF config is read; no weights are loaded).
        spec: the policy's LoRA spec.
    """

    def __init__(self, model_path: str, spec: LoraSpec) -> None:
        from transformers import AutoConfig, AutoModelForCausalLM

        with torch.device("meta"):
            self._meta = apply_lora(AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_path)), spec)
        self.shapes = {name: tuple(t.shape) for name, t in adapter_tensors(self._meta)}
        self.bytes = 4 * sum(torch.Size(s).numel() for s in self.shapes.values())   # float32, as trained
        self._root: Path | None = None   # made at the first `write`
        self._tensors: dict[str, Tensor] = {}

    def receive(self, buckets: Iterable[list[tuple[str, Tensor]]]) -> tuple[int, int]:
        """Take one sync's buckets (each checked before any of it is kept); every adapter tensor
        must arrive. Returns `(tensors loaded, bytes received)`.

        Raises:
            KeyError: a name that is not one of this adapter's tensors.
            ValueError: a shape mismatch, or tensors missing at the end.
        """
        tensors, nbytes = {}, 0
        for bucket in buckets:
            for name, tensor in bucket:
                if name not in self.shapes:
                    raise KeyError(f"load_weights: {name!r} is not a LoRA adapter tensor of the rollout model "
                                   f"(it has {len(self.shapes)}, e.g. {next(iter(self.shapes))!r})")
                if tuple(tensor.shape) != self.shapes[name]:
                    raise ValueError(f"load_weights: {name!r} has shape {tuple(tensor.shape)}, the rollout "
                                     f"adapter expects {self.shapes[name]}")
            for name, tensor in bucket:   # copies: the policy may send its live tensors
                tensors[name] = tensor.detach().to("cpu", copy=True).contiguous()
                nbytes += tensor.numel() * tensor.element_size()
        missing = sorted(set(self.shapes) - set(tensors))
        if missing:
            raise ValueError(f"load_weights: the update lacks {len(missing)} of the adapter's {len(self.shapes)} "
                             f"tensors, e.g. {missing[:3]}; an adapter-only sync must send all of them")
        self._tensors = tensors
        return len(tensors), nbytes

    def write(self, lora_id: int) -> str:
        """The last received adapter in PEFT format under a directory of its own; returns its path."""
        if self._root is None:
            self._root = Path(tempfile.mkdtemp(prefix="raygraph-lora-"))
        path = self._root / str(lora_id)
        save_adapter(self._meta, path, self._tensors)
        return str(path)

    def drop(self, lora_id: int) -> None:
        if self._root is not None:
            shutil.rmtree(self._root / str(lora_id), ignore_errors=True)

    def close(self) -> None:
        if self._root is not None:
            shutil.rmtree(self._root, ignore_errors=True)
