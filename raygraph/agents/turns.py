"""Token ids of the messages that follow a model turn, from the tokenizer's own chat template.

Token-in, token-out: an episode's token stream is exactly what the engine saw and produced. The
model's tokens are kept as generated; what comes next (the end of the assistant turn when the
model did not close it, the tool / user messages, the next assistant header) is rendered by the
chat template and tokenized ON ITS OWN, then appended. The prefix the engine already saw is never
re-tokenized, so a model that emits a non-canonical tokenization of its text, or a template that
would render history differently, cannot change what is trained.

How the appended part is found: the template renders a stand-in conversation
`[user, assistant MARK, *new messages]` with the generation prompt; the text after `MARK` is the
appended part. If the model's turn ended with a stop token whose text starts that part (the
template's end-of-turn, e.g. `<|im_end|>`), that text is dropped (the model already produced it);
if the turn was cut by a length budget, it is kept, so every turn is closed the way the template
closes it.

A template that renders the assistant turn differently once more messages follow (e.g. one that
drops earlier reasoning) cannot change what is trained either: only the appended part is rendered.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

__all__ = ["TurnTemplate"]

_USER, _MARK = "RGUSERTURN", "RGMODELTURN"


class TurnTemplate:
    """Renders what follows a model turn, as token ids.

    Args:
        tokenizer: the policy's Hugging Face tokenizer, with a chat template.
        chat_template_kwargs: extra template variables (e.g. `tools=` schemas, `enable_thinking`).
        stop_token_ids: the ids that end a model turn (eos and the configured stop ids).
    """

    def __init__(self, tokenizer: Any, chat_template_kwargs: dict | None = None,
                 stop_token_ids: Sequence[int] = ()) -> None:
        if getattr(tokenizer, "chat_template", None) is None:
            raise ValueError("multi-turn episodes need a tokenizer with a chat template (to render the "
                             "messages between turns)")
        self.tokenizer = tokenizer
        self.kwargs = dict(chat_template_kwargs or {})
        self.stop_texts = {i: tokenizer.decode([i]) for i in stop_token_ids}
        self.appended_text([{"role": "user", "content": _USER}], None)   # fails now, not mid-episode

    def _render(self, messages: list[dict], generation_prompt: bool) -> str:
        return self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt,
                                                  **self.kwargs)

    def appended_text(self, messages: Sequence[dict], last_token: int | None) -> str:
        """The text that follows a model turn whose last token is `last_token`: its end of turn
        unless the model produced it, `messages` rendered, then the next assistant header."""
        full = self._render([{"role": "user", "content": _USER}, {"role": "assistant", "content": _MARK},
                             *messages], generation_prompt=True)
        if _MARK not in full:
            raise ValueError("the chat template does not show an assistant turn's text once more messages follow "
                             "it, so the end of a model turn cannot be found; multi-turn episodes need a template "
                             "that keeps past assistant turns (set model.tokenizer_path to a tokenizer with one)")
        after = full[full.index(_MARK) + len(_MARK):]
        stop_text = self.stop_texts.get(last_token)
        if stop_text and after.startswith(stop_text):
            after = after[len(stop_text):]
        return after

    def appended_tokens(self, messages: Sequence[dict], last_token: int | None) -> list[int]:
        """`appended_text` tokenized on its own (no special tokens added)."""
        return self.tokenizer(self.appended_text(messages, last_token), add_special_tokens=False)["input_ids"]
