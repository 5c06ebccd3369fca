"""The nodes of a workflow's per-step graph: plain descriptions, no Ray, no actors.

A node names a role and a method (`CallNode`), a whole-batch function (`ApplyNode`), a merge
of values (`GatherNode`) or a weight sync (`SyncNode`); arguments may be other nodes. Nodes are
made by a `GraphBuilder` (see `raygraph.graph.builder`), which checks role and method names
as the graph is built, and are turned into actor tasks by `raygraph.graph.lowering` against the
role groups of a running job.

Nodes are either *whole* (one value: the input, gathers, applies, syncs) or *sharded* (one
value per rank of a role).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

__all__ = ["DAGNode", "InputNode", "CallNode", "GatherNode", "ApplyNode", "SyncNode", "MultiOutputNode"]


class DAGNode:
    """A value in the per-step graph (whole, or sharded over a role's ranks)."""

    sharded = False

    def _deps(self) -> list[DAGNode]:
        return []


class InputNode(DAGNode):
    """The driver's per-step input (the prompts Batch). Use as `with InputNode() as prompts:`."""

    def __enter__(self) -> InputNode:
        return self

    def __exit__(self, *exc) -> None:
        return None


def _node_args(args: Sequence[Any], kwargs: dict[str, Any]) -> list[DAGNode]:
    return [a for a in [*args, *kwargs.values()] if isinstance(a, DAGNode)]


class CallNode(DAGNode):
    """`<role>.<method>(*args, **kwargs)` on every rank of `role` (sharded: one result per rank)."""

    sharded = True

    def __init__(self, role: str, method: str, args: Sequence[Any], kwargs: dict[str, Any]):
        self.role, self.method, self.args, self.kwargs = role, method, tuple(args), dict(kwargs)

    def _deps(self) -> list[DAGNode]:
        return _node_args(self.args, self.kwargs)


class GatherNode(DAGNode):
    """One whole value from `inputs`: shards concatenated (dicts: per-key mean), inputs unioned."""

    def __init__(self, inputs: Sequence[DAGNode]):
        if not inputs or not all(isinstance(n, DAGNode) for n in inputs):
            raise TypeError("gather takes one or more DAG nodes")
        self.inputs = tuple(inputs)

    def _deps(self) -> list[DAGNode]:
        return list(self.inputs)


class ApplyNode(DAGNode):
    """`fn(*args, **kwargs)` on whole values, run on the coordinator actor."""

    def __init__(self, fn: Callable, args: Sequence[Any], kwargs: dict[str, Any]):
        if getattr(fn, "__name__", "<lambda>") == "<lambda>" or "<locals>" in getattr(fn, "__qualname__", ""):
            raise TypeError(f"apply needs a module-level function (picklable by reference), got {fn!r}")
        self.fn, self.args, self.kwargs = fn, tuple(args), dict(kwargs)

    def _deps(self) -> list[DAGNode]:
        return _node_args(self.args, self.kwargs)


class SyncNode(DAGNode):
    """Weight sync `src` -> `dst` after `after` is computed; value: the `weights/*` stats dict."""

    def __init__(self, src: str, dst: str, after: DAGNode | None, **options: Any):
        self.src, self.dst, self.after, self.options = src, dst, after, options

    def _deps(self) -> list[DAGNode]:
        return [self.after] if self.after is not None else []


class MultiOutputNode(DAGNode):
    """The graph's outputs: a list of whole values (sharded outputs are gathered)."""

    def __init__(self, outputs: Sequence[DAGNode]):
        self.outputs = list(outputs)

    def _deps(self) -> list[DAGNode]:
        return list(self.outputs)
