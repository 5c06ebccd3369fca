"""LoRA adapters on a causal LM (Hu et al. 2021), built with `peft`, and the tensors they move as.

    spec = LoraSpec(rank=8, alpha=16, target_modules="all-linear")
    model = apply_lora(load_causal_lm(path), spec)       # a peft.PeftModel; only lora_A/B train
    with model.disable_adapter():                         # the base model: the RL reference
        ...

A LoRA layer computes `W x + (alpha / rank) * B A x` with `A` (rank, in) and `B` (out, rank);
`B` starts at zero, so a fresh adapter leaves the model unchanged. Three views of the weights:

* `adapter_tensors`: the adapter only, in peft's state-dict names (what a rollout engine that
  holds the same adapter structure loads; what `save_adapter` writes in PEFT format);
* `merged_tensors`: every tensor in the base model's Hugging Face names, each LoRA layer's
  weight merged (`W + (alpha / rank) B A`): a plain model for `from_pretrained` or an engine
  that cannot run adapters;
* the peft model's own parameters (training, checkpoints).

`gather` arguments turn a (possibly sharded) tensor into the full one (FSDP2's `full_tensor`;
every rank must walk the same tensors in the same order); by default tensors are used as they are.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from raygraph.errors import ConfigInvalid

__all__ = [
    "ALL_LINEAR", "LoraError", "LoraSpec", "adapter_tensors", "apply_lora", "check_lora_on_config",
    "hf_name", "is_adapter_name", "lora_layers", "merged_tensors", "save_adapter",
]

ALL_LINEAR = "all-linear"   # every nn.Linear except the output head (peft's meaning)
_PREFIX = "base_model.model."

Gather = Callable[[torch.Tensor], torch.Tensor]


class LoraError(ConfigInvalid, ValueError):
    """A LoRA setting that cannot be applied to this model (the message says which and why)."""


@dataclass(frozen=True)
class LoraSpec:
    """What `model.lora` asks for, as flat values (workers receive this, never the config).

    Args:
        rank: r, the inner dimension of each adapter (B A has rank <= r).
        alpha: scaling numerator: the update is `(alpha / rank) B A`.
        dropout: dropout on the adapter's input (training only).
        target_modules: "all-linear", or module-name suffixes (e.g. ("q_proj", "v_proj")).
    """

    rank: int
    alpha: float = 16.0
    dropout: float = 0.0
    target_modules: str | tuple[str, ...] = ALL_LINEAR

    def peft_config(self):
        from peft import LoraConfig

        targets = self.target_modules if isinstance(self.target_modules, str) else list(self.target_modules)
        return LoraConfig(r=self.rank, lora_alpha=self.alpha, lora_dropout=self.dropout,
                          target_modules=targets, bias="none", task_type="CAUSAL_LM")


def apply_lora(model: nn.Module, spec: LoraSpec) -> nn.Module:
    """Wrap `model` with LoRA adapters; base parameters are frozen, adapters trainable (float32).

    Raises:
        LoraError: a target matches no module, matches a module that is not an `nn.Linear`, or
            the rank exceeds a targeted layer's smaller dimension (then B A could not have it).
    """
    from peft import get_peft_model
    from peft.utils.error import NoMatchingPeftModuleError

    _check_targets(model, spec)
    try:
        with warnings.catch_warnings():   # peft asks the model a question transformers 5 renamed
            warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning)
            peft_model = get_peft_model(model, spec.peft_config())
    except NoMatchingPeftModuleError as exc:
        raise LoraError(f"model.lora.target_modules={_show(spec.target_modules)} matches no module of the "
                        f"model; its linear layers are named {', '.join(_linear_suffixes(model))}") from exc
    dims = {name: min(m.in_features, m.out_features) for name, m in lora_layers(peft_model).items()}
    too_small = [name for name, dim in dims.items() if spec.rank > dim]
    if too_small:
        name = min(too_small, key=dims.get)   # the tightest layer
        raise LoraError(f"model.lora.rank={spec.rank} is larger than the smaller dimension ({dims[name]}) of "
                        f"{hf_name(name)} ({len(too_small)} targeted layer(s) in all): a rank-{spec.rank} "
                        f"update cannot exist there; use rank <= {dims[name]} or target other modules")
    for name, param in peft_model.named_parameters():
        if is_adapter_name(name):
            param.data = param.data.float()   # trained: float32 master weights, as full fine-tuning
    return peft_model


def _check_targets(model: nn.Module, spec: LoraSpec) -> None:
    """Explicit targets must each name (as a suffix) at least one nn.Linear, and nothing else."""
    if isinstance(spec.target_modules, str):
        return
    modules = dict(model.named_modules())
    for target in spec.target_modules:
        hits = [m for n, m in modules.items() if n == target or n.endswith(f".{target}")]
        if not hits:
            raise LoraError(f"model.lora.target_modules: {target!r} matches no module of the model; its "
                            f"linear layers are named {', '.join(_linear_suffixes(model))}")
        kinds = sorted({type(m).__name__ for m in hits if not isinstance(m, nn.Linear)})
        if kinds:
            raise LoraError(f"model.lora.target_modules: {target!r} matches {kinds[0]} modules, not linear layers; "
                            f"raygraph trains LoRA on nn.Linear layers only: "
                            f"{', '.join(_linear_suffixes(model))}")
        if target == "lm_head" and getattr(getattr(model, "config", None), "tie_word_embeddings", False):
            raise LoraError("model.lora.target_modules: 'lm_head' is tied to the input embeddings in this model; "
                            "an adapter on it would untie them in the merged export; leave it out")


def _linear_suffixes(model: nn.Module) -> list[str]:
    return sorted({n.rsplit(".", 1)[-1] for n, m in model.named_modules() if isinstance(m, nn.Linear)})


def _show(targets: str | tuple[str, ...]) -> str:
    return repr(targets) if isinstance(targets, str) else repr(list(targets))


def lora_layers(model: nn.Module) -> dict[str, nn.Module]:
    """Module name -> peft LoRA layer, in module order."""
    from peft.tuners.lora import LoraLayer

    return {name: m for name, m in model.named_modules() if isinstance(m, LoraLayer)}


def is_adapter_name(name: str) -> bool:
    """Whether a peft parameter name belongs to an adapter (lora_A / lora_B)."""
    return ".lora_A." in name or ".lora_B." in name


def hf_name(name: str) -> str:
    """peft name -> the base model's HF name (`base_model.model.` and `.base_layer` dropped)."""
    name = name[len(_PREFIX):] if name.startswith(_PREFIX) else name
    return name.replace(".base_layer.", ".")


def _named_tensors(model: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """Parameters (tied ones once) and persistent buffers, in a fixed order."""
    persistent = set(model.state_dict().keys())
    yield from model.named_parameters()
    yield from ((n, b) for n, b in model.named_buffers() if n in persistent)


def adapter_tensors(model: nn.Module, gather: Gather = lambda t: t) -> Iterator[tuple[str, torch.Tensor]]:
    """(peft name, full tensor) of every adapter parameter (detached)."""
    for name, param in model.named_parameters():
        if is_adapter_name(name):
            yield name, gather(param.detach())


def merged_tensors(model: nn.Module, gather: Gather = lambda t: t) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF name, full tensor) of the base model with every adapter merged into its layer.

    Each merged weight is new; other tensors are the gathered (or live, unsharded) ones.
    """
    layers = {f"{name}.base_layer.weight": m for name, m in lora_layers(model).items()}
    for name, tensor in _named_tensors(model):
        if is_adapter_name(name):
            continue
        full = gather(tensor.detach())
        layer = layers.get(name)
        if layer is not None:
            full = full + _delta(layer, gather).to(full.dtype)
        yield hf_name(name), full


def _delta(layer: nn.Module, gather: Gather) -> torch.Tensor:
    """(alpha / rank) B A of a LoRA layer's active adapter, (out, in), float32."""
    key = layer.active_adapters[0]
    a = gather(layer.lora_A[key].weight.detach()).float()   # (rank, in)
    b = gather(layer.lora_B[key].weight.detach()).float()   # (out, rank)
    return (b @ a) * layer.scaling[key]


def save_adapter(model: nn.Module, path: str | Path, tensors: dict[str, torch.Tensor]) -> None:
    """Write the adapter in PEFT format (`adapter_config.json`, `adapter_model.safetensors`),
    loadable with `PeftModel.from_pretrained(base, path)`. `tensors`: `adapter_tensors` (full)."""
    model.save_pretrained(str(path), state_dict={k: v.contiguous() for k, v in tensors.items()})


def check_lora_on_config(model_config, spec: LoraSpec) -> None:
    """Apply `spec` to a weightless (meta-device) model built from a HF config; raises `LoraError`
    as `apply_lora` would on the real model, in milliseconds and without loading weights."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(model_config)
    apply_lora(model, spec)

