"""Actor tasks: what one call asks an actor to do, and the data plumbing the coordinator runs.

A `Task` is a small picklable description: which operation, which role/method, and how to
build the call's arguments from constants and the values of upstream tasks (`Arg`). Callers
pass upstream values *positionally* after the task, so keyword arguments may come from
upstream values even though Ray Compiled Graphs only bind positional ones. This module knows
nothing about graphs: `raygraph.graph` lowers a workflow's graph into these tasks.

The coordinator functions (`scatter`, `gather`, `apply`) see whole batches; they run on a small
coordinator actor, never on the driver.
"""

from __future__ import annotations

import numbers
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from raygraph.batch import SHARD, Batch
from raygraph.cluster.weights import combine_stats

__all__ = ["Arg", "Task", "resolve", "scatter", "merge_shards", "gather", "run_whole", "combine_sync", "with_status",
           "OK", "INPUT", "WHOLE_OPS"]

OK = True   # the status value interpreted execution returns next to every task's result
INPUT = ("input", 0)   # the value id of a plan's input (other ids: (task index, result index))
WHOLE_OPS = ("scatter", "gather", "apply", "weights_combine")   # whole-batch plumbing, not role calls
WEIGHT_OPS = ("weights_local", "weights_send", "weights_recv", "weights_drain")   # RoleHost methods


@dataclass(frozen=True)
class Arg:
    """A constant (`const`) or the `index`-th upstream value passed to the task."""

    const: Any = None
    index: int | None = None


@dataclass(frozen=True)
class Task:
    """One operation on one actor.

    Args:
        op: "call" (worker method), "scatter", "gather", "apply", a weight-sync op
            ("weights_local", "weights_send", "weights_recv", "weights_combine"), or "plan"
            (a whole plan run in one actor: `extra["ops"]` lists `(task, input ids, output ids)`,
            `extra["outputs"]` the value ids returned).
        role, method, rank: what runs (for "call") and how errors name it.
        args, kwargs: argument templates resolved against the upstream values.
        n_out: number of results (scatter returns one per shard).
        groups: for "gather": how many consecutive upstream values form each input (its shards).
        fn: for "apply": the module-level function to run.
        extra: operation-specific constants (e.g. weight-sync options).
        status: also return `OK` as a last result (interpreted execution watches these).
    """

    op: str
    role: str = ""
    method: str = ""
    rank: int = 0
    args: tuple[Arg, ...] = ()
    kwargs: dict[str, Arg] = field(default_factory=dict)
    n_out: int = 1
    groups: tuple[int, ...] = ()
    fn: Callable | None = None
    extra: dict[str, Any] = field(default_factory=dict)
    status: bool = False

    @property
    def label(self) -> str:
        """Task name on the dashboard: `rollout.generate`, `apply:compute_advantages`, `scatter`."""
        if self.role:
            return f"{self.role}.{self.method}"
        return f"{self.op}:{self.method}" if self.method else self.op


def resolve(task: Task, values: Sequence[Any]) -> tuple[list[Any], dict[str, Any]]:
    """The positional and keyword arguments of `task`, given the upstream `values`."""
    def one(a: Arg) -> Any:
        return a.const if a.index is None else values[a.index]

    return [one(a) for a in task.args], {k: one(a) for k, a in task.kwargs.items()}


def with_status(task: Task, out: Any) -> Any:
    """What an actor returns for `task`: `out`, plus `OK` as a last result when `task.status`."""
    if not task.status:
        return out
    return (*out, OK) if task.n_out > 1 else (out, OK)


def run_whole(task: Task, values: Sequence[Any]) -> Any:
    """Run a whole-batch task (`WHOLE_OPS`) on its upstream values; a tuple when `n_out > 1`."""
    if task.op == "scatter":
        parts = scatter(merge_shards(values), task.n_out)
        return tuple(parts) if task.n_out > 1 else parts[0]
    if task.op == "gather":
        return gather(values, task.groups)
    if task.op == "apply":
        args, kwargs = resolve(task, values)
        return task.fn(*args, **kwargs)
    if task.op == "weights_combine":
        return combine_sync(values)
    raise ValueError(f"not a whole-batch task op: {task.op!r}")


def combine_sync(values: Sequence[Any]) -> dict:
    """One `weights/*` dict from the sender's and receivers' reports of one weight sync."""
    reports = [v for v in values if isinstance(v, dict) and ("sender" in v or "receiver" in v)]
    sender = next((r["sender"] for r in reports if r.get("sender")), {})
    receivers = [r["receiver"] for r in reports if "receiver" in r]
    return combine_stats(sender, receivers)


def scatter(value: Any, parts: int) -> list[Any]:
    """Split a Batch over `parts` ranks, keeping prompt groups together; replicate anything else.

    Each share of a Batch says which share of which scatter it is (meta `SHARD`)."""
    if isinstance(value, Batch):
        round_id = uuid.uuid4().hex
        shares = value.chunk_by_group(parts)
        for rank, share in enumerate(shares):
            share.meta[SHARD] = {"round": round_id, "rank": rank, "world": parts}
        return shares
    return [value] * parts


def merge_shards(shards: Sequence[Any]) -> Any:
    """One value from per-rank values: Batches concatenated, dicts averaged per key."""
    shards = list(shards)
    if len(shards) == 1:
        return shards[0]
    if all(isinstance(s, Batch) for s in shards):
        return Batch.concat(shards)
    if all(isinstance(s, dict) for s in shards):
        return _mean_dicts(shards)
    if all(s is None for s in shards):
        return None
    return shards


def _mean_dicts(dicts: Sequence[dict]) -> dict:
    out: dict[str, Any] = {}
    for key in dicts[0]:
        vals = [d[key] for d in dicts if key in d]
        if all(isinstance(v, numbers.Real) and not isinstance(v, bool) for v in vals):
            out[key] = float(sum(vals) / len(vals))
        else:
            out[key] = vals[0]
    return out


def gather(values: Sequence[Any], groups: Sequence[int]) -> Any:
    """Merge each input's shards, then union the inputs (Batch columns; dict keys).

    Args:
        values: all shards of all inputs, input after input.
        groups: the number of shards of each input.
    """
    merged, start = [], 0
    for n in groups:
        merged.append(merge_shards(values[start:start + n]))
        start += n
    out = merged[0]
    for nxt in merged[1:]:
        if isinstance(out, Batch) and isinstance(nxt, Batch):
            out = out.union(nxt)
        elif isinstance(out, dict) and isinstance(nxt, dict):
            out = {**out, **nxt}
        else:
            raise TypeError(f"cannot gather a {type(out).__name__} with a {type(nxt).__name__}; "
                            "gather Batches with Batches and metric dicts with dicts")
    return out
