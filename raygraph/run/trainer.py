"""The training loop: build the workflow's graph and the roles once, then run the graph every step.

    run(cfg) ─► run dir + assets ─► graph (names checked, no actor yet) ─► Ray ─► roles
             ─► resume | warm start ─► for each step: prompts → graph → metrics → [validate]
             → [checkpoint] ─► final checkpoint + summary

Everything algorithm-specific lives in the workflow file; this loop never branches on it.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import ray

from raygraph.agents.dispatch import start_board
from raygraph.algos.kl_control import make_kl_controller
from raygraph.algos.user_code import import_plugins
from raygraph.cluster import build_roles
from raygraph.config.engine_choice import auto_engine_line
from raygraph.config.workflow_ref import load_workflow
from raygraph.graph import step_metrics
from raygraph.graph.executor import Executor
from raygraph.graph.report import graph_facts, split_report
from raygraph.run import resume
from raygraph.run.feed import StepData, merge_outputs
from raygraph.run.graphs import build_graphs
from raygraph.run.health import UpdateHealth
from raygraph.run.ledger import SampleLedger
from raygraph.run.recovery import Recoveries, find_dead_actors, lost_nodes
from raygraph.run.role_specs import placement_plan, role_specs
from raygraph.run.samples import SampleDumps
from raygraph.run.setup import prepare_run, start_ray
from raygraph.run.stage_recovery import StageRunner
from raygraph.run.stopping import RunStopped, StopFlag
from raygraph.run.streaming import StreamFeed
from raygraph.run.tracking import Tracker
from raygraph.run.validation import run_validation
from raygraph.run.warm_start import run_warm_start

__all__ = ["run", "RunSummary"]

log = logging.getLogger("raygraph")


@dataclass
class RunSummary:
    run_dir: Path
    steps_done: int
    val_accuracy_start: float | None
    val_accuracy_end: float | None
    wall_s: float
    stopped_early: bool
    stop_signal: int | None = None  # the signal that stopped the run early (`raygraph train` exits 128 + it)


def run(cfg, address: str | None = None) -> RunSummary:
    """Train with `cfg` (a validated `RaygraphConfig`); returns where the run went and how it did.

    A run stopped by a signal at a step boundary returns with `stopped_early` and `stop_signal`
    set; one that could not reach a boundary in time raises `RunStopped` (`raygraph.run.stopping`).
    Raises `TrainingFailed` when no step updated the policy (`raygraph.run.health`).
    """
    recoveries = Recoveries(cfg.trainer.max_restarts)
    # a recovered run reports the whole run: its wall time and the validation before its first step
    started, val_start = time.perf_counter(), None
    with StopFlag(cfg.trainer.stop_timeout_s) as stop:
        while True:
            try:
                summary = _run(cfg, address, stop, recoveries)
            except KeyboardInterrupt:
                if stop.requested:  # the stop timed out, or a second signal came
                    raise RunStopped(stop.signum) from None
                raise
            except _AttemptFailed as failed:
                val_start = failed.val_start if val_start is None else val_start
                if stop.requested or not recoveries.should_retry(failed.error, failed.dead_actors, failed.step,
                                                                 failed.lost_nodes):
                    raise failed.error from None
                # the same run directory, from its newest complete checkpoint
                cfg = cfg.model_copy(update={"run_name": failed.run_name, "trainer": cfg.trainer.model_copy(
                    update={"resume": "auto"})})
                continue
            summary = replace(summary, wall_s=time.perf_counter() - started, val_accuracy_start=(
                summary.val_accuracy_start if val_start is None else val_start))
            _print_summary(summary)
            return summary


class _AttemptFailed(Exception):
    """One attempt of the run failed at `step`; `dead_actors` were found dead right after, some of
    them on `lost_nodes`."""

    def __init__(self, error: Exception, step: int, dead_actors: list[str], run_name: str,
                 lost_nodes: list[str], val_start: float | None):
        super().__init__(str(error))
        self.error, self.step, self.dead_actors, self.run_name = error, step, dead_actors, run_name
        self.lost_nodes, self.val_start = lost_nodes, val_start


def _run(cfg, address: str | None, stop: StopFlag, recoveries: Recoveries) -> RunSummary:
    started = time.perf_counter()
    import_plugins(cfg.plugins)   # the driver too (the actors import them when they start)
    workflow = load_workflow(cfg.workflow)
    ctx = prepare_run(cfg)
    data = StepData.load(cfg, workflow.data_format)
    specs = role_specs(cfg, workflow.roles)
    step_graph, val_graph = build_graphs(cfg, workflow)   # before any actor starts: names checked
    start_ray(cfg, address)
    stop.install()  # ray.init replaced the SIGTERM handler
    print(f"[raygraph] run directory: {ctx.run_dir}", flush=True)
    if (engine := auto_engine_line(cfg)) is not None:
        print(f"[raygraph] {engine}", flush=True)
    recoveries.run_dir = ctx.run_dir
    plan = placement_plan(cfg, workflow.roles)
    roles = build_roles(run_name=ctx.ray_name, pools=plan.pools, specs=specs, colocate=plan.fused,
                        weight_sync=plan.weight_sync, placement_timeout_s=cfg.placement.placement_timeout_s,
                        weight_sync_timeout_s=cfg.placement.weight_sync_timeout_s,
                        bucket_bytes=cfg.placement.weight_bucket_mb << 20,
                        weight_sync_verify=cfg.placement.weight_sync_verify,
                        weight_sync_shared_memory=cfg.placement.weight_sync_shared_memory, plugins=cfg.plugins)
    if cfg.rollout.agent is not None and cfg.rollout.agent.dispatch == "least_loaded":
        try:
            roles.services.append(start_board(ctx.ray_name))
        except BaseException:
            roles.shutdown()
            raise
    kl_cfg = cfg.algorithm.kl_in_reward
    loop = _Loop(cfg, ctx, roles, data, recoveries, SampleLedger(ctx.run_dir),
                 make_kl_controller(kl_cfg.controller, kl_cfg.coef, kl_cfg.target_kl, kl_cfg.horizon))
    status = "FAILED"
    try:
        loop.start(step_graph, val_graph, specs, stop)
        status = "KILLED" if loop.train(stop) else "FINISHED"
    except Exception as exc:
        raise loop.failed(exc) from exc
    finally:
        loop.close(status)
    return RunSummary(ctx.run_dir, loop.steps_done, loop.val_start, loop.val_end, time.perf_counter() - started,
                      loop.stopped, stop.signum if loop.stopped else None)


@dataclass
class _Loop:
    """One attempt's training loop: what it works with, and where it is (what a failure, a stop or
    the summary needs to know)."""

    cfg: Any
    ctx: Any
    roles: Any
    data: StepData
    recoveries: Recoveries
    ledger: SampleLedger
    kl_ctl: Any
    tracker: Tracker | None = None
    runner: StageRunner | None = None
    dumps: SampleDumps | None = None
    val_graph: Any = None
    extra_batches: int = 0  # prompt batches the step graph may read beyond its own
    lookahead: int = 0      # the next step's prompt shares handed out early (max_staleness)
    stream: StreamFeed | None = None   # streaming rollouts (rollout.streaming)
    version: int = 0        # the rollout's weight version
    step: int = 0           # the step running (or the last one run)
    steps_done: int = 0     # the last step logged
    saved: int = 0          # the last step checkpointed
    consistent: int | None = None  # the last step whose update, sync and KL update all finished
    metrics: dict = field(default_factory=dict)   # the last step's
    stopped: bool = False
    val_start: float | None = None
    val_end: float | None = None

    def start(self, step_graph, val_graph, specs, stop: StopFlag) -> None:
        """Resume or warm-start, open tracking, build the step runner, validate before step 1
        (a stop signal cuts the warm start short and skips that validation)."""
        cfg, ctx, roles = self.cfg, self.ctx, self.roles
        self.saved, self.version = resume.restore(ctx.resume, roles, self.data, self.kl_ctl, cfg.trainer.seed)
        self.steps_done = self.saved
        self.ledger.resumed_from(self.saved, "recovery" if self.recoveries.count else "start")
        self.recoveries.resumed(self.saved)
        if self.saved == 0 and cfg.trainer.warm_start is not None:
            run_warm_start(cfg, roles, stopping=lambda: stop.requested)
        self.tracker = Tracker(ctx.run_dir, total_steps=cfg.trainer.total_steps,
                               mlflow_uri=ctx.mlflow_uri if cfg.logging.mlflow else None,
                               experiment=cfg.experiment, run_name=ctx.run_name, params=ctx.resolved,
                               console=cfg.logging.console, log_every=cfg.logging.log_every, start_step=self.saved)
        if self.tracker.mlflow_run_id:
            print(f"[raygraph] MLflow run {self.tracker.mlflow_run_id} at {ctx.mlflow_uri}", flush=True)
        # profile: interpreted and unfused, so that every stage is a Ray task in the timeline (a
        # compiled graph runs as one long task per actor, a fused plan as one task per step)
        mode = "interpreted" if cfg.trainer.profile else cfg.trainer.executor
        self.runner = StageRunner(  # restarts a dead rollout/reward actor alone and reruns its step
            lambda: Executor(step_graph, roles, mode=mode, fuse=not cfg.trainer.profile,
                             timeout_s=cfg.trainer.step_timeout_s), roles, specs, self.recoveries, ctx.run_dir,
            # a restarted rollout rank would have lost its streamed groups: streaming recovers at run level
            enabled=mode == "interpreted" and cfg.trainer.max_restarts > 0 and not cfg.rollout.streaming,
            timeout_s=cfg.placement.weight_sync_timeout_s + 10, placement_timeout_s=cfg.placement.placement_timeout_s)
        self.extra_batches = graph_facts(step_graph).extra_prompt_batches
        self.lookahead = roles.rollout.world_size if cfg.placement.max_staleness and not cfg.rollout.streaming else 0
        if cfg.rollout.streaming:
            self.stream = StreamFeed(roles.rollout, self.data, ahead=cfg.placement.max_staleness, n=cfg.rollout.n,
                                     next_step=self.saved + 1, last_step=cfg.trainer.total_steps,
                                     timeout_s=cfg.trainer.step_timeout_s or float("inf"))
        self.dumps = SampleDumps(ctx.run_dir, cfg.trainer.dump_rollouts, cfg.trainer.dump_rows)
        self.val_graph = val_graph
        first = self.saved == 0 and cfg.trainer.val_before_train and not stop.requested
        self.val_start = self._validate(0).get("val/accuracy") if first else None
        self.val_end = self.val_start
        roles.take_step_stats()  # start the per-stage clocks at the first step

    def train(self, stop: StopFlag) -> bool:
        """Every remaining step (validating and checkpointing as configured); whether a signal stopped it."""
        health, total = UpdateHealth(), self.cfg.trainer.total_steps
        for step in range(self.saved + 1, total + 1):
            if stop.requested:  # the signal came after the last step's check, or before any step
                if self.steps_done > self.saved:
                    self._save(self.steps_done)
                stop.checkpointed()
                self.stopped = True
                return True
            self.step = step
            metrics = self._one_step(step)
            health.observe(step, metrics)
            stopping = stop.requested  # read once: a signal may land anywhere in this iteration
            last = step == total
            if last or (self.cfg.trainer.val_every and step % self.cfg.trainer.val_every == 0):
                metrics.update(self._validate(step))
                self.val_end = metrics.get("val/accuracy", self.val_end)
            self.tracker.log(step, metrics, force=last or stopping or "val/accuracy" in metrics)
            self.steps_done = step
            if last or stopping or (self.cfg.trainer.save_every and step % self.cfg.trainer.save_every == 0):
                self._save(step)
            if stopping:
                stop.checkpointed()
                self.stopped = True
                return True
        health.check()
        return False

    def _one_step(self, step: int) -> dict[str, float]:
        """Run the step graph on the step's prompts; its metrics (the report's facts applied)."""
        t0 = time.perf_counter()
        self.consistent = None  # from here the sampler, then the roles, move on to this step
        prompts = self.data.next_prompts(step=step, kl_coef=self.kl_ctl.value, lookahead_shares=self.lookahead,
                                         extra_batches=self.extra_batches)
        prompts.meta[step_metrics.DUMP_ROWS] = self.dumps.rows_for(step)
        streamed = {} if self.stream is None else {**self.stream.fill(step), **self.stream.take(step, prompts)}
        outputs, report = split_report(self.runner.run(prompts, step=step, version=self.version))
        self.metrics = metrics = merge_outputs(outputs)
        self.ledger.trained(step, self.data.settle(prompts, report.prompt_batches))
        metrics.update(self.recoveries.take_metrics())
        if report.records:
            self.tracker.log_samples(self.dumps.write(step, report.records, "train"), report.records)
        metrics["timing/step_s"] = time.perf_counter() - t0
        metrics.update(self.roles.take_step_stats())
        metrics["perf/tokens_per_s"] = metrics.get("rollout/tokens", 0.0) / metrics["timing/step_s"]
        if streamed:
            metrics.update(streamed, **{"stream/trainer_idle_frac": streamed["stream/wait_s"] / metrics["timing/step_s"]})
        self.version = self.version if report.weight_version is None else report.weight_version
        if report.kl_in_reward is not None:   # the graph computes it whenever the controller adapts
            self.kl_ctl.update(report.kl_in_reward, len(prompts) * self.cfg.rollout.n)
        self.consistent = step
        return metrics

    def _validate(self, at_step: int) -> dict[str, float]:
        return run_validation(self.val_graph, self.roles, self.data.val_prompts, step=at_step, dumps=self.dumps,
                              tracker=self.tracker, timeout_s=self.cfg.trainer.step_timeout_s)

    def _save(self, step: int) -> None:
        resume.save(self.ctx, self.roles, step, self.data, self.kl_ctl, self.version)
        self.saved = step

    def failed(self, exc: Exception) -> _AttemptFailed:
        """Checkpoint what is consistent (unless a rank died with its state), and say how it failed."""
        dead = find_dead_actors(self.roles, exc)  # a dead rank's state is gone: no checkpoint can be consistent
        if dead:
            log.warning("run failed: no checkpoint written on the way out (%s died, and its state with it)",
                        ", ".join(dead))
        else:
            unlogged = self.metrics if self.consistent is not None and self.consistent > self.steps_done else None
            resume.save_after_failure(self.ctx, self.roles, self.data, self.kl_ctl, self.version,
                                      step=self.consistent, tracker=self.tracker, metrics=unlogged)
        return _AttemptFailed(exc, self.step, dead, self.ctx.run_name, lost_nodes(self.roles), self.val_start)

    def close(self, status: str) -> None:
        if self.cfg.trainer.profile:  # Ray task timeline (chrome://tracing or Perfetto); see docs/benchmarks.md
            ray.timeline(filename=str(self.ctx.run_dir / "timeline.json"))
        if self.runner is not None:
            self.runner.teardown()
        self.roles.shutdown()
        if self.tracker is not None:
            self.tracker.close(status)


def _print_summary(s: RunSummary) -> None:
    def fmt(value: float | None) -> str:
        return "n/a" if value is None else f"{value:.3f}"

    print(f"[raygraph] {'stopped' if s.stopped_early else 'done'} after step {s.steps_done} "
          f"in {s.wall_s:.1f}s; validation accuracy {fmt(s.val_accuracy_start)} -> {fmt(s.val_accuracy_end)}; "
          f"run directory {s.run_dir}", flush=True)
