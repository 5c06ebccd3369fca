"""A `ray.util.collective` backend over a standalone torch process group.

Why not Ray's built-in "gloo" backend: it initialises torch.distributed's *default* process
group (and sub-groups of it). A policy rank already has a default group (its own data-parallel
group, used by FSDP), so the weight-sync group (policy rank 0 + every rollout rank) must be a
separate, standalone group. This backend builds one from a `TCPStore` hosted by the sender and a
`ProcessGroupGloo` (CPU) or `ProcessGroupNCCL` (GPU), and registers it with
`ray.util.collective` as backend "RAYGRAPH", so callers use the ordinary
`ray.util.collective.broadcast(tensor, src_rank, group_name)`.

Joining is two-phase: the sender `open_store`s (port chosen by the OS, no race), then every
member `join`s. Each member records its arrival in the store, so a member that never shows up is
named in the timeout error ("rollout rank 1 did not arrive") instead of hanging.
"""

from __future__ import annotations

from datetime import timedelta

import ray
import torch
import torch.distributed as dist
from ray.util.collective.collective_group.base_collective_group import BaseGroup
from ray.util.collective.types import BroadcastOptions

from raygraph.cluster.errors import WeightSyncError
from raygraph.cluster.rendezvous import listening_socket, master_store, member_store

__all__ = ["BACKEND", "StandaloneGroup", "open_store", "join", "group", "leave"]

BACKEND = "RAYGRAPH"
_STORES: dict[str, dist.TCPStore] = {}      # group name -> store (sender holds the master)
_PENDING: dict[str, dict] = {}              # group name -> join arguments, read by the group class


class StandaloneGroup(BaseGroup):
    """A `BaseGroup` whose communicator is a standalone torch process group (not the default)."""

    def __init__(self, world_size: int, rank: int, group_name: str):
        super().__init__(world_size, rank, group_name)
        cfg = _PENDING.pop(group_name)
        self.labels: list[str] = cfg["labels"]
        self.timeout_s: float = cfg["timeout_s"]
        self.device = torch.device(cfg["device"])
        self._store = cfg["store"]
        self._arrivals = 0
        self.arrive("join")
        prefix = dist.PrefixStore(f"{group_name}/pg", self._store)
        timeout = timedelta(seconds=self.timeout_s)
        if self.device.type == "cuda":
            opts = dist.ProcessGroupNCCL.Options()
            opts._timeout = timeout
            self._pg = dist.ProcessGroupNCCL(prefix, rank, world_size, opts)
        else:
            self._pg = dist.ProcessGroupGloo(prefix, rank, world_size, timeout)

    def arrive(self, what: str) -> None:
        """Barrier through the store: raise naming every member that did not arrive in time."""
        self.exchange(what, "1")

    def exchange(self, what: str, value: str) -> list[str]:
        """Every member's `value`, by rank, through the store (all members call it in the same
        order); raise naming every member that did not arrive in time."""
        self._arrivals += 1
        step = self._arrivals
        self._store.set(f"arrive/{step}/{self._rank}", value)
        keys = [f"arrive/{step}/{r}" for r in range(self._world_size)]
        try:
            self._store.wait(keys, timedelta(seconds=self.timeout_s))
        except Exception as exc:  # noqa: BLE001 - torch raises DistStoreError / RuntimeError on timeout
            missing = [self.labels[r] for r, k in enumerate(keys) if not self._store.check([k])]
            if not missing:
                raise
            raise WeightSyncError(
                f"weight-sync group {self._group_name!r} ({what}): {', '.join(missing)} did not "
                f"arrive within {self.timeout_s:.0f}s (as seen by {self.labels[self._rank]})") from exc
        return [self._store.get(k).decode() for k in keys]

    def fence(self) -> None:
        """A barrier in the group's own stream (gloo/NCCL), ordered with its broadcasts: returns
        once every member has reached its matching `fence`."""
        opts = dist.BarrierOptions()
        opts.timeout = timedelta(seconds=self.timeout_s)
        if not self._pg.barrier(opts).wait():
            raise WeightSyncError(f"barrier in {self._group_name!r} did not complete")

    @classmethod
    def backend(cls) -> str:
        return BACKEND

    @classmethod
    def check_backend_availability(cls) -> bool:
        return dist.is_available()

    def destroy_group(self) -> None:
        self._pg = None
        _STORES.pop(self._group_name, None)

    def broadcast(self, tensor, broadcast_options=BroadcastOptions()) -> None:
        t = tensor[0] if isinstance(tensor, list) else tensor
        opts = dist.BroadcastOptions()
        opts.rootRank = broadcast_options.root_rank
        opts.timeout = timedelta(seconds=self.timeout_s)
        work = self._pg.broadcast([t], opts)
        if not work.wait():
            raise WeightSyncError(f"broadcast in {self._group_name!r} did not complete")

    def barrier(self, barrier_options=None) -> None:
        self.arrive("barrier")

    def _unsupported(self, *args, **kwargs):
        raise NotImplementedError("the RAYGRAPH collective backend implements broadcast and barrier only")

    allreduce = reduce = allgather = reducescatter = send = recv = _unsupported


def _register() -> None:
    from ray.util.collective.backend_registry import _global_registry, register_collective_backend

    if not _global_registry.is_registered(BACKEND):
        register_collective_backend(BACKEND, StandaloneGroup)


def open_store(group_name: str, world_size: int, timeout_s: float) -> tuple[str, int]:
    """Sender side, phase 1: host the group's TCPStore on a free port; returns (ip, port)."""
    ip = ray.util.get_node_ip_address()
    store = master_store(listening_socket(ip), world_size, timeout_s)  # on the node's address only
    _STORES[group_name] = store
    return ip, store.port


def join(group_name: str, rank: int, world_size: int, addr: str, port: int, *, device: str,
         timeout_s: float, labels: list[str]) -> None:
    """Phase 2 (every member): connect to the store and build the group via ray.util.collective."""
    import ray.util.collective as col

    _register()
    store = _STORES.get(group_name) if rank == 0 else None
    if store is None:
        try:
            store = member_store(addr, port, world_size, timeout_s)
        except Exception as exc:  # noqa: BLE001 - name who we waited for
            raise WeightSyncError(f"weight-sync group {group_name!r}: could not reach the store of "
                                  f"{labels[0]} at {addr}:{port} within {timeout_s:.0f}s "
                                  f"({labels[0]} did not arrive): {exc}") from exc
        _STORES[group_name] = store
    _PENDING[group_name] = {"labels": labels, "timeout_s": timeout_s, "device": device, "store": store}
    col.init_collective_group(world_size, rank, backend=BACKEND, group_name=group_name)


def group(group_name: str) -> StandaloneGroup:
    import ray.util.collective as col

    return col.collective.get_group_handle(group_name)


def leave(group_name: str) -> None:
    import ray.util.collective as col

    if col.is_group_initialized(group_name):
        col.destroy_collective_group(group_name)
    _STORES.pop(group_name, None)
