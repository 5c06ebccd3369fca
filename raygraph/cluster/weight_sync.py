"""Weight sync between role groups: which transport, which actors, which tasks.

`WeightSync` owns everything a run knows about moving weights: the bucket size, the timeouts,
whether buckets are verified, and the collective group of each (src, dst) pair. Fused
(colocated) pairs sync in-process on every fused actor; other pairs get a collective group
(sender = `src` rank 0, receivers = every `dst` rank) created once by `connect`.
"""

from __future__ import annotations

import dataclasses
import uuid
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from raygraph.cluster import tasks
from raygraph.cluster.actor_ids import actor_id
from raygraph.cluster.errors import CallSite, wait_calls

if TYPE_CHECKING:
    from raygraph.cluster.roles import RoleGroup

__all__ = ["WeightSync"]


class WeightSync:
    """The weight-sync state of one run.

    Args:
        run_name: prefix of the collective groups' names.
        groups: role name -> `RoleGroup` (read, never written).
        bucket_bytes: size of one bucket.
        timeout_s: bound on joining a group and on each transfer.
        verify: senders checksum every bucket and receivers refuse one that does not match
            (in-process syncs of fused pairs always check).
        shared_memory: a group whose members share a host moves bucket bytes through /dev/shm
            and only headers over the group (`raygraph.cluster.collective_transport`).
    """

    def __init__(self, run_name: str, groups: Mapping[str, RoleGroup], *, bucket_bytes: int,
                 timeout_s: float, verify: bool = True, shared_memory: bool = True):
        self.run_name, self.groups = run_name, groups
        self.bucket_bytes, self.timeout_s, self.verify = bucket_bytes, timeout_s, verify
        self.shared_memory = shared_memory
        self._collectives: dict[tuple[str, str], str] = {}   # (src, dst) -> collective group name

    def connect(self, pairs: Sequence[tuple[str, str]]) -> None:
        """Create one collective group per (src, dst) pair whose ranks live in different processes."""
        for src, dst in pairs:
            if self.fused(src, dst):
                continue
            sender, receivers = self.groups[src], self.groups[dst]
            name = f"{self.run_name}/weights/{src}->{dst}/{uuid.uuid4().hex[:6]}"
            members = [(sender.actors[0], sender.sites[0], src)] + [
                (a, site, dst) for a, site in zip(receivers.actors, receivers.sites)]
            labels = [f"{role} rank {site.rank} ({site.actor_name} on {site.node_ip})" for _, site, role in members]
            world = len(members)
            addr, port = wait_calls([sender.actors[0].weights_open.remote(name, world, self.timeout_s)],
                                    sender.sites[:1], ["weights_open"])[0]
            refs = [actor.weights_join.remote(role, name, rank, world, addr, port, self.timeout_s, labels,
                                              self.verify, self.shared_memory)
                    for rank, (actor, _, role) in enumerate(members)]
            wait_calls(refs, [m[1] for m in members], ["weights_join"] * world, timeout_s=self.timeout_s + 10)
            self._collectives[(src, dst)] = name

    def collective_pairs(self) -> list[tuple[str, str]]:
        """The (src, dst) pairs whose weights move over a collective group."""
        return list(self._collectives)

    def reconnect(self, actors: Sequence[Any]) -> list[tuple[str, str]]:
        """Create a fresh collective group for every pair with a member among `actors` (started
        again after a death: the old group still names the dead process); returns those pairs."""
        ids = {actor_id(a) for a in actors}
        pairs = [(src, dst) for src, dst in self._collectives
                 if ids & {actor_id(a) for a in (self.groups[src].actors[0], *self.groups[dst].actors)}]
        self.connect(pairs)
        return pairs

    def fused(self, src: str, dst: str) -> bool:
        """Whether ranks of roles `src` and `dst` share actor processes (weights move in-process)."""
        return self.groups[src].shares_actors_with(self.groups[dst])

    def transfer_tasks(self, src: str, dst: str, *, strict: bool = True, corrupt_bucket: int | None = None,
              version: int | None = None) -> list[tuple[Any, tasks.Task, CallSite]]:
        """The (actor, Task, site) triples of one sync; their results feed `weights_combine`.

        Fused pairs: one in-process task per fused actor. Otherwise: `src` rank 0 sends, the other
        `src` ranks walk their buckets too (FSDP gathers each full tensor on every rank), and every
        `dst` rank receives.

        Args:
            strict: raise on a bucket that fails verification (else report weights/verified=0).
            corrupt_bucket: for tests only: flip one byte of that bucket after its checksum.
            version: stamp this version instead of the next one (e.g. the step when resuming).
        """
        sender, receivers = self.groups[src], self.groups[dst]
        if self.fused(src, dst):
            extra = {"src": src, "dst": dst, "bucket_bytes": self.bucket_bytes, "strict": strict,
                     "corrupt_bucket": corrupt_bucket, "version": version}
            return [(a, tasks.Task("weights_local", role=dst, method="load_weights", rank=r, extra=extra), site)
                    for r, (a, site) in enumerate(zip(receivers.actors, receivers.sites))]
        if (src, dst) not in self._collectives:
            raise ValueError(f"no weight-sync group for {src}->{dst}; pass weight_sync=[({src!r}, {dst!r})] "
                             "to build_roles")
        group = self._collectives[(src, dst)]
        send = tasks.Task("weights_send", role=src, method="weight_buckets", rank=0,
                          extra={"src": src, "group": group, "bucket_bytes": self.bucket_bytes,
                                 "corrupt_bucket": corrupt_bucket, "version": version})
        out = [(sender.actors[0], send, sender.sites[0])]
        drain = tasks.Task("weights_drain", role=src, method="weight_buckets",
                           extra={"src": src, "bucket_bytes": self.bucket_bytes})
        for r, (a, site) in enumerate(zip(sender.actors[1:], sender.sites[1:]), start=1):
            out.append((a, dataclasses.replace(drain, rank=r), site))
        for r, (a, site) in enumerate(zip(receivers.actors, receivers.sites)):
            recv = tasks.Task("weights_recv", role=dst, method="load_weights", rank=r,
                              extra={"dst": dst, "group": group, "strict": strict})
            out.append((a, recv, site))
        return out

    def sync_now(self, src: str = "policy", dst: str = "rollout", **options: Any) -> dict:
        """Push `src`'s weights to every `dst` rank now (outside a graph), e.g. after loading a
        checkpoint; blocks and returns the combined `weights/*` stats. Options as for `transfer_tasks`."""
        triples = self.transfer_tasks(src, dst, **options)
        refs = [actor.run.options(name=f"{task.role}.{task.op}").remote(task) for actor, task, _ in triples]
        reports = wait_calls(refs, [t[2] for t in triples], [t[1].op for t in triples],
                             timeout_s=self.timeout_s * 2 + 10)
        return tasks.combine_sync(tuple(reports))
