"""The id of an actor, from its handle: the one place raygraph reads a private Ray attribute.

Ray 2.60 gives an actor its own id publicly (`ray.get_runtime_context().get_actor_id()`, inside
the actor) but has no public accessor on a handle, and the driver needs the id without a round
trip: to name the actor an error's traceback mentions, and to tell fused roles' actors apart.
`tests/cluster/test_runtime.py` checks it against the public in-actor id.
"""

from __future__ import annotations

from typing import Any

__all__ = ["actor_id"]


def actor_id(handle: Any) -> str:
    """The hex id of the actor behind `handle` (the id Ray prints in errors about it)."""
    return handle._actor_id.hex()   # noqa: SLF001 - no public accessor on a handle in Ray 2.60
