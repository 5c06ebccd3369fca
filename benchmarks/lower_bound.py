"""How close a raygraph step is to the compute it contains: `overhead = raygraph step / lower bound`.

    .venv/bin/python benchmarks/lower_bound.py configs/demo.yaml [key=value ...] \\
        [--steps 30] [--warmup 3] [--variants full,recompute,one_actor] [--threads 1] [--rounds 1]

The lower bound runs one GRPO step's compute sequentially in THIS process with the plain workers
(`raygraph.workers.*`, built with exactly the constructor arguments the trainer gives its actors),
no Ray: prompts -> `rollout.generate` -> `reward.score` -> `policy.logprobs` (only when
`actor.old_logprobs` resolves to recompute, as in the workflow) -> `reference.logprobs` (when
the config uses a KL term) -> `whole_batch.compute_advantages` ->
`policy.update` -> `rollout.load_weights(policy.weight_buckets())` -> `step_metrics.rollout_metrics`.
Same model, data order, seeds and warm start as `raygraph train`, so both sides sample the same
responses (`same_samples` compares their per-step reward means).

Two measurements, one run:

paired (the headline): raygraph's own pieces (`build_roles`, the workflow DAG, `Executor`, the
  warm start) driven step by step exactly as `raygraph.trainer.run` does, and the lower bound(s)
  in this process, interleaved STEP BY STEP (the order rotates every step). Each step's ratio
  compares two executions a fraction of a second apart, so the load of a shared machine cancels;
  `overhead` is the median of the per-step ratios.
step_time: `benchmarks/step_time.py` (an ordinary `raygraph train`) in a subprocess, `--rounds`
  times, reported next to the paired lower bound's median. Cross-check only: on a shared machine
  the load changes between the two phases.

Variants of the lower bound (`--variants`):
  full       the same stages as the GRPO workflow under this config;
  recompute  `full` with a separate `policy.logprobs` pass for the old log-probs whatever
             `actor.old_logprobs` says (what raygraph did before that option): what skipping it saves;
  one_actor  `full` inside ONE Ray actor, one task per step (timed at the driver): the floor
             for a colocated step fused into a single actor call.
`--threads` lists torch intra-op thread counts for the lower bound (actors run with
OMP_NUM_THREADS = their whole CPUs, 1 in the demo, so 1 is the like-for-like comparison there). Two knobs change only the paired
raygraph side, to find where time goes: `--actor-threads N` (the actors' OMP_NUM_THREADS, through
`build_roles(env_vars=...)`) and `--no-dashboard` (local Ray without the dashboard processes).
Ray starts worker processes at niceness 15; `RAY_worker_niceness=0` in the environment starts
them at 0 (docs/benchmarks.md, section 1).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch


def _load_cfg(config: str, overrides: list[str], out_dir: str):
    from raygraph.config import load_config

    cfg = load_config(config, [*overrides, "trainer.val_every=0", "trainer.resume=never", "data.val_files=[]",
                               "logging.mlflow=false", "checkpoint.save_hf=false", f"trainer.output_dir={out_dir}",
                               "run_name=lower-bound"])
    p = cfg.placement
    if p.train_workers != 1 or (p.mode == "disaggregated" and p.rollout_workers != 1):
        raise SystemExit("lower_bound.py runs one process: use placement.train_workers=1 (and rollout_workers=1)")
    if cfg.workflow != "grpo" or p.max_staleness:
        raise SystemExit("lower_bound.py reproduces the synchronous GRPO step (workflow grpo, "
                         "placement.max_staleness=0)")
    return cfg


def _kl_controller(cfg):
    from raygraph.algos.kl_control import make_kl_controller

    k = cfg.algorithm.kl_in_reward
    return make_kl_controller(k.controller, k.coef, k.target_kl, k.horizon)


class LowerBound:
    """The GRPO step's compute with plain workers in this process (no Ray)."""

    def __init__(self, cfg, *, threads: int, old_logprobs: str | None = None):
        from raygraph.config.workflow_ref import load_workflow
        from raygraph.run.feed import StepData
        from raygraph.run.role_specs import role_specs
        from raygraph.workers.freed_memory import keep_freed_memory

        self.cfg, self.threads = cfg, threads
        self.old_logprobs = old_logprobs or cfg.old_logprobs_source   # recompute | rollout | update
        torch.set_num_threads(threads)
        if not torch.cuda.is_available():   # what every CPU role actor does (raygraph.cluster.host)
            keep_freed_memory()
        specs = role_specs(cfg, load_workflow(cfg.workflow).roles)   # the actors' constructor arguments
        self.w = {name: spec.factory(**spec.kwargs) for name, spec in specs.items()}
        self.data, self.kl_ctl = StepData.load(cfg), _kl_controller(cfg)
        self.bucket_bytes = cfg.placement.weight_bucket_mb << 20
        self._warm_start()

    def _warm_start(self) -> None:
        """`raygraph.warm_start.run_warm_start` without Ray: same rows, same order, one weight copy."""
        from raygraph.run.warm_start import warm_start_batches

        ws = self.cfg.trainer.warm_start
        if ws is None:
            return
        for batch in warm_start_batches(self.cfg):
            self.w["policy"].sft_update(batch, lr=ws.lr)
        self.w["rollout"].load_weights(self.w["policy"].weight_buckets(self.bucket_bytes), 1)

    def step(self, step: int) -> dict:
        from raygraph.graph import step_metrics, whole_batch

        torch.set_num_threads(self.threads)
        w, alg, seconds = self.w, self.cfg.algorithm, {}

        def timed(stage, fn, *args, **kwargs):
            start = time.perf_counter()
            out = fn(*args, **kwargs)
            seconds[f"timing/{stage}_s"] = time.perf_counter() - start
            return out

        t0 = time.perf_counter()
        prompts = self.data.next_prompts(step=step, kl_coef=self.kl_ctl.value)
        rollouts = timed("rollout.generate", w["rollout"].generate, prompts)
        batch = rollouts.union(timed("reward.score", w["reward"].score, rollouts))
        if self.old_logprobs == "recompute":
            batch = batch.union(timed("policy.logprobs", w["policy"].logprobs, rollouts))
        if "reference" in w:
            batch = batch.union(timed("reference.logprobs", w["reference"].logprobs, rollouts))
        batch = timed("apply_compute_advantages", whole_batch.compute_advantages, batch, prompts, estimator=alg.advantage,
                      gamma=alg.gamma, lam=alg.lam, eps=alg.norm_eps, kl_kind=alg.kl_in_reward.kind,
                      old_from_rollout=self.old_logprobs == "rollout")
        metrics = timed("policy.update", w["policy"].update, batch)
        timed("rollout.load_weights", w["rollout"].load_weights, w["policy"].weight_buckets(self.bucket_bytes),
              step + 1)
        metrics.update(timed("apply_rollout_metrics", step_metrics.rollout_metrics, batch))
        step_s = time.perf_counter() - t0
        self.kl_ctl.update(metrics.get("actor/kl_in_reward", 0.0), len(prompts) * self.cfg.rollout.n)
        return {"step_s": step_s, "reward/mean": metrics["reward/mean"], **seconds}


class OneActor:
    """The `full` lower bound inside ONE Ray actor, one task per step: what a step fused into a
    single actor call would cost (the actor process and one round trip, nothing else)."""

    def __init__(self, cfg):
        import ray

        cls = ray.remote(num_cpus=0)(LowerBound)
        self.actor = cls.options(runtime_env={"env_vars": {"OMP_NUM_THREADS": "1"}}).remote(cfg, threads=1)

    def step(self, step: int) -> dict:
        import ray

        t0 = time.perf_counter()
        row = ray.get(self.actor.step.remote(step))
        return {**row, "step_s": time.perf_counter() - t0}


class RaygraphLoop:
    """`raygraph.trainer.run`'s step loop (same roles, DAG, executor, warm start) without logging."""

    def __init__(self, cfg, *, actor_threads: int | None = None, dashboard: bool = True):
        from raygraph.cluster import build_roles
        from raygraph.config.workflow_ref import load_workflow
        from raygraph.graph import GraphBuilder
        from raygraph.graph.executor import Executor
        from raygraph.run.feed import StepData
        from raygraph.run.role_specs import placement_plan, role_specs
        from raygraph.run.setup import prepare_run, start_ray
        from raygraph.run.warm_start import run_warm_start

        self.cfg = cfg
        ctx = prepare_run(cfg)
        workflow = load_workflow(cfg.workflow)
        if not dashboard:   # investigation: the same local Ray without the dashboard processes
            import ray

            from raygraph.run.setup import ACTOR_ENV

            ray.init(address="local", num_cpus=max(os.cpu_count() or 1, 4), include_dashboard=False,
                     runtime_env={"env_vars": dict(ACTOR_ENV)})
        start_ray(cfg, None)   # no-op when Ray is up
        specs = role_specs(cfg, workflow.roles)
        p, plan = cfg.placement, placement_plan(cfg, workflow.roles)
        self.roles = build_roles(run_name=ctx.ray_name, pools=plan.pools, specs=specs, colocate=plan.fused,
                                 weight_sync=plan.weight_sync, placement_timeout_s=p.placement_timeout_s,
                                 weight_sync_timeout_s=p.weight_sync_timeout_s,
                                 bucket_bytes=p.weight_bucket_mb << 20, weight_sync_verify=p.weight_sync_verify,
                                 env_vars={"OMP_NUM_THREADS": str(actor_threads)} if actor_threads else None)
        if cfg.trainer.warm_start is not None:
            run_warm_start(cfg, self.roles)
        self.executor = Executor(workflow.build(GraphBuilder.of(self.roles), cfg), self.roles,
                                 mode=cfg.trainer.executor)
        self.data, self.kl_ctl = StepData.load(cfg), _kl_controller(cfg)
        self.roles.take_step_stats()

    def step(self, step: int) -> dict:
        from raygraph.run.feed import merge_outputs

        t0 = time.perf_counter()
        prompts = self.data.next_prompts(step=step, kl_coef=self.kl_ctl.value)
        metrics = merge_outputs(self.executor.run(prompts))
        step_s = time.perf_counter() - t0
        metrics.update(self.roles.take_step_stats())
        self.kl_ctl.update(metrics.get("actor/kl_in_reward", 0.0), len(prompts) * self.cfg.rollout.n)
        stages = {k: v for k, v in metrics.items() if k.startswith("timing/")}
        return {"step_s": step_s, "reward/mean": metrics["reward/mean"], **stages}

    def close(self) -> None:
        self.executor.teardown()
        self.roles.shutdown()


def _stats(rows: list[dict]) -> dict:
    step_s = [r["step_s"] for r in rows]
    keys = sorted({k for r in rows for k in r if k.startswith("timing/")})
    return {"step_s_median": round(statistics.median(step_s), 5), "step_s_mean": round(statistics.fmean(step_s), 5),
            "stages_mean_s": {k: round(statistics.fmean(r.get(k, 0.0) for r in rows), 5) for k in keys}}


def paired(cfg, *, steps: int, warmup: int, variants: list[str], threads: list[int],
           actor_threads: int | None = None, dashboard: bool = True) -> dict:
    """Raygraph and lower-bound steps interleaved one by one; per-step ratios."""
    from raygraph.run.setup import ensure_assets

    ensure_assets(cfg)
    sides = {f"lower_bound_{v}_{t}thread": LowerBound(cfg, threads=t, old_logprobs="recompute" if v == "recompute" else None)
             for t in threads for v in variants if v != "one_actor"}
    torch.set_num_threads(1)
    sides["raygraph"] = RaygraphLoop(cfg, actor_threads=actor_threads, dashboard=dashboard)
    if "one_actor" in variants:
        sides["lower_bound_in_one_actor"] = OneActor(cfg)
    rows: dict[str, list[dict]] = {name: [] for name in sides}
    loads = []
    try:
        names = list(sides)
        for step in range(1, warmup + steps + 1):
            order = names[step % len(names):] + names[:step % len(names)]   # rotate who goes first
            for name in order:
                rows[name].append(sides[name].step(step))
            loads.append(os.getloadavg()[0])
    finally:
        sides["raygraph"].close()
    timed = {name: r[warmup:] for name, r in rows.items()}
    rg = timed["raygraph"]
    out: dict = {"raygraph": _stats(rg), "load_avg_1min": {"min": round(min(loads), 2), "max": round(max(loads), 2),
                                                           "median": round(statistics.median(loads), 2)}}
    out["raygraph"]["outside_stages_s"] = round(out["raygraph"]["step_s_mean"] - sum(
        v for k, v in out["raygraph"]["stages_mean_s"].items()), 5)
    for name in sides:
        if name == "raygraph":
            continue
        ratios = [g["step_s"] / b["step_s"] for g, b in zip(rg, timed[name])]
        q = statistics.quantiles(ratios, n=4)
        out[name] = {**_stats(timed[name]), "overhead": round(statistics.median(ratios), 3),
                     "overhead_iqr": [round(q[0], 3), round(q[2], 3)],
                     "ratio_of_medians": round(out["raygraph"]["step_s_median"] / statistics.median(
                         r["step_s"] for r in timed[name]), 3),
                     "same_samples": [r["reward/mean"] for r in rows[name]] == [r["reward/mean"] for r in rows["raygraph"]]}
    full = next((n for n in timed if n.startswith("lower_bound_full_1")), None)
    if full and "lower_bound_in_one_actor" in timed:   # what one actor task per step costs over in-process
        out["lower_bound_in_one_actor"]["vs_in_process"] = round(statistics.median(
            a["step_s"] / b["step_s"] for a, b in zip(timed["lower_bound_in_one_actor"], timed[full])), 3)
    return out


def step_time_subprocess(config: str, overrides: list[str], steps: int, warmup: int) -> dict:
    """`benchmarks/step_time.py` (a real `raygraph train`) in a subprocess; its JSON."""
    proc = subprocess.run([sys.executable, str(Path(__file__).with_name("step_time.py")), config, *overrides,
                           "--steps", str(steps), "--warmup", str(warmup)], capture_output=True, text=True)
    if proc.returncode:
        raise RuntimeError(f"step_time.py failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    out = json.loads(proc.stdout[proc.stdout.rfind("\n{") + 1:])
    return {k: out[k] for k in ("step_s_median", "step_s_mean", "stages_mean_s")}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("config")
    parser.add_argument("overrides", nargs="*", help="key.path=value overrides (both sides)")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--variants", default="full,recompute,one_actor",
                        help="lower-bound variants: full, recompute, one_actor")
    parser.add_argument("--threads", default="1", help="comma-separated torch threads for the lower bound")
    parser.add_argument("--rounds", type=int, default=1, help="step_time.py subprocess runs (0 = none)")
    parser.add_argument("--actor-threads", type=int, default=None,
                        help="investigation: OMP_NUM_THREADS of the paired run's actors (build_roles env_vars; "
                             "default: the actor's whole CPUs)")
    parser.add_argument("--no-dashboard", action="store_true",
                        help="investigation: start the paired run's local Ray without the dashboard")
    args = parser.parse_args()
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    started = time.strftime("%Y-%m-%d %H:%M %Z")
    # trainer output (warm start, Ray) goes to stderr; stdout is the JSON
    with tempfile.TemporaryDirectory(prefix="raygraph-lb-") as tmp, contextlib.redirect_stdout(sys.stderr):
        cfg = _load_cfg(args.config, args.overrides, tmp)
        result = {"config": args.config, "overrides": args.overrides, "placement_mode": cfg.placement.mode,
                  "executor": cfg.trainer.executor, "steps": args.steps, "warmup": args.warmup, "date": started,
                  "machine": f"{os.cpu_count()} CPUs, torch {torch.__version__}",
                  "paired": paired(cfg, steps=args.steps, warmup=args.warmup, variants=args.variants.split(","),
                                   threads=[int(t) for t in args.threads.split(",")],
                                   actor_threads=args.actor_threads, dashboard=not args.no_dashboard)}
        result["paired"].update(actor_threads=args.actor_threads or "cpu share", dashboard=not args.no_dashboard,
                                old_logprobs=cfg.old_logprobs_source)
    runs = []
    for _ in range(args.rounds):
        runs.append({**step_time_subprocess(args.config, args.overrides, args.steps, args.warmup),
                     "load_avg_1min": round(os.getloadavg()[0], 2)})
    if runs:
        lb = result["paired"][next(k for k in result["paired"] if k.startswith("lower_bound_full"))]
        result["step_time"] = {"runs": runs, "step_s_median_of_runs": statistics.median(r["step_s_median"] for r in runs),
                               "vs_paired_lower_bound_full": round(statistics.median(
                                   r["step_s_median"] for r in runs) / lb["step_s_median"], 3)}
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
