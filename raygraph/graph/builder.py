"""What a workflow writes its graph with: `roles.<role>.bind(...)`, `gather`, `apply`, `sync_weights`.

A workflow's `build(roles, cfg)` receives a `GraphBuilder`. It knows each role's worker class,
not its actors, so a graph can be built (and every role and method name checked) before any
actor starts::

    with InputNode() as prompts:
        rollouts = roles.rollout.bind("generate", prompts)     # sharded: one value per rank
        batch = roles.gather(rollouts, roles.reward.bind("score", rollouts))
        metrics = roles.policy.bind("update", batch)           # whole -> split by prompt group
        dag = MultiOutputNode([roles.gather(metrics), roles.sync_weights(after=metrics)])

`roles.policy.bind("updat", ...)` raises at once, naming the role, the method and the valid ones.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping
from typing import Any

from raygraph.errors import ConfigInvalid
from raygraph.graph.nodes import ApplyNode, CallNode, DAGNode, GatherNode, SyncNode

__all__ = ["GraphBuilder", "RoleNodes", "GraphBuildError", "public_methods"]


class GraphBuildError(ConfigInvalid, ValueError):
    """A graph names a role the run does not have, or a method its worker does not define."""


def public_methods(worker_cls: Callable[..., Any]) -> list[str]:
    """The methods a graph may call on a worker class (public callables), sorted."""
    return sorted(name for name, value in inspect.getmembers(worker_cls)
                  if not name.startswith("_") and callable(value) and not inspect.isclass(value))


class RoleNodes:
    """Node factory for one role: `bind(method, *args, **kwargs)` makes a `CallNode`."""

    def __init__(self, name: str, worker_cls: Callable[..., Any]):
        self.name, self.worker_cls = name, worker_cls

    def bind(self, method: str, *args: Any, **kwargs: Any) -> CallNode:
        """A node: `method` on every rank of this role. Whole-batch inputs are split by prompt group.

        Raises:
            GraphBuildError: the worker class has no public method `method`.
        """
        self.require(method)
        return CallNode(self.name, method, args, kwargs)

    def require(self, method: str) -> None:
        """Raise `GraphBuildError` unless the worker defines the public method `method`."""
        if not inspect.isclass(self.worker_cls):
            return  # a factory function: its methods are known only once it has run
        valid = public_methods(self.worker_cls)
        if method not in valid:
            raise GraphBuildError(f"role {self.name!r} ({self.worker_cls.__name__}) has no method {method!r}; "
                                  f"valid methods: {', '.join(valid)}")

    def __repr__(self) -> str:
        return f"RoleNodes({self.name!r}, {getattr(self.worker_cls, '__name__', self.worker_cls)!r})"


class GraphBuilder:
    """The `roles` a workflow's `build(roles, cfg)` receives.

    Args:
        workers: role name -> worker class (or factory) of every role the run starts.
        absent: role name -> why this run does not start it and what to bind instead (the
            message when a workflow binds it).
    """

    def __init__(self, workers: Mapping[str, Callable[..., Any]], absent: Mapping[str, str] | None = None):
        self._roles = {name: RoleNodes(name, cls) for name, cls in workers.items()}
        self._absent = dict(absent or {})

    @classmethod
    def of(cls, roles: Any) -> GraphBuilder:
        """A builder over running role groups (anything with `.groups: {name: RoleGroup}`)."""
        return cls({name: group.worker_cls for name, group in roles.groups.items()})

    def __getattr__(self, name: str) -> RoleNodes:
        roles = self.__dict__.get("_roles", {})
        if name in roles:
            return roles[name]
        absent = self.__dict__.get("_absent", {})
        if name in absent:
            raise GraphBuildError(f"this run has no role {name!r}: {absent[name]}")
        raise GraphBuildError(f"this run has no role {name!r}; roles are {sorted(roles)} (a workflow "
                              "declares the roles it binds in its module-level ROLES)")

    def __getitem__(self, name: str) -> RoleNodes:
        return getattr(self, name)

    def names(self) -> list[str]:
        """The roles this run starts."""
        return list(self._roles)

    def gather(self, *nodes: DAGNode) -> GatherNode:
        """A node holding the whole result: shards concatenated, inputs' columns unioned."""
        return GatherNode(nodes)

    def apply(self, fn: Callable, *args: Any, **kwargs: Any) -> ApplyNode:
        """A node running the module-level function `fn` on whole values on the coordinator."""
        return ApplyNode(fn, args, kwargs)

    def sync_weights(self, after: DAGNode | None = None, src: str = "policy", dst: str = "rollout", *,
                     strict: bool = True, corrupt_bucket: int | None = None) -> SyncNode:
        """A node that pushes `src`'s weights to every `dst` rank once `after` is done.

        Its value is a dict: weights/verified, weights/version, weights/bytes, weights/sync_s (and
        weights/receivers, weights/gbytes_per_s; weights/via_shared_memory over a collective group).

        Args:
            strict: raise on a bucket that fails verification (else report weights/verified=0).
            corrupt_bucket: for tests only: flip one byte of that bucket after its checksum.
        """
        self[src].require("weight_buckets")
        self[dst].require("load_weights")
        return SyncNode(src, dst, after, strict=strict, corrupt_bucket=corrupt_bucket)

    def __repr__(self) -> str:
        return f"GraphBuilder({sorted(self._roles)})"
