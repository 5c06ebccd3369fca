"""Load Hugging Face causal LMs, reward models and tokenizers the way every role needs them.

One place decides the dtype, the attention backend and the pad/eos alignment, so the policy,
the reference, the rollout engine and the reward model all see the same conventions:

* tokenizers pad on the LEFT (prompts are left-padded; see `raygraph.batch`), and a tokenizer
  without a pad token pads with eos (a warning says so);
* the attention backend is `flash_attention_2` when it is installed and CUDA is available,
  else `sdpa`; `attn_impl=` or the environment variable `RAYGRAPH_ATTN_IMPL` overrides it;
* a reward model's `config.pad_token_id` is made equal to its tokenizer's pad id (HF sequence
  classifiers locate "the last token" with it; a mismatch silently scores the wrong token).
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from transformers import AutoTokenizer, PreTrainedTokenizerBase

if TYPE_CHECKING:   # the model classes are imported where a model is loaded: importing them takes
    # ~5 s (transformers' model loading pulls in torch.distributed.tensor, sympy, dynamo, scipy),
    # which the driver, needing only a tokenizer, never pays
    from transformers import PreTrainedModel

__all__ = [
    "ATTN_IMPL_ENV", "ATTN_IMPLS", "enable_gradient_checkpointing", "load_causal_lm", "load_reward_model", "load_tokenizer",
    "resolve_attn_impl", "resolve_dtype", "NO_HUB_KERNELS",
]

log = logging.getLogger(__name__)

ATTN_IMPL_ENV = "RAYGRAPH_ATTN_IMPL"
ATTN_IMPLS = ("auto", "sdpa", "eager", "flash_attention_2", "flash_attention_3", "flex_attention")
_DTYPES = {
    "float32": torch.float32, "fp32": torch.float32,
    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
    "float16": torch.float16, "fp16": torch.float16,
}
_logged_attn_choices: set[tuple[str, str]] = set()
# transformers >= 5.2x kernelizes a loaded model with kernels fetched from the Hub by default, on
# CUDA, when the model switches to train mode: offline or untrusted that raises (seen on an H200:
# "Kernel repository 'kernels-community/rotary' could not verify publisher trust status" from
# `model.train()`), and online it would swap the layers raygraph's numerics are checked against.
# Every model raygraph loads keeps transformers' own layers.
NO_HUB_KERNELS = {"use_kernels": False}


def resolve_dtype(dtype: str | torch.dtype) -> torch.dtype:
    """`"float32" | "fp32" | "bfloat16" | "bf16" | "float16" | "fp16"` (or a torch dtype) -> torch dtype."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in _DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; valid: {', '.join(_DTYPES)}")
    return _DTYPES[dtype]


def _flash_attn_installed() -> bool:
    try:
        import flash_attn  # noqa: F401
    except ImportError:
        return False
    return True


def resolve_attn_impl(requested: str = "auto") -> str:
    """The attention implementation to pass to `from_pretrained(attn_implementation=...)`.

    `RAYGRAPH_ATTN_IMPL` (when set and non-empty) wins over `requested`. "auto" means
    `flash_attention_2` when the `flash_attn` package is importable and CUDA is available,
    else `sdpa`. Each distinct choice is logged once per process.
    """
    env = os.environ.get(ATTN_IMPL_ENV, "").strip()
    choice = env or requested
    if choice not in ATTN_IMPLS:
        source = f"${ATTN_IMPL_ENV}" if env else "attn_impl"
        raise ValueError(f"unknown attention implementation {choice!r} (from {source}); valid: {ATTN_IMPLS}")
    resolved = choice
    if choice == "auto":
        resolved = "flash_attention_2" if torch.cuda.is_available() and _flash_attn_installed() else "sdpa"
    key = (choice, resolved)
    if key not in _logged_attn_choices:
        _logged_attn_choices.add(key)
        why = f"${ATTN_IMPL_ENV}" if env else "auto-detected" if choice == "auto" else "requested"
        log.info("attention implementation: %s (%s)", resolved, why)
    return resolved


def enable_gradient_checkpointing(model: PreTrainedModel) -> None:
    """Non-reentrant activation recomputation in the backward pass; turns the KV cache off."""
    kwargs = {"use_reentrant": False}
    if hasattr(model, "activation_checkpointing_enable"):  # transformers >= 5.x name
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    model.config.use_cache = False


def load_tokenizer(path: str | Path) -> PreTrainedTokenizerBase:
    """Tokenizer from a local path or hub id, left-padding, with a pad token guaranteed.

    Raises:
        ValueError: when the tokenizer has neither a pad nor an eos token.
    """
    tok = AutoTokenizer.from_pretrained(str(path))
    if tok.pad_token_id is None:
        if tok.eos_token is None:
            raise ValueError(f"tokenizer at {path} has neither a pad nor an eos token: add one to its "
                             "tokenizer_config.json, or set model.tokenizer_path to a tokenizer that has one")
        log.warning("tokenizer at %s has no pad token; padding with eos %r", path, tok.eos_token)
        tok.pad_token = tok.eos_token
    tok.padding_side = "left"
    return tok


def load_causal_lm(
    path: str | Path,
    dtype: str | torch.dtype = "float32",
    attn_impl: str = "auto",
    gradient_checkpointing: bool = False,
) -> PreTrainedModel:
    """`AutoModelForCausalLM.from_pretrained(path)` with raygraph's dtype/attention conventions.

    Args:
        path: local directory or hub id.
        dtype: parameter dtype, see `resolve_dtype`.
        attn_impl: see `resolve_attn_impl`.
        gradient_checkpointing: recompute activations in the backward pass (non-reentrant);
            also turns the KV cache off, which training never uses.

    Returns:
        The model on CPU, in eval mode (callers move it and switch to train mode).
    """
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        str(path), dtype=resolve_dtype(dtype), attn_implementation=resolve_attn_impl(attn_impl), **NO_HUB_KERNELS)
    if gradient_checkpointing:
        enable_gradient_checkpointing(model)
    return model.eval()


def load_reward_model(
    path: str | Path,
    dtype: str | torch.dtype = "float32",
    attn_impl: str = "auto",
    tokenizer: PreTrainedTokenizerBase | None = None,
) -> PreTrainedModel:
    """A one-label `AutoModelForSequenceClassification` (a scalar reward model), frozen, eval mode.

    `config.pad_token_id` is aligned with the tokenizer (`tokenizer`, else the one at `path`).

    Raises:
        ValueError: when the model has more than one label.
    """
    from transformers import AutoModelForSequenceClassification

    model = AutoModelForSequenceClassification.from_pretrained(
        str(path), dtype=resolve_dtype(dtype), attn_implementation=resolve_attn_impl(attn_impl), **NO_HUB_KERNELS)
    if model.config.num_labels != 1:
        raise ValueError(f"reward model at {path} has num_labels={model.config.num_labels}; expected 1")
    tok = tokenizer if tokenizer is not None else load_tokenizer(path)
    if model.config.pad_token_id != tok.pad_token_id:
        log.warning("reward model at %s: config.pad_token_id %s != tokenizer pad id %s; using the tokenizer's",
                    path, model.config.pad_token_id, tok.pad_token_id)
        model.config.pad_token_id = tok.pad_token_id
    model.requires_grad_(False)
    return model.eval()
