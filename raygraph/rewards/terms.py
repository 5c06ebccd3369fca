"""Reward terms: one or more reward functions with weights, and what a failing call does.

    score(sample) = sum_k weight_k * f_k(response_text, ground_truth, extra_info)

A *call* is one function on one sample. Calls run inline in the reward worker (`reward.workers=0`)
or in a pool of worker processes (`raygraph.rewards.pool`, where `reward.timeout_s` bounds each
call). A call that raises, returns something that is not a number, or outlives the timeout
follows `reward.on_error` (`ON_ERROR_POLICIES`, named like `reward.on_non_finite`):

- "fail": `RewardFunctionError` naming the function, the row, the sample's uid and the cause.
  The trainer treats it like any exception in a worker (`raygraph.run.recovery`): a bug, not an
  infrastructure failure, so the run ends instead of restarting into the same error.
- "zero": that term scores 0 for the sample; the columns `reward_extra.errors` and
  `reward_extra.timeouts` count the failed calls of each sample (so the metrics `reward/errors`
  and `reward/timeouts` are failed calls per sample: with one function, the share of samples),
  and one warning per batch names the function, the cause and the first uids.

Columns: the first term's extras keep their names (`acc` feeds validation accuracy); the extras
of later terms are named `<term>/<extra>`. With named terms (`reward.functions`), each term's
unweighted score is the column `<term>/mean`, logged as `reward/<term>/mean`.
"""

from __future__ import annotations

import logging
import numbers
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from raygraph.algos.user_code import is_code_ref
from raygraph.errors import RewardFailed

__all__ = ["ON_ERROR_POLICIES", "RewardFunctionError", "RewardTerm", "Call", "Outcome", "make_terms",
           "call_one", "combine"]

log = logging.getLogger("raygraph")

ON_ERROR_POLICIES = ("fail", "zero")
BY_SOURCE = "data_source"   # the name of the one term that picks each row's reward by its data_source


class RewardFunctionError(RewardFailed, RuntimeError):
    """A reward function raised, returned a non-number or timed out (under `reward.on_error=fail`)."""


@dataclass(frozen=True)
class RewardTerm:
    """One reward function: `ref` is a registry name or `file.py:fn` (None = by data_source)."""

    name: str
    ref: str | None
    weight: float = 1.0


@dataclass(frozen=True)
class Call:
    """One function (`term`, an index into the terms) on one sample (`row` of the batch)."""

    term: int
    row: int
    text: str
    truth: Any
    info: Any
    source: Any


@dataclass
class Outcome:
    """What one call gave: a score and extras, or a failure ("TypeName: message")."""

    score: float = 0.0
    extras: dict[str, float] = field(default_factory=dict)
    failure: str | None = None
    timed_out: bool = False


def make_terms(function: str | None, functions: Sequence[Mapping[str, Any]] = ()) -> list[RewardTerm]:
    """The terms of a reward config: `functions` ({function, weight, name?} each) when given,
    otherwise the single `function` (None = by data source) with weight 1."""
    if not functions:
        return [RewardTerm(BY_SOURCE if function is None else _default_name(function), function, 1.0)]
    return [RewardTerm(f.get("name") or _default_name(f["function"]), f["function"], float(f.get("weight", 1.0)))
            for f in functions]


def _default_name(ref: str) -> str:
    return ref.rpartition(":")[2] if is_code_ref(ref) else ref


def call_one(fn_for: Callable[[Call], Callable], call: Call) -> Outcome:
    """Run one call; any exception (or a non-number) becomes the outcome's `failure`."""
    try:
        result = fn_for(call)(call.text, call.truth, call.info)
        return Outcome(_number(result.score, "score"),
                       {name: _number(value, f"extra {name!r}") for name, value in result.extras.items()})
    except Exception as exc:  # noqa: BLE001 - user code: every error is reported with the sample
        return Outcome(failure=f"{type(exc).__name__}: {exc}")


def _number(value: Any, what: str) -> float:
    if isinstance(value, numbers.Real) and not isinstance(value, bool):
        return float(value)
    if hasattr(value, "numel") and value.numel() == 1:   # a one-element tensor
        return float(value)
    raise TypeError(f"returned {value!r} ({type(value).__name__}) as the {what}; a score must be a number")


def combine(terms: Sequence[RewardTerm], outcomes: Mapping[tuple[int, int], Outcome], n: int, *,
            uids: Sequence[Any] | None, on_error: str, named: bool) -> tuple[list[float], dict[str, list[float]]]:
    """Weighted scores (n,) and extra columns from the calls' outcomes, keyed (term, row).

    Rows without outcomes (empty responses) score 0. Failures follow `on_error` (module docstring);
    `named` adds each term's `<term>/mean` column.
    """
    if on_error not in ON_ERROR_POLICIES:
        raise ValueError(f"on_error={on_error!r}; valid: {', '.join(ON_ERROR_POLICIES)}")
    failed = [(k, row, o) for (k, row), o in sorted(outcomes.items()) if o.failure is not None]
    if failed and on_error == "fail":
        raise RewardFunctionError(_describe(terms, failed, uids, n) + "; fix the function, or set "
                                  "reward.on_error=zero to score such calls 0 (counted in reward/errors, "
                                  "reward/timeouts)")
    if failed:
        log.warning("%s; scored 0 (reward.on_error=zero)", _describe(terms, failed, uids, n))
    scores, extras = [0.0] * n, {}
    for (k, row), outcome in outcomes.items():
        term = terms[k]
        scores[row] += term.weight * outcome.score
        for name, value in outcome.extras.items():
            extras.setdefault(name if k == 0 else f"{term.name}/{name}", [0.0] * n)[row] = value
    if named:
        for k, term in enumerate(terms):
            column = extras.setdefault(f"{term.name}/mean", [0.0] * n)
            for row in range(n):
                if (k, row) in outcomes:
                    column[row] = outcomes[k, row].score
    if on_error == "zero":   # always present (0 when nothing failed): every rank's batch has the same columns
        extras["errors"], extras["timeouts"] = [0.0] * n, [0.0] * n
        for _, row, outcome in failed:
            extras["timeouts" if outcome.timed_out else "errors"][row] += 1.0
    return scores, extras


def _describe(terms: Sequence[RewardTerm], failed: list, uids: Sequence[Any] | None, n: int) -> str:
    """'reward function 'x' failed for 2 calls on 8 samples: row 3 (uid 'a'): ValueError: ...; ...'"""
    first = "; ".join((f"reward function {terms[k].ref!r}" if terms[k].ref else "the data_source's reward function")
                      + f" on row {row}"
                      + (f" (uid {uids[row]!r})" if uids is not None else "") + f": {o.failure}"
                      for k, row, o in failed[:3])
    more = f" (and {len(failed) - 3} more)" if len(failed) > 3 else ""
    return f"{len(failed)} reward call(s) failed on {n} samples: {first}{more}"
