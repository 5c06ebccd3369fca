"""Least-loaded dispatch of episodes over rollout ranks (`rollout.agent.dispatch: least_loaded`):
the board's claims, orphans and memory, and two ranks sharing a round over a seeded engine, whose
episodes must equal those of the even split while the fast rank runs the slow rank's groups."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
import torch

from raygraph.agents.dispatch import KEEP_ROUNDS, GroupBoard
from raygraph.agents.env import register_env
from raygraph.agents.episode import AgentBudgets
from raygraph.agents.loop import AgentLoop
from raygraph.batch import SHARD, UID, Batch
from raygraph.cluster.tasks import scatter
from raygraph.models.tiny import build_tiny_tokenizer
from raygraph.workers.agent_dispatch import dispatch_tag, shared_episodes

TOK = build_tiny_tokenizer()
EOS = TOK.eos_token_id


# ---------------------------------------------------------------------------------------- board
def test_a_rank_claims_its_own_groups_first_then_the_last_of_the_busiest():
    board = GroupBoard(is_dead=lambda handle: False)
    board.register("r", 0, 2, ["a0", "a1"])
    board.register("r", 1, 2, ["b0", "b1", "b2"])
    assert board.claim("r", 0) == (0, 0, "a0")
    assert board.claim("r", 0) == (0, 1, "a1")
    assert board.claim("r", 0) == (1, 2, "b2")   # stolen from the tail: the owner works from the front
    assert board.claim("r", 1) == (1, 0, "b0")
    assert board.claim("r", 1) == (1, 1, "b1")
    assert board.claim("r", 1) is None and board.claim("r", 0) is None


def test_an_owner_gets_back_what_others_ran_and_runs_what_a_dead_claimant_held():
    dead: set[str] = set()
    board = GroupBoard(is_dead=lambda handle: handle in dead)
    board.register("r", 0, 2, ["a0", "a1", "a2"], claimant="rank0")
    board.register("r", 1, 2, [], claimant="rank1")
    assert board.claim("r", 1) == (0, 2, "a2")
    assert board.claim("r", 1) == (0, 1, "a1")
    board.done("r", 0, 2, ["episodes of a2"])
    assert board.collect("r", 0) == {"done": {2: ["episodes of a2"]}, "orphans": {}}
    assert board.collect("r", 0) == {"done": {}, "orphans": {}}   # a1 still running on a live rank
    dead.add("rank1")
    assert board.collect("r", 0) == {"done": {}, "orphans": {1: "a1"}}   # a2 came back: not rerun
    assert board.collect("r", 0) == {"done": {}, "orphans": {}}


def test_a_failed_rank_releases_its_claims_and_finished_rounds_are_forgotten():
    board = GroupBoard(is_dead=lambda handle: False)
    board.register("r", 0, 3, ["a0", "a1"], claimant="rank0")
    board.register("r", 1, 3, ["b0", "b1", "b2"], claimant="rank1")
    board.register("r", 2, 3, [], claimant="rank2")
    assert board.claim("r", 2) == (1, 2, "b2")
    assert board.claim("r", 2) == (0, 1, "a1")
    board.done("r", 1, 2, ["episodes of b2"])
    board.release("r", 2)   # rank 2 failed holding a1
    board.release("r", 1)   # rank 1 failed: its groups are nobody's work, what was run for it is dropped
    assert board.collect("r", 0) == {"done": {}, "orphans": {1: "a1"}}
    assert board.claim("r", 0) == (0, 0, "a0") and board.claim("r", 0) is None   # b0, b1 not taken
    board.finish("r", 0)
    assert board.rounds() == 0   # every rank finished or failed
    for k in range(KEEP_ROUNDS + 3):   # rounds of failed steps are never finished: bounded memory
        board.register(f"failed{k}", 0, 2, ["x"])
    assert board.rounds() == KEEP_ROUNDS
    with pytest.raises(ValueError, match="registered twice"):
        board.register(f"failed{KEEP_ROUNDS + 2}", 0, 2, ["x"])
    with pytest.raises(KeyError, match="not on the board"):
        board.claim("failed0", 1)


def test_each_generate_call_on_a_scatter_is_a_round_of_its_own():
    """ReMax samples and decodes greedily from the same shares; a validation with val_n > 1 calls
    generate twice too: each call is its own round, and so are different sampling settings."""
    from raygraph.workers.agent_dispatch import Dispatch

    rank0, rank1, tag = Dispatch(16), Dispatch(16), {"round": "s", "rank": 0, "world": 2}
    names = [rank0.round_of(tag, (False, 1.0))["round"], rank0.round_of(tag, (True, 1.0))["round"]]
    assert names == ["s#0:False:1.0", "s#1:True:1.0"]
    assert [rank1.round_of({**tag, "rank": 1}, (False, 1.0))["round"],
            rank1.round_of({**tag, "rank": 1}, (True, 1.0))["round"]] == names


def test_the_scatter_tags_each_share_and_a_gather_drops_the_tag():
    batch = Batch({"x": torch.arange(6)}, {UID: np.array(["a", "a", "b", "b", "c", "c"], dtype=object)})
    shares = scatter(batch, 2)
    tags = [s.meta[SHARD] for s in shares]
    assert [t["rank"] for t in tags] == [0, 1] and {t["world"] for t in tags} == {2}
    assert tags[0]["round"] == tags[1]["round"] != scatter(batch, 2)[0].meta[SHARD]["round"]
    assert dispatch_tag(shares[1]) == tags[1] and dispatch_tag(scatter(batch, 1)[0]) is None
    assert SHARD not in Batch.concat(shares).meta and SHARD not in batch.meta


# ------------------------------------------------------------------------------- two ranks
class SeededEngine:
    """A continuous engine whose turn depends on its seed only (as vLLM's CPU sampler): the text
    `s<seed % 97>`, log-probs from the seed."""
    lock_step = False

    def __init__(self):
        self.queue, self.seen = [], []

    def submit(self, key, prompt, max_tokens, seed):
        self.queue.append((key, seed))

    def pending(self):
        return len(self.queue)

    def abort(self):
        self.queue = []

    def poll(self):
        out = []
        for key, seed in self.queue:
            tokens = TOK(f"s{seed % 97}", add_special_tokens=False)["input_ids"] + [EOS]
            out.append((key, tokens, [-(seed % 13 + j) / 10 for j in range(len(tokens))]))
            self.seen.append(seed)
        self.queue = []
        return out


GATE = threading.Event()   # a row with extra_info.gated waits for it (at most 30 s) at each step


class Slow:
    """Two turns; a row with extra_info.slow sleeps `slow` seconds per step, one with
    extra_info.gated waits for `GATE`."""

    def __init__(self, row):
        self.row, self.k = row, 0

    def step(self, response):
        self.k += 1
        time.sleep(self.row["extra_info"].get("slow", 0.0))
        if self.row["extra_info"].get("gated"):
            GATE.wait(timeout=30)
        return f"again {self.k}", float(len(response)), self.k >= 2


def _loop() -> AgentLoop:
    register_env("test_dispatch.Slow", Slow)
    budgets = AgentBudgets(max_turns=3, max_new_tokens=8, max_total_tokens=128, max_message_tokens=8)
    return AgentLoop(tokenizer=TOK, stop_token_ids=[EOS], budgets=budgets, env="test_dispatch.Slow")


def _share(rank: int, groups: int, n: int, slow: float, gated: bool = False):
    """Rank `rank`'s share: `groups` prompt groups of `n` rows, seeds distinct per row."""
    uids = [f"r{rank}g{g}" for g in range(groups) for _ in range(n)]
    rows = Batch({}, {UID: np.array(uids, dtype=object)})
    prompts = [TOK(f"q{rank} {i}", add_special_tokens=False)["input_ids"] for i in range(len(uids))]
    env_rows = [{"uid": u, "extra_info": {"slow": slow, "gated": gated}} for u in uids]
    seeds = [1000 * rank + i for i in range(len(uids))]
    return prompts, env_rows, seeds, rows


def _as_tuples(episodes):
    return [(ep.prompt, ep.tokens, ep.mask, ep.logprobs, ep.rewards, ep.truncation, ep.turns) for ep in episodes]


def test_two_ranks_share_a_round_by_load_and_return_what_the_even_split_gives():
    shares = [_share(0, 4, 2, 0.0), _share(1, 4, 2, 0.05)]   # rank 1's environment is slow
    even = [_as_tuples(_loop().run(SeededEngine(), *share[:3])) for share in shares]
    board = GroupBoard(is_dead=lambda handle: False)
    out, errors = {}, []

    def rank(r):
        try:
            tag = {"round": "step1", "rank": r, "world": 2}
            out[r] = shared_episodes(_loop(), SeededEngine(), *shares[r], tag, 2, board=board, me=r)
        except Exception as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=rank, args=(r,)) for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not errors, errors
    assert [_as_tuples(out[0]), _as_tuples(out[1])] == even
    assert board.rounds() == 0   # both owners finished: the round is forgotten


def test_the_fast_rank_runs_groups_of_the_slow_one(monkeypatch):
    # Rank 1's episodes wait until rank 0 has claimed all of its own groups (a sleep of rank 1's
    # environment was not slow enough on a loaded machine: rank 0's thread could be starved).
    GATE.clear()
    shares = [_share(0, 4, 2, 0.0), _share(1, 4, 2, 0.0, gated=True)]
    board = GroupBoard(is_dead=lambda handle: False)
    claims: list[tuple[int, int]] = []   # (claiming rank, owner)
    claim = board.claim

    def watched(round_id, r):
        got = claim(round_id, r)
        if got is not None:
            claims.append((r, got[0]))
        if r == 0 and (got is None or got[0] == 1):   # rank 0 is through its own groups
            GATE.set()
        return got

    monkeypatch.setattr(board, "claim", watched)
    threads = [threading.Thread(target=shared_episodes, args=(
        _loop(), SeededEngine(), *shares[r], {"round": "s", "rank": r, "world": 2}, 2),
        kwargs={"board": board, "me": r}) for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert (0, 1) in claims and (1, 0) not in claims   # only the fast rank helped
    assert len(claims) == 8


def test_an_owner_runs_the_group_a_dead_rank_held():
    prompts, env_rows, seeds, rows = _share(0, 3, 2, 0.0)
    even = _as_tuples(_loop().run(SeededEngine(), prompts, env_rows, seeds))
    dead: set[str] = set()
    board = GroupBoard(is_dead=lambda handle: handle in dead)
    board.register("r", 1, 2, [], claimant="rank1")
    stolen = []

    class Thief:   # rank 1 takes rank 0's last group as soon as rank 0 registers, then dies
        def __getattr__(self, name):
            return getattr(board, name)

        def register(self, *args):
            board.register(*args)
            stolen.append(board.claim("r", 1))
            dead.add("rank1")

    got = shared_episodes(_loop(), SeededEngine(), prompts, env_rows, seeds, rows,
                          {"round": "r", "rank": 0, "world": 2}, 4, board=Thief(), me="rank0")
    assert stolen[0][:2] == (0, 2)
    assert _as_tuples(got) == even


def test_a_rank_takes_groups_while_it_runs_fewer_episodes_than_its_window():
    """The window counts episodes (groups_in_flight x rollout.n): groups of 8 samples two at a
    time in training, single-sample validation groups sixteen at a time."""
    from raygraph.agents.episode import Episode
    from raygraph.workers.agent_dispatch import _Share

    for size, groups_at_once in ((8, 2), (1, 16)):
        board = GroupBoard(is_dead=lambda handle: False)
        payloads = [([[1]] * size, [{}] * size, [0] * size) for _ in range(40)]
        board.register("r", 0, 1, payloads)
        share, episodes = _Share(board, {"round": "r", "rank": 0}, payloads, window=16), []
        while (more := share.more(episodes)) is not None:
            episodes += [Episode(len(episodes), p, s) for p, s in zip(more[0], more[2])]
        assert len(share.running) == groups_at_once and len(episodes) == 16
