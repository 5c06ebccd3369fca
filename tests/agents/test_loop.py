"""The agent loop over a scripted engine: token/mask/log-prob alignment, reward placement, budgets
and truncation reasons, tools, environment failures and close(), concurrency and determinism."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from raygraph.agents.env import EnvContractError, register_env
from raygraph.agents.episode import AgentBudgets
from raygraph.agents.loop import AgentLoop, EnvFailed
from raygraph.models.tiny import build_tiny_tokenizer

TOK = build_tiny_tokenizer()
EOS = TOK.eos_token_id


def ids(text: str) -> list[int]:
    return TOK(text, add_special_tokens=False)["input_ids"]


class ScriptedEngine:
    """Answers each episode's turns from a script (text per turn); log-prob of token j is -(j+1)/10.
    `lock_step` False: one finished turn per poll, in submission order (continuous)."""

    def __init__(self, scripts: dict[int, list[str]], lock_step: bool = False, eos: bool = True):
        self.scripts, self.lock_step, self.eos = scripts, lock_step, eos
        self.queue, self.turn, self.submitted = [], {}, []

    def submit(self, key, prompt, max_tokens, seed):
        self.submitted.append((key, list(prompt), max_tokens, seed))
        self.queue.append((key, max_tokens))

    def pending(self):
        return len(self.queue)

    def abort(self):
        self.queue = []

    def poll(self):
        batch = self.queue if self.lock_step else self.queue[:1]
        self.queue = [] if self.lock_step else self.queue[1:]
        out = []
        for key, max_tokens in batch:
            k = self.turn.get(key, 0)
            self.turn[key] = k + 1
            tokens = (ids(self.scripts[key][k]) + ([EOS] if self.eos else []))[:max_tokens]
            out.append((key, tokens, [-(j + 1) / 10 for j in range(len(tokens))]))
        return out


class Countdown:
    """Reward 0.5 per turn, done after `turns` turns; the observation says which turn is next."""
    closed: list[int] = []

    def __init__(self, row, turns: int = 2, fail_at: int | None = None, sleep_s: float = 0.0):
        self.row, self.turns, self.fail_at, self.sleep_s, self.k = row, turns, fail_at, sleep_s, 0

    def step(self, response):
        self.k += 1
        time.sleep(self.sleep_s * (self.row["extra_info"].get("slow", 0)))
        if self.fail_at == self.k and self.row["extra_info"].get("fail", 1):
            raise RuntimeError("the environment broke")
        return (f"t{self.k}", 0.5, self.k >= self.turns)

    def close(self):
        Countdown.closed.append(self.row["uid"])


def loop(env: type = Countdown, budgets=None, **kwargs) -> AgentLoop:
    """A loop over `env`, registered under a name of its own (as a plugin would)."""
    budgets = budgets or AgentBudgets(max_turns=4, max_new_tokens=8, max_total_tokens=64, max_message_tokens=8)
    name = f"test_loop.{env.__qualname__}.{id(env)}"
    register_env(name, env)
    return AgentLoop(tokenizer=TOK, stop_token_ids=[EOS], budgets=budgets, env=name, **kwargs)


def rows(n, **extra):
    return [{"uid": i, "extra_info": dict(extra)} for i in range(n)]


PROMPT = ids("1+")


def test_tokens_masks_logprobs_and_rewards_line_up_turn_by_turn():
    engine = ScriptedEngine({0: ["ab", "cd"]})
    (ep,) = loop(env_args={"turns": 2}).run(engine, [PROMPT], rows(1), [7])
    obs = ids("<|user|>t1<|end|><|assistant|>")   # the model's eos already closed turn 1
    assert ep.tokens == ids("ab") + [EOS] + obs + ids("cd") + [EOS]
    assert ep.mask == [1, 1, 1] + [0] * len(obs) + [1, 1, 1]
    assert ep.logprobs == pytest.approx([-0.1, -0.2, -0.3] + [0.0] * len(obs) + [-0.1, -0.2, -0.3])
    # each turn's reward on its last token; the return is their sum
    assert ep.rewards[2] == 0.5 and ep.rewards[-1] == 0.5 and sum(ep.rewards) == 1.0
    assert ep.turns == 2 and ep.truncation == "none"
    # turn 2 was asked with exactly the stream so far: the prefix is never re-tokenized
    assert engine.submitted[1][1] == PROMPT + ep.tokens[:3 + len(obs)]
    # per-turn seeds depend on the episode seed and the turn only
    assert [s for *_, s in engine.submitted] == [7, 7 + 1_000_003]


def test_a_turn_cut_by_its_budget_is_closed_by_the_template_and_reported():
    engine = ScriptedEngine({0: ["abcdefghij", "x"]}, eos=False)
    budgets = AgentBudgets(max_turns=2, max_new_tokens=4, max_total_tokens=64, max_message_tokens=8)
    (ep,) = loop(budgets=budgets, env_args={"turns": 2}).run(engine, [PROMPT], rows(1), [0])
    # no eos was generated, so the appended part starts with the end-of-turn token
    assert ep.tokens[4:4 + len(ids("<|end|><|user|>t1"))] == ids("<|end|><|user|>t1")
    assert ep.truncation == "length"   # the environment finished, on a turn that was cut


def test_turn_and_context_budgets_end_episodes_with_their_reason():
    never_done = {"turns": 99}
    turns = AgentBudgets(max_turns=3, max_new_tokens=4, max_total_tokens=500, max_message_tokens=8)
    (ep,) = loop(budgets=turns, env_args=never_done).run(ScriptedEngine({0: ["a"] * 5}), [PROMPT], rows(1), [0])
    assert (ep.turns, ep.truncation) == (3, "turns")
    context = AgentBudgets(max_turns=9, max_new_tokens=4, max_total_tokens=len(PROMPT) + 12, max_message_tokens=8)
    engine = ScriptedEngine({0: ["abc"] * 9})
    (ep,) = loop(budgets=context, env_args=never_done).run(engine, [PROMPT], rows(1), [0])
    assert ep.truncation == "context" and len(PROMPT) + len(ep.tokens) <= context.max_total_tokens
    # every request asked for no more than what was left of the context
    assert all(len(p) + m <= context.max_total_tokens for _, p, m, _ in engine.submitted)


def test_long_observations_are_cut_to_their_token_budget_and_say_so():
    class Chatty:
        def __init__(self, row):
            self.k = 0

        def step(self, response):
            self.k += 1
            return "x" * 50, 0.0, self.k >= 2

    (ep,) = loop(env=Chatty).run(ScriptedEngine({0: ["a", "b"]}), [PROMPT], rows(1), [0])
    observation = ep.messages[1]
    assert observation["truncated"] and observation["tokens"] == 8
    assert observation["text"].startswith("x" * 8 + "\n[truncated: 42 more tokens]")


def test_environment_failures_name_the_episode_and_every_environment_is_closed():
    Countdown.closed = []
    data = [{"uid": 0, "extra_info": {"fail": 0}}, {"uid": 1, "extra_info": {"fail": 1}}]
    with pytest.raises(EnvFailed, match=r"Countdown raised in episode 1 \(uid 1\) after turn 2: RuntimeError: the environment broke"):
        loop(env_args={"turns": 5, "fail_at": 2}).run(
            ScriptedEngine({0: ["a"] * 5, 1: ["b"] * 5}), [PROMPT, PROMPT], data, [0, 1])
    assert sorted(Countdown.closed) == [0, 1]


def test_a_step_that_breaks_the_contract_is_a_clear_error():
    class Bad:
        def __init__(self, row):
            pass

        def step(self, response):
            return "obs", "1.0", False

    with pytest.raises(EnvContractError, match="returned reward '1.0'; it must be a finite number"):
        loop(env=Bad).run(ScriptedEngine({0: ["a"]}), [PROMPT], rows(1), [0])


def test_a_slow_environment_does_not_hold_up_the_other_episodes():
    """Episode 0's environment takes 0.5 s per step; the 3 others finish both turns meanwhile."""
    finished_at = {}

    class Clocked(Countdown):
        def step(self, response):
            out = super().step(response)
            if out[2]:
                finished_at[self.row["uid"]] = time.monotonic()
            return out

    data = [{"uid": i, "extra_info": {"slow": int(i == 0)}} for i in range(4)]
    start = time.monotonic()
    loop(env=Clocked, env_args={"turns": 2, "sleep_s": 0.5}).run(
        ScriptedEngine({i: ["a", "b"] for i in range(4)}), [PROMPT] * 4, data, [0, 1, 2, 3])
    assert max(finished_at[i] for i in (1, 2, 3)) - start < 0.4
    assert finished_at[0] - start >= 1.0


def test_a_timed_out_reaction_ends_only_its_episode():
    budgets = AgentBudgets(max_turns=4, max_new_tokens=8, max_total_tokens=64, max_message_tokens=8)
    data = [{"uid": i, "extra_info": {"slow": int(i == 0)}} for i in range(2)]
    eps = loop(budgets=budgets, env_args={"turns": 2, "sleep_s": 1.0}, env_timeout_s=0.3).run(
        ScriptedEngine({0: ["a", "b"], 1: ["a", "b"]}), [PROMPT] * 2, data, [0, 1])
    assert [e.truncation for e in eps] == ["env_timeout", "none"]


def test_a_streaming_run_starts_work_while_others_wait_and_closes_each_environment_as_it_ends():
    """`streaming` (a rank's loop that runs as long as training): an episode handed over by `more`
    while every running episode waits for a slow environment starts at once (`more` is asked at
    least every 0.1 s), an ended episode's environment is closed then, not when the run ends, and
    ended episodes are forgotten. Without it, the new episode waits for the slow step (1 s)."""
    def run(streaming: bool) -> tuple[list[int], list[bool], list]:
        Countdown.closed.clear()
        ended, closed_first, begun = [], [], time.monotonic()

        def more(episodes):
            for ep in episodes:
                if ep.done and ep.index not in ended:
                    ended.append(ep.index)
                    closed_first.append(ep.uid in Countdown.closed)
            if time.monotonic() - begun > 0.3 and not more.handed:   # "submitted" while episode 0 waits
                more.handed = True
                return [PROMPT], [{"uid": 1, "extra_info": {}}], [0]
            return None
        more.handed = False

        engine = ScriptedEngine({0: ["a"], 1: ["b"]})
        out = loop(env_args={"turns": 1, "sleep_s": 1.0}).run(engine, [PROMPT], [{"uid": 0, "extra_info": {"slow": 1}}],
                                                           [0], more=more, streaming=streaming)
        assert sorted(Countdown.closed) == [0, 1]   # each environment closed once, either way
        return ended, closed_first, out

    ended, closed_first, out = run(streaming=True)
    assert ended == [1, 0] and closed_first == [True, True] and out == []
    ended, closed_first, out = run(streaming=False)
    assert ended == [0, 1] and closed_first == [False, False] and [ep.index for ep in out] == [0, 1]


def test_more_sees_every_episode_it_hands_over_even_one_that_ends_as_it_starts():
    """An episode with no room for a turn ends as it starts ("context"); the run must not end
    before `more` has seen it (a streaming rank would wait for it for ever)."""
    budgets = AgentBudgets(max_turns=2, max_new_tokens=4, max_total_tokens=len(PROMPT) + 2, max_message_tokens=8)
    seen = []

    def more(episodes):
        seen.extend(ep.index for ep in episodes if ep.done and ep.index not in seen)
        if not more.handed:
            more.handed = True
            return [PROMPT * 3], [{"uid": 9, "extra_info": {}}], [0]
        return None
    more.handed = False

    out = loop(budgets=budgets).run(ScriptedEngine({}), [], [], [], more=more)
    assert [ep.truncation for ep in out] == ["context"] and seen == [0]


def test_async_environments_and_lock_step_engines_give_the_same_episodes():
    class AsyncCountdown(Countdown):
        async def step(self, response):
            await asyncio.sleep(0.01)
            return Countdown.step(self, response)

    scripts = {i: ["ab", "c", "d"] for i in range(3)}
    plain = loop(env_args={"turns": 3}).run(ScriptedEngine(scripts), [PROMPT] * 3, rows(3), [0, 1, 2])
    waves = loop(env=AsyncCountdown, env_args={"turns": 3}).run(
        ScriptedEngine(scripts, lock_step=True), [PROMPT] * 3, rows(3), [0, 1, 2])
    assert [(e.tokens, e.mask, e.rewards) for e in plain] == [(e.tokens, e.mask, e.rewards) for e in waves]
    assert threading.active_count() < 60   # the pool is bounded


def test_tool_calls_run_and_their_results_come_back_as_tool_messages(tmp_path):
    tools = tmp_path / "my_tools.py"
    tools.write_text('def add(a: int, b: int) -> int:\n    """Add.\n\n    Args:\n        a: first\n        b: second\n    """\n'
                     '    return a + b\n')
    # the tiny tokenizer has no "<" or "_": a parser of the user's own reads "CALL add 2 3"
    parser = tmp_path / "my_parser.py"
    parser.write_text("from raygraph.agents.tools import ToolCall\n"
                      "def parse(text):\n"
                      "    if not text.startswith('CALL'):\n        return []\n"
                      "    parts = text.split()\n"
                      "    if len(parts) != 4:\n        return [ToolCall('', {}, error='say CALL name a b')]\n"
                      "    return [ToolCall(parts[1], {'a': int(parts[2]), 'b': int(parts[3])})]\n")
    engine = ScriptedEngine({0: ["CALL add 2 3", "CALL add", "5"]})
    # tools only: the episode ends at the first turn without a tool call; the tiny template has no
    # tool role token, so tool results come as user messages
    (ep,) = AgentLoop(tokenizer=TOK, stop_token_ids=[EOS], tools=[f"{tools}:add"], tool_role="user",
                      tool_parser=f"{parser}:parse",
                      budgets=AgentBudgets(max_turns=5, max_new_tokens=64, max_total_tokens=400,
                                           max_message_tokens=64)).run(engine, [PROMPT], rows(1), [0])
    shown = [(m["role"], m["text"]) for m in ep.messages]
    assert shown[1] == ("user", "5")
    assert shown[3] == ("user", "error: say CALL name a b")
    assert shown[4] == ("assistant", "5") and ep.truncation == "none"
    assert dict(ep.tool_status) == {"ok": 1, "error": 1}
