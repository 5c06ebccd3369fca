"""Prompt formatting: chat messages -> the text the model sees -> token ids.

A prompt in the dataset schema is a list of chat messages ``[{"role": ..., "content": ...}]``
(a bare string is accepted as one user message). With ``apply_chat_template=True`` the
tokenizer's own chat template renders it with the generation prompt appended, so the model's
first generated token is the assistant's first token. With ``apply_chat_template=False`` the
message contents are joined with blank lines and used verbatim (for base models).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

__all__ = ["Messages", "check_messages", "format_prompt", "encode_text"]

Messages = list[dict[str, str]]


def check_messages(prompt: Any) -> Messages | None:
    """Return `prompt` as a message list, or None when it is missing, empty or malformed.

    Accepts a non-empty string (-> one user message) or a non-empty list of mappings that each
    have string ``role`` and ``content``, at least one content being non-blank.
    """
    if isinstance(prompt, str):
        return [{"role": "user", "content": prompt}] if prompt.strip() else None
    if not isinstance(prompt, Sequence) or len(prompt) == 0:
        return None
    messages = []
    for m in prompt:
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) \
                or not isinstance(m.get("content"), str):
            return None
        messages.append({"role": m["role"], "content": m["content"]})
    if not any(m["content"].strip() for m in messages):
        return None
    return messages


def format_prompt(tokenizer: Any, messages: Messages, apply_chat_template: bool = True,
                  chat_template_kwargs: dict[str, Any] | None = None) -> str:
    """The prompt text the model is conditioned on.

    Args:
        tokenizer: a Hugging Face tokenizer (with a chat template when `apply_chat_template`).
        messages: chat messages, already checked by `check_messages`.
        apply_chat_template: render with the tokenizer's template and the generation prompt;
            otherwise join the contents with blank lines.
        chat_template_kwargs: extra variables of the template (e.g. ``enable_thinking=False``
            for Qwen3), passed to ``tokenizer.apply_chat_template``.
    """
    if not apply_chat_template:
        return "\n\n".join(m["content"] for m in messages)
    if getattr(tokenizer, "chat_template", None) is None:
        raise ValueError("apply_chat_template=True but the tokenizer has no chat template; "
                         "set apply_chat_template=False for a base model")
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True,
                                         **(chat_template_kwargs or {}))


def encode_text(tokenizer: Any, texts: list[str], add_special_tokens: bool) -> list[list[int]]:
    """Token ids of each text, without padding or truncation.

    Pass ``add_special_tokens=False`` for a rendered chat template (it already holds its BOS
    etc.) and for responses; True for a raw prompt, which gets the tokenizer's usual BOS.
    """
    if not texts:
        return []
    return tokenizer(texts, add_special_tokens=add_special_tokens, padding=False,
                     truncation=False)["input_ids"]
