"""A critic: a causal-LM body (no `lm_head`) with a linear value head, one scalar per token.

Loaded from any causal-LM checkpoint (`AutoModel.from_pretrained` keeps the transformer body
and drops `lm_head`); the head is freshly initialised unless the directory holds a
`value_head.safetensors` written by `save_pretrained`. Saved critics are therefore a plain HF
base-model directory plus one small extra file.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from safetensors.torch import load_file, save_file
from torch import nn

from raygraph.models.loading import (
    NO_HUB_KERNELS,
    enable_gradient_checkpointing,
    resolve_attn_impl,
    resolve_dtype,
)

if TYPE_CHECKING:   # imported where a model is loaded (see raygraph.models.loading)
    from transformers import PreTrainedModel

__all__ = ["VALUE_HEAD_FILE", "ValueModel"]

VALUE_HEAD_FILE = "value_head.safetensors"
_HEAD_PREFIX = "v_head."
_BODY_PREFIX = "body."


class ValueModel(nn.Module):
    """`values = v_head(body(input_ids).last_hidden_state)`, shape `(B, T)`.

    Args:
        body: a transformer base model (e.g. `Qwen2Model`) returning `last_hidden_state`.
        v_head: `nn.Linear(hidden_size, 1)`.
    """

    def __init__(self, body: PreTrainedModel, v_head: nn.Linear) -> None:
        super().__init__()
        self.body = body
        self.v_head = v_head

    @property
    def config(self):
        return self.body.config

    @classmethod
    def from_pretrained(cls, path: str | Path, dtype: str | torch.dtype = "float32", attn_impl: str = "auto",
                        gradient_checkpointing: bool = False, seed: int = 0) -> ValueModel:
        """Body from `path` (causal-LM or saved critic); head from `path` or a seeded init.

        The seeded init (`N(0, 1/(hidden+1))` weights, zero bias) is identical on every rank,
        which FSDP2 needs: each rank shards the tensor it built locally.
        """
        torch_dtype = resolve_dtype(dtype)
        from transformers import AutoModel

        body = AutoModel.from_pretrained(str(path), dtype=torch_dtype,
                                         attn_implementation=resolve_attn_impl(attn_impl), **NO_HUB_KERNELS)
        if gradient_checkpointing:
            enable_gradient_checkpointing(body)
        hidden = body.config.get_text_config().hidden_size
        v_head = nn.Linear(hidden, 1, dtype=torch_dtype)
        head_file = Path(path) / VALUE_HEAD_FILE
        if head_file.exists():
            state = {k.removeprefix(_HEAD_PREFIX): v for k, v in load_file(str(head_file)).items()}
            v_head.load_state_dict(state)
        else:
            gen = torch.Generator().manual_seed(seed)
            with torch.no_grad():
                v_head.weight.copy_(torch.randn(v_head.weight.shape, generator=gen) / math.sqrt(hidden + 1))
                v_head.bias.zero_()
        return cls(body, v_head).eval()

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                position_ids: torch.Tensor | None = None) -> torch.Tensor:
        """`(B, T)` ids -> `(B, T)` float32 values (value of the state after reading token t)."""
        hidden = self.body(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                           use_cache=False).last_hidden_state
        return self.v_head(hidden).squeeze(-1).float()

    def save_pretrained(self, path: str | Path, state_dict: dict[str, torch.Tensor] | None = None) -> None:
        """Write the body in HF format plus `value_head.safetensors`.

        Args:
            state_dict: full (unsharded) `ValueModel` state dict, e.g. gathered from FSDP
                shards; defaults to this module's own.
        """
        path = Path(path)
        state_dict = self.state_dict() if state_dict is None else state_dict
        body_sd = {k.removeprefix(_BODY_PREFIX): v for k, v in state_dict.items() if k.startswith(_BODY_PREFIX)}
        head_sd = {k: v.detach().cpu().contiguous() for k, v in state_dict.items() if k.startswith(_HEAD_PREFIX)}
        self.body.save_pretrained(path, state_dict=body_sd)
        save_file(head_sd, str(path / VALUE_HEAD_FILE))
