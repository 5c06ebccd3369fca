"""Environments that ship with raygraph (`rollout.agent.env: <name>`, see `raygraph.agents.env`).

* `reveal_then_answer`: the multi-turn demo's (`configs/demo_multiturn.yaml`). After the model's
  first turn it reveals the rest of the problem (`extra_info.reveal`); the second turn is scored
  1 when its text is exactly the ground truth, else 0. Success needs the second turn.
* `retry_with_feedback`: one retry after a wrong first answer, with the answer as feedback; the
  retry pays `retry_reward`. Success after the first turn needs the model to use the feedback.
* `tool_answer`: for tool use. A turn with a tool call is not scored (the tool's result follows);
  the first turn without one is the answer: 1 when its last number (or `#### n`) is the ground truth.
"""

from __future__ import annotations

from raygraph.rewards.rules import gsm8k_flexible

__all__ = ["RetryWithFeedbackEnv", "RevealThenAnswerEnv", "ToolAnswerEnv"]


class RetryWithFeedbackEnv:
    """Turn 1 right: reward 1, done. Wrong: the feedback `"<answer>="` (the answer, in the warm
    start's copy format) and one more turn, worth `retry_reward` when right."""

    def __init__(self, row: dict, retry_reward: float = 0.5) -> None:
        self.answer = str(row["reward_model"]["ground_truth"]).strip()
        self.retry_reward, self.turn = retry_reward, 0

    def step(self, response: str):
        self.turn += 1
        right = response.strip() == self.answer
        if self.turn == 1 and not right:
            return f"{self.answer}=", 0.0, False
        return None, (1.0 if self.turn == 1 else self.retry_reward) if right else 0.0, True


class RevealThenAnswerEnv:
    """Reveal `row["extra_info"]["reveal"]` after turn 1; score turn 2 by exact match."""

    def __init__(self, row: dict, reward: float = 1.0) -> None:
        self.reveal = str(row["extra_info"]["reveal"])
        self.answer = str(row["reward_model"]["ground_truth"]).strip()
        self.reward, self.turn = reward, 0

    def step(self, response: str):
        self.turn += 1
        if self.turn == 1:
            return self.reveal, 0.0, False
        return None, self.reward if response.strip() == self.answer else 0.0, True


class ToolAnswerEnv:
    """Answer turns (no tool call) end the episode: 1 if their last number is the ground truth."""

    def __init__(self, row: dict) -> None:
        self.answer = str(row["reward_model"]["ground_truth"]).strip()

    def step(self, response: str, tool_calls=()):
        if tool_calls:
            return None, 0.0, False
        return None, gsm8k_flexible(response, self.answer).score, True
