"""One multi-turn episode: its token stream, masks, log-probs, rewards, and how it ended.

Layout (the batch's, see `raygraph.batch`): the episode's first prompt is the row's prompt; every
token after it is in the row's response, in the order the engine saw them:

    response  = turn 1 tokens | messages 1 | turn 2 tokens | messages 2 | ... | turn k tokens
    mask      =   1 1 ... 1   |  0 ... 0   |   1 ... 1     |  0 ... 0   | ... |   1 ... 1
    attention =   1 everywhere a token is (model, tool, user and template tokens alike)

`len(tokens) == len(mask) == len(logprobs) == len(rewards)` always (checked in `check`). A
reward an environment gives after turn t is placed on the last token of turn t; the episode's
rewards sum to its return. Observation and template tokens have log-prob 0 and are never trained.

Budgets (`AgentBudgets`) end an episode early; the reason is kept (`TRUNCATIONS`):
    "turns"    `max_turns` model turns were taken and the environment was not done
    "length"   the last turn hit `max_new_tokens` without a stop token
    "context"  the next messages + a turn would not fit `max_total_tokens`, or the last turn was
               cut by what was left of it
    "env_timeout"  an environment step or tool ran past `env_timeout_s`
    "none"     the environment said done (or, without one, the model answered without a tool call)
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

__all__ = ["AgentBudgets", "Episode", "TRUNCATIONS"]

TRUNCATIONS = ("none", "turns", "length", "context", "env_timeout")


@dataclass(frozen=True)
class AgentBudgets:
    """Per-episode limits, in tokens where lengths are meant (`rollout.agent`)."""
    max_turns: int
    max_new_tokens: int       # per model turn
    max_total_tokens: int     # prompt + every turn and message (the engine's context at most)
    max_message_tokens: int   # one tool result or observation; longer ones are cut (and say so)


@dataclass
class Episode:
    """The state of one episode while it runs, and its record afterwards."""
    index: int
    prompt: list[int]
    seed: int | None                       # None: greedy turns
    uid: object = None                     # the row's uid (errors name it)
    tokens: list[int] = field(default_factory=list)
    mask: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    rewards: list[float] = field(default_factory=list)
    turns: int = 0
    last_room: int = 0                     # the token budget the latest turn was given
    truncation: str = "none"
    done: bool = False
    tool_status: Counter = field(default_factory=Counter)   # ok / error / timeout
    env_s: float = 0.0
    elsewhere: bool = False                # run by another rollout rank than its owner (least-loaded dispatch)
    messages: list[dict] = field(default_factory=list)       # role, text, tokens, reward (for dumps)
    # streamed episodes only (`raygraph.workers.streaming_episodes`): the weight version of each
    # token; a message token has the version of the model token before it
    versions: list[int] = field(default_factory=list)

    def turn_seed(self) -> int | None:
        """The seed of the next model turn: a function of the episode's seed and the turn only, so
        an episode's samples do not depend on how the engine interleaved it with others."""
        return None if self.seed is None else (self.seed + 1_000_003 * self.turns) % (2**31 - 1)

    def next_request(self, budgets: AgentBudgets) -> tuple[list[int], int] | None:
        """`(prompt ids, max tokens)` of the next model turn, or None when no token fits the context."""
        used = len(self.prompt) + len(self.tokens)
        room = min(budgets.max_new_tokens, budgets.max_total_tokens - used)
        if room < 1:
            return None
        self.last_room = room
        return self.prompt + self.tokens, room

    def add_model_turn(self, tokens: list[int], logprobs: list[float], text: str,
                       versions: list[int] | None = None) -> None:
        """Append a model turn; `versions`: the weight version that sampled each token (streaming)."""
        if versions is not None:
            self.versions += versions
        self.tokens += tokens
        self.mask += [1] * len(tokens)
        self.logprobs += logprobs
        self.rewards += [0.0] * len(tokens)
        self.turns += 1
        self.messages.append({"role": "assistant", "text": text, "tokens": len(tokens), "reward": 0.0})

    def add_reward(self, reward: float) -> None:
        """Add `reward` on the last token of the latest model turn (the turn it answers)."""
        if reward == 0.0:
            return
        last = max(i for i, m in enumerate(self.mask) if m)
        self.rewards[last] += reward
        turn = next(m for m in reversed(self.messages) if m["role"] == "assistant")
        turn["reward"] += reward

    def add_messages(self, tokens: list[int], shown: list[dict]) -> None:
        """Append the tokens of the messages between two turns (never trained)."""
        self.versions += self.versions[-1:] * len(tokens)
        self.tokens += tokens
        self.mask += [0] * len(tokens)
        self.logprobs += [0.0] * len(tokens)
        self.rewards += [0.0] * len(tokens)
        self.messages += shown

    def finish(self, truncation: str) -> None:
        if truncation not in TRUNCATIONS:
            raise ValueError(f"unknown truncation {truncation!r}; valid: {', '.join(TRUNCATIONS)}")
        self.truncation, self.done = truncation, True

    @property
    def total_reward(self) -> float:
        return float(sum(self.rewards))

    def check(self) -> None:
        """The alignment every loss relies on; an episode that breaks it is a bug, never trained."""
        sizes = {len(self.tokens), len(self.mask), len(self.logprobs), len(self.rewards)} | \
            ({len(self.versions)} if self.versions else set())
        if len(sizes) != 1:
            raise AssertionError(f"episode {self.index}: tokens/mask/logprobs/rewards(/versions) lengths differ: "
                                 f"{len(self.tokens)}, {len(self.mask)}, {len(self.logprobs)}, {len(self.rewards)}"
                                 f"{f', {len(self.versions)}' if self.versions else ''}")
        if any(r and not m for r, m in zip(self.rewards, self.mask)):
            raise AssertionError(f"episode {self.index}: a reward sits on a token the model did not generate")
