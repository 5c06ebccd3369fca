"""Validation: one graph run over the held-out prompts; `val/*` metrics, samples kept and shown."""

from __future__ import annotations

import time

from raygraph.batch import Batch
from raygraph.graph import step_metrics
from raygraph.graph.executor import Executor
from raygraph.graph.nodes import DAGNode
from raygraph.graph.report import split_report
from raygraph.run.feed import merge_outputs
from raygraph.run.samples import SampleDumps, console_lines

__all__ = ["run_validation"]


def run_validation(graph: DAGNode, roles, prompts: Batch | None, *, step: int, dumps: SampleDumps,
                   tracker=None, timeout_s: float | None = None) -> dict[str, float]:
    """Run `graph` (`raygraph.graph.fragments.validation_graph`, with its report) once over `prompts`.

    The generations go to `<run>/samples/val_step_<step>.jsonl` (and MLflow through `tracker`),
    and the console shows the first few. Returns the `val/*` metrics ({} without prompts).
    """
    if prompts is None:
        return {}
    rows = dumps.val_rows or step_metrics.VAL_CONSOLE_ROWS   # always a few, for the console
    prompts = Batch(prompts.tensors, prompts.non_tensors, {**prompts.meta, step_metrics.DUMP_ROWS: rows})
    executor = Executor(graph, roles, mode="interpreted", timeout_s=timeout_s)  # the step watchdog
    try:
        t0 = time.perf_counter()
        outputs, report = split_report(executor.run(prompts))
        metrics = merge_outputs(outputs)
        metrics["timing/validation_s"] = time.perf_counter() - t0
    finally:
        executor.teardown()
    records = report.records
    path = dumps.write(step, records, "val")
    if tracker is not None:
        tracker.log_samples(path, records)
    print(f"[raygraph] validation at step {step}: accuracy {metrics.get('val/accuracy', float('nan')):.3f} "
          f"({len(records)} samples in {path})", flush=True)
    for line in console_lines(records[:step_metrics.VAL_CONSOLE_ROWS]):
        print(line, flush=True)
    return metrics
