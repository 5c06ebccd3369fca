"""What the driver needs back from a step, as a typed report the graph builder appends to every graph.

A workflow's outputs are metric dicts, for people. What the driver acts on travels apart, in a
`StepReport` that `with_report` adds as the graph's last output, so no workflow can forget it and
no control value hides among display numbers:

    weight_version   the version the rollout ranks hold after the step's weight sync (None: the
                     graph syncs no weights)
    kl_in_reward     mean KL of the batch the advantages were computed on, for the adaptive KL
                     controller (None: the graph computes no advantages)
    prompt_batches   prompt batches the trained rows came from: 1 plus the extra batches used
    records          the rows the driver asked for with `meta[DUMP_ROWS]`, as text records

The report's inputs are found in the graph, from one table of the whole-batch functions that
leave these facts on a batch (`_FACT_SOURCES`); `GraphFacts` says what a graph provides, and
`require` turns a fact the run depends on into a build-time error when the graph lacks it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from raygraph.batch import PROMPT_BATCHES_USED, Batch
from raygraph.graph import dapo, step_metrics, whole_batch
from raygraph.graph.builder import GraphBuildError
from raygraph.graph.nodes import ApplyNode, CallNode, DAGNode, MultiOutputNode, SyncNode

__all__ = ["StepReport", "GraphFacts", "graph_facts", "with_report", "split_report", "step_report"]

# whole-batch function -> the report facts its output batch carries in `meta` (or, for the
# metric functions in _INPUT_SOURCES, the batch they describe: their first argument)
_FACT_SOURCES = {
    whole_batch.compute_advantages: ("kl_in_reward",),
    dapo.filter_groups: ("prompt_batches",),
    dapo.add_round: ("prompt_batches",),
    step_metrics.rollout_metrics: ("records",),
    step_metrics.validation_metrics: ("records",),
}
_INPUT_SOURCES = {step_metrics.rollout_metrics, step_metrics.validation_metrics}


@dataclass(frozen=True)
class StepReport:
    """What one run of a step graph tells the driver (see the module docstring)."""

    weight_version: int | None = None
    kl_in_reward: float | None = None
    prompt_batches: int = 1
    records: list = field(default_factory=list)


@dataclass(frozen=True)
class GraphFacts:
    """What a graph provides and needs, derived from its nodes (never declared by hand).

    Attributes:
        extra_prompt_batches: extra prompt batches the graph reads (`refill_prompts` rounds); the
            driver attaches that many to each step's prompts.
        provides: the report's facts some node of the graph computes (`_FACT_SOURCES`).
        applies: the names of the whole-batch functions the graph applies.
        calls: the role methods the graph calls, as "role.method".
    """

    extra_prompt_batches: int = 0
    provides: frozenset = frozenset()
    applies: frozenset = frozenset()
    calls: frozenset = frozenset()

    def require(self, what: str, because: str) -> None:
        """Raise `GraphBuildError` unless the graph provides the fact `what` or applies the
        whole-batch function of that name; `because` says which setting needs it."""
        if what not in self.provides | self.applies:
            raise GraphBuildError(f"{because}, but the workflow's graph has no {what} (it applies: "
                                  f"{', '.join(sorted(self.applies)) or 'no whole-batch function'})")


def _nodes(dag: DAGNode) -> list[DAGNode]:
    seen, order, stack = set(), [], [dag]
    while stack:
        node = stack.pop()
        if id(node) in seen:
            continue
        seen.add(id(node))
        order.append(node)
        stack.extend(node._deps())
    return order


def graph_facts(dag: DAGNode) -> GraphFacts:
    """The `GraphFacts` of `dag`."""
    applies = [n for n in _nodes(dag) if isinstance(n, ApplyNode)]
    rounds = [n.kwargs.get("round", 0) for n in applies if n.fn is dapo.refill_prompts]
    return GraphFacts(extra_prompt_batches=max(rounds, default=0),
                      provides=frozenset(f for n in applies for f in _FACT_SOURCES.get(n.fn, ())),
                      applies=frozenset(n.fn.__name__ for n in applies),
                      calls=frozenset(f"{n.role}.{n.method}" for n in _nodes(dag) if isinstance(n, CallNode)))


def with_report(dag: DAGNode) -> MultiOutputNode:
    """`dag` with a `StepReport` node appended as its last output (`split_report` takes it off)."""
    outputs = list(dag.outputs) if isinstance(dag, MultiOutputNode) else [dag]
    nodes = _nodes(dag)
    found = [n.args[0] if n.fn in _INPUT_SOURCES else n for n in nodes
             if isinstance(n, ApplyNode) and n.fn in _FACT_SOURCES]
    sources = list({id(n): n for n in found}.values())   # a batch both computed and described: once
    syncs = [n for n in nodes if isinstance(n, SyncNode)]
    report = ApplyNode(step_report, (*sources, *syncs), {"n_batches": len(sources)})
    return MultiOutputNode([*outputs, report])


def split_report(outputs: list) -> tuple[list, StepReport]:
    """(the workflow's outputs, the report) of a graph built `with_report`."""
    if not outputs or not isinstance(outputs[-1], StepReport):
        raise TypeError("the graph has no step report: build it with raygraph.graph.report.with_report")
    return outputs[:-1], outputs[-1]


def step_report(*values: Batch | dict, n_batches: int) -> StepReport:
    """The report from the batches that carry its facts (the first `n_batches` values) and the
    weight syncs' results (the rest).

    With several syncs the version is the highest (every sync of a step pushes the same update).
    `prompt_batches` is the largest count any batch carries (the last round's adds up the others).
    """
    batches, syncs = values[:n_batches], values[n_batches:]
    versions = [int(s["weights/version"]) for s in syncs if "weights/version" in s]
    kl = [float(b.meta["kl_in_reward"]) for b in batches if "kl_in_reward" in b.meta]
    used = [int(b.meta[PROMPT_BATCHES_USED]) for b in batches if PROMPT_BATCHES_USED in b.meta]
    records: list = []
    for batch in batches:   # the first batch that carries rows asked for
        rows = batch.meta.get(step_metrics.DUMP_ROWS)
        if rows and len(batch):
            records = step_metrics.sample_records(batch, rows)
            break
    return StepReport(weight_version=max(versions) if versions else None,
                      kl_in_reward=kl[-1] if kl else None, prompt_batches=max(used, default=1), records=records)
