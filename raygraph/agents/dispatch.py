"""Episodes of one step shared over the rollout ranks by load (`rollout.agent.dispatch: least_loaded`).

The graph still splits a step's prompts evenly (`Batch.chunk_by_group`), and each rank still
returns the rows of ITS share, in order. What changes is who runs them: every rank puts its share's
prompt groups on one `GroupBoard` (a small Ray actor of the run), then runs groups from the board,
its own first, and when none of its own are left, the last unclaimed groups of the rank with the
most left. A rank holds at most `groups_in_flight` groups at once, so a rank slowed by long
episodes (slow environments, long answers) takes fewer groups and the others take the rest.
Episodes a rank ran for another go back through the board to their owner.

Results do not depend on who ran what: each row's sampling seed is drawn by its owner, as with the
even split, and on vLLM's CPU build a sample depends on its seed, prompt and the weights only. So
a step's batch is the one the even split gives, bit for bit (tested).

A group claimed by a rank that then dies or fails goes back to its owner, who runs it itself: an
owner never waits on a dead rank. Liveness is probed with a call on the claimant's actor (it
queues behind a live actor's running task; it fails at once on a dead one).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

__all__ = ["BoardClient", "GroupBoard", "board_name", "rank_board", "start_board"]

KEEP_ROUNDS = 16   # rounds a board remembers (a failed step's round is never collected)


def board_name(run_name: str) -> str:
    """The Ray actor name of the run's board (`<run>/dispatch`)."""
    return f"{run_name}/dispatch"


class _Round:
    def __init__(self, world: int) -> None:
        self.world = world
        self.payloads: dict[int, list[Any]] = {}       # owner rank -> its groups' payloads
        self.claimants: dict[int, Any] = {}            # rank -> its actor handle (None: not known)
        self.gone: set[int] = set()                    # ranks that failed (released) or were found dead
        self.claimed: dict[tuple[int, int], int] = {}  # (owner, group) -> rank running it
        self.done: dict[tuple[int, int], Any] = {}     # (owner, group) -> episodes, until collected
        self.returned: set[tuple[int, int]] = set()    # (owner, group) handed back to its owner
        self.finished: set[int] = set()                # owners that have every group back


class GroupBoard:
    """The prompt groups of each dispatched generate call ("round"), who runs them, their results.

    Args:
        is_dead: `is_dead(claimant) -> bool` for what a rank registered as its claimant (None: Ray's
            probe of an `(actor id, actor handle)` pair).
    """

    def __init__(self, is_dead: Callable[[Any], bool] | None = None) -> None:
        self._rounds: OrderedDict[str, _Round] = OrderedDict()
        self._lock = threading.Lock()
        self._is_dead = is_dead or _RayProbes().is_dead

    def _round(self, round_id: str) -> _Round:
        r = self._rounds.get(round_id)
        if r is None:
            raise KeyError(f"dispatch round {round_id} is not on the board (finished, or one of more than "
                           f"{KEEP_ROUNDS} rounds since)")
        return r

    def _dead(self, r: _Round, rank: int) -> bool:
        """Whether `rank` failed or died (a rank of unknown handle counts as alive until it releases)."""
        if rank not in r.gone and r.claimants.get(rank) is not None and self._is_dead(r.claimants[rank]):
            r.gone.add(rank)
        return rank in r.gone

    def register(self, round_id: str, rank: int, world: int, payloads: list[Any], claimant: Any = None) -> None:
        """Rank `rank` of `world` puts its share's groups (one payload each, in order) on the board."""
        with self._lock:
            r = self._rounds.get(round_id)
            if r is None:
                r = self._rounds[round_id] = _Round(world)
                while len(self._rounds) > KEEP_ROUNDS:
                    self._rounds.popitem(last=False)
            if rank in r.payloads or not 0 <= rank < r.world or world != r.world:
                raise ValueError(f"dispatch round {round_id}: rank {rank} of {world} registered twice or does not "
                                 f"fit a world of {r.world}")
            r.payloads[rank], r.claimants[rank] = list(payloads), claimant

    def claim(self, round_id: str, rank: int) -> tuple[int, int, Any] | None:
        """The next group for `rank` to run, `(owner, group index, payload)`: its own first, then the
        last unclaimed group of the live rank with the most unclaimed; None when none is left (the
        groups of a rank that failed or died are nobody's work: its step fails anyway)."""
        with self._lock:
            r = self._round(round_id)
            left = {owner: [j for j in range(len(p)) if (owner, j) not in r.claimed] for owner, p in r.payloads.items()}
            if left.get(rank):
                owner, j = rank, left[rank][0]
            else:
                owners = sorted((o for o in left if left[o]), key=lambda o: (-len(left[o]), o))
                owner = next((o for o in owners if not self._dead(r, o)), None)
                if owner is None:
                    return None
                j = left[owner][-1]
            r.claimed[(owner, j)] = rank
            return owner, j, r.payloads[owner][j]

    def done(self, round_id: str, owner: int, group: int, episodes: Any) -> None:
        """The episodes of `owner`'s group `group`, run by another rank (dropped if the owner is gone)."""
        with self._lock:
            r = self._round(round_id)
            if owner not in r.gone:
                r.done[(owner, group)] = episodes

    def release(self, round_id: str, rank: int) -> None:
        """`rank` failed: the groups it claimed and did not finish go back to their owners, its own
        unclaimed ones are nobody's work, and what others ran for it is dropped."""
        with self._lock:
            r = self._rounds.get(round_id)
            if r is not None:
                r.gone.add(rank)
                r.done = {key: episodes for key, episodes in r.done.items() if key[0] != rank}

    def collect(self, round_id: str, owner: int) -> dict[str, dict[int, Any]]:
        """What `owner` gets back now: `done` (group -> episodes run by others) and `orphans`
        (group -> payload: groups whose claimant died or failed, now the owner's to run)."""
        with self._lock:
            r = self._round(round_id)
            done = {j: r.done.pop((o, j)) for o, j in list(r.done) if o == owner}
            r.returned.update((owner, j) for j in done)
            orphans = {}
            for (o, j), rank in list(r.claimed.items()):
                if o == owner and rank != owner and (o, j) not in r.returned and self._dead(r, rank):
                    r.claimed[(o, j)] = owner
                    orphans[j] = r.payloads[owner][j]
        return {"done": done, "orphans": orphans}

    def finish(self, round_id: str, owner: int) -> None:
        """`owner` has all its groups back; the round is forgotten once every owner has."""
        with self._lock:
            r = self._rounds.get(round_id)
            if r is not None:
                r.finished.add(owner)
                if len(r.finished | r.gone) >= r.world:
                    del self._rounds[round_id]

    def rounds(self) -> int:
        """Rounds remembered (a finished round is forgotten)."""
        return len(self._rounds)


class _RayProbes:
    """Whether an actor is dead, by a call that queues behind its running task (one per actor at a
    time; answers at once: a probe not back yet means alive)."""

    def __init__(self) -> None:
        self._probes: dict[str, Any] = {}
        self._lock = threading.Lock()

    def is_dead(self, claimant: tuple[str, Any]) -> bool:
        """`claimant`: (the actor's id, its handle), as a rank registers itself."""
        import ray
        from ray.exceptions import ActorUnavailableError, RayActorError

        key, handle = claimant
        with self._lock:
            probe = self._probes.get(key) or handle.__ray_ready__.remote()
            self._probes[key] = probe
            ready, _ = ray.wait([probe], timeout=0)
            if not ready:
                return False
            self._probes.pop(key, None)
        try:
            ray.get(probe)
        except ActorUnavailableError:
            return False
        except RayActorError:
            return True
        return False


def start_board(run_name: str, timeout_s: float = 30.0):
    """The run's board as a Ray actor (no CPU), on the driver's node, named `board_name(run_name)`
    (waiting up to `timeout_s` for the name: a killed board of an earlier attempt may still hold it)."""
    import time

    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    here = NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=False)
    cls = ray.remote(num_cpus=0, max_concurrency=16)(GroupBoard)
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            board = cls.options(name=board_name(run_name), scheduling_strategy=here).remote()
            ray.get(board.rounds.remote())
            return board
        except ValueError:   # the name is taken
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)


class BoardClient:
    """The run's board as a rollout rank calls it: each `GroupBoard` method, a blocking call on the actor."""

    def __init__(self, handle) -> None:
        self._handle = handle

    def __getattr__(self, name: str):
        import ray

        method = getattr(self._handle, name)
        return lambda *args: ray.get(method.remote(*args))


def rank_board() -> tuple[BoardClient, tuple]:
    """From inside a rollout actor (`<run>/<roles>/<rank>`): the run's board, and this rank as the
    board's probe knows it, `(actor id, actor handle)`."""
    import ray

    context = ray.get_runtime_context()
    run_name = context.get_actor_name().rsplit("/", 2)[0]
    return BoardClient(ray.get_actor(board_name(run_name))), (context.get_actor_id(), context.current_actor)
