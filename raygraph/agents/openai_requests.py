"""OpenAI-style requests as token ids, and model turns as OpenAI-style responses
(`raygraph.agents.endpoint` serves them for `raygraph.agents.program`).

What a request may ask for, and what is refused (a 400 whose message says why):

* `messages` (chat) are rendered with the policy's chat template and the generation prompt, then
  tokenized as they are (no special tokens added): the exact ids the engine sees are recorded.
  A completion's `prompt` is a string (tokenized as a raw prompt, with the tokenizer's BOS) or a
  list of token ids (used as they are).
* `max_tokens` / `max_completion_tokens` lower the turn's budget; they never raise it past
  `rollout.agent.max_new_tokens` or the room left in `max_total_tokens`.
* `temperature` and `top_p` are accepted when they are the run's own (`rollout.temperature`,
  `rollout.top_p`) or left out: a turn sampled otherwise would not be the distribution trained on.
* Refused: `n` > 1 (send n requests, each is recorded), `stream`, `stop`, `seed` (the run seeds
  every turn for reproducibility), penalties, `logit_bias`, `top_k`, `min_p`, `top_logprobs` > 0,
  `tools` / `functions` / `response_format` other than text (describe tools in the messages and
  parse the answer in the program).
* `logprobs` are always recorded; a request with `logprobs` gets the sampled tokens' log-probs.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from raygraph.agents.endpoint import RequestRefused

__all__ = ["TurnRequest", "parse_request", "response_body"]

# key -> the value that changes nothing (None: any value given is refused)
_REFUSED = {"n": 1, "stream": False, "stop": None, "seed": None, "presence_penalty": 0, "frequency_penalty": 0,
            "repetition_penalty": 1, "logit_bias": None, "top_k": -1, "min_p": 0, "top_logprobs": 0,
            "best_of": 1, "tools": None, "tool_choice": "none", "functions": None, "function_call": "none",
            "suffix": None}
_WHY = {"n": "send n requests instead (each one is recorded)",
        "seed": "raygraph seeds every turn itself so that runs resume exactly",
        "tools": "describe the tools in the messages and parse the model's answer in the program",
        "functions": "describe the tools in the messages and parse the model's answer in the program",
        "stream": "responses come whole"}


@dataclass
class TurnRequest:
    """One request as the engine sees it."""
    kind: str                 # "chat" or "completion"
    prompt: list[int]
    max_tokens: int | None    # what the client asked for (None: the run's budget)
    logprobs: bool            # the client wants the log-probs back
    model: str


def parse_request(kind: str, body: dict, tokenizer: Any, chat_template_kwargs: dict,
                  temperature: float, top_p: float) -> TurnRequest:
    """The token ids and budget of a request, or `RequestRefused` saying what it asks that the run
    cannot honour."""
    _check_sampling(body, temperature, top_p)
    if kind == "chat":
        prompt = _chat_ids(body.get("messages"), tokenizer, chat_template_kwargs)
        wants_logprobs = bool(body.get("logprobs"))
    else:
        prompt = _completion_ids(body.get("prompt"), tokenizer)
        wants_logprobs = body.get("logprobs") is not None
    cap = body.get("max_completion_tokens", body.get("max_tokens"))
    if cap is not None and (not isinstance(cap, int) or isinstance(cap, bool) or cap < 1):
        raise RequestRefused(f"max_tokens must be a positive integer, got {cap!r}")
    return TurnRequest(kind, prompt, cap, wants_logprobs, str(body.get("model") or "policy"))


def _check_sampling(body: dict, temperature: float, top_p: float) -> None:
    for key, neutral in _REFUSED.items():
        value = body.get(key)
        if value is None or value == neutral or (key in ("stop", "logit_bias", "tools", "functions") and not value):
            continue
        raise RequestRefused(f"{key}={value!r} is not supported by raygraph's training endpoint: "
                             f"{_WHY.get(key, 'it would change the distribution that is trained on')}")
    for key, run_value in (("temperature", temperature), ("top_p", top_p)):
        value = body.get(key)
        if value is not None and abs(float(value) - run_value) > 1e-6:
            raise RequestRefused(f"{key}={value} differs from the run's ({run_value}, rollout.{key}): a turn "
                                 "sampled otherwise is not the distribution trained on; leave it out")
    form = body.get("response_format")
    if form is not None and form != {"type": "text"}:
        raise RequestRefused(f"response_format={form!r} is not supported (constrained decoding changes the "
                             "distribution trained on): parse the answer in the program")


def _chat_ids(messages: Any, tokenizer: Any, kwargs: dict) -> list[int]:
    if not isinstance(messages, list) or not messages:
        raise RequestRefused("messages must be a non-empty list of {role, content} objects")
    plain = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise RequestRefused(f"messages[{i}] is not a {{role, content}} object: {m!r}")
        content = m.get("content")
        if isinstance(content, list):   # content parts: text only
            if any(not isinstance(p, dict) or p.get("type") != "text" for p in content):
                raise RequestRefused(f"messages[{i}]: only text content parts are supported")
            content = "".join(p.get("text", "") for p in content)
        if content is not None and not isinstance(content, str):
            raise RequestRefused(f"messages[{i}].content must be text, got {type(content).__name__}")
        plain.append({"role": m["role"], "content": content or ""})
    try:
        text = tokenizer.apply_chat_template(plain, tokenize=False, add_generation_prompt=True, **kwargs)
    except Exception as exc:  # noqa: BLE001 - the template's own error, passed to the client
        raise RequestRefused(f"the chat template refused these messages: {type(exc).__name__}: {exc}") from exc
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def _completion_ids(prompt: Any, tokenizer: Any) -> list[int]:
    if isinstance(prompt, str) and prompt:
        return tokenizer(prompt, add_special_tokens=True)["input_ids"]
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        vocab = len(tokenizer)
        if not all(0 <= t < vocab for t in prompt):
            raise RequestRefused(f"prompt token ids must lie in [0, {vocab})")
        return list(prompt)
    raise RequestRefused("prompt must be a non-empty string or a non-empty list of token ids (one prompt per request)")


def response_body(request: TurnRequest, prompt: Sequence[int], tokens: Sequence[int], logprobs: Sequence[float],
                  text: str, finish: str, tokenizer: Any) -> dict:
    """The OpenAI-style response of one model turn; `raygraph` holds the exact token ids."""
    usage = {"prompt_tokens": len(prompt), "completion_tokens": len(tokens), "total_tokens": len(prompt) + len(tokens)}
    pieces = [tokenizer.decode([t]) for t in tokens] if request.logprobs else []
    if request.kind == "chat":
        choice = {"index": 0, "finish_reason": finish, "message": {"role": "assistant", "content": text},
                  "logprobs": {"content": [{"token": p, "logprob": lp, "bytes": list(p.encode()), "top_logprobs": []}
                                           for p, lp in zip(pieces, logprobs)]} if request.logprobs else None}
        kind = "chat.completion"
    else:
        choice = {"index": 0, "finish_reason": finish, "text": text,
                  "logprobs": {"tokens": pieces, "token_logprobs": list(logprobs), "top_logprobs": None,
                               "text_offset": None} if request.logprobs else None}
        kind = "text_completion"
    return {"id": f"rg-{uuid.uuid4().hex[:16]}", "object": kind, "created": int(time.time()), "model": request.model,
            "choices": [choice], "usage": usage,
            "raygraph": {"prompt_token_ids": list(prompt), "completion_token_ids": list(tokens)}}
