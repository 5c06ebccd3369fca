"""Pure parts of the runtime (no Ray actors): graph building and lowering, gather/scatter, bucket packing."""

from __future__ import annotations

import pytest
import torch

from raygraph.batch import PROMPT_IDS, UID, Batch
from raygraph.cluster import tasks
from raygraph.cluster.weights import InProcessTransport, bucket_checksum, pack_bucket, unpack_bucket
from raygraph.graph import GraphBuilder, GraphBuildError, InputNode, MultiOutputNode
from raygraph.graph.lowering import lower


class _Worker:
    """What the lowering tests' graphs call."""

    def generate(self, batch, greedy=False): ...

    def logprobs(self, batch): ...

    def score(self, batch): ...


def summarise(batch):
    return {}


def _layout(worlds):
    return {role: (_Worker, [f"{role}/{r}" for r in range(w)]) for role, w in worlds.items()}


def test_lowering_splits_once_passes_rank_wise_and_resplits_on_mismatch(fake_roles):
    roles = fake_roles(_layout({"rollout": 2, "policy": 2, "reward": 1}))
    g = GraphBuilder.of(roles)
    with InputNode() as prompts:
        rollouts = g.rollout.bind("generate", prompts, greedy=True)
        old = g.policy.bind("logprobs", rollouts)          # same world: rank-wise, no coordinator task
        scores = g.reward.bind("score", rollouts)          # 2 -> 1: one re-split on the coordinator
        dag = MultiOutputNode([g.gather(rollouts, old, scores)])
    plan = lower(dag, roles)
    ops = [(op.actor.name, op.task.label) for op in plan.ops]
    assert ops == [("coordinator", "scatter"), ("rollout/0", "rollout.generate"), ("rollout/1", "rollout.generate"),
                   ("policy/0", "policy.logprobs"), ("policy/1", "policy.logprobs"),
                   ("coordinator", "scatter"), ("reward/0", "reward.score"), ("coordinator", "gather")]
    gen0, logp1 = plan.ops[1], plan.ops[4]
    assert gen0.task.kwargs == {"greedy": tasks.Arg(const=True)} and gen0.inputs == [(0, 0)]
    assert logp1.inputs == [(2, 0)]                             # rank 1's rollout shard, by reference
    assert plan.ops[7].task.groups == (2, 2, 1) and plan.outputs == [(7, 0)]


def test_apply_rejects_lambdas_and_dag_must_use_its_input(fake_roles):
    roles = fake_roles(_layout({"rollout": 1}))
    g = GraphBuilder.of(roles)
    with pytest.raises(TypeError, match="module-level"):
        g.apply(lambda b: b)
    with pytest.raises(ValueError, match="InputNode"):
        lower(MultiOutputNode([g.gather(g.rollout.bind("generate", 3))]), roles)


def test_method_names_are_checked_when_the_graph_is_built():
    g = GraphBuilder({"policy": _Worker, "rollout": _Worker})
    with pytest.raises(GraphBuildError, match=r"role 'policy' \(_Worker\) has no method 'updat'; "
                                              r"valid methods: generate, logprobs, score"):
        g.policy.bind("updat", None)
    with pytest.raises(GraphBuildError, match=r"no role 'critic'; roles are \['policy', 'rollout'\]"):
        g.critic.bind("values", None)
    with pytest.raises(GraphBuildError, match="no method 'weight_buckets'"):
        g.sync_weights()                                     # _Worker cannot send weights


def test_lowering_refuses_a_role_the_run_did_not_start(fake_roles):
    with InputNode() as prompts:
        dag = MultiOutputNode([GraphBuilder({"critic": _Worker}).critic.bind("score", prompts)])
    with pytest.raises(GraphBuildError, match="role 'critic', which this run did not start"):
        lower(dag, fake_roles(_layout({"rollout": 1})))


def test_gather_concatenates_shards_unions_inputs_and_averages_metrics():
    a = Batch({PROMPT_IDS: torch.arange(4).reshape(2, 2)}, {UID: ["a", "a"]})
    b = Batch({PROMPT_IDS: torch.arange(4, 8).reshape(2, 2)}, {UID: ["b", "b"]})
    scores = Batch({"score": torch.tensor([1.0, 2.0, 3.0, 4.0])})
    whole = tasks.gather([a, b, scores], groups=(2, 1))
    assert whole[PROMPT_IDS].tolist() == [[0, 1], [2, 3], [4, 5], [6, 7]] and whole["score"].tolist() == [1, 2, 3, 4]
    assert tasks.gather([{"x": 1.0, "s": "r0"}, {"x": 3.0, "s": "r1"}], groups=(2,)) == {"x": 2.0, "s": "r0"}
    parts = tasks.scatter(tasks.merge_shards([a, b]), 2)
    assert [list(p[UID]) for p in parts] == [["a", "a"], ["b", "b"]]
    assert tasks.scatter({"k": 1}, 3) == [{"k": 1}] * 3


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
    with pytest.raises(ValueError, match="must share pool and world_size"):
        build_roles("x", pools, specs, colocate=[("policy", "reward")])
    with pytest.raises(ValueError, match="unknown role 'critic'"):
        build_roles("x", pools, specs, colocate=[("policy", "critic")])
    with pytest.raises(ValueError, match="uses pool 'q'"):
        build_roles("x", pools, {"policy": RoleSpec(dict, pool="q")})
