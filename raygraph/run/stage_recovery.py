"""Stage-level recovery: when only actors of stateless roles die in a step, restart those actors
and run the step again, with no checkpoint reload.

    step 8: snapshot the rollout's sampling RNG ─► graph ✗ (rollout+reward rank 0 died)
            ─► the policy did not update yet? ─► start that actor again in its bundle
            ─► new weight-sync group ─► every rollout rank back to the step's RNG snapshot
            ─► push the policy's weights (checksummed) ─► graph again (same prompts, same seeds)

An actor whose vLLM engine died (`RolloutEngineDied`: the actor answers, its engine does not)
or one of whose environment hosts died (`EnvHostDied`, `rollout.agent.env_hosts`) counts as dead:
it is killed and started again the same way (with new hosts).

Stateless: rollout, reward and the frozen models (the reference, and a workflow's extra roles
such as a distillation teacher, all played by `ReferenceWorker`) hold nothing a checkpoint
restores beyond weights (the rollout's sampling RNG is snapshotted at each step's start, so the
rerun samples the same tokens and the step's result equals an uninterrupted one). A dead actor
qualifies when every role it hosts is stateless and none is in a torch.distributed group: in a
disaggregated layout the `rollout+reward` actors, and a frozen model on a pool of its own
(`placement.roles`) unless it is FSDP-sharded (`shard`); an actor fused with the policy (every
role in colocated mode, the reference by default), a sharded frozen model or the coordinator
does not.

Never trained twice: the rerun happens only when no trained role (policy, critic) ran an update
in the failed step (their stage clocks say so; an update still running counts as one). Otherwise,
or when anything of the restart fails, the error goes on to run-level recovery
(`raygraph.run.recovery`), which reloads the newest checkpoint. Each stage-level recovery takes
one of `trainer.max_restarts`, is said on the console, recorded in `recoveries.jsonl` with
`kind: "stage"` and counted in `recovery/*` metrics (`recovery/stage_count`).
Only the interpreted executor is recovered this way (a compiled graph is torn down with its actors).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import ray

from raygraph.cluster import RoleError, RoleSpec
from raygraph.cluster.errors import ACTOR_DIED
from raygraph.cluster.restart import restart_actors, restartable
from raygraph.config.role_kinds import kind_of
from raygraph.run.recovery import (
    ACTOR_UNUSABLE,
    Recoveries,
    failure_is_recoverable,
    find_dead_actors,
    lost_nodes,
)

__all__ = ["StageRunner", "stateless_roles"]


def stateless_roles(specs: dict[str, RoleSpec]) -> tuple[str, ...]:
    """The roles of `specs` that a restart loses nothing of: those whose kind restarts at stage
    level (`raygraph.config.role_kinds`: rollout, reward, the reference, every `extra_roles`)."""
    return tuple(r for r in specs if kind_of(r).restart == "stage")


def _dead_by_its_error(exc: Exception) -> list[str]:
    """[the actor] that `exc` says is dead (Ray declared it so) or unusable (its rollout engine or
    environment host died, `ACTOR_UNUSABLE`), else []. A ping can still go unanswered then: on a
    lost node, Ray reports the step's call failed before it answers a new one."""
    if isinstance(exc, RoleError) and exc.cause.startswith((ACTOR_DIED, *ACTOR_UNUSABLE)) and exc.actor_name:
        return [exc.actor_name]
    return []


def _trained(roles: list[str]) -> list[str]:
    return [r for r in roles if kind_of(r).trained]


class StageRunner:
    """Runs the step graph; recovers a step whose only dead actors host stateless roles.

    Args:
        make_executor: builds the step's `Executor` over the current actors (called again after a restart).
        roles: the run's `Roles`; specs: the `RoleSpec`s they were built from.
        recoveries: the run's recovery budget and records.
        run_dir: where the rollout's per-step RNG snapshot goes (`stage_state/rollout/rank<r>`).
        enabled: stage-level recovery wanted (interpreted executor, `trainer.max_restarts` > 0).
        timeout_s: bound on asking the trained roles whether they updated.
        placement_timeout_s: bound on a restarted actor's start (its bundle may wait for a node).
    """

    def __init__(self, make_executor: Callable[[], Any], roles, specs: dict[str, RoleSpec],
                 recoveries: Recoveries, run_dir: Path, *, enabled: bool, timeout_s: float = 60.0,
                 placement_timeout_s: float = 60.0):
        self.make_executor, self.roles, self.specs, self.recoveries = make_executor, roles, specs, recoveries
        self.state_dir, self.timeout_s = Path(run_dir) / "stage_state", timeout_s
        self.placement_timeout_s, self.stateless = placement_timeout_s, stateless_roles(specs)
        self.executor = make_executor()
        rollout_names = [s.actor_name for s in roles.rollout.sites] if "rollout" in roles.names() else []
        self.enabled = enabled and all(restartable(roles, specs, n, self.stateless) for n in rollout_names)

    def run(self, prompts: Any, *, step: int, version: int) -> list[Any]:
        """The step graph's outputs for `prompts`, recovering stateless actors once if one dies."""
        if self.enabled and "rollout" in self.roles.names():
            self._rollout_state("save_checkpoint")
        try:
            return self.executor.run(prompts)
        except Exception as exc:
            if not self.enabled or not self._recover(exc, step, version):
                raise
        return self.executor.run(prompts)

    def teardown(self) -> None:
        self.executor.teardown()

    def _recover(self, exc: Exception, step: int, version: int) -> bool:
        # an actor on a lost node is waited for until Ray declares it dead (find_dead_actors); an
        # actor whose vLLM engine died is alive but of no use until it is started again
        dead = sorted({*find_dead_actors(self.roles, exc), *_dead_by_its_error(exc)})
        if not dead or not failure_is_recoverable(exc, dead):
            return False
        if not all(restartable(self.roles, self.specs, n, self.stateless) for n in dead):
            return False
        updated = self._trained_roles_updated()
        if updated is not False:
            why = "a trained role already updated" if updated else "the trained roles did not answer"
            print(f"[raygraph] step {step}: not recovering at stage level ({why}); run-level recovery instead",
                  flush=True)
            return False
        if not self.recoveries.stage_failed(exc, dead, step, lost_nodes(self.roles)):
            return False
        started = time.monotonic()
        try:
            self.executor.teardown()
            new = restart_actors(self.roles, self.specs, dead, self.placement_timeout_s)
            self.roles.weights.reconnect(new)
            if "rollout" in self.roles.names():   # every rank: survivors sampled in the failed step too
                self._rollout_state("load_checkpoint")
            weights = self._push_weights(version)
            self.executor = self.make_executor()
        except Exception as again:  # noqa: BLE001 - run-level recovery takes over from the original error
            print(f"[raygraph] stage-level recovery failed ({type(again).__name__}: {again}); "
                  "falling back to run-level recovery", flush=True)
            return False
        self.recoveries.stage_done(step, time.monotonic() - started, weights)
        return True

    def _push_weights(self, version: int) -> dict:
        out: dict = {}
        for src, dst in self.roles.weights.collective_pairs():
            out = self.roles.weights.sync_now(src, dst, version=version)
            if out.get("weights/verified", 1.0) != 1.0:
                raise RuntimeError(f"weights pushed to the restarted {dst} failed verification: {out}")
        return out

    def _rollout_state(self, method: str) -> None:
        """Save (step start) or load (rerun) every rollout rank's sampling RNG."""
        group = self.roles.rollout
        group.call_each(method, [(str(self.state_dir / "rollout" / f"rank{r}"),) for r in range(group.world_size)])

    def _trained_roles_updated(self) -> bool | None:
        """Whether a trained role ran an update since the step began (None: no answer in time).

        The stage clocks of the trained roles' actors record each task when it ends, and an
        actor runs one task at a time, so asking for them waits for a running update to end."""
        trained = _trained(self.roles.names())
        hosts = {id(a): a for role in trained for a in self.roles[role].actors}
        refs = [a.take_stats.remote() for a in hosts.values()]
        ready, _ = ray.wait(refs, num_returns=len(refs), timeout=self.timeout_s)
        if len(ready) < len(refs):
            return None
        labels = [label for stats in ray.get(refs) for label in stats["timings"]]
        return any(label.split(".")[0] in trained and "update" in label for label in labels)
