"""What a workflow is written in, and how it runs.

    nodes.py        InputNode, MultiOutputNode and the node kinds (plain descriptions, no Ray)
    builder.py      GraphBuilder: `roles.<role>.bind(...)`, gather, apply, sync_weights; names checked
    whole_batch.py  the advantage step a graph applies to the WHOLE batch (global normalisation)
    corrections.py  importance corrections of the rollouts (engine mismatch, stale rows), whole-batch
    step_metrics.py metrics, validation accuracy and pass@k, sample records: what a step shows people
    dapo.py         DAPO batch shaping (overlong penalty, truncation mask, group filter): whole-batch too
    report.py       the typed StepReport every graph ends with (what the driver acts on), GraphFacts
    fragments.py    graph pieces the policy-gradient workflows share
    lowering.py     graph -> plan of actor tasks over running role groups (fusion of one-actor plans)
    executor.py     Executor: runs the plan each step (interpreted or Ray compiled graph)

Importing this package does not import Ray: a workflow file (and `raygraph validate`) can build
and check a graph without a cluster. `raygraph.graph.executor` is the only `ray.dag` import.
"""

from raygraph.graph import corrections, step_metrics, whole_batch
from raygraph.graph.builder import GraphBuilder, GraphBuildError
from raygraph.graph.nodes import InputNode, MultiOutputNode

__all__ = ["GraphBuilder", "GraphBuildError", "InputNode", "MultiOutputNode", "corrections", "step_metrics",
           "whole_batch"]
