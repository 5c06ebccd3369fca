"""The real-model tool-use example's parts: the calculator tool and the tool_arith data (disjoint
splits; the warm start's tool call parses and the calculator's answer is the ground truth)."""

from __future__ import annotations

import pytest

from raygraph.agents.calculator import calculator
from raygraph.agents.tools import Toolbox, parse_hermes
from raygraph.data.prompts import read_rows
from raygraph.data.tool_arith import write_tool_arith


@pytest.mark.parametrize(("expression", "value"), [("347 * 29", "10063"), ("(12 + 3) * 4", "60"), ("2 / 4", "0.5"),
                                                   ("-3 + 10", "7")])
def test_the_calculator_evaluates_arithmetic(expression, value):
    assert calculator(expression) == value


@pytest.mark.parametrize("expression", ["__import__('os').system('true')", "2 ** 10", "10**13 * 10"])
def test_the_calculator_refuses_anything_else(expression):
    with pytest.raises(ValueError):
        calculator(expression)


def test_a_calculator_call_that_fails_is_an_error_message_to_the_model():
    box = Toolbox(["calculator"])
    (call,) = parse_hermes('<tool_call>{"name": "calculator", "arguments": {"expression": "os.system(1)"}}</tool_call>')
    result = box.call(call)
    assert result.status == "error" and "only numbers" in result.text


def test_tool_arith_splits_are_disjoint_and_the_warm_start_shows_the_call_and_the_answer_to_its_result(tmp_path):
    train, val = write_tool_arith(tmp_path, n_train=40, n_val=8, n_warm=16)
    rows = {name: [r for _, _, r in read_rows(tmp_path / f"{name}.parquet")] for name in ("train", "val", "warm_start")}
    question = {name: {next(m["content"] for m in r["prompt"] if m["role"] == "user") for r in part}
                for name, part in rows.items()}
    assert len(question["train"]) == 40 and len(question["val"]) == 8 and len(question["warm_start"]) == 16
    assert not (question["train"] & question["val"]) and not (question["warm_start"] & (question["train"] | question["val"]))
    calls, answers = 0, 0
    for row in rows["warm_start"]:
        roles = [m["role"] for m in row["prompt"]]
        expression = row["prompt"][1]["content"].removeprefix("What is ").removesuffix("?")
        if roles == ["system", "user"]:            # the first move: the call
            (call,) = parse_hermes(row["response"])
            assert call.name == "calculator" and call.arguments == {"expression": expression}
            calls += 1
        else:                                      # the second move: the answer, once the call's result is there
            assert roles == ["system", "user", "assistant", "tool"]
            (call,) = parse_hermes(row["prompt"][2]["content"])
            result = Toolbox(["calculator"]).call(call).text
            assert call.arguments == {"expression": expression} and row["prompt"][3]["content"] == result
            assert row["response"] == f"#### {result}" and result == calculator(expression)
            answers += 1
    assert calls == answers == 8
    for row in rows["val"]:
        expression = row["prompt"][-1]["content"].removeprefix("What is ").removesuffix("?")
        assert calculator(expression) == row["reward_model"]["ground_truth"]


def test_the_tool_use_example_config_loads_and_tells_the_prompts_about_the_calculator():
    from raygraph.config import load_config
    from raygraph.run.feed import prompt_template_kwargs

    cfg = load_config("configs/smollm2_tools.yaml")
    assert cfg.rollout.agent.tools == ["calculator"] and cfg.reward.kind == "env" and cfg.data.toy.task == "tool_arith"
    (schema,) = prompt_template_kwargs(cfg)["tools"]
    assert schema["function"]["name"] == "calculator"
    assert schema["function"]["parameters"]["required"] == ["expression"]
