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
* `tools` (function schemas) go to the chat template (`tools=`), as `rollout.agent.tools`'
  schemas do; the reply's tool calls are read with `rollout.agent.tool_parser` (hermes:
  `<tool_call>{...}</tool_call>`) and returned as `tool_calls` (the blocks taken out of `content`),
  `finish_reason` "tool_calls". Assistant messages with `tool_calls` and `tool` messages are passed
  to the template as they come (JSON-string arguments as objects). `tool_choice` may be "auto" or
  "none" (no calls are read); forcing a call would need constrained decoding.
* Refused: `n` > 1 (send n requests, each is recorded), `stream`, `stop`, `seed` (the run seeds
  every turn for reproducibility), penalties, `logit_bias`, `top_k`, `min_p`, `top_logprobs` > 0,
  `tool_choice` "required" or a named function, legacy `functions`, a `response_format` other than
  text (parse the answer in the program).
* `logprobs` are always recorded; a request with `logprobs` gets the sampled tokens' log-probs.
"""

from __future__ import annotations

import json
import re
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
            "best_of": 1, "functions": None, "function_call": "none",
            "suffix": None}
_WHY = {"n": "send n requests instead (each one is recorded)",
        "seed": "raygraph seeds every turn itself so that runs resume exactly",
        "functions": "send tools= (function schemas) instead",
        "stream": "responses come whole"}


@dataclass
class TurnRequest:
    """One request as the engine sees it."""
    kind: str                 # "chat" or "completion"
    prompt: list[int]
    max_tokens: int | None    # what the client asked for (None: the run's budget)
    logprobs: bool            # the client wants the log-probs back
    model: str
    tools: bool = False       # read tool calls from the reply (tools offered, tool_choice not "none")
    text: str | None = None   # the prompt as text (rendered messages, or the string); None: sent as ids


def parse_request(kind: str, body: dict, tokenizer: Any, chat_template_kwargs: dict,
                  temperature: float, top_p: float) -> TurnRequest:
    """The token ids and budget of a request, or `RequestRefused` saying what it asks that the run
    cannot honour."""
    _check_sampling(body, temperature, top_p)
    tools = _tools(body.get("tools"))
    if kind == "chat":
        kwargs = {**chat_template_kwargs, **({"tools": tools} if tools else {})}
        text, prompt = _chat_ids(body.get("messages"), tokenizer, kwargs)
        wants_logprobs = bool(body.get("logprobs"))
    else:
        text, prompt = _completion_ids(body.get("prompt"), tokenizer)
        wants_logprobs = body.get("logprobs") is not None
    cap = body.get("max_completion_tokens", body.get("max_tokens"))
    if cap is not None and (not isinstance(cap, int) or isinstance(cap, bool) or cap < 1):
        raise RequestRefused(f"max_tokens must be a positive integer, got {cap!r}")
    return TurnRequest(kind, prompt, cap, wants_logprobs, str(body.get("model") or "policy"),
                       tools=bool(tools) and body.get("tool_choice") != "none",
                       text=text)


def _tools(tools: Any) -> list[dict]:
    if not tools:
        return []
    if not isinstance(tools, list) or any(not isinstance(t, dict) or t.get("type") != "function"
                                          or not isinstance(t.get("function"), dict) for t in tools):
        raise RequestRefused("tools must be a list of {\"type\": \"function\", \"function\": {name, description, "
                             "parameters}} objects")
    return tools


def _check_sampling(body: dict, temperature: float, top_p: float) -> None:
    for key, neutral in _REFUSED.items():
        value = body.get(key)
        if value is None or value == neutral or (key in ("stop", "logit_bias", "functions") and not value):
            continue
        raise RequestRefused(f"{key}={value!r} is not supported by raygraph's training endpoint: "
                             f"{_WHY.get(key, 'it would change the distribution that is trained on')}")
    for key, run_value in (("temperature", temperature), ("top_p", top_p)):
        value = body.get(key)
        if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))):
            raise RequestRefused(f"{key} must be a number, got {value!r}")
        if value is not None and abs(float(value) - run_value) > 1e-6:
            raise RequestRefused(f"{key}={value} differs from the run's ({run_value}, rollout.{key}): a turn "
                                 "sampled otherwise is not the distribution trained on; leave it out")
    if body.get("tool_choice") not in (None, "auto", "none"):
        raise RequestRefused(f"tool_choice={body['tool_choice']!r} is not supported: forcing a call needs constrained "
                             "decoding, which changes the distribution trained on; use \"auto\"")
    form = body.get("response_format")
    if form is not None and form != {"type": "text"}:
        raise RequestRefused(f"response_format={form!r} is not supported (constrained decoding changes the "
                             "distribution trained on): parse the answer in the program")


def _chat_ids(messages: Any, tokenizer: Any, kwargs: dict) -> tuple[str, list[int]]:
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
        message = {"role": m["role"], "content": content or ""}
        if m.get("tool_calls"):
            message["tool_calls"] = [_tool_call(c, i) for c in m["tool_calls"]]
        message.update({k: m[k] for k in ("tool_call_id", "name") if m.get(k) is not None})
        plain.append(message)
    try:
        text = tokenizer.apply_chat_template(plain, tokenize=False, add_generation_prompt=True, **kwargs)
    except Exception as exc:  # noqa: BLE001 - the template's own error, passed to the client
        raise RequestRefused(f"the chat template refused these messages: {type(exc).__name__}: {exc}") from exc
    return text, tokenizer(text, add_special_tokens=False)["input_ids"]


def _tool_call(call: Any, i: int) -> dict:
    """An assistant message's tool call for the template: JSON-string arguments as an object."""
    function = call.get("function") if isinstance(call, dict) else None
    if not isinstance(function, dict) or not isinstance(function.get("name"), str):
        raise RequestRefused(f"messages[{i}].tool_calls: each needs a function with a name, got {call!r}")
    arguments = function.get("arguments") or {}
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError as exc:
            raise RequestRefused(f"messages[{i}].tool_calls: arguments are not JSON: {exc}") from exc
    return {"type": "function", "id": call.get("id"), "function": {"name": function["name"], "arguments": arguments}}


def _completion_ids(prompt: Any, tokenizer: Any) -> tuple[str | None, list[int]]:
    if isinstance(prompt, str) and prompt:
        ids = tokenizer(prompt, add_special_tokens=True)["input_ids"]
        plain = tokenizer(prompt, add_special_tokens=False)["input_ids"]
        added = len(ids) - len(plain)   # the text the ids stand for: the string after what the tokenizer prepends
        text = tokenizer.decode(ids[:added], skip_special_tokens=False) + prompt if ids[added:] == plain else None
        return text, ids
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        vocab = len(tokenizer)
        if not all(0 <= t < vocab for t in prompt):
            raise RequestRefused(f"prompt token ids must lie in [0, {vocab})")
        return None, list(prompt)
    raise RequestRefused("prompt must be a non-empty string or a non-empty list of token ids (one prompt per request)")


_HERMES_BLOCK = re.compile(r"<tool_call>.*?</tool_call>", re.DOTALL)


def response_body(request: TurnRequest, prompt: Sequence[int], tokens: Sequence[int], logprobs: Sequence[float],
                  text: str, finish: str, tokenizer: Any, tool_calls: Sequence[Any] = ()) -> dict:
    """The OpenAI-style response of one model turn; `raygraph` holds the exact token ids.
    `tool_calls` are the reply's parsed calls (`raygraph.agents.tools.ToolCall`, none malformed)."""
    usage = {"prompt_tokens": len(prompt), "completion_tokens": len(tokens), "total_tokens": len(prompt) + len(tokens)}
    pieces = [tokenizer.decode([t]) for t in tokens] if request.logprobs else []
    message = {"role": "assistant", "content": text}
    if tool_calls:
        content = _HERMES_BLOCK.sub("", text).strip()
        message = {"role": "assistant", "content": content or None,
                   "tool_calls": [{"id": f"call_{uuid.uuid4().hex[:12]}", "type": "function",
                                   "function": {"name": c.name, "arguments": json.dumps(c.arguments)}}
                                  for c in tool_calls]}
        finish = "tool_calls"
    if request.kind == "chat":
        choice = {"index": 0, "finish_reason": finish, "message": message,
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
