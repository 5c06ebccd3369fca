"""Validation: greedy decoding of the held-out prompts, scored by the reward role (`val/*` metrics)."""

from __future__ import annotations

import time

from raygraph.batch import Batch
from raygraph.graph.executor import Executor
from raygraph.graph.nodes import DAGNode
from raygraph.run.feed import merge_outputs

__all__ = ["run_validation"]


def run_validation(graph: DAGNode, roles, prompts: Batch | None) -> dict[str, float]:
    """Run `graph` (`raygraph.graph.fragments.validation_graph`) once over `prompts`; {} without validation prompts."""
    if prompts is None:
        return {}
    executor = Executor(graph, roles, mode="interpreted")
    try:
        t0 = time.perf_counter()
        metrics = merge_outputs(executor.run(prompts))
        metrics["timing/validation_s"] = time.perf_counter() - t0
        return metrics
    finally:
        executor.teardown()
