"""Built-in rule rewards and the default registry `REWARDS`.

Every function scores 1.0 for a correct final answer and 0.0 otherwise, and reports the same
two extras so that mixed-source batches have uniform columns:

- ``acc``: 1.0 when the answer is correct.
- ``format_ok``: 1.0 when the response had the expected answer format.

| name | data sources | rule |
| --- | --- | --- |
| ``toy_arith`` | toy_arith | the stripped response equals the ground truth exactly ("7" for "3+4=") |
| ``gsm8k`` | openai/gsm8k, gsm8k | strict: the number after the LAST ``####``; no ``####`` scores 0 |
| ``gsm8k_flexible`` | (by name only) | as ``gsm8k``, falling back to the last number in the text |
| ``math_boxed`` | math, lighteval/MATH, ... | content of the last ``\\boxed{}`` equals the ground truth after light normalisation |
| ``word_problems`` | word_problems | 1 for a correct ``#### <n>`` final line, 0.5 for the format alone (one ``####``, on the last line) |

GSM8K is strict by default (as verl's default): the prompt asks for ``####``, and rewarding
the last number instead teaches the policy to stop following the format.
"""

from __future__ import annotations

import re
from decimal import Decimal, InvalidOperation

from raygraph.rewards.registry import RewardRegistry, RewardResult

__all__ = ["REWARDS", "toy_arith", "gsm8k", "gsm8k_flexible", "math_boxed", "word_problems",
           "last_boxed", "normalize_math"]

REWARDS = RewardRegistry()

_INT = re.compile(r"-?\d+")
_NUMBER = r"-?\d[\d,]*(?:\.\d+)?"
_HASH_ANSWER = re.compile(r"####\s*\$?\s*(" + _NUMBER + ")")
_ANY_NUMBER = re.compile(_NUMBER)


def _result(correct: bool, format_ok: bool) -> RewardResult:
    return RewardResult(float(correct), {"acc": float(correct), "format_ok": float(format_ok)})


def _same_number(a: str, b: str) -> bool:
    """Numeric equality of two decimal strings ("18.00" == "18"); string equality otherwise."""
    a, b = a.replace(",", "").strip().rstrip("."), b.replace(",", "").strip().rstrip(".")
    try:
        return Decimal(a) == Decimal(b)
    except InvalidOperation:
        return a == b


@REWARDS.register("toy_arith", sources=("toy_arith",))
def toy_arith(response_text: str, ground_truth: str, extra_info: dict | None = None) -> RewardResult:
    """Exact match of the whole (stripped) response with the integer answer."""
    text = response_text.strip()
    return _result(text == str(ground_truth).strip(), _INT.fullmatch(text) is not None)


@REWARDS.register("gsm8k", sources=("openai/gsm8k", "gsm8k"))
def gsm8k(response_text: str, ground_truth: str, extra_info: dict | None = None) -> RewardResult:
    """Strict GSM8K: the number after the last ``####`` must equal the ground truth."""
    found = _HASH_ANSWER.findall(response_text)
    if not found:
        return _result(False, False)
    return _result(_same_number(found[-1], str(ground_truth)), True)


@REWARDS.register("word_problems", sources=("word_problems",))
def word_problems(response_text: str, ground_truth: str, extra_info: dict | None = None) -> RewardResult:
    """Format-learning reward: the answer must be the last line, `#### <number>`, written once.

    Score: 1 when that number is the ground truth, 0.5 for the format with a wrong number, 0
    otherwise (no `####`, several, or text after it: repeating `#### n` until the length cap must
    not pay). Extras `acc` (correct and formatted) and `format_ok`.
    """
    lines = [line.strip() for line in response_text.strip().splitlines() if line.strip()]
    found = _HASH_ANSWER.fullmatch(lines[-1].rstrip(".")) if lines else None
    formatted = found is not None and response_text.count("####") == 1
    correct = formatted and _same_number(found.group(1), str(ground_truth))
    return RewardResult(1.0 if correct else 0.5 if formatted else 0.0,
                        {"acc": float(correct), "format_ok": float(formatted)})


@REWARDS.register("gsm8k_flexible")
def gsm8k_flexible(response_text: str, ground_truth: str,
                   extra_info: dict | None = None) -> RewardResult:
    """GSM8K with a fallback: without ``####`` the last number in the text is the answer."""
    strict = gsm8k(response_text, ground_truth, extra_info)
    if strict.extras["format_ok"]:
        return strict
    numbers = _ANY_NUMBER.findall(response_text)
    return _result(bool(numbers) and _same_number(numbers[-1], str(ground_truth)), False)


def last_boxed(text: str) -> str | None:
    """Content of the last ``\\boxed{...}`` (or ``\\fbox{...}``), braces balanced; else None."""
    start = max(text.rfind("\\boxed"), text.rfind("\\fbox"))
    if start < 0:
        return None
    i = text.find("{", start)
    if i < 0 or text[start:i].strip() not in ("\\boxed", "\\fbox"):
        m = re.match(r"\\boxed (\S+)", text[start:])  # "\boxed 5" form
        return m.group(1).rstrip("$.") if m else None
    depth = 0
    for j in range(i, len(text)):
        depth += {"{": 1, "}": -1}.get(text[j], 0)
        if depth == 0:
            return text[i + 1:j]
    return None


_REMOVE = ("\\left", "\\right", "\\!", "\\,", "\\;", "\\:", "$", "^\\circ", "^{\\circ}",
           "\\%", "%", "\\displaystyle")


def normalize_math(answer: str) -> str:
    """Light normalisation of a LaTeX answer: spacing, ``\\left``/``\\right``, ``$``, degree and
    percent signs, ``\\text{}`` wrappers, ``dfrac``/``tfrac``, a trailing period. No algebra."""
    s = answer.strip()
    s = re.sub(r"\\text\{(.*?)\}", r"\1", s)
    s = re.sub(r"\\mbox\{(.*?)\}", r"\1", s)
    for token in _REMOVE:
        s = s.replace(token, "")
    s = s.replace("\\dfrac", "\\frac").replace("\\tfrac", "\\frac")
    s = re.sub(r"\s+", "", s).rstrip(".")
    return s


@REWARDS.register("math_boxed", sources=("math", "lighteval/MATH",
                                         "DigitalLearningGmbH/MATH-lighteval",
                                         "HuggingFaceH4/MATH-500"))
def math_boxed(response_text: str, ground_truth: str, extra_info: dict | None = None) -> RewardResult:
    """The last ``\\boxed{}`` of the response equals the ground truth (itself unboxed if boxed)."""
    answer = last_boxed(response_text)
    if answer is None:
        return _result(False, False)
    truth = str(ground_truth)
    truth = last_boxed(truth) or truth
    a, b = normalize_math(answer), normalize_math(truth)
    return _result(a == b or _same_number(a, b), True)
