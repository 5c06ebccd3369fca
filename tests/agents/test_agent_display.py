"""What a user sees of episodes: the step metrics (hand-computed), the dump records, the console
lines and the MLflow table cell of a conversation; and the sandbox refusal at validate."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from raygraph.batch import (
    AGENT_CONVERSATION,
    AGENT_ENV_S,
    AGENT_TOOL_ERROR,
    AGENT_TOOL_OK,
    AGENT_TOOL_TIMEOUT,
    AGENT_TRUNCATION,
    AGENT_TURNS,
    RESPONSE_MASK,
    RESPONSE_TEXT,
    TOKEN_LEVEL_SCORES,
    Batch,
)
from raygraph.graph.step_metrics import agent_metrics, sample_records
from raygraph.run.samples import console_lines
from raygraph.run.tracking import _cell

CONVERSATION = [{"role": "assistant", "text": "3", "tokens": 2, "reward": 0.0},
                {"role": "user", "text": "7=", "tokens": 2, "reward": 0.0},
                {"role": "assistant", "text": "7", "tokens": 2, "reward": 0.5}]


def episodes() -> Batch:
    conversations = np.empty(2, dtype=object)
    conversations[:] = [CONVERSATION, CONVERSATION[:1]]
    return Batch({RESPONSE_MASK: torch.ones(2, 3, dtype=torch.int64), TOKEN_LEVEL_SCORES: torch.tensor([[0, 0, .5], [0, 0, 0.]]),
                  AGENT_TURNS: torch.tensor([2, 1]), AGENT_ENV_S: torch.tensor([0.5, 0.25]),
                  AGENT_TOOL_OK: torch.tensor([2, 0]), AGENT_TOOL_ERROR: torch.tensor([1, 0]),
                  AGENT_TOOL_TIMEOUT: torch.tensor([0, 1])},
                 {AGENT_TRUNCATION: ["none", "turns"], AGENT_CONVERSATION: conversations, RESPONSE_TEXT: ["37", "3"]})


def test_agent_metrics_are_per_episode_means_and_truncation_shares():
    m = agent_metrics(episodes())
    assert m["agent/turns_mean"] == 1.5 and m["agent/turns_max"] == 2.0 and m["agent/env_s_mean"] == 0.375
    assert (m["agent/tool_calls_ok"], m["agent/tool_calls_error"], m["agent/tool_calls_timeout"]) == (1.0, 0.5, 0.5)
    assert m["agent/truncated/none"] == 0.5 and m["agent/truncated/turns"] == 0.5 and m["agent/truncated/length"] == 0


def test_dumps_console_and_mlflow_show_the_conversation_turn_by_turn():
    record = sample_records(episodes())[0]
    assert record["conversation"] == CONVERSATION and record["truncation"] == "none" and record["score"] == 0.5
    lines = console_lines([record])
    assert lines[1:] == ["[raygraph]     assistant: '3' (2 tokens, reward 0)", "[raygraph]     user: '7=' (2 tokens)",
                         "[raygraph]     assistant: '7' (2 tokens, reward 0.5)", "[raygraph]     ended: none"]
    assert _cell(CONVERSATION) == "assistant: 3\nuser: 7=\nassistant: 7"


def test_python_exec_without_network_isolation_is_refused_at_validate(monkeypatch):
    from raygraph.agents import sandbox
    from raygraph.config import agent_checks, load_config

    cfg = load_config("configs/demo_multiturn.yaml", ["rollout.agent.tools=[python_exec]"])

    def unavailable():
        raise sandbox.SandboxUnavailable("neither `unshare -n` nor `unshare -rn` works here")

    monkeypatch.setattr(agent_checks, "network_isolation", unavailable)
    assert any("python_exec: neither" in p for p in agent_checks.agent_problems(cfg))
    monkeypatch.undo()
    assert agent_checks.agent_problems(cfg) == []


@pytest.mark.parametrize("value", [1, 0.5, "x", None])
def test_scalar_cells_stay_as_they_are(value):
    assert _cell(value) == value
