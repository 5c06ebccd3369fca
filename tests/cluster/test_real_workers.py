"""The runtime with the real workers and the tiny model: colocated vs disaggregated placement
give identical rollouts and updates, and weight sync is bit-exact and versioned."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("raygraph.workers.policy")
pytest.importorskip("raygraph.workers.rollout_hf")

from raygraph.cluster import PoolSpec, RoleSpec, build_roles  # noqa: E402
from raygraph.graph import GraphBuilder, InputNode, MultiOutputNode
from raygraph.graph.executor import Executor  # noqa: E402


@pytest.fixture(scope="module")
def real(ray_local):
    import _real

    ray_local.cloudpickle.register_pickle_by_value(_real)
    return _real


@pytest.fixture(scope="module")
def layouts(real, tiny_model_path):
    pools = {"train": PoolSpec(bundles=1, cpus_per_bundle=1.0)}
    specs = {"policy": RoleSpec(real.InspectablePolicy, {"model_path": tiny_model_path, "lr": 1e-2,
                                                          "micro_batch_size": 4}, pool="train"),
             "rollout": RoleSpec(real.InspectableRollout, {"model_path": tiny_model_path, "seed": 3, "n": 2,
                                                            "max_new_tokens": 6}, pool="train")}
    out = {}
    try:
        for mode in ("colocated", "disaggregated"):
            out[mode] = build_roles(f"test-real/{mode}", pools, specs, weight_sync=[("policy", "rollout")],
                                    colocate=[("policy", "rollout")] if mode == "colocated" else [], bucket_bytes=64 << 10)
        yield out
    finally:
        for roles in out.values():
            roles.shutdown()


def _step(roles, real):
    g = GraphBuilder.of(roles)
    with InputNode() as prompts:
        rollouts = g.rollout.bind("generate", prompts)
        old = g.policy.bind("logprobs", rollouts)
        batch = g.apply(real.signed_advantages, g.gather(rollouts, old))
        metrics = g.policy.bind("update", batch)
        return MultiOutputNode([g.gather(metrics), g.sync_weights(after=metrics),
                                g.apply(real.digest, batch)])


def test_layouts_agree_and_sync_is_bit_exact(layouts, real, tiny_model_path):
    prompts = real.prompts(tiny_model_path)
    seen = {}
    for mode, roles in layouts.items():
        executor = Executor(_step(roles, real), roles)
        assert executor.plan.fused == (mode == "colocated")   # one rank, one actor: one task per step
        metrics, sync, digest = executor.run(prompts)
        _, sync2, digest2 = executor.run(prompts)
        assert sync["weights/verified"] == sync2["weights/verified"] == 1.0, mode
        assert set(digest["versions"]) == {0} and set(digest2["versions"]) == {int(sync["weights/version"])}
        assert sync2["weights/version"] == sync["weights/version"] + 1
        policy, rollout = roles.policy.call_rank0("state"), roles.rollout.call_rank0("state")
        assert all(torch.equal(policy[k], rollout[k]) for k in policy), mode
        assert sync["weights/bytes"] == sum(t.numel() * t.element_size() for t in policy.values())
        seen[mode] = (metrics, digest, digest2, policy)
    co, dis = seen["colocated"], seen["disaggregated"]
    assert co[1] == dis[1] and co[2] == dis[2]          # same rollouts before and after the update
    assert co[0] == dis[0]                              # same update metrics
    assert all(torch.equal(co[3][k], dis[3][k]) for k in co[3])
