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

A lost node's actors vanish without a word: the first error to reach the driver is a surviving
rank's collective reporting a closed connection, or Ray calling an actor "temporarily
unavailable", while Ray still calls the node alive (its GCS declares a silent node dead after a
few missed health checks, ~15 s by default). `find_dead_actors` then waits for Ray's verdict, up
to its own detection bound, so that the failure is recovered (not taken for a bug), the record
names the dead actors and `lost_nodes` the dead nodes, and the roles are not rebuilt on the node
that is going away.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import ray

from raygraph.cluster import RoleError, WeightSyncError
from raygraph.cluster.errors import ACTOR_DIED

__all__ = ["Recoveries", "failure_is_recoverable", "find_dead_actors", "lost_nodes", "INFRASTRUCTURE_CAUSES",
           "ACTOR_UNUSABLE", "LOST_PEER_SIGNS"]

log = logging.getLogger("raygraph")

# Causes after which the actor that raised is alive but of no use until it is started again: a vLLM
# engine's processes died (workers/vllm_deaths), an environment host died (agents/env_hosts).
ACTOR_UNUSABLE = ("RolloutEngineDied", "EnvHostDied")
# RoleError causes (exception type names, or our own wording) that mean the infrastructure failed.
INFRASTRUCTURE_CAUSES = (ACTOR_DIED, "no result within", "ActorDiedError", "RayActorError",
                         "ActorUnavailableError", "NodeDiedError", "ObjectLostError", "OwnerDiedError",
                         "ObjectFetchTimedOutError", "WorkerCrashedError", "LocalRayletDiedError",
                         "RayChannelTimeoutError", "GetTimeoutError", "ObjectReconstructionFailedError",
                         "WeightSyncError",   # a receiving actor's transfer timed out, lost a peer or failed its checksum
                         *ACTOR_UNUSABLE)


# What a failed call says when a process it talked to vanished before Ray declared it dead: a
# collective's surviving rank (gloo, NCCL), or Ray itself (the actor's connection dropped).
LOST_PEER_SIGNS = ("Connection closed by peer", "Connection reset by peer", "Broken pipe",
                   "remote process exited or there was a network error", "ActorUnavailableError",
                   "is temporarily unavailable")


def find_dead_actors(roles, exc: BaseException) -> list[str]:
    """Names of the run's dead actors after `exc` (`Roles.dead_actors`). When none is dead yet but
    `exc` says a peer vanished (`LOST_PEER_SIGNS`), keep asking until Ray reports the death (a
    lost node takes its health-check time), at most `node_death_bound_s()`; [] if none died.
    A failure of an actor that says it is unusable (`ACTOR_UNUSABLE`) is not waited for: the peer
    that vanished was its engine or environment host (no run actor), so no verdict would come."""
    dead = roles.dead_actors()
    if dead or _unusable(exc) or not any(sign in str(exc) for sign in LOST_PEER_SIGNS):
        return dead
    bound_s, started = node_death_bound_s(), time.monotonic()
    print(f"[raygraph] {_where(exc)}: a peer vanished; waiting up to {bound_s:.0f}s for Ray to report "
          "which actor or node died", flush=True)
    while not dead and time.monotonic() - started < bound_s:
        time.sleep(0.5)
        dead = roles.dead_actors()   # an actor on a silent node does not answer: ~3 s per round
    return dead


def _unusable(exc: BaseException) -> bool:
    return isinstance(exc, RoleError) and exc.cause.startswith(ACTOR_UNUSABLE)


def node_death_bound_s() -> float:
    """The longest Ray's GCS takes to declare a silent node dead: `health_check_failure_threshold`
    missed checks, each up to `health_check_timeout_ms` and `health_check_period_ms` apart
    (5 x (10 s + 3 s) with Ray's defaults)."""
    try:
        config = ray._config   # the cluster's system config, as the driver received it
        ms = config.health_check_failure_threshold() * (config.health_check_timeout_ms()
                                                        + config.health_check_period_ms())
    except Exception:  # noqa: BLE001 - not connected, or a Ray without these settings: the defaults
        ms = 5 * (10_000 + 3_000)
    return ms / 1000


def lost_nodes(roles) -> list[str]:
    """`<ip> (<node id>)` of each node that hosts one of the run's role actors and that Ray calls dead
    ([] when Ray cannot say: this runs while a failure is handled and must not replace its error)."""
    try:
        alive = {n["NodeID"] for n in ray.nodes() if n.get("Alive")}
    except Exception:  # noqa: BLE001 - the GCS unreachable: the failure's own error says more
        return []
    return sorted({f"{s.node_ip} ({s.node_id[:12]})" for group in roles.groups.values() for s in group.sites
                   if s.node_id and s.node_id not in alive})


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

    def should_retry(self, exc: BaseException, dead_actors: list[str], failed_step: int,
                     nodes_lost: Sequence[str] = ()) -> bool:
        """Decide on one failure; when retrying, record it (console, recoveries.jsonl)."""
        if not self._take_one(exc, dead_actors):
            return False
        self._failed_at, self._failed_step = time.monotonic(), failed_step
        self._record_failure("run", exc, dead_actors, failed_step,
                             "rebuilding the roles and resuming from the newest checkpoint", nodes_lost)
        return True

    def stage_failed(self, exc: BaseException, dead_actors: list[str], failed_step: int,
                     nodes_lost: Sequence[str] = ()) -> bool:
        """A step failed and only actors of stateless roles died: take one recovery from the budget
        and record it (kind "stage") if any is left."""
        if not self._take_one(exc, dead_actors):
            return False
        self._record_failure("stage", exc, dead_actors, failed_step,
                             "restarting only those actors and running the step again", nodes_lost)
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
                        action: str, nodes_lost: Sequence[str]) -> None:
        where = _where(exc)
        record = {"recovery": self.count, "kind": kind, "time": time.time(), "failed_step": failed_step,
                  "cause": getattr(exc, "cause", type(exc).__name__) or type(exc).__name__,
                  "where": where, "dead_actors": dead_actors, "lost_nodes": list(nodes_lost)}
        print(f"[raygraph] recovery {self.count}/{self.max_restarts}: step {failed_step} failed "
              f"({record['cause']}; {where}{'; dead: ' + ', '.join(dead_actors) if dead_actors else ''}"
              f"{'; lost node ' + ', '.join(nodes_lost) if nodes_lost else ''}); {action}", flush=True)
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
