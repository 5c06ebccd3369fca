"""The checks of `rollout.agent` against the rest of the config (`raygraph validate` runs them):
the environment, its arguments, the tools and the parser are loaded here, before any actor starts."""

from __future__ import annotations

import importlib.util

from raygraph.agents.env import check_env_args, load_env
from raygraph.agents.program import load_program, program_problems
from raygraph.agents.sandbox import SandboxUnavailable, network_isolation
from raygraph.agents.tools import Toolbox, tool_parser
from raygraph.algos.user_code import UserCodeError

__all__ = ["agent_problems"]


def agent_problems(cfg) -> list[str]:
    """One line per problem of `rollout.agent` (none when it is unset and `reward.kind` is not env)."""
    agent = cfg.rollout.agent
    if agent is None:
        return ["reward.kind=env scores the episodes of an environment: set rollout.agent.env"] \
            if cfg.reward.kind == "env" else []
    problems = []
    if cfg.data.format != "rl":
        problems.append(f"rollout.agent runs episodes from prompts; data.format={cfg.data.format!r} has no rollouts")
    if not cfg.data.apply_chat_template:
        problems.append("rollout.agent renders the messages between turns with the chat template: set "
                        "data.apply_chat_template=true")
    if agent.env is not None and cfg.reward.kind != "env":
        problems.append(f"rollout.agent.env gives the rewards, so set reward.kind=env (it is {cfg.reward.kind!r})")
    problems += _program_problems(cfg)
    if agent.env_hosts and agent.env is None:
        problems.append("rollout.agent.env_hosts hosts environments: set rollout.agent.env (tools run in the "
                        "rollout rank)")
    if agent.env is None and agent.program is None and cfg.reward.kind == "env":
        problems.append("reward.kind=env needs an environment: set rollout.agent.env (tools alone give no reward)")
    if agent.dispatch == "least_loaded" and cfg.resolved_rollout_engine != "vllm":
        problems.append("rollout.agent.dispatch=least_loaded needs rollout.engine=vllm: the HF sampler draws from one "
                        "generator per rank, so an episode's tokens would depend on which rank ran it")
    total = agent.total_tokens(cfg.data.max_prompt_length, cfg.rollout.max_new_tokens)
    if total <= cfg.data.max_prompt_length:
        problems.append(f"rollout.agent.max_total_tokens={total} leaves no room after data.max_prompt_length="
                        f"{cfg.data.max_prompt_length}")
    if cfg.rollout.max_model_len is not None and total > cfg.rollout.max_model_len:
        problems.append(f"rollout.agent.max_total_tokens={total} exceeds rollout.max_model_len="
                        f"{cfg.rollout.max_model_len}: an episode would not fit the engine's context")
    return problems + _user_code_problems(agent)


def _program_problems(cfg) -> list[str]:
    agent = cfg.rollout.agent
    if agent.program is None:
        return [f"rollout.agent.{name} is set but there is no rollout.agent.program to take it"
                for name in ("program_args", "program_timeout_s", "program_host") if getattr(agent, name)]
    problems = []
    if agent.env is not None or agent.tools:
        problems.append("rollout.agent.program runs the whole episode (its own tools and environment): leave "
                        "rollout.agent.env and rollout.agent.tools unset")
    if cfg.reward.kind != "env":
        problems.append(f"rollout.agent.program returns the episode's reward, so set reward.kind=env "
                        f"(it is {cfg.reward.kind!r})")
    if agent.dispatch != "even":
        problems.append("rollout.agent.program runs with rollout.agent.dispatch=even")
    if importlib.util.find_spec("openai") is None:
        problems.append("rollout.agent.program gives the program an openai.AsyncOpenAI client: pip install "
                        "'raygraph[agents]' (the openai package)")
    try:
        problems += program_problems(load_program(agent.program), agent.program_args)
    except UserCodeError as exc:
        problems.append(f"rollout.agent.program: {exc}")
    try:
        tool_parser(agent.tool_parser)   # reads the tool calls of replies to requests that offer tools
    except UserCodeError as exc:
        problems.append(f"rollout.agent.tool_parser: {exc}")
    return problems


def _user_code_problems(agent) -> list[str]:
    problems = []
    if agent.env is not None:
        try:
            problems += check_env_args(load_env(agent.env), agent.env_args)
        except UserCodeError as exc:
            problems.append(f"rollout.agent.env: {exc}")
    elif agent.env_args:
        problems.append("rollout.agent.env_args is set but there is no rollout.agent.env to take it")
    if agent.tools:
        try:
            Toolbox(agent.tools)
            tool_parser(agent.tool_parser)
        except UserCodeError as exc:
            problems.append(f"rollout.agent.tools: {exc}")
    if "python_exec" in agent.tools:
        try:
            network_isolation()
        except SandboxUnavailable as exc:
            problems.append(f"rollout.agent.tools: python_exec: {exc}")
    return problems
