"""Typed errors of the Ray layer and the one helper that waits on remote calls.

Every failure of a role's actor reaches the driver as a `RoleError` that names the role, the
rank, the node and carries the remote traceback. `wait_calls` is the only place that waits on
role calls: it returns as soon as any call fails, so a dead rank is reported even while the
other ranks hang (e.g. in a collective that the dead rank will never join).
"""

from __future__ import annotations

import time
import traceback
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import ray
from ray.exceptions import ActorUnavailableError, RayActorError, RayTaskError

from raygraph.errors import RoleFailed

__all__ = ["RoleError", "PlacementError", "WeightSyncError", "CallSite", "RemoteFailure", "wait_calls", "ACTOR_DIED"]

# The cause of a `RoleError` whose actor Ray declared dead (not merely unreachable for now).
ACTOR_DIED = "the actor died (process exited or was killed)"


class PlacementError(RoleFailed, RuntimeError):
    """A placement group could not be placed within its bounded wait."""


class WeightSyncError(RoleFailed, RuntimeError):
    """A weight transfer timed out, lost a participant, or failed verification."""


@dataclass(frozen=True)
class CallSite:
    """Where a remote call ran: enough to name it in an error."""

    role: str
    rank: int
    actor_name: str = ""
    node_id: str = ""
    node_ip: str = ""

    def describe(self) -> str:
        where = f"node {self.node_ip or '?'} ({self.node_id[:12] or '?'})"
        return f"role {self.role!r} rank {self.rank} [actor {self.actor_name or '?'}] on {where}"


class RemoteFailure(Exception):
    """Raised inside an actor around a worker exception; carries the site and the traceback.

    It is a plain picklable exception so that Ray ships it to the driver intact; the driver
    turns it into a `RoleError`.
    """

    def __init__(self, site: CallSite, method: str, tb: str, cause_type: str):
        super().__init__(site, method, tb, cause_type)
        self.site, self.method, self.tb, self.cause_type = site, method, tb, cause_type

    def __str__(self) -> str:
        return f"{self.site.describe()} failed in {self.method}: {self.cause_type}\n{self.tb}"

    @staticmethod
    def wrap(site: CallSite, method: str, exc: BaseException) -> RemoteFailure:
        if isinstance(exc, RemoteFailure):
            return exc
        tb = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
        return RemoteFailure(site, method, tb, type(exc).__name__)


class RoleError(RoleFailed, RuntimeError):
    """A role's remote call failed (exception in the worker, or the actor died).

    Attributes:
        role, rank: which member of which role group failed.
        node_id, node_ip: where it ran.
        method: the worker method (or runtime step) that failed.
        remote_traceback: the traceback text from the actor (or Ray's death cause).
    """

    def __init__(self, site: CallSite, method: str, remote_traceback: str, cause: str = ""):
        self.role, self.rank = site.role, site.rank
        self.node_id, self.node_ip, self.actor_name = site.node_id, site.node_ip, site.actor_name
        self.method, self.remote_traceback, self.cause = method, remote_traceback, cause
        super().__init__(f"{site.describe()} failed in {method!r}: {cause}\n"
                         f"--- remote traceback ---\n{remote_traceback}")

    def __reduce__(self):
        site = CallSite(self.role, self.rank, self.actor_name, self.node_id, self.node_ip)
        return (RoleError, (site, self.method, self.remote_traceback, self.cause))


def to_role_error(exc: BaseException, site: CallSite, method: str) -> RoleError:
    """Translate what `ray.get` raised into a `RoleError` (prefers the site recorded remotely)."""
    if isinstance(exc, RoleError):
        return exc
    cause = exc.cause if isinstance(exc, RayTaskError) else None
    if isinstance(cause, RemoteFailure):
        return RoleError(cause.site, cause.method, cause.tb, cause.cause_type)
    if isinstance(cause, RoleError):
        return cause
    if isinstance(exc, ActorUnavailableError):   # unreachable for now (a RayActorError, yet maybe alive)
        return RoleError(site, method, str(exc), "ActorUnavailableError")
    if isinstance(exc, RayActorError):
        return RoleError(site, method, str(exc), ACTOR_DIED)
    return RoleError(site, method, str(exc), type(exc).__name__)


def wait_calls(refs: Sequence[ray.ObjectRef], sites: Sequence[CallSite], methods: Sequence[str],
               timeout_s: float | None = None) -> list[Any]:
    """Wait for `refs`; raise `RoleError` for the FIRST failure without waiting for the rest.

    Args:
        refs: one ref per call; `sites[i]`/`methods[i]` name the call for error messages.
        timeout_s: overall bound; on expiry a `RoleError` names the first call still running.

    Returns:
        The values in `refs` order.
    """
    index = {ref: i for i, ref in enumerate(refs)}
    pending = list(refs)
    values: list[Any] = [None] * len(refs)
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    while pending:
        wait_s = 1.0 if deadline is None else max(0.0, min(1.0, deadline - time.monotonic()))
        ready, pending = ray.wait(pending, num_returns=1, timeout=wait_s)
        for ref in ready:
            i = index[ref]
            try:
                value = ray.get(ref)
            except Exception as exc:  # noqa: BLE001 - every remote failure becomes a RoleError
                raise to_role_error(exc, sites[i], methods[i]) from None
            values[i] = value
        if deadline is not None and pending and time.monotonic() >= deadline:
            i = index[pending[0]]
            raise RoleError(sites[i], methods[i], "", f"no result within {timeout_s:.1f}s")
    return values
