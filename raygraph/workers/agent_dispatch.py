"""A rollout rank's side of `rollout.agent.dispatch: least_loaded` (`raygraph.agents.dispatch`).

`shared_episodes` runs this rank's episodes of a step with the other ranks' help: it puts the
share's prompt groups on the run's board, runs groups off the board (its own first) with at most
`window` episodes at once (`rollout.agent.groups_in_flight` x `rollout.n`: as many groups of a
training step; a single-sample validation runs as many episodes), hands the episodes it ran for other ranks back through the board, and
returns the episodes of its own share in order, whoever ran them.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

from raygraph.agents.dispatch import KEEP_ROUNDS, rank_board
from raygraph.agents.episode import Episode
from raygraph.agents.loop import AgentLoop
from raygraph.batch import SHARD, Batch

__all__ = ["Dispatch", "shared_episodes", "dispatch_tag"]

POLL_S = 0.02   # how often a rank with nothing left to run asks the board for its episodes


class Dispatch:
    """A rank's least-loaded dispatch: its window (episodes at once) and the names of its rounds.

    A scatter's shares can feed several generate calls (ReMax's sampled and greedy rollouts, a
    validation with `val_n` > 1, a rollout output passed on to another generate): each call is a
    round of its own, `<scatter id>#<k>` for the k-th call on that scatter. Every rank runs the
    step's calls in the same order, so their k agree. The call's sampling settings are part of the
    name too: a rank only ever runs another's groups as that rank's own call would have."""

    def __init__(self, window: int) -> None:
        self.window = window
        self._calls: OrderedDict[str, int] = OrderedDict()   # scatter id -> calls made on it

    def round_of(self, tag: dict, settings: tuple = ()) -> dict:
        base = tag["round"]
        k = self._calls.pop(base, 0)
        self._calls[base] = k + 1
        while len(self._calls) > KEEP_ROUNDS:
            self._calls.popitem(last=False)
        return {**tag, "round": f"{base}#{k}" + "".join(f":{v}" for v in settings)}


def dispatch_tag(rows: Batch) -> dict | None:
    """The scatter's tag of a share (`Batch` meta `SHARD`), when it has another rank to share with."""
    tag = rows.meta.get(SHARD)
    return tag if tag is not None and tag["world"] > 1 else None


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
        claim = self.board.claim(self.round, self.rank)
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
                self.board.done(self.round, owner, j, group)

    def collect(self, loop: AgentLoop, engine) -> bool:
        """Take what others ran of this rank's groups, and run here (in one call) those whose
        claimant died or failed; whether anything came back."""
        back = self.board.collect(self.round, self.rank)
        self.mine.update(back["done"])
        if back["orphans"]:
            groups = list(back["orphans"].items())
            prompts = [prompt for _, payload in groups for prompt in payload[0]]
            env_rows = [row for _, payload in groups for row in payload[1]]
            seeds = [seed for _, payload in groups for seed in payload[2]]
            episodes, start = loop.run(engine, prompts, env_rows, seeds), 0
            for j, payload in groups:
                self.mine[j] = episodes[start:start + len(payload[0])]
                start += len(payload[0])
        return bool(back["done"] or back["orphans"])

    def own_episodes(self) -> list[Episode] | None:
        """Every own group's episodes in order, once all are back (else None)."""
        if len(self.mine) < len(self.payloads):
            return None
        return [ep for j in range(len(self.payloads)) for ep in self.mine[j]]


def shared_episodes(loop: AgentLoop, engine, prompts: Sequence[list[int]], env_rows: Sequence[dict],
                    seeds: Sequence[int | None], rows: Batch, tag: dict, window: int,
                    board: Any = None, me: Any = None) -> list[Episode]:
    """The episodes of this rank's share (`rows`, tagged `tag` by the scatter), run with the other
    ranks of the round taking groups by load (module docstring); a group is taken while this rank
    runs fewer than `window` episodes.

    `board`, `me`: the board (`GroupBoard`'s methods, called) and this rank as its `is_dead`
    knows it (None: the run's, `raygraph.agents.dispatch.rank_board`)."""
    if board is None:
        board, me = rank_board()
    payloads = [(list(prompts[a:b]), list(env_rows[a:b]), list(seeds[a:b])) for a, b in rows.group_bounds()]
    board.register(tag["round"], tag["rank"], tag["world"], payloads, me)
    share = _Share(board, tag, payloads, window)
    try:
        while True:   # run groups off the board (own first) while there are any; then wait for own ones
            share.exhausted = False
            share.hand_back(loop.run(engine, [], [], [], more=share.more))
            if (own := share.own_episodes()) is not None:
                break
            if not share.collect(loop, engine) and share.own_episodes() is None:
                time.sleep(POLL_S)
        board.finish(tag["round"], tag["rank"])
        return own
    except BaseException:
        try:
            board.release(tag["round"], tag["rank"])   # the owners run what this rank held
        except Exception:  # noqa: BLE001 - the board itself gone: nothing to hand back; keep the first error
            pass
        raise

