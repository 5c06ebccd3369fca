"""A rollout rank's side of `rollout.agent.dispatch: least_loaded` (`raygraph.agents.dispatch`).

`shared_episodes` runs this rank's episodes of a step with the other ranks' help: it puts the
share's prompt groups on the run's board, runs groups off the board (its own first) with at most
`window` episodes at once (`rollout.agent.groups_in_flight` x `rollout.n`: as many groups of a
training step; a single-sample validation runs as many episodes), hands the episodes it ran for other ranks back through the board, and
returns the episodes of its own share in order, whoever ran them.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

from raygraph.agents.dispatch import board_name
from raygraph.agents.episode import Episode
from raygraph.agents.loop import AgentLoop
from raygraph.batch import SHARD, UID, Batch

__all__ = ["shared_episodes", "dispatch_tag"]

POLL_S = 0.02   # how often a rank with nothing left to run asks the board for its episodes


def dispatch_tag(rows: Batch) -> dict | None:
    """The scatter's tag of a share (`Batch` meta `SHARD`), when it has another rank to share with."""
    tag = rows.meta.get(SHARD)
    return tag if tag is not None and tag["world"] > 1 else None


def _groups(rows: Batch) -> list[tuple[int, int]]:
    """Row ranges of the prompt groups (rows sharing a uid, contiguous)."""
    if UID not in rows.non_tensors or len(rows) == 0:
        return [(i, i + 1) for i in range(len(rows))]
    ids = rows.non_tensors[UID]
    starts = [0] + [i for i in range(1, len(ids)) if ids[i] != ids[i - 1]] + [len(ids)]
    return list(zip(starts[:-1], starts[1:]))


class _Share:
    """This rank's part of one round: the groups it runs, those it owns, what came back."""

    def __init__(self, board, tag: dict, payloads: list[tuple], window: int) -> None:
        self.board, self.round, self.rank, self.window = board, tag["round"], tag["rank"], window   # episodes
        self.payloads = payloads
        self.running: dict[tuple[int, int], range] = {}   # (owner, group) -> its episodes' positions
        self.mine: dict[int, list[Episode]] = {}          # own group -> its episodes
        self.exhausted = False

    def more(self, episodes: list[Episode]):
        """`AgentLoop.run`'s `more`: hand back finished groups, then claim one if there is room."""
        self.hand_back(episodes)
        if self.exhausted or sum(map(len, self.running.values())) >= self.window:
            return None
        claim = _get(self.board.claim.remote(self.round, self.rank))
        if claim is None:
            self.exhausted = True
            return None
        owner, group, payload = claim
        self.running[(owner, group)] = range(len(episodes), len(episodes) + len(payload[0]))
        return payload

    def hand_back(self, episodes: list[Episode]) -> None:
        for key, positions in list(self.running.items()):
            group = [episodes[i] for i in positions]
            if not all(ep.done for ep in group):
                continue
            for ep in group:
                ep.check()
            del self.running[key]
            owner, j = key
            if owner == self.rank:
                self.mine[j] = group
            else:
                for ep in group:
                    ep.elsewhere = True
                _get(self.board.done.remote(self.round, owner, j, group))

    def wait_for_own(self, loop: AgentLoop, engine) -> list[Episode]:
        """Every own group's episodes, in order: those others ran, and those whose claimant died
        (run here)."""
        while len(self.mine) < len(self.payloads):
            back = _get(self.board.collect.remote(self.round, self.rank))
            self.mine.update(back["done"])
            for j, payload in back["orphans"].items():
                self.mine[j] = loop.run(engine, *payload)
            if not back["done"] and not back["orphans"] and len(self.mine) < len(self.payloads):
                time.sleep(POLL_S)
        _get(self.board.finish.remote(self.round, self.rank))
        return [ep for j in range(len(self.payloads)) for ep in self.mine[j]]


def shared_episodes(loop: AgentLoop, engine, prompts: Sequence[list[int]], env_rows: Sequence[dict],
                    seeds: Sequence[int | None], rows: Batch, tag: dict, window: int,
                    board: Any = None, me: Any = None) -> list[Episode]:
    """The episodes of this rank's share (`rows`, tagged `tag` by the scatter), run with the other
    ranks of the round taking groups by load (module docstring); a group is taken while this rank
    runs fewer than `window` episodes.

    `board`, `me`: the run's board and this rank's actor handle (None: found through Ray)."""
    import ray  # only here: the HF sampler's process may have no Ray (a plain worker, benchmarks)

    if board is None:
        board = ray.get_actor(board_name(_run_name()))
        me = ray.get_runtime_context().current_actor
    payloads = [(list(prompts[a:b]), list(env_rows[a:b]), list(seeds[a:b])) for a, b in _groups(rows)]
    _get(board.register.remote(tag["round"], tag["rank"], tag["world"], payloads, me))
    share = _Share(board, tag, payloads, window)
    try:
        episodes = loop.run(engine, [], [], [], more=share.more)
        share.hand_back(episodes)
        return share.wait_for_own(loop, engine)
    except BaseException:
        board.release.remote(tag["round"], tag["rank"])   # the owners run what this rank held
        raise


def _run_name() -> str:
    """The run's actor-name prefix: this actor is `<run>/<roles>/<rank>`."""
    import ray

    return ray.get_runtime_context().get_actor_name().rsplit("/", 2)[0]


def _get(ref) -> Any:
    import ray

    return ray.get(ref) if isinstance(ref, ray.ObjectRef) else ref   # a board in this process answers at once
