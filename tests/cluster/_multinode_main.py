"""Run in a subprocess by test_multinode.py: a two-node Ray cluster on this machine, a
disaggregated layout spanning both nodes, one RL-shaped step per executor (interpreted, then
compiled) with a cross-node weight broadcast each.
Prints one JSON line; exits non-zero on failure."""

from __future__ import annotations

import json
import os
import sys

import ray
import torch
from ray.cluster_utils import Cluster

sys.path.insert(0, os.path.dirname(__file__))
import _dummies as d  # noqa: E402

from raygraph.cluster import PoolSpec, RoleSpec, build_roles  # noqa: E402
from raygraph.graph import GraphBuilder, InputNode, MultiOutputNode
from raygraph.graph.executor import Executor  # noqa: E402


def main() -> None:
    env = {"OMP_NUM_THREADS": "1"}
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 2, "env_vars": env})
    cluster.add_node(num_cpus=2, env_vars=env)
    cluster.wait_for_nodes()
    ray.init(address=cluster.address, runtime_env={"env_vars": env})
    ray.cloudpickle.register_pickle_by_value(d)
    pools = {"train": PoolSpec(bundles=2, cpus_per_bundle=0.5, strategy="STRICT_SPREAD"),
             "gen": PoolSpec(bundles=2, cpus_per_bundle=0.5, strategy="STRICT_SPREAD")}
    specs = {"policy": RoleSpec(d.Policy, {"seed": 0}, world_size=2, pool="train", distributed=True),
             "rollout": RoleSpec(d.Rollout, {"seed": 0}, world_size=2, pool="gen"),
             "reward": RoleSpec(d.Reward, {}, world_size=1, pool="gen")}
    try:
        with build_roles("multinode/run", pools, specs, weight_sync=[("policy", "rollout")], placement_timeout_s=60,
                         weight_sync_timeout_s=30, bucket_bytes=300) as roles:
            first = roles.weights.sync_now()
            g = GraphBuilder.of(roles)
            with InputNode() as prompts:
                rollouts = g.rollout.bind("generate", prompts)
                batch = g.apply(d.advantages, g.gather(rollouts, g.reward.bind("score", rollouts)))
                metrics = g.policy.bind("update", batch)
                dag = MultiOutputNode([g.gather(metrics), g.sync_weights(after=metrics),
                                       g.apply(d.digest, batch)])
            runs = {}
            for mode in ("interpreted", "compiled"):   # one step each; the second sees the first's update
                executor = Executor(dag, roles, mode=mode)
                try:
                    runs[mode] = executor.run(d.prompts(4, per_group=2))
                finally:
                    executor.teardown()
            policy = roles.policy.call_rank0("state")
            equal = [all(torch.equal(policy[k], s[k]) for k in policy) for s in roles.rollout.call("state")]
            result = {"rollout_nodes": sorted({s.node_id for s in roles.rollout.sites}),
                      "policy_nodes": sorted({s.node_id for s in roles.policy.sites}),
                      "first": first, "equal": equal,
                      "syncs": [runs[m][1] for m in runs], "versions": [runs[m][2]["versions"] for m in runs]}
    finally:
        ray.shutdown()
        cluster.shutdown()
    print("RESULT " + json.dumps(result))
    v0 = int(first["weights/version"])
    ok = (len(result["rollout_nodes"]) == 2 and len(result["policy_nodes"]) == 2 and all(equal)
          and all(s["weights/verified"] == 1.0 for s in [first, *result["syncs"]])
          and [set(v) for v in result["versions"]] == [{v0}, {v0 + 1}])
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
