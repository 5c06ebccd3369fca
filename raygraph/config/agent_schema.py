"""`rollout.agent`: multi-turn episodes with an environment and/or tools (docs/agents.md)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, field_validator

from raygraph.algos.user_code import absolute_ref
from raygraph.config.section import Section

__all__ = ["AgentConfig"]


def _absolute(value):
    return absolute_ref(value) if isinstance(value, str) and ":" in value else value


class AgentConfig(Section):
    env: str | None = Field(None, description="The environment: a registered name (reveal_then_answer, tool_answer) "
                                              "or my_env.py:MyEnv (raygraph.agents.env has the contract); null = "
                                              "tools only: an episode ends when the model answers without a tool call.")
    program: str | None = Field(None, description="Your own agent code instead of an environment: my_agent.py:run, "
                                "an async def run(row, client, **program_args) -> reward (or {'reward': r, ...}) "
                                "where client is an openai.AsyncOpenAI served by this run's rollout ranks; every "
                                "request is a recorded model turn (raygraph.agents.program, docs/agents.md). "
                                "Needs reward.kind=env and the openai package (pip install 'raygraph[agents]').")
    program_args: dict[str, Any] = Field(default_factory=dict, description="Keyword arguments of every call of "
                                         "rollout.agent.program (checked against its signature).")
    program_timeout_s: float | None = Field(None, gt=0, description="One program episode's time limit: past it "
                                            "the program is cancelled, its reward is 0 and its truncation "
                                            "env_timeout (the calls it made are kept). null = none (a hung "
                                            "program then stops the step at trainer.step_timeout_s).")
    program_host: str | None = Field(None, description="The address the rollout ranks' endpoint binds (one "
                                     "interface, never all); null = the node's own address as Ray knows it.")
    env_args: dict[str, Any] = Field(default_factory=dict, description="Keyword arguments of the environment's "
                                                                         "constructor (checked against it).")
    tools: list[str] = Field(default_factory=list, description="Tools the model may call: python_exec (sandboxed, "
                             "raygraph.agents.sandbox) or my_tools.py:fn (typed, with a docstring); their schemas go to "
                             "the chat template (tools=).")
    tool_parser: str = Field("hermes", description="How tool calls are read from a turn (and from an agent "
                             "program's replies to requests with tools=): hermes (<tool_call>{json}</tool_call>) "
                             "or my_parser.py:parse.")
    tool_role: str = Field("tool", description="Chat role of tool results (a template without a tool role: user).")
    max_turns: int = Field(4, ge=1, description="Model turns per episode at most (truncation 'turns').")
    max_new_tokens: int | None = Field(None, ge=1, description="Tokens per model turn; null = rollout.max_new_tokens.")
    max_total_tokens: int | None = Field(None, ge=2, description="Prompt + every turn and message per episode "
                                         "(truncation 'context'); null = data.max_prompt_length + max_turns x "
                                         "max_new_tokens + (max_turns - 1) x (max_message_tokens + 16).")
    max_message_tokens: int = Field(256, ge=1, description="Tokens of one tool result or observation; longer ones "
                                                           "are cut and say so.")
    tool_timeout_s: float = Field(10.0, gt=0, description="One tool call's time limit (python_exec has its own "
                                                          "process limits too).")
    env_timeout_s: float | None = Field(None, gt=0, description="One reaction's limit (tools + environment step); "
                                        "the episode then ends with truncation 'env_timeout'. null = none.")
    env_workers: int = Field(16, ge=1, description="Threads per rollout rank running environment steps and tools "
                                                   "while the engine keeps generating (with env_hosts: also the "
                                                   "steps one host runs at once).")
    env_hosts: int = Field(0, ge=0, description="Ray actors per rollout rank hosting the environments, each on a "
                           "placement-group bundle of its own (raygraph.agents.env_hosts): CPU-heavy environments "
                           "run beside the engine, a step past env_timeout_s frees its thread at once and its host "
                           "restarts, a crashing environment takes down its host only (the step is recovered). "
                           "0 = in the rollout rank's threads.")
    env_host_cpus: float = Field(1.0, gt=0, description="CPUs of each env host (its bundle).")
    dispatch: Literal["even", "least_loaded"] = Field(
        "even", description="How a step's episodes go over the rollout ranks: even (each rank runs its equal share "
        "of the prompt groups) or least_loaded (ranks take groups as they have room, so a rank slowed by long "
        "episodes takes fewer; the batch is the same, bit for bit on vLLM's CPU build; vLLM engine only; "
        "raygraph.agents.dispatch).")
    groups_in_flight: int = Field(2, ge=1, description="With dispatch=least_loaded: prompt groups one rollout rank "
                                  "runs at once, counted as groups_in_flight x rollout.n episodes (a single-sample "
                                  "validation runs as many episodes); fewer: finer balance, smaller engine batches.")

    _refs = field_validator("env", "tool_parser", "program")(lambda value: _absolute(value))

    @field_validator("tools")
    @classmethod
    def _tool_refs(cls, value: list[str]) -> list[str]:
        return [_absolute(v) for v in value]

    def turn_tokens(self, rollout_max_new_tokens: int) -> int:
        return self.max_new_tokens or rollout_max_new_tokens

    def total_tokens(self, max_prompt_length: int, rollout_max_new_tokens: int) -> int:
        """`max_total_tokens`, its default filled in."""
        return self.max_total_tokens or (max_prompt_length + self.max_turns * self.turn_tokens(rollout_max_new_tokens)
                                         + (self.max_turns - 1) * (self.max_message_tokens + 16))
