"""Pure parts of the runtime (no Ray actors): DAG lowering, gather/scatter, bucket packing."""

from __future__ import annotations

import pytest
import torch

from raygraph.batch import PROMPT_IDS, UID, Batch
from raygraph.cluster import steps as S
from raygraph.cluster.weights import InProcessTransport, bucket_checksum, pack_bucket, unpack_bucket
from raygraph.dag import InputNode, MultiOutputNode, lower


class _FakeActor:
    def __init__(self, name):
        self.name = name
        self._actor_id = type("Id", (), {"hex": lambda _self: name})()


class _FakeRoles:
    """Just enough of `Roles` for lowering: groups with fake actors, and a coordinator."""

    run_name = "fake"

    def __init__(self, worlds):
        from raygraph.cluster.errors import CallSite
        from raygraph.cluster.roles import RoleGroup

        self.coordinator = _FakeActor("coordinator")
        self.groups = {role: RoleGroup(role, self, [_FakeActor(f"{role}/{r}") for r in range(w)],
                                       [CallSite(role, r) for r in range(w)]) for role, w in worlds.items()}

    def __getattr__(self, name):
        return self.__dict__["groups"][name]

    def gather(self, *nodes):
        from raygraph.dag import GatherNode

        return GatherNode(self, nodes)


def summarise(batch):
    return {}


def test_lowering_splits_once_passes_rank_wise_and_resplits_on_mismatch():
    roles = _FakeRoles({"rollout": 2, "policy": 2, "reward": 1})
    with InputNode() as prompts:
        rollouts = roles.rollout.bind("generate", prompts, greedy=True)
        old = roles.policy.bind("logprobs", rollouts)          # same world: rank-wise, no coordinator step
        scores = roles.reward.bind("score", rollouts)          # 2 -> 1: one re-split on the coordinator
        dag = MultiOutputNode([roles.gather(rollouts, old, scores)])
    plan = lower(dag)
    ops = [(op.actor.name, op.step.label) for op in plan.ops]
    assert ops == [("coordinator", "scatter"), ("rollout/0", "rollout.generate"), ("rollout/1", "rollout.generate"),
                   ("policy/0", "policy.logprobs"), ("policy/1", "policy.logprobs"),
                   ("coordinator", "scatter"), ("reward/0", "reward.score"), ("coordinator", "gather")]
    gen0, logp1 = plan.ops[1], plan.ops[4]
    assert gen0.step.kwargs == {"greedy": S.Arg(const=True)} and gen0.inputs == [(0, 0)]
    assert logp1.inputs == [(2, 0)]                             # rank 1's rollout shard, by reference
    assert plan.ops[7].step.groups == (2, 2, 1) and plan.outputs == [(7, 0)]


def test_apply_rejects_lambdas_and_dag_must_use_its_input():
    from raygraph.dag import ApplyNode

    roles = _FakeRoles({"rollout": 1})
    with pytest.raises(TypeError, match="module-level"):
        ApplyNode(roles, lambda b: b, (), {})
    with pytest.raises(ValueError, match="InputNode"):
        lower(MultiOutputNode([roles.gather(roles.rollout.bind("generate", 3))]))


def test_gather_concatenates_shards_unions_inputs_and_averages_metrics():
    a = Batch({PROMPT_IDS: torch.arange(4).reshape(2, 2)}, {UID: ["a", "a"]})
    b = Batch({PROMPT_IDS: torch.arange(4, 8).reshape(2, 2)}, {UID: ["b", "b"]})
    scores = Batch({"score": torch.tensor([1.0, 2.0, 3.0, 4.0])})
    whole = S.gather([a, b, scores], groups=(2, 1))
    assert whole[PROMPT_IDS].tolist() == [[0, 1], [2, 3], [4, 5], [6, 7]] and whole["score"].tolist() == [1, 2, 3, 4]
    assert S.gather([{"x": 1.0, "s": "r0"}, {"x": 3.0, "s": "r1"}], groups=(2,)) == {"x": 2.0, "s": "r0"}
    parts = S.scatter(S.merge_shards([a, b]), 2)
    assert [list(p[UID]) for p in parts] == [["a", "a"], ["b", "b"]]
    assert S.scatter({"k": 1}, 3) == [{"k": 1}] * 3


def test_pack_unpack_roundtrip_and_checksum_sees_one_flipped_bit():
    bucket = [("w", torch.randn(3, 5)), ("b", torch.randn(7).to(torch.bfloat16)), ("i", torch.arange(3))]
    meta, payload = pack_bucket(bucket, torch.device("cpu"))
    back = unpack_bucket(meta, payload)
    assert [n for n, _ in back] == ["w", "b", "i"] and all(torch.equal(x, y) for (_, x), (_, y) in zip(bucket, back))
    assert meta["checksum"] == bucket_checksum(t for _, t in back)
    payload.view(torch.uint8)[3] ^= 1
    assert meta["checksum"] != bucket_checksum(t for _, t in unpack_bucket(meta, payload))


def test_in_process_transport_loads_verified_buckets_and_reports_corruption():
    src = [[("a", torch.ones(4))], [("b", torch.zeros(2))]]
    loaded = {}

    def load(buckets, version):
        for bucket in buckets:
            loaded.update({n: t.clone() for n, t in bucket})
        loaded["version"] = version

    t = InProcessTransport()
    t.send(iter(src), 7, corrupt_bucket=1)
    stats = t.receive(load, strict=False)
    assert stats["weights/verified"] == 0.0 and "bucket 1" in stats["weights/errors"][0]
    assert set(loaded) == {"a", "version"} and loaded["version"] == 7   # the bad bucket was skipped
    t.send(iter(src), 8)
    assert t.receive(load)["weights/verified"] == 1.0 and torch.equal(loaded["b"], torch.zeros(2))


def test_build_roles_rejects_bad_layouts_before_touching_ray():
    from raygraph.cluster import PoolSpec, RoleSpec, build_roles

    pools = {"p": PoolSpec(bundles=2)}
    specs = {"policy": RoleSpec(dict, world_size=2, pool="p"), "rollout": RoleSpec(dict, world_size=2, pool="p"),
             "reward": RoleSpec(dict, world_size=1, pool="p")}
    with pytest.raises(ValueError, match="disaggregated mode cannot fuse 'policy' and 'rollout'"):
        build_roles("x", pools, specs, mode="disaggregated", colocate=[("policy", "rollout")])
    with pytest.raises(ValueError, match="must share pool and world_size"):
        build_roles("x", pools, specs, mode="colocated", colocate=[("policy", "reward")])
    with pytest.raises(ValueError, match="unknown role 'critic'"):
        build_roles("x", pools, specs, colocate=[("policy", "critic")])
    with pytest.raises(ValueError, match="uses pool 'q'"):
        build_roles("x", pools, {"policy": RoleSpec(dict, pool="q")})
