"""Run in a subprocess by test_multinode.py: a two-node Ray cluster on this machine, a
disaggregated layout spanning both nodes, one RL-shaped step and a cross-node weight broadcast.
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
from raygraph.dag import Executor, InputNode, MultiOutputNode  # noqa: E402


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
        with build_roles("multinode/run", pools, specs, mode="disaggregated", placement_timeout_s=60,
                         weight_sync_timeout_s=30, bucket_bytes=300) as roles:
            first = roles.sync_weights_now()
            with InputNode() as prompts:
                rollouts = roles.rollout.bind("generate", prompts)
                batch = roles.apply(d.advantages, roles.gather(rollouts, roles.reward.bind("score", rollouts)))
                metrics = roles.policy.bind("update", batch)
                dag = MultiOutputNode([roles.gather(metrics), roles.sync_weights(after=metrics),
                                       roles.apply(d.digest, batch)])
            executor = Executor(dag)
            metrics, sync, digest = executor.run(d.prompts(4, per_group=2))
            policy = roles.policy.call_rank0("state")
            equal = [all(torch.equal(policy[k], s[k]) for k in policy) for s in roles.rollout.call("state")]
            result = {"rollout_nodes": sorted({s.node_id for s in roles.rollout.sites}),
                      "policy_nodes": sorted({s.node_id for s in roles.policy.sites}),
                      "first": first, "sync": sync, "metrics": metrics, "equal": equal,
                      "versions": digest["versions"]}
    finally:
        ray.shutdown()
        cluster.shutdown()
    print("RESULT " + json.dumps(result))
    ok = (len(result["rollout_nodes"]) == 2 and len(result["policy_nodes"]) == 2 and all(equal)
          and sync["weights/verified"] == 1.0 and first["weights/verified"] == 1.0
          and set(result["versions"]) == {int(first["weights/version"])})
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
