"""Wiring of weight sync between role groups: which transport, which actors, which steps.

Fused (colocated) pairs sync in-process on every fused actor; other pairs get a collective group
(sender = `src` rank 0, receivers = every `dst` rank) created once by `setup_weight_groups`.
"""

from __future__ import annotations

import dataclasses
import uuid
from typing import TYPE_CHECKING

from raygraph.cluster import steps as S
from raygraph.cluster.errors import wait_calls

if TYPE_CHECKING:
    from raygraph.cluster.roles import Roles

__all__ = ["setup_weight_groups", "sync_steps", "sync_now"]


def setup_weight_groups(roles: Roles, pairs: list[tuple[str, str]]) -> None:
    """Create one collective group per (src, dst) pair whose ranks live in different processes."""
    for src, dst in pairs:
        if roles.fused(src, dst):
            continue
        sender, receivers = roles.groups[src], roles.groups[dst]
        name = f"{roles.run_name}/weights/{src}->{dst}/{uuid.uuid4().hex[:6]}"
        members = [(sender.actors[0], sender.sites[0], src)] + [
            (a, site, dst) for a, site in zip(receivers.actors, receivers.sites)]
        labels = [f"{role} rank {site.rank} ({site.actor_name} on {site.node_ip})" for _, site, role in members]
        world, timeout = len(members), roles.weight_sync_timeout_s
        addr, port = wait_calls([sender.actors[0].weights_open.remote(name, world, timeout)],
                                sender.sites[:1], ["weights_open"])[0]
        refs = [actor.weights_join.remote(role, name, rank, world, addr, port, timeout, labels,
                                          roles.weight_sync_verify)
                for rank, (actor, _, role) in enumerate(members)]
        wait_calls(refs, [m[1] for m in members], ["weights_join"] * world, timeout_s=timeout + 10)
        roles.weight_groups[(src, dst)] = name


def sync_steps(roles: Roles, src: str, dst: str, *, strict: bool = True,
               corrupt_bucket: int | None = None, version: int | None = None) -> list[tuple]:
    """The (actor, Step, site) triples of one sync; their results feed `weights_combine`.

    Fused pairs: one in-process step per fused actor. Otherwise: `src` rank 0 sends, the other
    `src` ranks walk their buckets too (FSDP gathers each full tensor on every rank), and every
    `dst` rank receives.
    """
    sender, receivers = roles.groups[src], roles.groups[dst]
    if roles.fused(src, dst):
        extra = {"src": src, "dst": dst, "bucket_bytes": roles.bucket_bytes, "strict": strict,
                 "corrupt_bucket": corrupt_bucket, "version": version}
        return [(a, S.Step("weights_local", role=dst, method="load_weights", rank=r, extra=extra), site)
                for r, (a, site) in enumerate(zip(receivers.actors, receivers.sites))]
    if (src, dst) not in roles.weight_groups:
        raise ValueError(f"no weight-sync group for {src}->{dst}; pass weight_sync=[({src!r}, {dst!r})] "
                         "to build_roles")
    group = roles.weight_groups[(src, dst)]
    send = S.Step("weights_send", role=src, method="weight_buckets", rank=0,
                  extra={"src": src, "group": group, "bucket_bytes": roles.bucket_bytes,
                         "corrupt_bucket": corrupt_bucket, "version": version})
    out = [(sender.actors[0], send, sender.sites[0])]
    drain = S.Step("weights_drain", role=src, method="weight_buckets",
                   extra={"src": src, "bucket_bytes": roles.bucket_bytes})
    for r, (a, site) in enumerate(zip(sender.actors[1:], sender.sites[1:]), start=1):
        out.append((a, dataclasses.replace(drain, rank=r), site))
    for r, (a, site) in enumerate(zip(receivers.actors, receivers.sites)):
        step = S.Step("weights_recv", role=dst, method="load_weights", rank=r,
                      extra={"dst": dst, "group": group, "strict": strict})
        out.append((a, step, site))
    return out


def sync_now(roles: Roles, src: str, dst: str, **options) -> dict:
    """Blocking sync from the driver; returns the combined `weights/*` stats."""
    triples = sync_steps(roles, src, dst, **options)
    refs = [actor.run.options(name=f"{step.role}.{step.op}").remote(step) for actor, step, _ in triples]
    reports = wait_calls(refs, [t[2] for t in triples], [t[1].op for t in triples],
                         timeout_s=roles.weight_sync_timeout_s * 2 + 10)
    from raygraph.cluster.steps import combine_sync

    return combine_sync(tuple(reports))
