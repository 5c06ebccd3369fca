r"""The pieces of an LLM judge that need no model (`reward.kind=judge`, docs/rewards.md): the
judge's prompt from a template, its verdict parsed into a number, and the answer it judges.

- Template: a Python format string (`template_format: python`, fields in braces) or a Jinja
  template (`jinja`), with the fields `question` (the prompt's last user message, else the whole
  prompt), `prompt` (the prompt as the policy saw it, chat markup included), `response` (the
  answer judged: a multi-turn episode's last model turn) and `ground_truth` ("" when none).
- Parser: a regular expression whose first matching group (else its whole match) is the number, searched
  in the judge's output; or user code (`file.py:fn` or `package.module:fn`, nothing else: a
  pattern such as `Score: (\d+)` stays a pattern) taking the output text and returning a number,
  or None when it cannot read one. An output the parser reads no number from is a parse failure
  (`reward.on_error`).
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Mapping
from typing import Any

import torch

from raygraph.algos.user_code import load_function

__all__ = ["CODE_REF", "DEFAULT_PARSER", "DEFAULT_TEMPLATE", "FIELDS", "final_answer_ids", "make_parser", "make_template",
           "question_of"]

FIELDS = ("question", "prompt", "response", "ground_truth")
DEFAULT_TEMPLATE = ("Rate how well the answer solves the task, from 0 (wrong) to 10 (perfect).\n"
                    "Task: {question}\nAnswer: {response}\nReply with the number only.")
DEFAULT_PARSER = r"(-?\d+(?:\.\d+)?)"   # the first number in the output
# user code rather than a pattern: path/to/file.py:fn or package.module:fn, nothing else
CODE_REF = re.compile(r"[^\s:]+\.py:[A-Za-z_]\w*|[A-Za-z_][\w.]*:[A-Za-z_]\w*")


def make_template(template: str, template_format: str = "python") -> Callable[[Mapping[str, str]], str]:
    """`fields -> judge prompt text`. A field the template names that is not one of `FIELDS` is
    a `ValueError` here, before any row is judged."""
    if template_format == "jinja":
        import jinja2

        try:
            compiled = jinja2.Environment(undefined=jinja2.StrictUndefined).from_string(template)
        except jinja2.TemplateSyntaxError as exc:
            raise ValueError(f"reward.judge.template is not a valid Jinja template: {exc}") from exc
        unknown = sorted(_jinja_names(template) - set(FIELDS))
        render: Callable[[Mapping[str, str]], str] = lambda fields: compiled.render(**fields)  # noqa: E731
    elif template_format == "python":
        try:
            fields = [name for _, name, _, _ in _python_fields(template) if name is not None]
        except ValueError as exc:
            raise ValueError(f"reward.judge.template is not a valid format string: {exc}") from exc
        names = {name.split(".")[0].split("[")[0] for name in fields}
        unknown = sorted(names - set(FIELDS))
        if "" in names or any(name.isdigit() for name in names):
            raise ValueError("reward.judge.template has a positional field ({} or {0}); name the field, e.g. "
                             "{response}")
        render = lambda fields: template.format(**fields)  # noqa: E731
    else:
        raise ValueError(f"unknown template_format {template_format!r}; valid: python, jinja")
    if unknown:
        raise ValueError(f"reward.judge.template names {unknown}, which are not fields of a judged row; "
                         f"the fields are {list(FIELDS)}")
    return render


def _python_fields(template: str):
    import string

    return list(string.Formatter().parse(template))


def _jinja_names(template: str) -> set[str]:
    import jinja2
    from jinja2 import meta

    return set(meta.find_undeclared_variables(jinja2.Environment().parse(template)))


def make_parser(spec: str) -> Callable[[str], float | None]:
    """`judge output -> score or None` from a regex or a `file.py:fn` reference (module docstring)."""
    if CODE_REF.fullmatch(spec):
        fn = load_function(spec)
        return lambda text: _number(fn(text))
    try:
        pattern = re.compile(spec)
    except re.error as exc:
        raise ValueError(f"reward.judge.parser {spec!r} is neither file.py:fn nor a valid regular expression: "
                         f"{exc}") from exc

    def parse(text: str) -> float | None:
        found = pattern.search(text)
        if found is None:
            return None
        groups = [g for g in found.groups() if g is not None]   # the first group that matched
        try:
            return _number(float(groups[0] if pattern.groups else found.group(0)))
        except (IndexError, TypeError, ValueError):
            return None
    return parse


def _number(value: Any) -> float | None:
    """A finite float, or None (the parser read no number)."""
    if value is None or isinstance(value, bool):
        return None
    try:
        out = float(value)
    except (TypeError, ValueError):
        return None
    return out if math.isfinite(out) else None


def final_answer_ids(response: torch.Tensor, mask: torch.Tensor) -> list[int]:
    """The token ids of the last run of model tokens of one row (mask 1): the whole response of a
    single-turn row, the last model turn of a multi-turn episode."""
    idx = torch.nonzero(mask).flatten().tolist()
    if not idx:
        return []
    start = len(idx) - 1
    while start > 0 and idx[start - 1] == idx[start] - 1:
        start -= 1
    return response[idx[start]:idx[-1] + 1].tolist()


def question_of(messages: Any, prompt_text: str) -> str:
    """The prompt's last user message (chat prompts), else the prompt text."""
    if isinstance(messages, (list, tuple)):
        users = [m.get("content") for m in messages if isinstance(m, Mapping) and m.get("role") == "user"]
        if users and isinstance(users[-1], str):
            return users[-1]
    return prompt_text
