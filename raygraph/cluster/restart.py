"""Start dead role actors again, one by one, in the placement-group bundles they held.

Used for roles that hold nothing a checkpoint must restore beyond weights (rollout, reward, an
unsharded frozen model on its own actors): the new actor gets the same name, bundle, resources
and environment, its workers are constructed from the same specs, and the caller then reconnects
weight sync and
pushes the current weights (`WeightSync.reconnect`, `WeightSync.sync_now`). Roles in a
torch.distributed group are not restarted here: their peers' group would still name the dead rank.
"""

from __future__ import annotations

import time

import ray

from raygraph.cluster.actor_ids import actor_id
from raygraph.cluster.errors import CallSite, wait_calls
from raygraph.cluster.roles import Roles, RoleSpec

__all__ = ["restart_actors", "restartable"]


def restartable(roles: Roles, specs: dict[str, RoleSpec], actor_name: str, stateless: tuple[str, ...]) -> bool:
    """Whether `actor_name` can be started again alone: every role it hosts is in `stateless` and
    none is in a torch.distributed group."""
    launch = roles.launches.get(actor_name)
    return launch is not None and all(r in stateless and not specs[r].distributed for r in launch[3])


def restart_actors(roles: Roles, specs: dict[str, RoleSpec], names: list[str],
                   timeout_s: float | None = None) -> list:
    """Start each actor of `names` again in its bundle, construct its workers, and put the new
    handle where the old one was (`roles.hosts`, each role group's ranks and call sites).

    Args:
        timeout_s: bound on each actor's start (its bundle may wait for a node to come back).

    Returns:
        The new actor handles, in the order of `names`.

    Raises:
        RoleError: an actor failed to start or to construct a worker.
    """
    new = []
    for name in names:
        cls, options, args, unit = roles.launches[name]
        actor = _start(roles, name, cls, options, args)
        info = wait_calls([actor.node_info.remote()], [CallSite("+".join(unit), args[1][unit[0]], name)],
                          ["start"], timeout_s=timeout_s)[0]
        old = [h for h in roles.hosts if _name_of(roles, h) == name]
        roles.hosts = [actor if h in old else h for h in roles.hosts]
        for role in unit:
            group, rank = roles.groups[role], args[1][role]
            group.actors[rank] = actor
            group.sites[rank] = CallSite(role, rank, name, info["node_id"], info["node_ip"])
        wait_calls([actor.construct.remote(role, specs[role].factory, specs[role].kwargs) for role in unit],
                   [roles.groups[role].sites[args[1][role]] for role in unit], ["__init__"] * len(unit))
        new.append(actor)
    return new


def _start(roles: Roles, name: str, cls, options: dict, args: tuple):
    """Create the actor again under its old name; the GCS frees a dead actor's name only once the
    death is processed, so ask again for a few seconds before taking `<name>/restarted`."""
    for old in [h for h in roles.hosts if _name_of(roles, h) == name]:
        ray.kill(old, no_restart=True)
    deadline = time.monotonic() + 10
    while True:
        try:
            return cls.options(**options).remote(*args)
        except ValueError as exc:   # ActorAlreadyExistsError is a ValueError
            if "already taken" not in str(exc):
                raise
            if time.monotonic() > deadline:
                return cls.options(**{**options, "name": f"{name}/restarted"}).remote(*args)
            time.sleep(0.2)


def _name_of(roles: Roles, actor) -> str | None:
    for group in roles.groups.values():
        for a, site in zip(group.actors, group.sites):
            if actor_id(a) == actor_id(actor):
                return site.actor_name
    return None
