"""The Ray layer with dummy workers: layouts, DAG executors, weight sync, failures."""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest
import ray
import torch

from raygraph.cluster import PlacementError, PoolSpec, RoleError, RoleSpec, build_roles
from raygraph.graph import GraphBuilder, InputNode, MultiOutputNode
from raygraph.graph.executor import Executor


def _specs(d, policy_world=2, rollout_world=2):
    return {"policy": RoleSpec(d.Policy, {"seed": 0}, world_size=policy_world, pool="train", distributed=True),
            "rollout": RoleSpec(d.Rollout, {"seed": 0}, world_size=rollout_world, pool="train"),
            "reward": RoleSpec(d.Reward, {}, world_size=1, pool="train")}


def test_actor_threads_follow_its_cpu_share(dummies):
    """torch intra-op threads = the actor's whole CPUs: 2 alone in a 2-CPU bundle, 1 when two
    actors share it; an explicit OMP_NUM_THREADS wins. The driver's OMP_WAIT_POLICY (the suite sets
    PASSIVE, tests/conftest.py) reaches the actors, as docs/benchmarks.md tells shared machines to do.
    The actors set these themselves, with no Ray runtime env (which would start each through Ray's
    setup_worker process, docs/runtime.md) unless `env_vars` asks for variables of the caller's.
    First in the file: its 2-CPU bundle needs room that the module's layouts (5 of the 8 CPUs) take."""
    pools = {"p": PoolSpec(bundles=1, cpus_per_bundle=2.0)}
    alone = {"policy": RoleSpec(dummies.Policy, {}, world_size=1, pool="p")}
    with build_roles("test-runtime/threads", pools, alone) as roles:
        env = roles.policy.call_rank0("env")
        assert env["OMP_NUM_THREADS"] == "2" and env["OMP_WAIT_POLICY"] == os.environ["OMP_WAIT_POLICY"] == "PASSIVE"
        assert env["TOKENIZERS_PARALLELISM"] == "false" and env["runtime_env_vars"] == {}
        assert roles.policy.call_rank0("threads") == 2
    shared = {**alone, "rollout": RoleSpec(dummies.Rollout, {}, world_size=1, pool="p")}
    with build_roles("test-runtime/threads2", pools, shared, weight_sync=[("policy", "rollout")]) as roles:
        env = roles.policy.call_rank0("env")
        assert env["OMP_NUM_THREADS"] == "1" and env["runtime_env_vars"] == {}
        assert roles.policy.call_rank0("threads") == 1
    with build_roles("test-runtime/threads3", pools, alone, env_vars={"OMP_NUM_THREADS": "3"}) as roles:
        env = roles.policy.call_rank0("env")
        assert env["OMP_NUM_THREADS"] == "3" and env["runtime_env_vars"]["OMP_NUM_THREADS"] == "3"
        assert roles.policy.call_rank0("threads") == 3


@pytest.fixture(scope="module")
def layouts(dummies):
    pools = {"train": PoolSpec(bundles=2, cpus_per_bundle=1.0)}
    out = {}
    try:
        for mode in ("colocated", "disaggregated"):
            out[mode] = build_roles(f"test-runtime/{mode}", pools, _specs(dummies), weight_sync=[("policy", "rollout")],
                                    colocate=[("policy", "rollout")] if mode == "colocated" else [], placement_timeout_s=30,
                                    weight_sync_timeout_s=20, bucket_bytes=300)
        yield out
    finally:
        for roles in out.values():
            roles.shutdown()


def _rl_step(roles, d):
    """The shape of a GRPO step: generate -> score + logprobs -> gather -> apply -> update -> sync."""
    g = GraphBuilder.of(roles)
    with InputNode() as prompts:
        rollouts = g.rollout.bind("generate", prompts)
        scores = g.reward.bind("score", rollouts)           # world 1 <- world 2: re-split
        old = g.policy.bind("logprobs", rollouts)
        batch = g.apply(d.advantages, g.gather(rollouts, scores, old), gamma=1.0)
        metrics = g.policy.bind("update", batch)
        sync = g.sync_weights(after=metrics)
        return MultiOutputNode([g.gather(metrics), sync, g.apply(d.digest, batch)])


def _probe(roles, d, **generate_kwargs):
    g = GraphBuilder.of(roles)
    with InputNode() as prompts:
        rollouts = g.rollout.bind("generate", prompts, **generate_kwargs)
        batch = g.gather(rollouts, g.reward.bind("score", rollouts), g.policy.bind("logprobs", rollouts))
        return MultiOutputNode([g.apply(d.digest, batch), g.apply(d.summarise, batch)])


def test_names_ranks_and_process_groups(layouts, dummies):
    co, dis = layouts["colocated"], layouts["disaggregated"]
    assert ray.get_actor("test-runtime/colocated/policy+rollout/1")
    assert ray.get_actor("test-runtime/disaggregated/policy/1")
    assert ray.util.get_placement_group("test-runtime/colocated/train")
    pids = co.policy.call("pid")
    assert pids == co.rollout.call("pid") and len(set(pids)) == 2          # fused: same processes
    assert not set(dis.policy.call("pid")) & set(dis.rollout.call("pid"))  # separate processes
    env = dis.policy.call("env")
    assert [e["RANK"] for e in env] == ["0", "1"] and {e["WORLD_SIZE"] for e in env} == {"2"}
    assert {e["OMP_NUM_THREADS"] for e in env} == {"1"}
    assert co.policy.call_rank0("pid") == pids[0]


def test_layouts_identical_and_sync_bit_exact(layouts, dummies):
    """Same seed and weights -> same rollouts in both layouts; after update + sync every rollout
    rank holds the policy's weights bit for bit and the next batch carries the new version."""
    results = {}
    for mode, roles in layouts.items():
        first = roles.weights.sync_now()
        assert first["weights/verified"] == 1.0
        executor = Executor(_rl_step(roles, dummies), roles)
        metrics, sync, digest = executor.run(dummies.prompts(4, per_group=2))
        _, sync2, digest2 = executor.run(dummies.prompts(4, per_group=2))
        assert sync["weights/verified"] == sync2["weights/verified"] == 1.0
        assert sync2["weights/version"] == sync["weights/version"] + 1 == first["weights/version"] + 2
        assert set(digest["versions"]) == {first["weights/version"]}
        assert set(digest2["versions"]) == {sync["weights/version"]}
        assert metrics["actor/world"] == 2.0 and sync["weights/receivers"] == 2.0
        assert sync["weights/bytes"] == sum(t.numel() * 4 for t in dummies.make_weights(0).values())
        policy = roles.policy.call_rank0("state")
        for state in roles.rollout.call("state"):
            assert all(torch.equal(policy[k], state[k]) for k in policy)
        results[mode] = (metrics, digest, digest2)
    assert results["colocated"] == results["disaggregated"]


def test_compiled_equals_interpreted(layouts, dummies):
    for roles in layouts.values():
        roles.weights.sync_now()
        dag = _probe(roles, dummies, greedy=True)
        big = dummies.prompts(64, per_group=4, width=256)
        outs = {}
        for mode in ("interpreted", "compiled"):
            executor = Executor(dag, roles, mode=mode)
            try:
                outs[mode] = executor.run(big)
                if mode == "compiled":   # Ray allows one live compiled graph per actor: say so clearly
                    with pytest.raises(RuntimeError, match="already belong to a live compiled graph"):
                        Executor(dag, roles, mode="compiled")
                # the batch never reaches the driver: only the small outputs come back
                assert executor.last_driver_bytes < 20_000 < big.nbytes() < executor.last_input_bytes
            finally:
                executor.teardown()
            roles.policy.call("pid")     # ordinary calls still work between and after runs
        assert outs["interpreted"] == outs["compiled"]
        assert outs["interpreted"][1]["rows"] == 256.0


def test_corrupted_bucket_is_detected_not_loaded(layouts, dummies):
    for mode, roles in layouts.items():
        before = roles.rollout.call("state")
        with pytest.raises(RoleError, match="failed verification.*NOT loaded") as info:
            roles.weights.sync_now(corrupt_bucket=1)
        assert info.value.role == "rollout", mode
        after = roles.rollout.call("state")
        assert all(torch.equal(a["layer.w"], b["layer.w"]) for a, b in zip(before, after))  # bucket 1
        report = roles.weights.sync_now(corrupt_bucket=0, strict=False)
        assert report["weights/verified"] == 0.0
        assert roles.weights.sync_now()["weights/verified"] == 1.0   # the group is still in step


def test_worker_exception_names_role_rank_node(layouts):
    roles = layouts["disaggregated"]
    with pytest.raises(RoleError) as info:
        roles.policy.call("fail", "boom-42")
    err = info.value
    assert err.role == "policy" and err.rank in (0, 1) and err.node_ip and err.node_id
    assert "boom-42" in err.remote_traceback and "_dummies.py" in err.remote_traceback


def test_infeasible_placement_fails_within_bound(ray_local):
    start = time.monotonic()
    with pytest.raises(PlacementError) as info:
        build_roles("test-runtime/infeasible", {"big": PoolSpec(bundles=2, cpus_per_bundle=64, strategy="SPREAD")},
                    {}, placement_timeout_s=2)
    assert time.monotonic() - start < 10
    msg = str(info.value)
    assert "2 x {'CPU': 64.0} (SPREAD)" in msg and "the cluster has {CPU: 8}" in msg


def test_failing_constructor_names_role_and_cleans_up(dummies):
    pools = {"p": PoolSpec(bundles=1, cpus_per_bundle=0.5)}
    specs = {"policy": RoleSpec(dummies.Policy, {"no_such_arg": 1}, world_size=1, pool="p")}
    with pytest.raises(RoleError, match="no_such_arg") as info:
        build_roles("test-runtime/ctor", pools, specs)
    assert (info.value.role, info.value.method) == ("policy", "__init__")
    with pytest.raises(ValueError):
        ray.get_actor("test-runtime/ctor/policy/0")
    states = [pg["state"] for pg in ray.util.placement_group_table().values() if pg["name"] == "test-runtime/ctor/p"]
    assert states == ["REMOVED"]


def test_killed_actor_surfaces_within_seconds(dummies):
    """Rank 1 dies in the middle of a DAG step while rank 0 keeps running: the driver hears
    about rank 1 within seconds, not when rank 0 finishes."""
    pools = {"p": PoolSpec(bundles=2, cpus_per_bundle=0.5)}
    specs = {"policy": RoleSpec(dummies.Policy, {}, world_size=2, pool="p")}
    with build_roles("test-runtime/kill", pools, specs, weight_sync=[("policy", "rollout")]) as roles:
        g = GraphBuilder.of(roles)
        with InputNode() as prompts:
            dag = MultiOutputNode([g.gather(g.policy.bind("hang", prompts, seconds=60))])
        executor = Executor(dag, roles)
        pid = roles.policy.call("pid")[1]
        threading.Timer(1.0, os.kill, (pid, signal.SIGKILL)).start()
        start = time.monotonic()
        with pytest.raises(RoleError) as info:
            executor.run(dummies.prompts(2))
        assert time.monotonic() - start < 15
        assert (info.value.role, info.value.rank) == ("policy", 1)
        assert "died" in str(info.value)


def test_collective_member_missing_times_out_naming_it(dummies):
    pools = {"p": PoolSpec(bundles=3, cpus_per_bundle=0.5)}
    specs = {"policy": RoleSpec(dummies.Policy, {}, world_size=1, pool="p"),
             "rollout": RoleSpec(dummies.Rollout, {}, world_size=2, pool="p")}
    with build_roles("test-runtime/timeout", pools, specs, weight_sync=[("policy", "rollout")],
                     weight_sync_timeout_s=2) as roles:
        roles.rollout.actors[1].call.remote("rollout", "sleep", 8)   # rank 1 never joins in time
        start = time.monotonic()
        with pytest.raises(RoleError, match=r"rollout rank 1 .* did not arrive within 2s"):
            roles.weights.sync_now()
        assert time.monotonic() - start < 8


def test_unverified_weight_sync_reaches_the_transport(dummies):
    """build_roles(weight_sync_verify=False): the sender sends no checksums, the rollout loads
    the weights bit for bit and the sync says it was not verified."""
    pools = {"p": PoolSpec(bundles=2, cpus_per_bundle=0.5)}
    specs = {"policy": RoleSpec(dummies.Policy, {"seed": 0}, world_size=1, pool="p"),
             "rollout": RoleSpec(dummies.Rollout, {"seed": 1}, world_size=1, pool="p")}
    with build_roles("test-runtime/unverified", pools, specs, weight_sync=[("policy", "rollout")], bucket_bytes=300,
                     weight_sync_verify=False) as roles:
        report = roles.weights.sync_now()
        assert report["weights/verified"] == 0.0 and report["weights/receivers"] == 1.0
        policy, rollout = roles.policy.call_rank0("state"), roles.rollout.call_rank0("state")
        assert all(torch.equal(policy[k], rollout[k]) for k in policy)


def _stable(runs):
    """Step outputs without wall times and weight-version numbers (those count every sync)."""
    out = []
    for metrics, sync, digest in runs:
        sync = {k: v for k, v in sync.items() if k not in ("weights/sync_s", "weights/gbytes_per_s", "weights/version")}
        out.append((metrics, sync, {k: v for k, v in digest.items() if k != "versions"}))
    return out


@pytest.fixture(scope="module")
def single_actor(dummies):
    """Policy, rollout and reward fused into one actor (colocated, one rank)."""
    pools = {"train": PoolSpec(bundles=1, cpus_per_bundle=1.0)}
    with build_roles("test-runtime/fused", pools, _specs(dummies, 1, 1), weight_sync=[("policy", "rollout")],
                     colocate=[("policy", "rollout", "reward")], bucket_bytes=300) as roles:
        yield roles


def test_single_actor_plan_runs_as_one_task_with_identical_results(single_actor, dummies, layouts):
    roles = single_actor
    dag = _rl_step(roles, dummies)
    coordinator = "test-runtime/fused/coordinator"
    fused = Executor(dag, roles)
    assert coordinator not in ray.util.list_named_actors(), "a fused plan needs no coordinator actor"
    unfused = Executor(dag, roles, fuse=False)   # whole-batch steps as tasks of their own: started now
    assert coordinator in ray.util.list_named_actors()
    assert fused.plan.fused and len(fused.plan.ops) == 1 and not unfused.plan.fused
    assert len(unfused.plan.ops) > 8   # each node its own task (scatter, generate, score, ...)
    assert "rollout.generate" in fused.plan.describe() and "apply:advantages" in fused.plan.describe()
    # two ranks or two actors: plans stay as they are
    co = layouts["colocated"]
    assert not Executor(_rl_step(co, dummies), co).plan.fused
    start = roles.policy.call_rank0("state")
    results = {}
    for name, executor in (("fused", fused), ("unfused", unfused)):
        roles.policy.call("load_state", start)   # same starting weights for both
        roles.weights.sync_now()
        roles.take_step_stats()
        results[name] = [executor.run(dummies.prompts(4, per_group=2)) for _ in range(2)]
        timings = roles.take_step_stats()
        # per-stage clocks still see every stage, including the coordinator's (run in the actor now)
        assert {"timing/rollout.generate_s", "timing/policy.update_s", "timing/apply_advantages_s",
                "timing/gather_s"} <= set(timings), timings
        # peak memory per unit of fused roles: a Python process with torch loaded, on this machine
        assert 0.05 < timings["perf/peak_rss_gb/policy+rollout+reward"] < 24
        assert 0.05 < timings["perf/peak_rss_gb/coordinator"] < 24
        assert executor.last_driver_bytes < 5_000
    assert _stable(results["fused"]) == _stable(results["unfused"])
    first, second = results["fused"]
    assert second[1]["weights/version"] == first[1]["weights/version"] + 1
    assert set(second[2]["versions"]) == {int(first[1]["weights/version"])}   # rollout used the synced weights


def test_single_actor_plan_compiled_and_errors_name_the_role(single_actor, dummies):
    roles = single_actor
    g = GraphBuilder.of(roles)
    with InputNode() as prompts:
        rollouts = g.rollout.bind("generate", prompts)
        dag = MultiOutputNode([g.apply(dummies.summarise, g.gather(rollouts, g.reward.bind("score", rollouts)))])
    interpreted = Executor(dag, roles).run(dummies.prompts(3))
    compiled = Executor(dag, roles, mode="compiled")
    try:
        assert compiled.plan.fused and compiled.run(dummies.prompts(3)) == interpreted
    finally:
        compiled.teardown()
    g = GraphBuilder.of(roles)
    with InputNode() as prompts:
        failing = MultiOutputNode([g.gather(g.policy.bind("fail", "fused-boom", batch=prompts))])
    with pytest.raises(RoleError, match="fused-boom") as info:
        Executor(failing, roles).run(dummies.prompts(1))
    assert (info.value.role, info.value.rank, info.value.method) == ("policy", 0, "fail")
    g = GraphBuilder.of(roles)
    with InputNode() as prompts:
        bad_apply = MultiOutputNode([g.apply(dummies.explode, g.gather(g.rollout.bind("generate", prompts)))])
    with pytest.raises(RoleError, match="no such column") as info:
        Executor(bad_apply, roles).run(dummies.prompts(1))
    assert (info.value.role, info.value.method) == ("coordinator", "apply:explode")
    assert info.value.actor_name == "test-runtime/fused/policy+rollout+reward/0"


def test_compiled_step_longer_than_rays_get_timeout(layouts, dummies):
    """Ray's compiled-graph `get` gives up after RAY_CGRAPH_get_timeout (10 s) unless told to block."""
    roles = layouts["disaggregated"]
    g = GraphBuilder.of(roles)
    with InputNode() as seconds:
        dag = MultiOutputNode([g.gather(g.policy.bind("sleep", seconds))])
    executor = Executor(dag, roles, mode="compiled")
    try:
        executor._compiled._get_timeout = 0.5   # stands for the 10 s default, to keep the test short
        assert executor.run(1.5) == [[1.5, 1.5]]
    finally:
        executor.teardown()


@ray.remote(num_cpus=0)
class _SaysItsId:
    def my_id(self) -> str:
        return ray.get_runtime_context().get_actor_id()


def test_the_actor_id_read_from_a_handle_is_the_id_the_actor_has(ray_local):
    """`raygraph.cluster.actor_ids.actor_id` is the only read of a private Ray attribute: it must
    stay equal to Ray's public in-actor id (a Ray upgrade that moves it fails here)."""
    from raygraph.cluster.actor_ids import actor_id

    handle = _SaysItsId.remote()
    try:
        assert actor_id(handle) == ray.get(handle.my_id.remote())
    finally:
        ray.kill(handle)


def _after_death(actor) -> str:
    """What calling `actor` gives once its process was SIGKILLed: "died" (Ray gave up on it) or
    "restarted" (a new process answers). Ray answers "unavailable" while it decides."""
    for _ in range(100):
        try:
            ray.get(actor.ping.remote())
            return "restarted"
        except ray.exceptions.ActorDiedError:
            return "died"
        except ray.exceptions.ActorUnavailableError:
            continue
    return "unavailable 100 times"


def test_ray_restarts_no_role_actor(dummies):
    """Role actors are created with `max_restarts=0` (docs/runtime.md, "Failures"): a dead
    process is a failed call, and only raygraph's recovery (`cluster.restart`) starts it again."""
    pools = {"p": PoolSpec(bundles=1, cpus_per_bundle=0.5)}
    specs = {"policy": RoleSpec(dummies.Policy, {}, world_size=1, pool="p")}
    with build_roles("test-runtime/no-restart", pools, specs) as roles:
        [(_, options, _, _)] = roles.launches.values()
        assert options["max_restarts"] == 0   # what `cluster.restart` starts again with
        [pid] = roles.policy.call("pid")
        os.kill(pid, signal.SIGKILL)
        assert _after_death(roles.hosts[0]) == "died"
