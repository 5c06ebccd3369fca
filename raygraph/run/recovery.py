"""Run-level recovery: when an actor or a node dies, or a stage outlives `trainer.step_timeout_s`,
tear the run's actors down, build them again and continue from the newest complete checkpoint.

    attempt 1: ... step 7 ... step 8 ✗ (rollout rank 0 died)
    recovery:  roles shut down (actors, placement groups, collective groups go with them)
    attempt 2: roles built again (placement waits up to placement.placement_timeout_s for the
               resources to come back) → resume from checkpoint step 7 → step 8 (same prompts,
               same seeds) → ...

What counts as recoverable: a dead actor (any of the run's actors fails its ping, whatever error
reached the driver first, e.g. a peer's collective failing because its partner died), a lost
node or object, a stage that timed out, a weight-sync failure. A Python exception in a worker
while every actor is alive (a bug, a bad reward, NaN) is not: it would fail again, so it ends
the run at once. Each recovery is said on the console and recorded in `recoveries.jsonl`
(cause, role/rank/node, seconds to restart, checkpoint step) and in the next step's metrics
(`recovery/count`, `recovery/restart_s`, `recovery/redone_steps`), so MLflow shows it too.
A dead stateless actor alone (rollout, reward) is first recovered at stage level
(`raygraph.run.stage_recovery`), which records here too, with `kind: "stage"`.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path

from raygraph.cluster import RoleError, WeightSyncError

__all__ = ["Recoveries", "failure_is_recoverable", "INFRASTRUCTURE_CAUSES"]

log = logging.getLogger("raygraph")

# RoleError causes (exception type names, or our own wording) that mean the infrastructure failed.
INFRASTRUCTURE_CAUSES = ("the actor died", "no result within", "ActorDiedError", "RayActorError",
                         "ActorUnavailableError", "NodeDiedError", "ObjectLostError", "OwnerDiedError",
                         "ObjectFetchTimedOutError", "WorkerCrashedError", "LocalRayletDiedError",
                         "RayChannelTimeoutError", "GetTimeoutError", "ObjectReconstructionFailedError")


def failure_is_recoverable(exc: BaseException, dead_actors: list[str]) -> bool:
    """Whether restarting the roles can cure `exc`: the infrastructure failed, not the code."""
    if dead_actors:
        return True
    if isinstance(exc, WeightSyncError):
        return True
    if isinstance(exc, RoleError):
        return exc.cause.startswith(INFRASTRUCTURE_CAUSES)
    return False


@dataclass
class Recoveries:
    """Counts and records recoveries of one run (the driver's state across attempts)."""

    max_restarts: int
    run_dir: Path | None = None
    count: int = 0
    stage_count: int = 0
    _failed_at: float | None = None
    _failed_step: int = 0
    _pending: dict = field(default_factory=dict)

    def should_retry(self, exc: BaseException, dead_actors: list[str], failed_step: int) -> bool:
        """Decide on one failure; when retrying, record it (console, recoveries.jsonl)."""
        if not self._take_one(exc, dead_actors):
            return False
        self._failed_at, self._failed_step = time.monotonic(), failed_step
        self._record_failure("run", exc, dead_actors, failed_step,
                             "rebuilding the roles and resuming from the newest checkpoint")
        return True

    def stage_failed(self, exc: BaseException, dead_actors: list[str], failed_step: int) -> bool:
        """A step failed and only actors of stateless roles died: take one recovery from the budget
        and record it (kind "stage") if any is left."""
        if not self._take_one(exc, dead_actors):
            return False
        self._record_failure("stage", exc, dead_actors, failed_step,
                             "restarting only those actors and running the step again")
        return True

    def stage_done(self, failed_step: int, restart_s: float, weights: dict) -> None:
        """The dead actors run again with the current weights: record how long it took."""
        print(f"[raygraph] recovery {self.count} (stage): actors back after {restart_s:.1f}s, step {failed_step} "
              "runs again (no checkpoint loaded)", flush=True)
        self._write({"recovery": self.count, "kind": "stage", "time": time.time(), "rerun_step": failed_step,
                     "restart_s": restart_s, "redone_steps": 0,
                     "weights_verified": weights.get("weights/verified")})
        self._pending = {"recovery/count": float(self.count), "recovery/restart_s": restart_s,
                         "recovery/redone_steps": 0.0, "recovery/stage_count": float(self.stage_count + 1)}
        self.stage_count += 1

    def _take_one(self, exc: BaseException, dead_actors: list[str]) -> bool:
        if not failure_is_recoverable(exc, dead_actors):
            return False
        if self.count >= self.max_restarts:
            log.error("not recovering: trainer.max_restarts=%d recoveries already used", self.max_restarts)
            return False
        self.count += 1
        return True

    def _record_failure(self, kind: str, exc: BaseException, dead_actors: list[str], failed_step: int,
                        action: str) -> None:
        where = _where(exc)
        record = {"recovery": self.count, "kind": kind, "time": time.time(), "failed_step": failed_step,
                  "cause": getattr(exc, "cause", type(exc).__name__) or type(exc).__name__,
                  "where": where, "dead_actors": dead_actors}
        print(f"[raygraph] recovery {self.count}/{self.max_restarts}: step {failed_step} failed "
              f"({record['cause']}; {where}{'; dead: ' + ', '.join(dead_actors) if dead_actors else ''}); "
              f"{action}", flush=True)
        self._write(record)

    def resumed(self, checkpoint_step: int) -> None:
        """The roles are back and the checkpoint is loaded: record how long it took."""
        if self._failed_at is None:
            return
        restart_s = time.monotonic() - self._failed_at
        redone = max(0, self._failed_step - checkpoint_step - 1)
        print(f"[raygraph] recovery {self.count}: training again after {restart_s:.1f}s from checkpoint step "
              f"{checkpoint_step} ({redone} finished steps to redo)", flush=True)
        self._write({"recovery": self.count, "kind": "run", "time": time.time(), "resumed_from": checkpoint_step,
                     "restart_s": restart_s, "redone_steps": redone})
        self._pending = {"recovery/count": float(self.count), "recovery/restart_s": restart_s,
                         "recovery/redone_steps": float(redone)}
        self._failed_at = None

    def take_metrics(self) -> dict[str, float]:
        """The last recovery's numbers, once (for the first step after it)."""
        out, self._pending = self._pending, {}
        return out

    def _write(self, record: dict) -> None:
        if self.run_dir is None:
            return
        with (Path(self.run_dir) / "recoveries.jsonl").open("a") as f:
            f.write(json.dumps(record) + "\n")


def _where(exc: BaseException) -> str:
    if isinstance(exc, RoleError):
        return f"role {exc.role!r} rank {exc.rank} on node {exc.node_ip or '?'}, in {exc.method!r}"
    return type(exc).__name__
