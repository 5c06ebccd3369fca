"""Whether training did anything: a run whose every update was skipped is a failure, not "done".

A non-finite loss or gradient norm skips an optimizer step (workers/train_loop.py) and is counted in
`actor/skipped_steps` of `actor/optimizer_steps`. A few skips are survivable and are said in the
log; a run in which no step updated the policy at all ends with `TrainingFailed` (exit code 1).
"""

from __future__ import annotations

import logging

from raygraph.errors import RecoveryFailed

__all__ = ["TrainingFailed", "UpdateHealth"]

log = logging.getLogger("raygraph")


class TrainingFailed(RecoveryFailed, RuntimeError):
    """The run finished its steps but never trained (every optimizer step was skipped)."""


class UpdateHealth:
    """Counts training steps whose policy update was entirely skipped."""

    def __init__(self, prefix: str = "actor"):
        self.skipped_key, self.steps_key = f"{prefix}/skipped_steps", f"{prefix}/optimizer_steps"
        self.steps = 0
        self.all_skipped_steps = 0

    def observe(self, step: int, metrics: dict[str, float]) -> None:
        """Record one training step's metrics (steps without an update, e.g. prefetch, are ignored)."""
        attempted = metrics.get(self.steps_key, 0.0)
        if not attempted:
            return
        self.steps += 1
        if metrics.get(self.skipped_key, 0.0) >= attempted:
            self.all_skipped_steps += 1
            log.warning("step %d: every optimizer step was skipped (non-finite loss or gradient norm); "
                        "the policy did not change", step)

    def check(self) -> None:
        """Raise `TrainingFailed` if steps ran and none of them updated the policy."""
        if self.steps and self.all_skipped_steps == self.steps:
            raise TrainingFailed(f"all {self.steps} training steps skipped every optimizer step (non-finite loss "
                                 "or gradient norm): the policy never changed. Look for NaN/Inf in reward/*, "
                                 "actor/* and health/non_finite_metrics in metrics.jsonl")
