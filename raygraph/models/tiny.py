"""Tiny models built locally: no download, ever.

`build_tiny_lm(path)` writes a randomly initialised Qwen2 causal LM and a character-level
tokenizer (with chat template, pad and eos) via `save_pretrained`, so every code path loads it
back through the real `from_pretrained(path)`. `build_tiny_reward_model(path)` does the same for
a one-label sequence-classification model. Sizes are chosen for 2 CPU cores.
"""

from __future__ import annotations

from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import (
    AutoModelForCausalLM,
    AutoModelForSequenceClassification,
    PreTrainedTokenizerFast,
    Qwen2Config,
)

__all__ = ["build_tiny_tokenizer", "build_tiny_lm", "tiny_config", "build_tiny_reward_model", "built_size", "TINY_SIZES"]

PAD, EOS, BOS = "<|pad|>", "<|end|>", "<|start|>"
ROLE_TOKENS = ["<|system|>", "<|user|>", "<|assistant|>"]
_CHARS = list("0123456789+-*=?:.,()[]{}/\\#$%&!'\" abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ\n")

# The chat template: <|user|>text<|end|><|assistant|> ... the assistant turn ends with <|end|>.
CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}"
    "{% if m['role'] != 'assistant' or not loop.last %}<|end|>{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)

# name -> (hidden, layers, heads, kv_heads, intermediate). "tiny" is ~0.2M params + embeddings. Every
# preset has head_dim >= 32 (hidden / heads), which vLLM's CPU attention needs.
TINY_SIZES = {
    "tiny": (64, 2, 2, 1, 128),   # head_dim 32: the smallest vLLM's CPU attention accepts
    "small": (128, 4, 4, 2, 384),
    "25m": (512, 6, 8, 4, 1536),
    "100m": (768, 12, 12, 4, 3072),
    "500m": (1024, 24, 16, 8, 4096),
}


def build_tiny_tokenizer() -> PreTrainedTokenizerFast:
    """A character-level tokenizer with special tokens and a chat template, built in code."""
    specials = [PAD, EOS, BOS, *ROLE_TOKENS]
    vocab = {tok: i for i, tok in enumerate(specials + _CHARS)}
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token=PAD))
    core.pre_tokenizer = pre_tokenizers.Split(pattern="", behavior="isolated")
    core.decoder = decoders.Fuse()
    core.add_special_tokens(specials)
    tok = PreTrainedTokenizerFast(
        tokenizer_object=core, pad_token=PAD, eos_token=EOS, bos_token=BOS, unk_token=PAD,
        padding_side="left", model_max_length=4096,
    )
    tok.chat_template = CHAT_TEMPLATE
    return tok


def _qwen2_config(tok: PreTrainedTokenizerFast, size: str, **overrides) -> Qwen2Config:
    hidden, layers, heads, kv_heads, inter = TINY_SIZES[size]
    return Qwen2Config(
        vocab_size=len(tok), hidden_size=hidden, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=kv_heads, intermediate_size=inter,
        max_position_embeddings=512, tie_word_embeddings=True,
        pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id, bos_token_id=tok.bos_token_id,
        **overrides,
    )


def tiny_config(size: str = "tiny") -> Qwen2Config:
    """The config `build_tiny_lm` would save for `size` (no weights are made)."""
    return _qwen2_config(build_tiny_tokenizer(), size)


def build_tiny_lm(path: str | Path, *, size: str = "tiny", seed: int = 0) -> Path:
    """Save a random-init Qwen2 causal LM and its tokenizer to `path`; returns the path."""
    path = Path(path)
    tok = build_tiny_tokenizer()
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(_qwen2_config(tok, size), dtype=torch.float32)
    model.generation_config.pad_token_id = tok.pad_token_id
    model.generation_config.eos_token_id = tok.eos_token_id
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return path


def build_tiny_reward_model(path: str | Path, *, size: str = "tiny", seed: int = 0) -> Path:
    """Save a random-init one-label Qwen2 sequence classifier (a reward model) to `path`."""
    path = Path(path)
    tok = build_tiny_tokenizer()
    torch.manual_seed(seed)
    config = _qwen2_config(tok, size, num_labels=1)
    model = AutoModelForSequenceClassification.from_config(config, dtype=torch.float32)
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return path


def built_size(path: str | Path) -> str | None:
    """The `TINY_SIZES` name of the model saved at `path`, "custom" if none matches, None if absent."""
    config_file = Path(path) / "config.json"
    if not config_file.is_file():
        return None
    import json

    config = json.loads(config_file.read_text())
    shape = (config.get("hidden_size"), config.get("num_hidden_layers"), config.get("num_attention_heads"),
             config.get("num_key_value_heads"), config.get("intermediate_size"))
    return next((name for name, dims in TINY_SIZES.items() if dims == shape), "custom")
