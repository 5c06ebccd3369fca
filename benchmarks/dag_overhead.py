"""Per-step overhead of the DAG executors on a no-op DAG over real role groups.

The DAG has the shape of a GRPO step (generate on 2 rollout ranks -> score on 1 reward rank
(re-split) + logprobs on 2 policy ranks -> gather -> apply -> update on 2 policy ranks ->
gathered metrics + summary), every worker method returns immediately, so the wall time per
step is the runtime's own cost: task submission, scatter/gather on the coordinator, object
transfer and result collection. Run for both executors and both placement modes.

    .venv/bin/python benchmarks/dag_overhead.py [--steps 50] [--rows 64]

Prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import numpy as np
import ray
import torch

from raygraph.batch import PROMPT_IDS, RESPONSES, TOKEN_LEVEL_SCORES, UID, Batch
from raygraph.cluster import PoolSpec, RoleSpec, build_roles
from raygraph.graph import GraphBuilder, InputNode, MultiOutputNode
from raygraph.graph.executor import Executor


class NoOp:
    """Returns immediately; Batch-returning methods return one small new column."""

    def generate(self, batch: Batch) -> Batch:
        return batch.with_columns(**{RESPONSES: batch[PROMPT_IDS]})

    def score(self, batch: Batch) -> Batch:
        return Batch({TOKEN_LEVEL_SCORES: torch.zeros(len(batch))})

    def logprobs(self, batch: Batch) -> Batch:
        return Batch({"old_logprobs": torch.zeros(len(batch))})

    def update(self, batch: Batch) -> dict:
        return {"actor/rows": float(len(batch))}


def identity(batch: Batch) -> Batch:
    return batch


def summary(batch: Batch) -> dict:
    return {"rows": float(len(batch))}


def build_dag(roles):
    g = GraphBuilder.of(roles)
    with InputNode() as prompts:
        rollouts = g.rollout.bind("generate", prompts)
        batch = g.gather(rollouts, g.reward.bind("score", rollouts), g.policy.bind("logprobs", rollouts))
        batch = g.apply(identity, batch)
        metrics = g.policy.bind("update", batch)
        return MultiOutputNode([g.gather(metrics), g.apply(summary, batch)])


def measure(roles, mode: str, prompts: Batch, steps: int) -> dict:
    executor = Executor(build_dag(roles), roles, mode=mode)
    try:
        for _ in range(5):
            executor.run(prompts)
        times = []
        for _ in range(steps):
            start = time.perf_counter()
            executor.run(prompts)
            times.append(time.perf_counter() - start)
    finally:
        executor.teardown()
    times_ms = sorted(t * 1e3 for t in times)
    return {"mean_ms": round(statistics.mean(times_ms), 2), "p50_ms": round(times_ms[len(times_ms) // 2], 2),
            "p90_ms": round(times_ms[int(len(times_ms) * 0.9)], 2), "actor_calls_per_step": len(executor.plan.ops),
            "driver_bytes_received": executor.last_driver_bytes, "driver_bytes_sent": executor.last_input_bytes}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--rows", type=int, default=64)
    args = parser.parse_args()
    ray.init(num_cpus=8, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"OMP_NUM_THREADS": "1"}})
    prompts = Batch({PROMPT_IDS: torch.zeros(args.rows, 128, dtype=torch.int64)},
                    {UID: np.array([f"p{i}" for i in range(args.rows)], dtype=object)})
    pools = {"train": PoolSpec(bundles=2, cpus_per_bundle=1.0)}
    specs = {"policy": RoleSpec(NoOp, world_size=2, pool="train"),
             "rollout": RoleSpec(NoOp, world_size=2, pool="train"),
             "reward": RoleSpec(NoOp, world_size=1, pool="train")}
    result = {"steps": args.steps, "rows": args.rows, "batch_bytes": prompts.nbytes()}
    for placement in ("colocated", "disaggregated"):
        with build_roles(f"bench-dag/{placement}", pools, specs,
                         colocate=[("policy", "rollout")] if placement == "colocated" else [], weight_sync=()) as roles:
            result[placement] = {mode: measure(roles, mode, prompts, args.steps)
                                 for mode in ("interpreted", "compiled")}
    print(json.dumps(result, indent=1))
    ray.shutdown()


if __name__ == "__main__":
    main()
