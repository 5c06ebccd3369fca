"""The agent loop when things go wrong: slow reactions queued for a thread are not timed out,
hung ones end their episode and, when they hold every thread, the run; a failed run aborts its
engine requests and closes every environment, also those a late reaction creates; special-token
tool tags reach the parser; numpy rewards; truncation labels; empty rollout shards keep columns."""

from __future__ import annotations

import time

import numpy as np
import pytest
import torch

from raygraph.agents.env import register_env
from raygraph.agents.episode import AgentBudgets
from raygraph.agents.loop import AgentLoop, EnvFailed
from raygraph.batch import RESPONSE_ATTENTION, RESPONSE_MASK, Batch
from raygraph.models.tiny import build_tiny_tokenizer

TOK = build_tiny_tokenizer()
EOS = TOK.eos_token_id
PROMPT = TOK("1+", add_special_tokens=False)["input_ids"]


class Engine:
    """Every submitted turn answers "a" + eos (or `length` tokens without eos) on the next poll."""
    lock_step = False

    def __init__(self, length: int | None = None):
        self.queue, self.aborted, self.length = [], [], length

    def submit(self, key, prompt, max_tokens, seed):
        self.queue.append((key, max_tokens))

    def pending(self):
        return len(self.queue)

    def poll(self):
        out = []
        for key, room in self.queue:
            tokens = [5] * min(self.length, room) if self.length else [5, EOS]
            out.append((key, tokens, [0.0] * len(tokens)))
        self.queue = []
        return out

    def abort(self):
        self.aborted, self.queue = list(self.queue), []


class Sleepy:
    """`sleep_s` per step; done after `turns`; episode `fail` raises at its first step."""
    opened, closed = [], []

    def __init__(self, row, sleep_s: float = 0.0, turns: int = 1):
        self.row, self.sleep_s, self.turns, self.k = row, sleep_s, turns, 0
        Sleepy.opened.append(row["uid"])

    def step(self, response):
        self.k += 1
        if self.row.get("fail"):
            raise RuntimeError("boom")
        time.sleep(self.sleep_s * self.row.get("slow", 1))
        return "o", np.float32(0.5), self.k >= self.turns

    def close(self):
        Sleepy.closed.append(self.row["uid"])


register_env("test_failures_sleepy", Sleepy)


def loop(**kwargs) -> AgentLoop:
    budgets = kwargs.pop("budgets", AgentBudgets(max_turns=4, max_new_tokens=8, max_total_tokens=64,
                                                 max_message_tokens=8))
    return AgentLoop(tokenizer=TOK, stop_token_ids=[EOS], budgets=budgets, env="test_failures_sleepy", **kwargs)


def test_time_queued_for_a_thread_is_not_counted_against_env_timeout_s():
    # 8 episodes, 2 threads, 0.2 s steps: the last ones wait 0.6 s for a thread, none runs 0.5 s
    eps = loop(env_workers=2, env_timeout_s=0.5, env_args={"sleep_s": 0.2}).run(
        Engine(), [PROMPT] * 8, [{"uid": i} for i in range(8)], [0] * 8)
    assert [e.truncation for e in eps] == ["none"] * 8
    assert [e.total_reward for e in eps] == [0.5] * 8   # a numpy reward is a number


def test_hung_reactions_end_their_episodes_then_the_run_when_they_hold_every_thread():
    rows = [{"uid": i, "slow": 20 if i < 1 else 0} for i in range(3)]
    agent = loop(env_workers=2, env_timeout_s=0.2, env_args={"sleep_s": 0.1})
    eps = agent.run(Engine(), [PROMPT] * 3, rows, [0] * 3)
    assert [e.truncation for e in eps] == ["env_timeout", "none", "none"] and agent.hung == 1
    with pytest.raises(EnvFailed, match="hold every one of the 2 env_workers threads"):
        agent.run(Engine(), [PROMPT] * 3, rows, [0] * 3)


def test_a_failed_run_aborts_its_engine_requests_and_closes_every_environment():
    Sleepy.opened, Sleepy.closed = [], []
    rows = [{"uid": 0, "fail": True}] + [{"uid": i, "slow": 3} for i in range(1, 4)]
    engine = Engine()
    agent = loop(env_workers=4, env_args={"sleep_s": 0.1, "turns": 3})
    with pytest.raises(EnvFailed, match="Sleepy raised in episode 0"):
        agent.run(engine, [PROMPT] * 4, rows, [0] * 4)
    # The other episodes' reactions finish after the failure (0.5 s was too short on a loaded 2-core
    # machine); an episode whose first reaction had not begun when episode 0 failed never opens its
    # environment (seen under `make test`): every environment opened is closed.
    deadline = time.monotonic() + 10
    while (len(Sleepy.closed) < len(Sleepy.opened) or not Sleepy.closed) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert sorted(Sleepy.closed) == sorted(Sleepy.opened) and 0 in Sleepy.opened
    assert engine.queue == []


def test_truncation_says_whether_a_turn_was_cut_by_its_budget_or_by_the_context():
    budgets = AgentBudgets(max_turns=3, max_new_tokens=8, max_total_tokens=len(PROMPT) + 8 + 7 + 5,
                           max_message_tokens=8)
    (full,) = loop(budgets=budgets, env_args={"turns": 1}).run(Engine(length=99), [PROMPT], [{"uid": 0}], [0])
    assert full.truncation == "length"
    (squeezed,) = loop(budgets=budgets, env_args={"turns": 3}).run(Engine(length=99), [PROMPT], [{"uid": 0}], [0])
    assert squeezed.truncation == "context" and squeezed.turns == 2 and squeezed.last_room < 8


def test_the_tool_parser_reads_tool_tags_that_are_special_tokens(tmp_path, smollm2_path):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(smollm2_path)
    tok.add_special_tokens({"additional_special_tokens": ["<tool_call>", "</tool_call>"]})
    agent = AgentLoop(tokenizer=tok, stop_token_ids=[tok.eos_token_id], tools=["calculator"],
                      budgets=AgentBudgets(max_turns=2, max_new_tokens=64, max_total_tokens=512, max_message_tokens=8))
    call = tok('<tool_call>{"name": "calculator", "arguments": {"expression": "6 * 7"}}</tool_call>',
               add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    text, raw = agent._texts(call)
    assert "<tool_call>" not in text and raw.startswith("<tool_call>") and not raw.endswith(tok.eos_token)
    assert [c.name for c in agent.reactor.parse(raw)] == ["calculator"]


def test_an_empty_rollout_shard_keeps_every_episode_column(tiny_model_path):
    from raygraph.data.prompts import collate_prompts
    from raygraph.workers.rollout_hf import HFRolloutWorker

    worker = HFRolloutWorker(model_path=tiny_model_path, seed=0, n=2, max_new_tokens=2, agent={
        "budgets": {"max_turns": 2, "max_new_tokens": 2, "max_total_tokens": 64, "max_message_tokens": 8},
        "env": "retry_with_feedback"})
    from raygraph.data.prompts import PromptRow
    prompts = collate_prompts([PromptRow(0, TOK("1+2=", add_special_tokens=False)["input_ids"], "1+2=", "toy_arith",
                                         "3", {})], TOK.pad_token_id)
    full, empty = worker.generate(prompts), worker.generate(prompts.select(slice(0, 0)))
    assert set(empty.columns()) == set(full.columns())
    for shards in ([empty, full], [full, empty]):
        merged = Batch.concat(shards)
        assert torch.equal(merged[RESPONSE_ATTENTION], full[RESPONSE_ATTENTION])
    with pytest.raises(ValueError, match="different columns"):
        Batch.concat([full, full.select_columns([RESPONSE_MASK])])
    worker.close()
    with pytest.raises(RuntimeError, match="after shutdown"):   # the loop's threads are let go
        worker.agent.pool.submit(print)
