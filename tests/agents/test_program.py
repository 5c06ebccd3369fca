"""Agent programs (`rollout.agent.program`) over a scripted engine: the endpoint serves an
`openai.AsyncOpenAI` client, every call's ids and log-probs are recorded as the engine made them,
calls that extend the row merge and others split (with the tiny and the SmolLM2 chat templates),
budgets, refusals, key and interface checks, timeouts and failures."""

from __future__ import annotations

import json
import socket
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from raygraph.agents.endpoint import Endpoint, node_address
from raygraph.agents.env import EnvContractError
from raygraph.agents.episode import AgentBudgets
from raygraph.agents.loop import EnvFailed
from raygraph.agents.program import Call, ProgramLoop, calls_to_rows
from raygraph.batch import PROMPT_IDS, PROMPT_MASK, PROMPT_TEXT, UID, Batch
from raygraph.data.chat import format_prompt
from raygraph.models.tiny import build_tiny_tokenizer
from raygraph.workers.agent_rollout import program_rows

TOK = build_tiny_tokenizer()
EOS = TOK.eos_token_id
PROGRAMS = Path(__file__).with_name("programs.py")
BUDGETS = AgentBudgets(max_turns=4, max_new_tokens=6, max_total_tokens=80, max_message_tokens=8)


def ids(text: str) -> list[int]:
    return TOK(text, add_special_tokens=False)["input_ids"]


class ScriptedEngine:
    """A `TurnEngine` answering each call with `answer(prompt, max_tokens) -> (ids, log-probs)`, all
    pending calls in one poll; keeps what it generated, in `made`."""
    lock_step = False

    def __init__(self, answer) -> None:
        self.answer, self.queue, self.made = answer, [], []

    def submit(self, key, prompt, max_tokens, seed):
        self.queue.append((key, list(prompt), max_tokens, seed))

    def pending(self):
        return len(self.queue)

    def abort(self):
        self.queue = []

    def poll(self):
        out = []
        for key, prompt, max_tokens, seed in self.queue:
            tokens, logprobs = self.answer(prompt, max_tokens)
            self.made.append({"prompt": prompt, "tokens": tokens, "logprobs": logprobs, "max_tokens": max_tokens,
                              "seed": seed})
            out.append((key, tokens, logprobs))
        self.queue = []
        return out


def echo_engine(cut: bool = False) -> ScriptedEngine:
    """Answers a call with the digit len(prompt) % 10 (nine of them with `cut`), then eos, cut to
    max_tokens; log-prob j of a call is -(j + 1) / 10 - len(prompt) / 1000."""
    def answer(prompt, max_tokens):
        tokens = (ids(str(len(prompt) % 10) * (9 if cut else 1)) + [EOS])[:max_tokens]
        return tokens, [-(j + 1) / 10 - len(prompt) / 1000 for j in range(len(tokens))]

    return ScriptedEngine(answer)


def replay(answers: list[list[int]]) -> ScriptedEngine:
    """Answers the calls in order with fixed token ids, log-prob -0.5 each."""
    answers = list(answers)

    def answer(prompt, max_tokens):
        tokens = answers.pop(0)
        return tokens, [-0.5] * len(tokens)

    return ScriptedEngine(answer)


def program_loop(name: str, budgets=BUDGETS, tokenizer=TOK, **kwargs) -> ProgramLoop:
    return ProgramLoop(tokenizer=tokenizer, stop_token_ids=[tokenizer.eos_token_id], budgets=budgets,
                       program=f"{PROGRAMS}:{name}", host="127.0.0.1", **kwargs)


def data_rows(n: int, tokenizer=TOK, **extra) -> tuple[list[list[int]], list[dict]]:
    rows, prompts = [], []
    for i in range(n):
        messages = [{"role": "user", "content": f"{i + 10}+3="}]
        rows.append({"prompt": messages, "reward_model": {"ground_truth": "3"}, "uid": f"u{i}",
                     "extra_info": {k: v[i] if isinstance(v, list) else v for k, v in extra.items()}})
        prompts.append(tokenizer(format_prompt(tokenizer, messages), add_special_tokens=False)["input_ids"])
    return prompts, rows


def run(loop: ProgramLoop, n: int = 3, engine=None, seeds=None, **extra):
    engine = engine or echo_engine()
    prompts, rows = data_rows(n, **extra)
    try:
        return loop.run(engine, prompts, rows, seeds or [None] * n), engine, prompts, rows
    finally:
        loop.shutdown()


def test_every_call_is_recorded_as_generated_and_an_extending_call_continues_the_row():
    episodes, engine, prompts, rows = run(program_loop("two_turns"), n=3, seeds=[7, 8, 9])
    assert len(engine.made) == 6
    for i, parts in enumerate(episodes):
        assert len(parts) == 1
        row = parts[0]
        first, second = (m for m in engine.made if m["prompt"][:len(prompts[i])] == prompts[i])
        assert row.prompt == prompts[i] == first["prompt"]
        # the second call's prompt is the row so far plus the feedback message and the next header
        context = second["prompt"][len(first["prompt"]) + len(first["tokens"]):]
        assert TOK.decode(context) == "<|user|>again<|end|><|assistant|>"
        assert row.tokens == first["tokens"] + context + second["tokens"]
        assert row.mask == [1] * len(first["tokens"]) + [0] * len(context) + [1] * len(second["tokens"])
        assert row.logprobs == first["logprobs"] + [0.0] * len(context) + second["logprobs"]
        # the reward (the second answer's length: one digit) sits on the last model token
        assert row.rewards == [0.0] * (len(row.tokens) - 1) + [1.0]
        assert row.uid == f"u{i}" and row.truncation == "none" and row.turns == 2
    # one seed per call: the episode's, then + 1_000_003 (as an environment episode's turns)
    assert sorted(m["seed"] for m in engine.made) == [7, 8, 9, 1_000_010, 1_000_011, 1_000_012]
    # the client saw the same ids and log-probs (the response's raygraph field and logprobs)
    extras = episodes[0][0].messages[-1]
    assert extras["role"] == "program" and extras["reward"] == 1.0 and extras["text"].startswith("returned reward 1;")
    first_reply = extras["first"]
    assert first_reply["raygraph"]["completion_token_ids"] == engine.made[0]["tokens"]
    assert [c["logprob"] for c in first_reply["choices"][0]["logprobs"]["content"]] == engine.made[0]["logprobs"]


def test_a_call_that_does_not_extend_the_row_starts_a_new_one_and_both_carry_the_reward():
    episodes, engine, prompts, _ = run(program_loop("rewritten_history"), n=2)
    for i, parts in enumerate(episodes):
        assert len(parts) == 2
        assert parts[0].prompt == prompts[i]
        assert parts[1].prompt == ids("<|user|>other<|end|><|assistant|>")
        for row in parts:
            assert row.mask == [1] * len(row.tokens) and row.rewards[-1] == 2.0 and sum(row.rewards) == 2.0
    batch = Batch({PROMPT_IDS: __import__("torch").zeros((2, 3), dtype=__import__("torch").int64),
                   PROMPT_MASK: __import__("torch").ones((2, 3), dtype=__import__("torch").int64)},
                  {UID: __import__("numpy").array(["u0", "u1"], dtype=object)})
    rows, flat = program_rows(batch, episodes, TOK)
    assert list(rows[UID]) == ["u0", "u0", "u1", "u1"]   # one group per prompt, whatever the split
    assert [r.prompt for r in flat] == [p for parts in episodes for p in (parts[0].prompt, parts[1].prompt)]
    mask = rows[PROMPT_MASK].bool()
    assert [rows[PROMPT_IDS][k][mask[k]].tolist() for k in range(4)] == [r.prompt for r in flat]
    assert list(rows[PROMPT_TEXT]) == [TOK.decode(r.prompt) for r in flat]
    assert rows[PROMPT_TEXT][1] == "<|user|>other<|end|><|assistant|>"


@pytest.mark.slow   # the SmolLM2 import, the first time
def test_merge_and_split_with_a_real_chat_template(smollm2_path):
    """SmolLM2's template: a turn the model tokenized canonically merges; the same text tokenized
    otherwise (one id per character) cannot be the prefix the template renders, so it splits."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(smollm2_path)
    question = [{"role": "user", "content": "What is 13+24?"}]
    answer = "The answer is 37."
    prompt = tok(format_prompt(tok, question), add_special_tokens=False)["input_ids"]
    follow = question + [{"role": "assistant", "content": answer}, {"role": "user", "content": "Sure?"}]
    second = tok(format_prompt(tok, follow), add_special_tokens=False)["input_ids"]
    end = tok.convert_tokens_to_ids("<|im_end|>")
    canonical = tok(answer, add_special_tokens=False)["input_ids"] + [end]
    odd = [tok.convert_tokens_to_ids(c if c != " " else "Ġ") for c in answer] + [end]
    assert tok.decode(odd) == tok.decode(canonical)   # the same text, other ids
    for tokens, n_rows in ((canonical, 1), (odd, 2)):
        calls = [Call(prompt, tokens, [-0.5] * len(tokens), answer), Call(second, [end], [-0.1], "")]
        rows = calls_to_rows(calls, prompt, "u", 1.0, "none", tok)
        assert len(rows) == n_rows
        assert rows[-1].prompt + rows[-1].tokens == second + [end]
        assert all(r.rewards[-1] == 1.0 for r in rows)


def test_budgets_cap_each_call_and_refuse_calls_past_max_turns():
    budgets = AgentBudgets(max_turns=3, max_new_tokens=5, max_total_tokens=80, max_message_tokens=8)
    episodes, engine, _, _ = run(program_loop("many_calls", budgets=budgets, program_args={"calls": 5}), n=1,
                                 engine=echo_engine(cut=True))
    assert [m["max_tokens"] for m in engine.made] == [5, 5, 5]    # max_tokens=100 asked, 5 given
    (row,) = episodes[0][:1]
    assert len(episodes[0]) == 3        # each call's raw prompt is new: one row each
    assert all(r.tokens and len(r.tokens) == 5 for r in episodes[0])
    assert episodes[0][-1].truncation == "turns" and episodes[0][-1].rewards[-1] == 3.0


def test_the_context_budget_refuses_a_prompt_with_no_room():
    budgets = AgentBudgets(max_turns=3, max_new_tokens=5, max_total_tokens=8, max_message_tokens=8)
    episodes, engine, _, rows = run(program_loop("asks_for", budgets=budgets), n=1)
    assert engine.made == [] and "rollout.agent.max_total_tokens=8" in episodes[0][-1].messages[-1]["error"]
    assert episodes[0][0].truncation == "context" and episodes[0][0].tokens == []


@pytest.mark.parametrize(("params", "served"), [
    ({"temperature": 0.7}, False), ({"temperature": 1.0, "top_p": 1.0}, True), ({"n": 2}, False),
    ({"stop": ["\n"]}, False), ({"seed": 3}, False), ({"max_tokens": 2}, True),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}]}, True),
    ({"functions": [{"name": "f"}]}, False),
    ({"response_format": {"type": "json_object"}}, False), ({"top_logprobs": 2, "logprobs": True}, False),
])
def test_sampling_parameters_are_honoured_when_they_are_the_runs_else_refused(params, served):
    episodes, engine, _, rows = run(program_loop("asks_for", program_args=params), n=1)
    assert episodes[0][0].rewards[-1:] == ([1.0] if served else [])
    if served:
        assert engine.made[0]["max_tokens"] == params.get("max_tokens", BUDGETS.max_new_tokens)
    else:
        assert engine.made == [] and "400" in episodes[0][-1].messages[-1]["error"]
        assert next(iter(params)) in episodes[0][-1].messages[-1]["error"]


def test_requests_need_the_runs_key_and_plain_http_works_with_it():
    episodes, engine, _, rows = run(program_loop("plain_http"), n=1)
    assert episodes[0][-1].messages[-1]["statuses"] == (401, 200)
    assert len(engine.made) == 1 and episodes[0][0].rewards[-1] == len(engine.made[0]["tokens"])


def _post(url: str, key: str | None):
    request = urllib.request.Request(url + "/chat/completions", data=b"{}", method="POST",
                                     headers={"Authorization": f"Bearer {key}"} if key else {})
    try:
        with urllib.request.urlopen(request, timeout=5) as reply:
            return reply.status
    except urllib.error.HTTPError as exc:
        return exc.code


def _outward_address() -> str:
    """This machine's address on its default route (a UDP connect sends nothing)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        try:
            probe.connect(("192.0.2.1", 9))
            return probe.getsockname()[0]
        except OSError:
            pytest.skip("this machine has no address besides the loopback one")


def test_the_endpoint_listens_on_one_interface_and_checks_key_and_episode():
    other = _outward_address()
    seen = []
    endpoint = Endpoint(lambda episode, kind, body: seen.append((episode, kind)) or {"ok": True}, host="127.0.0.1")
    try:
        url = endpoint.open_episode(4)
        assert _post(url, endpoint.key) == 200 and seen == [(4, "chat")]
        assert _post(url, "wrong") == 401 and _post(url, None) == 401
        assert _post(url.replace("/v1", "x/v1"), endpoint.key) == 410          # not an episode's URL
        with pytest.raises(ConnectionRefusedError):
            socket.create_connection((other, endpoint.port), timeout=5)      # not on the other interface
        endpoint.close_episodes()
        assert _post(url, endpoint.key) == 410 and seen == [(4, "chat")]      # the episode is over
    finally:
        endpoint.close()
    with pytest.MonkeyPatch.context() as patch:
        patch.setitem(__import__("sys").modules, "ray", None)   # as in a process without Ray
        assert node_address() == "127.0.0.1"
    outward = Endpoint(lambda *_: {}, host=other)
    try:
        with pytest.raises(ConnectionRefusedError):
            socket.create_connection(("127.0.0.1", outward.port), timeout=5)
        assert _post(outward.open_episode(0), outward.key) == 200
    finally:
        outward.close()


def test_a_hung_program_is_cut_by_its_timeout_and_keeps_its_calls():
    loop = program_loop("hangs_after_one_call", program_timeout_s=1.0)
    episodes, engine, _, _ = run(loop, n=3, hang=[0, 1, 0])
    assert [parts[-1].truncation for parts in episodes] == ["none", "env_timeout", "none"]
    assert [parts[-1].rewards[-1] for parts in episodes] == [1.0, 0.0, 1.0]
    assert len(episodes[1][0].tokens) == 2 and loop.timed_out == 1


def test_a_program_that_raises_stops_the_step_naming_the_episode():
    with pytest.raises(EnvFailed, match=r"program raises raised in episode 0 \(uid 'u0'\).*RuntimeError: the agent broke"):
        run(program_loop("raises"), n=1)


def test_a_program_must_return_a_number():
    with pytest.raises(EnvContractError, match=r"must return a finite number.*'fine'.*\(in episode 0 \(uid 'u0'\)"):
        run(program_loop("returns_text"), n=1)


def test_program_references_and_arguments_are_checked():
    with pytest.raises(EnvContractError, match="no agent program .*named 'missing'.*two_turns"):
        program_loop("missing")
    with pytest.raises(EnvContractError, match="does not take program_args"):
        program_loop("two_turns", program_args={"colour": 1})


def test_a_response_is_json_an_openai_client_parses():
    """(The openai package parsed every reply above; this pins the completions route's shape.)"""
    episodes, engine, _, _ = run(program_loop("many_calls", program_args={"calls": 1}), n=1)
    assert len(engine.made) == 1 and json.dumps(episodes[0][-1].messages)


PROGRAM = ["rollout.agent.env=null", "rollout.agent.program=raygraph.agents.demo_program:run"]


@pytest.mark.parametrize(("overrides", "problem"), [
    (PROGRAM + ["reward.kind=rule"], "rollout.agent.program returns the episode's reward, so set reward.kind=env"),
    (PROGRAM + ["rollout.agent.env=retry_with_feedback"], "leave rollout.agent.env and rollout.agent.tools unset"),
    (PROGRAM + ["rollout.agent.tools=[calculator]"], "leave rollout.agent.env and rollout.agent.tools unset"),
    (PROGRAM + ["rollout.agent.dispatch=least_loaded", "rollout.engine=vllm"], "dispatch=even"),
    (PROGRAM + ["rollout.agent.program_args={retry_rewrd: 1}"], "does not take program_args ['retry_rewrd']"),
    (["rollout.agent.env=null", f"rollout.agent.program={PROGRAMS}:nope"], "no agent program (an async def"),
    (["rollout.agent.program_timeout_s=3"], "no rollout.agent.program to take it"),
    (PROGRAM + ["rollout.agent.tool_parser=hermess"], "rollout.agent.tool_parser: unknown tool parser 'hermess'"),
])
def test_the_config_checks_the_program(overrides, problem):
    from raygraph.config import load_config
    from raygraph.config.loading import ConfigError

    with pytest.raises(ConfigError) as caught:
        load_config("configs/demo_multiturn.yaml", overrides)
    assert problem in str(caught.value)


def test_the_program_demo_config_has_no_problem():
    from raygraph.config import load_config
    from raygraph.config.agent_checks import agent_problems

    assert agent_problems(load_config("configs/demo_program.yaml")) == []


def test_an_episode_without_a_call_is_one_empty_row_scoring_zero(caplog):
    import numpy as np
    import torch

    from raygraph.batch import RESPONSE_MASK, RESPONSES
    from raygraph.workers.agent_rollout import episode_rows

    with caplog.at_level("WARNING", logger="raygraph"):
        episodes, engine, prompts, _ = run(program_loop("no_call"), n=2)
    assert "2 of 2 episodes made no model call" in caplog.text and engine.made == []
    assert [[(r.prompt, r.tokens, r.messages[-1]["reward"]) for r in parts] for parts in episodes] == \
        [[(prompts[0], [], 3.0)], [(prompts[1], [], 3.0)]]
    batch = Batch({PROMPT_IDS: torch.zeros((2, 3), dtype=torch.int64), PROMPT_MASK: torch.ones((2, 3), dtype=torch.int64)},
                  {UID: np.array(["u0", "u1"], dtype=object)})
    rows, flat = program_rows(batch, episodes, TOK)
    out = episode_rows(rows, flat, TOK, weight_version=0)
    assert out[RESPONSES].shape == (2, 1) and out[RESPONSE_MASK].sum() == 0   # a width the losses can take


TOOL_TEMPLATE = (   # Qwen2.5-like: tools in a system turn, calls as hermes blocks, results in a user turn
    "{% if tools %}{{ '<|im_start|>system\\nTools:' }}{% for t in tools %}{{ '\\n' + (t | tojson) }}{% endfor %}"
    "{{ '<|im_end|>\\n' }}{% endif %}"
    "{% for m in messages %}"
    "{% if m.role == 'assistant' and m.tool_calls %}{{ '<|im_start|>assistant\\n' }}"
    "{% for c in m.tool_calls %}{{ '<tool_call>\\n{\"name\": \"' + c.function.name + '\", \"arguments\": ' + "
    "(c.function.arguments | tojson) + '}\\n</tool_call>' }}{% endfor %}{{ '<|im_end|>\\n' }}"
    "{% elif m.role == 'tool' %}{{ '<|im_start|>user\\n<tool_response>\\n' + m.content + "
    "'\\n</tool_response><|im_end|>\\n' }}"
    "{% else %}{{ '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")


@pytest.mark.slow   # the SmolLM2 import, the first time
def test_tool_calls_are_returned_parsed_and_their_results_continue_the_row(smollm2_path):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(smollm2_path)
    tok.chat_template = TOOL_TEMPLATE
    end = tok.convert_tokens_to_ids("<|im_end|>")
    call = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "2+3"}}\n</tool_call>'
    engine = replay([tok(text, add_special_tokens=False)["input_ids"] + [end] for text in (call, "5")])
    budgets = AgentBudgets(max_turns=2, max_new_tokens=64, max_total_tokens=1024, max_message_tokens=64)
    loop = program_loop("uses_a_tool", budgets=budgets, tokenizer=tok)
    messages = [{"role": "user", "content": "What is 2+3?"}]
    row = {"prompt": messages, "reward_model": {"ground_truth": "5"}, "uid": "u", "extra_info": {}}
    try:
        (parts,) = loop.run(engine, [[0]], [row], [None])
    finally:
        loop.shutdown()
    choice = parts[-1].messages[-1]["first"]["choices"][0]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] is None
    (tool_call,) = choice["message"]["tool_calls"]
    assert tool_call["function"] == {"name": "calculator", "arguments": '{"expression": "2+3"}'}
    # the template renders the call as the model wrote it: the second call extends the row
    (only,) = parts
    first, second = engine.made
    assert first["prompt"] == tok(tok.apply_chat_template(messages, tools=[programs_calculator()], tokenize=False,
                                                          add_generation_prompt=True),
                                  add_special_tokens=False)["input_ids"]
    context = second["prompt"][len(first["prompt"]) + len(first["tokens"]):]
    assert tok.decode(context) == "\n<|im_start|>user\n<tool_response>\n5\n</tool_response><|im_end|>\n" \
                                  "<|im_start|>assistant\n"
    assert only.tokens == first["tokens"] + context + second["tokens"] and only.rewards[-1] == 1.0
    assert only.mask == [1] * len(first["tokens"]) + [0] * len(context) + [1] * len(second["tokens"])


def programs_calculator() -> dict:
    import importlib.util

    spec = importlib.util.spec_from_file_location("programs_for_schema", PROGRAMS)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.CALCULATOR


def test_tool_choice_that_forces_a_call_is_refused():
    episodes, engine, _, rows = run(program_loop("asks_for", program_args={"tool_choice": "required"}), n=1)
    assert engine.made == [] and "tool_choice='required' is not supported" in episodes[0][-1].messages[-1]["error"]


@pytest.mark.slow   # the SmolLM2 import, the first time
def test_a_turn_tokenized_otherwise_than_its_text_still_extends_its_row(smollm2_path):
    """SmolLM2 answers with its text spelled one id per character (not what tokenizing the text
    gives): the next call, whose messages repeat that text, is served with the model's own ids and
    extends the row instead of splitting it."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(smollm2_path)
    end = tok.convert_tokens_to_ids("<|im_end|>")
    odd = [tok.convert_tokens_to_ids(c if c != " " else "Ġ") for c in "It is 13."] + [end]
    engine = replay([odd, [tok.convert_tokens_to_ids("5"), end]])
    budgets = AgentBudgets(max_turns=2, max_new_tokens=16, max_total_tokens=512, max_message_tokens=64)
    loop = program_loop("two_turns", budgets=budgets, tokenizer=tok)
    row = {"prompt": [{"role": "user", "content": "13?"}], "reward_model": {"ground_truth": "13"}, "uid": "u",
           "extra_info": {}}
    try:
        (parts,) = loop.run(engine, [[0]], [row], [None])
    finally:
        loop.shutdown()
    first, second = engine.made
    assert second["prompt"][:len(first["prompt"]) + len(odd)] == first["prompt"] + odd   # the model's own ids
    (only,) = parts
    context = second["prompt"][len(first["prompt"]) + len(odd):]
    assert tok.decode(context) == "\n<|im_start|>user\nagain<|im_end|>\n<|im_start|>assistant\n"
    assert only.tokens == odd + context + second["tokens"]
    assert only.mask == [1] * len(odd) + [0] * len(context) + [1] * len(second["tokens"])


def test_a_request_of_an_earlier_run_is_never_served_in_a_later_one():
    """A request that reached the queue after its run ended (its URL was still open for a moment)
    names its run: the next run answers it 410 instead of serving it as one of its own episodes."""
    from raygraph.agents.openai_requests import TurnRequest
    from raygraph.agents.program import _Pending, _Run

    loop = program_loop("two_turns")
    loop._run_id = 2
    loop._episodes = [_Run(0, {}, None)]
    engine, late = echo_engine(), _Pending((1, 0), TurnRequest("chat", ids("x"), None, False, "policy"))
    loop._submit(engine, {}, late)
    with pytest.raises(Exception, match="this episode is over") as caught:
        late.reply.result(timeout=1)
    assert caught.value.status == 410 and engine.queue == []
    loop.shutdown()


def test_a_budget_refusal_the_program_does_not_catch_ends_its_episode_not_the_step(caplog):
    with caplog.at_level("WARNING", logger="raygraph"):
        episodes, engine, _, _ = run(program_loop("overflows"), n=2)
    assert engine.made == [] and [parts[-1].truncation for parts in episodes] == ["context", "context"]
    assert "after a call past its budget (context): BadRequestError" in caplog.text


def test_episodes_of_one_prompt_do_not_share_their_rows():
    loop = program_loop("appends_to_its_row")
    prompts, rows = data_rows(1)
    shared = [rows[0]] * 3   # as a prompt's n samples arrive: the same objects
    try:
        episodes = loop.run(echo_engine(), prompts * 3, shared, [None] * 3)
    finally:
        loop.shutdown()
    assert [parts[-1].messages[-1]["reward"] for parts in episodes] == [2.0, 2.0, 2.0]
    assert len(rows[0]["prompt"]) == 1


def test_a_malformed_content_length_is_refused():
    endpoint = Endpoint(lambda *_: {"ok": True}, host="127.0.0.1")
    try:
        url = endpoint.open_episode(0)
        with socket.create_connection((endpoint.host, endpoint.port), timeout=5) as conn:
            path = url.split(str(endpoint.port), 1)[1] + "/chat/completions"
            conn.sendall(f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Length: -5\r\n"
                         f"Authorization: Bearer {endpoint.key}\r\n\r\n".encode())
            assert conn.recv(200).startswith(b"HTTP/1.1 400")
    finally:
        endpoint.close()
