"""The environment contract: loading by name or reference, env_args checked like workflow_args,
step results checked, and the config's agent checks (`raygraph validate`)."""

from __future__ import annotations

import pytest

from raygraph.agents.builtin_envs import RetryWithFeedbackEnv, RevealThenAnswerEnv, ToolAnswerEnv
from raygraph.agents.env import EnvContractError, EnvStep, as_env_step, check_env_args, load_env
from raygraph.config import load_config
from raygraph.config.agent_checks import agent_problems
from raygraph.config.loading import ConfigError

ENV_FILE = '''
class Guess:
    def __init__(self, row, *, target: int, hints: bool = True):
        self.target = target

    def step(self, response):
        return {"observation": None, "reward": float(response == str(self.target)), "done": True}
'''


def test_environments_load_by_name_or_reference_with_clear_errors(tmp_path):
    assert load_env("retry_with_feedback") is RetryWithFeedbackEnv
    env_file = tmp_path / "my_env.py"
    env_file.write_text(ENV_FILE)
    cls = load_env(f"{env_file}:Guess")
    assert as_env_step(cls({}, target=3).step("3"), cls) == EnvStep(None, 1.0, True)
    with pytest.raises(EnvContractError, match="did you mean 'retry_with_feedback'"):
        load_env("retry_with_feedbak")
    with pytest.raises(EnvContractError, match="has no environment class with a step.response. method named 'nothing'; it defines: Guess"):
        load_env(f"{env_file}:nothing")


def test_env_args_are_checked_against_the_constructor(tmp_path):
    env_file = tmp_path / "my_env.py"
    env_file.write_text(ENV_FILE)
    cls = load_env(f"{env_file}:Guess")
    assert check_env_args(cls, {"target": 1}) == []
    problems = check_env_args(cls, {"targt": 1})
    assert problems == ["rollout.agent.env_args.targt is not an argument of Guess (did you mean "
                        "rollout.agent.env_args.target?); it takes: target, hints",
                        "rollout.agent.env_args.target is required by Guess"]


@pytest.mark.parametrize(("value", "message"), [
    ("obs", "must return (observation, reward, done)"),
    ({"observation": None, "reward": 1.0}, "without done"),
    ((3, 1.0, True), "observation of type int"),
    (("x", float("nan"), False), "must be a finite number"),
    (("x", True, False), "must be a finite number"),
])
def test_a_step_result_outside_the_contract_is_named(value, message):
    with pytest.raises(EnvContractError, match=message.replace("(", r"\(").replace(")", r"\)")):
        as_env_step(value, object())


def test_builtin_environments_score_as_documented():
    row = {"reward_model": {"ground_truth": "7"}, "extra_info": {"reveal": "4="}}
    retry = RetryWithFeedbackEnv(row)
    assert retry.step("3") == ("7=", 0.0, False) and retry.step("7") == (None, 0.5, True)
    assert RetryWithFeedbackEnv(row).step(" 7 ") == (None, 1.0, True)
    reveal = RevealThenAnswerEnv(row)
    assert reveal.step("7") == ("4=", 0.0, False) and reveal.step("7") == (None, 1.0, True)
    tool = ToolAnswerEnv(row)
    from raygraph.agents.tools import ToolCall
    assert tool.step("let me compute", tool_calls=[ToolCall("calculator", {"expression": "3+4"})]) == (None, 0.0, False)
    assert tool.step("So the answer is 7.") == (None, 1.0, True)


DEMO = "configs/demo_multiturn.yaml"


@pytest.mark.parametrize(("overrides", "problem"), [
    (["reward.kind=rule"], "rollout.agent.env gives the rewards, so set reward.kind=env"),
    (["rollout.agent.env_args={retry_rewrd: 0.2}"], "did you mean rollout.agent.env_args.retry_reward?"),
    (["rollout.agent=null"], "reward.kind=env scores the episodes of an environment: set rollout.agent.env"),
    (["rollout.agent.max_total_tokens=40", "rollout.engine=vllm", "rollout.max_model_len=32"],
     "exceeds rollout.max_model_len=32"),
    (["rollout.agent.tools=[nope_tool]"], "unknown"),
    (["rollout.agent.dispatch=least_loaded", "rollout.engine=hf"],
     "rollout.agent.dispatch=least_loaded needs rollout.engine=vllm"),
    (["rollout.agent.dispatch=most_loaded"], "least_loaded"),
])
def test_the_config_checks_the_agent(overrides, problem):
    with pytest.raises(ConfigError) as caught:
        load_config(DEMO, overrides)
    assert problem in str(caught.value)


def test_the_demo_config_has_no_agent_problem():
    assert agent_problems(load_config(DEMO)) == []
