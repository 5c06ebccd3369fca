"""Role groups: N actors per role, placed on pool bundles, several roles of a rank optionally fused.

`build_roles` is the one entry point: pools -> placement groups, specs -> `RoleHost` actors
(named `<run>/<role>/<rank>`, fused ones `<run>/<a+b>/<rank>`), torch.distributed rendezvous for
distributed roles, worker construction, and (when the sender and receiver of weights live in
different processes) the weight-sync collective group. Any failure on the way shuts down what
was created and re-raises. Which roles share a pool or an actor and which weights are synced is
decided by the caller (the driver's placement plan, `raygraph.run.role_specs.placement_plan`);
this layer knows no placement mode.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy, PlacementGroupSchedulingStrategy

from raygraph.cluster import tasks
from raygraph.cluster.actor_ids import actor_id
from raygraph.cluster.errors import CallSite, wait_calls
from raygraph.cluster.host import Coordinator, RoleHost
from raygraph.cluster.pools import PoolSpec, create_pool, remove_pool
from raygraph.cluster.weight_sync import WeightSync

__all__ = ["RoleSpec", "RoleGroup", "Roles", "build_roles"]

@dataclass(frozen=True)
class RoleSpec:
    """How to run one role.

    Args:
        factory: the worker class (plain Python, no Ray); called as `factory(**kwargs)` in the actor.
        kwargs: flat constructor arguments.
        world_size: number of ranks (actors, or fused-actor slots).
        pool: name of the resource pool whose bundles host the ranks (rank r -> bundle r % bundles).
        distributed: set up a torch.distributed group over the ranks before constructing.
    """

    factory: Callable[..., Any]
    kwargs: dict[str, Any] = field(default_factory=dict)
    world_size: int = 1
    pool: str = "default"
    distributed: bool = False

    def __post_init__(self) -> None:
        if self.world_size < 1:
            raise ValueError(f"RoleSpec.world_size must be >= 1, got {self.world_size}")


class RoleGroup:
    """The ranks of one role. Calls fan out to every rank; failures raise `RoleError`.

    Args:
        name: the role.
        worker_cls: the worker class every rank runs (what a graph may call on this role).
        actors, sites: one actor handle and one `CallSite` per rank.
    """

    def __init__(self, name: str, worker_cls: Callable[..., Any], actors: list, sites: list[CallSite]):
        self.name, self.worker_cls, self.actors, self.sites = name, worker_cls, actors, sites

    @property
    def world_size(self) -> int:
        return len(self.actors)

    def shares_actors_with(self, other: RoleGroup) -> bool:
        """Whether rank i of both roles lives in one actor process (fused in colocated mode)."""
        return self.world_size == other.world_size and all(a == b for a, b in zip(self.actors, other.actors))

    def call_async(self, method: str, *args: Any, **kwargs: Any) -> list[ray.ObjectRef]:
        """Submit `method` on every rank; returns one ref per rank (same args to all)."""
        return [a.call.options(name=f"{self.name}.{method}").remote(self.name, method, *args, **kwargs)
                for a in self.actors]

    def call(self, method: str, *args: Any, **kwargs: Any) -> list[Any]:
        """Run `method` on every rank and wait; returns the per-rank results.

        Raises:
            RoleError: for the first rank that fails (without waiting for the others).
        """
        refs = self.call_async(method, *args, **kwargs)
        return wait_calls(refs, self.sites, [method] * len(refs))

    def call_each(self, method: str, per_rank_args: Sequence[tuple]) -> list[Any]:
        """Run `method` on every rank with its own positional arguments (`per_rank_args[rank]`)."""
        if len(per_rank_args) != self.world_size:
            raise ValueError(f"{self.name}: {len(per_rank_args)} argument tuples for {self.world_size} ranks")
        refs = [a.call.options(name=f"{self.name}.{method}").remote(self.name, method, *args)
                for a, args in zip(self.actors, per_rank_args)]
        return wait_calls(refs, self.sites, [method] * len(refs))

    def call_sharded(self, method: str, batch: Any, **kwargs: Any) -> list[Any]:
        """Run `method` on every rank with that rank's share of `batch` (split by prompt group)."""
        shards = tasks.scatter(batch, self.world_size)
        refs = [a.call.options(name=f"{self.name}.{method}").remote(self.name, method, shard, **kwargs)
                for a, shard in zip(self.actors, shards)]
        return wait_calls(refs, self.sites, [method] * len(refs))

    def call_rank0(self, method: str, *args: Any, **kwargs: Any) -> Any:
        ref = self.actors[0].call.options(name=f"{self.name}.{method}").remote(self.name, method, *args, **kwargs)
        return wait_calls([ref], self.sites[:1], [method])[0]

    def __repr__(self) -> str:
        return f"RoleGroup({self.name!r}, world_size={self.world_size})"


class Roles:
    """All role groups of a run, their placement groups, the coordinator actor and weight sync.

    Attributes:
        groups: role name -> `RoleGroup` (also reachable as `roles.<name>` and `roles[name]`).
        weights: the run's `WeightSync` (`roles.weights.sync_now()` pushes weights now).
        coordinator: the actor that runs whole-batch tasks (scatter, gather, apply), started on
            first use: a run whose steps are fused into its only actor (one colocated rank) never
            starts one, which saves a process (~2 CPU-s of imports and ~0.3 GB) per run.
    """

    def __init__(self, run_name: str):
        self.run_name = run_name
        self.groups: dict[str, RoleGroup] = {}
        self.placement_groups: dict[str, Any] = {}
        self.hosts: list = []
        self._coordinator = None
        self._start_coordinator: Callable[[], Any] | None = None
        self.weights: WeightSync | None = None
        self.launches: dict[str, tuple] = {}   # actor name -> (actor class, options, args, fused roles)
        self.services: list = []   # other actors of the run (e.g. the agent dispatch board), killed with it
        self._closed = False

    @property
    def coordinator(self):
        return self.start_coordinator()

    def start_coordinator(self):
        """The coordinator actor, started now if it is not running yet (None before `build_roles`)."""
        if self._coordinator is None and self._start_coordinator is not None:
            self._coordinator = self._start_coordinator()
        return self._coordinator

    @coordinator.setter
    def coordinator(self, actor) -> None:
        self._coordinator = actor

    def __getattr__(self, name: str) -> RoleGroup:
        groups = self.__dict__.get("groups", {})
        if name in groups:
            return groups[name]
        raise AttributeError(f"no role {name!r}; roles are {sorted(groups)}")

    def __getitem__(self, name: str) -> RoleGroup:
        return getattr(self, name)

    def names(self) -> list[str]:
        return list(self.groups)

    def take_step_stats(self) -> dict[str, float]:
        """Per-step metrics from every actor, in one round trip.

        Returns:
            `timing/<stage>_s` since the last call (per task label, the slowest rank's seconds);
            `perf/peak_rss_gb/<unit>` (peak resident memory of the unit's processes, largest rank;
            a unit is a role, or fused roles like `policy+rollout`, or `coordinator`); on CUDA
            also `perf/cuda_peak_gb/<unit>` (torch's peak allocated memory).
        """
        actors = [*self.hosts, self._coordinator]
        out: dict[str, float] = {}

        def keep_max(key: str, value: float) -> None:
            out[key] = max(out.get(key, 0.0), value)

        for stats in ray.get([a.take_stats.remote() for a in actors if a is not None]):
            for label, seconds in stats["timings"].items():
                keep_max(f"timing/{label.replace(':', '_')}_s", seconds)
            keep_max(f"perf/peak_rss_gb/{stats['unit']}", stats["peak_rss_bytes"] / 2**30)
            if stats["cuda_peak_bytes"]:
                keep_max(f"perf/cuda_peak_gb/{stats['unit']}", stats["cuda_peak_bytes"] / 2**30)
        return out

    def dead_actors(self, timeout_s: float = 3.0) -> list[str]:
        """Names of the run's actors that are dead (a ping fails with an actor error). A busy or
        hung actor is not dead: its ping just does not answer within `timeout_s`; nor is one Ray
        calls unavailable (unreachable, e.g. on a node whose death Ray has not declared yet)."""
        from ray.exceptions import ActorUnavailableError, RayActorError

        names = {actor_id(group.actors[r]): site.actor_name
                 for group in self.groups.values() for r, site in enumerate(group.sites)}
        actors = [a for a in [*self.hosts, self._coordinator] if a is not None]
        refs = {a.ping.remote(): a for a in actors}
        ready, _ = ray.wait(list(refs), num_returns=len(refs), timeout=timeout_s)
        dead = []
        for ref in ready:
            try:
                ray.get(ref)
            except ActorUnavailableError:
                continue
            except RayActorError:
                actor = refs[ref]
                dead.append(names.get(actor_id(actor), f"{self.run_name}/coordinator"
                                      if actor is self._coordinator else actor_id(actor)))
        return sorted(set(dead))

    # --- teardown ---------------------------------------------------------------------------------
    def shutdown(self) -> None:
        """Kill every actor and remove every placement group (idempotent)."""
        if self._closed:
            return
        self._closed = True
        for actor in [*self.hosts, self._coordinator, *self.services]:
            if actor is not None:
                try:
                    ray.kill(actor, no_restart=True)
                except Exception:  # noqa: BLE001 - already dead
                    pass
        for pg in self.placement_groups.values():
            remove_pool(pg)

    def __enter__(self) -> Roles:
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()

    def __repr__(self) -> str:
        return f"Roles({self.run_name!r}, groups={list(self.groups.values())})"


def build_roles(run_name: str, pools: dict[str, PoolSpec], specs: dict[str, RoleSpec], *,
                colocate: Sequence[Sequence[str]] = (),
                placement_timeout_s: float = 60.0, weight_sync_timeout_s: float = 60.0,
                bucket_bytes: int = 64 << 20, env_vars: dict[str, str] | None = None,
                weight_sync: Sequence[tuple[str, str]] = (),
                weight_sync_verify: bool = True, weight_sync_shared_memory: bool = True,
                plugins: Sequence[str] = ()) -> Roles:
    """Create the placement groups, actors and workers of a run.

    Args:
        run_name: prefix of actor and placement-group names (`<run>/<role>/<rank>`, `<run>/<pool>`).
        pools: pool name -> `PoolSpec`.
        specs: role name -> `RoleSpec`.
        colocate: tuples of role names whose rank i shares ONE actor process (same pool and world
            size required); weights between fused roles move in-process.
        placement_timeout_s: bounded wait for each placement group.
        weight_sync_timeout_s: bound on joining and on each transfer of the weight-sync group.
        bucket_bytes: weight-sync bucket size.
        env_vars: extra environment for every actor. OMP_NUM_THREADS (torch's intra-op threads)
            defaults to the actor's whole CPUs (its bundle's `cpus_per_bundle` / actors sharing it,
            at least 1), as Ray does for tasks with `num_cpus`.
        weight_sync: (src, dst) role pairs whose weights are synced (e.g. `[("policy", "rollout")]`);
            pairs with a missing role are skipped. Pairs not fused get a collective group created
            here; fused pairs move weights in-process.
        weight_sync_verify: the collective groups' senders checksum every bucket and receivers
            refuse a bucket that does not match (in-process syncs of fused pairs always check).
        weight_sync_shared_memory: a collective group whose members share a host moves bucket
            bytes through /dev/shm (checked when the group is made), only headers over gloo.
        plugins: user code (module names or absolute `.py` paths) every actor imports when it
            starts, before its workers are constructed (`raygraph.algos.user_code`).

    Raises:
        PlacementError: a pool could not be placed in time. RoleError: an actor failed to start.
    """
    pairs = [p for p in weight_sync if p[0] in specs and p[1] in specs]
    _validate(pools, specs, colocate)
    roles = Roles(run_name)
    roles.weights = WeightSync(run_name, roles.groups, bucket_bytes=bucket_bytes,
                               timeout_s=weight_sync_timeout_s, verify=weight_sync_verify,
                               shared_memory=weight_sync_shared_memory)
    try:
        for name, spec in pools.items():
            roles.placement_groups[name] = create_pool(f"{run_name}/{name}", spec, placement_timeout_s)
        env = dict(env_vars or {})
        units = _fusion_units(specs, colocate)
        _create_hosts(roles, pools, specs, units, env, tuple(plugins))
        _init_distributed(roles, specs, placement_timeout_s)
        _construct(roles, specs)
        roles.weights.connect(pairs)
    except BaseException:
        roles.shutdown()
        raise
    return roles


def _validate(pools: dict[str, PoolSpec], specs: dict[str, RoleSpec], colocate) -> None:
    for role, spec in specs.items():
        if spec.pool not in pools:
            raise ValueError(f"role {role!r} uses pool {spec.pool!r}; pools are {sorted(pools)}")
        if "/" in role or "+" in role:
            raise ValueError(f"role name {role!r} may not contain '/' or '+'")
    seen: set[str] = set()
    for unit in colocate:
        for role in unit:
            if role not in specs:
                raise ValueError(f"colocate names unknown role {role!r}; roles are {sorted(specs)}")
            if role in seen:
                raise ValueError(f"role {role!r} appears in more than one colocate group")
            seen.add(role)
        first = specs[unit[0]]
        for role in unit[1:]:
            if (specs[role].pool, specs[role].world_size) != (first.pool, first.world_size):
                raise ValueError(f"colocated roles {tuple(unit)} must share pool and world_size")


def _fusion_units(specs: dict[str, RoleSpec], colocate) -> list[tuple[str, ...]]:
    fused = {r for unit in colocate for r in unit}
    return [tuple(u) for u in colocate] + [(r,) for r in specs if r not in fused]


# What each actor sets in its environment as it starts (`RoleHost`, `Coordinator`), with
# OMP_NUM_THREADS (its whole CPUs, at least 1). Not through a per-actor Ray runtime env: any
# runtime env makes Ray start the actor's process through its `setup_worker` process, ~0.35
# CPU-s more per actor (docs/benchmarks.md section 6b). Only `build_roles(env_vars=...)`, which
# may name variables read before an actor's first line runs, still takes that way.
START_ENV = {"TOKENIZERS_PARALLELISM": "false"}


def _runtime_env(explicit: dict[str, str], actor_env: dict[str, str]) -> dict:
    """Actor options: a runtime env only when the caller gave environment variables of its own."""
    return {"runtime_env": {"env_vars": actor_env}} if explicit else {}


def _create_hosts(roles: Roles, pools, specs, units, env, plugins: tuple[str, ...]) -> None:
    # Actors sharing a bundle split its resources evenly (fractional CPUs/GPUs).
    per_bundle: dict[tuple[str, int], int] = {}
    for unit in units:
        spec = specs[unit[0]]
        for rank in range(spec.world_size):
            key = (spec.pool, rank % pools[spec.pool].bundles)
            per_bundle[key] = per_bundle.get(key, 0) + 1
    coordinator_cls = ray.remote(num_cpus=0)(Coordinator)
    # On the driver's node: a run whose driver's node is lost is over anyway, while a coordinator
    # on a worker node made that node's loss a run-level failure even when only stateless roles ran
    # there. It needs no resources, so it fits any node; a soft affinity was not kept (Ray placed
    # it on a worker node when the driver's node had no CPUs).
    near_driver = NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=False)
    coordinator_env = {**START_ENV, "OMP_NUM_THREADS": "1", **env}
    roles._start_coordinator = lambda: coordinator_cls.options(
        name=f"{roles.run_name}/coordinator", scheduling_strategy=near_driver,
        **_runtime_env(env, coordinator_env)).remote(roles.run_name, plugins, coordinator_env)
    refs, labels = [], []
    members: dict[str, list] = {r: [] for r in specs}
    for unit in units:
        spec, pool = specs[unit[0]], pools[specs[unit[0]].pool]
        for rank in range(spec.world_size):
            bundle = rank % pool.bundles
            share = per_bundle[(spec.pool, bundle)]
            actor_name = f"{roles.run_name}/{'+'.join(unit)}/{rank}"
            cpus = pool.cpus_per_bundle / share
            cls = ray.remote(num_cpus=cpus, num_gpus=pool.gpus_per_bundle / share)(RoleHost)
            actor_env = {**START_ENV, "OMP_NUM_THREADS": str(max(1, int(cpus))), **env}
            options = dict(name=actor_name, max_restarts=0, **_runtime_env(env, actor_env),
                           scheduling_strategy=PlacementGroupSchedulingStrategy(
                               roles.placement_groups[spec.pool], placement_group_bundle_index=bundle))
            args = (actor_name, {role: rank for role in unit}, plugins, actor_env)
            roles.launches[actor_name] = (cls, options, args, unit)   # to start it again in its bundle
            actor = cls.options(**options).remote(*args)
            roles.hosts.append(actor)
            for role in unit:
                members[role].append((actor, actor_name))
            refs.append(actor.node_info.remote())
            labels.append((unit, rank, actor_name))
    if len(roles.hosts) > 1:   # steps not fused into one actor need it: start it beside the hosts
        roles.start_coordinator()
    sites = [CallSite("+".join(u), r, n) for u, r, n in labels]
    infos = wait_calls(refs, sites, ["start"] * len(refs))
    info_by_name = {n: info for (_, _, n), info in zip(labels, infos)}
    for role, actors in members.items():
        role_sites = [CallSite(role, rank, name, info_by_name[name]["node_id"], info_by_name[name]["node_ip"])
                      for rank, (_, name) in enumerate(actors)]
        roles.groups[role] = RoleGroup(role, specs[role].factory, [a for a, _ in actors], role_sites)


def _init_distributed(roles: Roles, specs: dict[str, RoleSpec], timeout_s: float) -> None:
    done: set = set()   # fused roles share one process group: init once per set of actors
    refs, sites, methods = [], [], []
    for role, spec in specs.items():
        group = roles.groups[role]
        key = tuple(actor_id(a) for a in group.actors)
        if not spec.distributed or key in done:
            continue
        done.add(key)
        addr, port = wait_calls([group.actors[0].free_port.remote()], group.sites[:1], ["free_port"])[0]
        for rank, actor in enumerate(group.actors):
            refs.append(actor.init_distributed.remote(role, rank, group.world_size, addr, port, timeout_s))
            sites.append(group.sites[rank])
            methods.append("init_distributed")
    wait_calls(refs, sites, methods, timeout_s=timeout_s + 5)


def _construct(roles: Roles, specs: dict[str, RoleSpec]) -> None:
    refs, sites = [], []
    for role, spec in specs.items():
        group = roles.groups[role]
        for rank, actor in enumerate(group.actors):
            refs.append(actor.construct.remote(role, spec.factory, spec.kwargs))
            sites.append(group.sites[rank])
    wait_calls(refs, sites, ["__init__"] * len(refs))
