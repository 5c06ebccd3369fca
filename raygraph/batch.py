"""`Batch`: the unit of data that moves between roles.

A batch is B rows. Each row has named tensor columns (first dimension B), named non-tensor
columns (numpy object arrays of length B) and batch-level `meta` (a plain dict).

Sequence layout used by every role::

    input_ids      = cat(prompt_ids, responses)          # (B, P + R)
    attention_mask = cat(prompt_mask, response_attention)  # (B, P + R)

`response_attention` is `response_mask` except in multi-turn rows (`raygraph.agents`), where the
response also holds observation / tool tokens: they are attended (attention 1) but not trained
(mask 0). A batch without the column attends exactly its `response_mask`.

`prompt_ids` are LEFT-padded to a common length P, `responses` RIGHT-padded to R, so the
first response token is always at column P. Column names below are the only spellings.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from raygraph.errors import MissingColumn

__all__ = [
    "Batch",
    "PROMPT_IDS", "PROMPT_MASK", "RESPONSES", "RESPONSE_MASK", "RESPONSE_ATTENTION", "RESPONSE_LENGTH",
    "SEQUENCE_COLUMNS", "ENV_SCORES", "response_attention", "last_valid_index",
    "ROLLOUT_LOGPROBS", "OLD_LOGPROBS", "REF_LOGPROBS", "ENTROPY", "VALUES",
    "TOKEN_LEVEL_SCORES", "TOKEN_LEVEL_REWARDS", "ADVANTAGES", "RETURNS",
    "REWARD_BASELINES", "WEIGHT_VERSION", "STALENESS", "TOKEN_WEIGHT_VERSION", "REWARD_EXTRA_PREFIX", "INPUT_IDS", "ATTENTION_MASK", "LOSS_MASK",
    "UID", "DATA_SOURCE", "GROUND_TRUTH", "PROMPT_TEXT", "PROMPT_MESSAGES", "RESPONSE_TEXT", "EXTRA_INFO",
    "JUDGE_PROMPT", "JUDGE_OUTPUT",
    "AGENT_TURNS", "AGENT_ENV_S", "AGENT_TOOL_OK", "AGENT_TOOL_ERROR", "AGENT_TOOL_TIMEOUT", "AGENT_TRUNCATION",
    "AGENT_ELSEWHERE",
    "AGENT_CONVERSATION", "NEXT_PROMPTS", "STREAM_TAKE", "EXTRA_PROMPTS", "PROMPT_BATCHES_USED", "extra_prompt_batch", "without_extra_prompts",
    "pad_right",
]

# --- tensor columns -------------------------------------------------------------------------
PROMPT_IDS = "prompt_ids"                # (B, P) int64, left-padded with the pad id
PROMPT_MASK = "prompt_mask"              # (B, P) int64, 1 on real prompt tokens
RESPONSES = "responses"                  # (B, R) int64, right-padded with the pad id
RESPONSE_MASK = "response_mask"          # (B, R) int64, 1 on generated tokens (eos included)
RESPONSE_ATTENTION = "response_attention"  # (B, R) int64, 1 on every real response token (multi-turn only)
RESPONSE_LENGTH = "response_length"      # (B,)   int64, number of generated tokens
ROLLOUT_LOGPROBS = "rollout_logprobs"    # (B, R) float32, the rollout engine's own log-probs
OLD_LOGPROBS = "old_logprobs"            # (B, R) float32, policy log-probs before the update
REF_LOGPROBS = "ref_logprobs"            # (B, R) float32, frozen reference policy log-probs
ENTROPY = "entropy"                      # (B, R) float32, policy entropy per position
VALUES = "values"                        # (B, R) float32, critic values
TOKEN_LEVEL_SCORES = "token_level_scores"    # (B, R) float32, reward placed on the last token
TOKEN_LEVEL_REWARDS = "token_level_rewards"  # (B, R) float32, scores minus KL penalty (if any)
ADVANTAGES = "advantages"                # (B, R) float32
RETURNS = "returns"                      # (B, R) float32
REWARD_BASELINES = "reward_baselines"    # (B,)   float32, e.g. ReMax greedy-rollout score
WEIGHT_VERSION = "weight_version"        # (B,)   int64, policy version that generated the row
STALENESS = "staleness"                  # (B,)   int64, versions the row's weights lag the policy's
TOKEN_WEIGHT_VERSION = "token_weight_version"  # (B, R) int64, version that sampled each token (streaming)
ENV_SCORES = "env_scores"                # (B, R) float32, an environment's per-turn rewards (multi-turn)
REWARD_EXTRA_PREFIX = "reward_extra."    # (B,)   float32 columns, e.g. "reward_extra.acc"

# What a forward pass over prompt + response reads (the attention column only when present).
SEQUENCE_COLUMNS = (PROMPT_IDS, PROMPT_MASK, RESPONSES, RESPONSE_MASK, RESPONSE_ATTENTION)

# --- supervised (SFT) rows: one sequence per row, no prompt/response split -------------------
INPUT_IDS = "input_ids"                  # (B, T) int64, right-padded
ATTENTION_MASK = "attention_mask"        # (B, T) int64
LOSS_MASK = "loss_mask"                  # (B, T) int64, 1 on tokens that are training targets

# --- non-tensor columns ---------------------------------------------------------------------
UID = "uid"                  # group id: the n samples of one prompt share it
DATA_SOURCE = "data_source"  # selects the rule reward
GROUND_TRUTH = "ground_truth"
PROMPT_TEXT = "prompt_text"  # the formatted prompt string (after the chat template)
PROMPT_MESSAGES = "prompt_messages"  # the prompt's chat messages (before the template)
RESPONSE_TEXT = "response_text"
JUDGE_PROMPT = "judge_prompt"  # str: what an LLM judge was asked about the row (reward.kind=judge)
JUDGE_OUTPUT = "judge_output"  # str: the judge's verdict text
EXTRA_INFO = "extra_info"

# --- multi-turn episodes (`raygraph.agents`), one row each ------------------------------------
AGENT_TURNS = "agent_turns"                # (B,) int64, model turns taken
AGENT_ENV_S = "agent_env_s"                # (B,) float32, seconds in environment steps and tools
AGENT_TOOL_OK, AGENT_TOOL_ERROR, AGENT_TOOL_TIMEOUT = "agent_tool_ok", "agent_tool_error", "agent_tool_timeout"  # (B,)
AGENT_ELSEWHERE = "agent_elsewhere"        # (B,) 1: run by another rollout rank than its share's (least_loaded)
AGENT_TRUNCATION = "agent_truncation"      # str: why the episode ended (`raygraph.agents.episode.TRUNCATIONS`)
AGENT_CONVERSATION = "agent_conversation"  # list of {role, text, tokens, reward}: the episode turn by turn

# --- meta keys set by the driver --------------------------------------------------------------
STREAM_TAKE = "stream_take"    # streaming rollouts: {rollout rank: uids of the finished groups it hands over}
NEXT_PROMPTS = "next_prompts"  # async pipelining: {uids of a rank's share now: its share next step}
# A step may generate from more prompts than its own batch: the driver attaches the batches that
# follow in the data order (as many as the step graph reads, `raygraph.graph.report`), and the
# batch a step trains on says in `meta[PROMPT_BATCHES_USED]` how many it used (1 = its own only);
# the driver puts the unused ones back in the data order.
EXTRA_PROMPTS = "extra_prompts"             # prompts.meta: [Batch, ...] the extra prompt batches, in data order
PROMPT_BATCHES_USED = "prompt_batches_used"  # batch.meta: int, prompt batches the rows came from
# --- meta keys set by the coordinator -----------------------------------------------------------
# A share of a scattered batch: {"round": id of that scatter, "rank": r, "world": parts}; the rollout
# ranks of a least-loaded agent dispatch find each other's shares by it (`raygraph.agents.dispatch`).
# Concatenation drops it (a gathered batch is no one's share).
SHARD = "shard"


def _as_object_array(values: Iterable[Any]) -> np.ndarray:
    values = list(values)
    out = np.empty(len(values), dtype=object)
    out[:] = values
    return out


@dataclass
class Batch:
    """Named columns of B rows. Cheap to pickle (tensors go through Ray's zero-copy path).

    Args:
        tensors: name -> tensor with first dimension B.
        non_tensors: name -> numpy object array (or any sequence) of length B.
        meta: batch-level values (not split or concatenated row-wise; the first batch's wins).
    """

    tensors: dict[str, torch.Tensor] = field(default_factory=dict)
    non_tensors: dict[str, np.ndarray] = field(default_factory=dict)
    meta: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.non_tensors = {k: v if isinstance(v, np.ndarray) and v.dtype == object
                            else _as_object_array(v) for k, v in self.non_tensors.items()}
        sizes = {k: v.shape[0] for k, v in self.tensors.items()}
        sizes.update({k: len(v) for k, v in self.non_tensors.items()})
        if len(set(sizes.values())) > 1:
            raise ValueError(f"Batch columns disagree on the number of rows: {sizes}")

    # --- access -------------------------------------------------------------------------------
    def __len__(self) -> int:
        for v in self.tensors.values():
            return int(v.shape[0])
        for v in self.non_tensors.values():
            return len(v)
        return 0

    def __contains__(self, name: str) -> bool:
        return name in self.tensors or name in self.non_tensors

    def __getitem__(self, name: str) -> Any:
        if name in self.tensors:
            return self.tensors[name]
        if name in self.non_tensors:
            return self.non_tensors[name]
        raise MissingColumn(f"Batch has no column {name!r}; it has {sorted(self.columns())}")

    def columns(self) -> list[str]:
        return [*self.tensors, *self.non_tensors]

    # --- building new batches -------------------------------------------------------------------
    def with_columns(self, **columns: Any) -> Batch:
        """Return a new batch with `columns` added or replaced (tensors by type, else non-tensor)."""
        tensors, non_tensors = dict(self.tensors), dict(self.non_tensors)
        for name, value in columns.items():
            if isinstance(value, torch.Tensor):
                tensors[name] = value
                non_tensors.pop(name, None)
            else:
                non_tensors[name] = value
                tensors.pop(name, None)
        return Batch(tensors, non_tensors, dict(self.meta))

    def union(self, other: Batch) -> Batch:
        """Columns of both batches (same rows); `other` wins where both have a column."""
        if len(self) != len(other) and self.columns() and other.columns():
            raise ValueError(f"cannot union batches of {len(self)} and {len(other)} rows")
        merged = self.with_columns(**other.tensors, **other.non_tensors)
        merged.meta.update(other.meta)
        return merged

    def select_columns(self, names: Sequence[str]) -> Batch:
        return Batch({k: v for k, v in self.tensors.items() if k in names},
                     {k: v for k, v in self.non_tensors.items() if k in names}, dict(self.meta))

    def select(self, index: Sequence[int] | torch.Tensor | np.ndarray | slice) -> Batch:
        """Rows at `index` (a slice, integer indices or a boolean mask)."""
        if isinstance(index, slice):
            return Batch({k: v[index] for k, v in self.tensors.items()},
                         {k: v[index] for k, v in self.non_tensors.items()}, dict(self.meta))
        idx = torch.as_tensor(np.asarray(index))
        if idx.numel() == 0:   # select([]): numpy makes an empty list float
            idx = idx.long()
        if idx.dtype == torch.bool:
            idx = idx.nonzero().flatten()
        np_idx = idx.numpy()
        return Batch({k: v[idx] for k, v in self.tensors.items()},
                     {k: v[np_idx] for k, v in self.non_tensors.items()}, dict(self.meta))

    def repeat_interleave(self, n: int) -> Batch:
        """Each row repeated `n` times in place (row i -> rows i*n .. i*n+n-1)."""
        idx = torch.arange(len(self)).repeat_interleave(n)
        return self.select(idx)

    def split(self, size: int) -> list[Batch]:
        """Consecutive pieces of `size` rows (the last may be shorter)."""
        if size < 1:
            raise ValueError(f"split size must be >= 1, got {size}")
        return [self.select(slice(i, i + size)) for i in range(0, len(self), size)]

    def micro_batches(self, max_rows: int, max_tokens: int | None = None) -> list[Batch]:
        """Consecutive micro-batches of at most `max_rows` rows, and with `max_tokens` at most that
        many padded tokens each, padding trimmed (token-budget micro-batching).

        With `max_tokens` (rollout layout: `prompt_ids`/`prompt_mask` left-padded, response columns
        right-padded), a micro-batch keeps only the prompt and response positions that hold a real
        token in one of its rows, and takes rows while `rows x (longest prompt + longest
        response)` stays within `max_tokens`; a row longer than the budget forms a micro-batch of
        its own. Response-aligned columns are the 2-D tensors as wide as `responses`. Results
        computed per micro-batch are narrower: `Batch.concat` (or `pad_right`) restores the width.
        Without `max_tokens`, or without the rollout layout, this is `split(max_rows)`.
        """
        if len(self) == 0:
            return []
        if max_tokens is None or PROMPT_MASK not in self or RESPONSE_MASK not in self:
            return self.split(max_rows)
        prompt_len = self[PROMPT_MASK].sum(-1).tolist()
        response_len = response_attention(self).sum(-1).tolist()
        bounds, start, longest_p, longest_r = [], 0, 0, 0
        for i in range(len(self)):
            p, r = max(longest_p, prompt_len[i]), max(longest_r, response_len[i])
            if i > start and (i - start == max_rows or (i - start + 1) * (p + r) > max_tokens):
                bounds.append((start, i))
                start, p, r = i, prompt_len[i], response_len[i]
            longest_p, longest_r = p, r
        bounds.append((start, len(self)))
        return [self.select(slice(a, b))._trim_padding() for a, b in bounds]

    def _trim_padding(self) -> Batch:
        """Drop prompt columns that are padding in every row (left) and response columns likewise (right)."""
        prompt_keep = self[PROMPT_MASK].bool().any(0).nonzero()
        first = int(prompt_keep[0]) if len(prompt_keep) else self[PROMPT_MASK].shape[1]
        response_keep = response_attention(self).bool().any(0).nonzero()
        end = int(response_keep[-1]) + 1 if len(response_keep) else 0
        width = self[RESPONSE_MASK].shape[1]
        tensors = {}
        for name, t in self.tensors.items():
            if name in (PROMPT_IDS, PROMPT_MASK):
                tensors[name] = t[:, first:]
            elif t.dim() == 2 and t.shape[1] == width:
                tensors[name] = t[:, :end]
            else:
                tensors[name] = t
        return Batch(tensors, dict(self.non_tensors), dict(self.meta))

    def chunk(self, parts: int) -> list[Batch]:
        """`parts` consecutive pieces whose sizes differ by at most one row."""
        bounds = np.linspace(0, len(self), parts + 1).round().astype(int)
        return [self.select(slice(int(a), int(b))) for a, b in zip(bounds[:-1], bounds[1:])]

    def chunk_by_group(self, parts: int, key: str = UID) -> list[Batch]:
        """`parts` pieces that keep rows sharing `key` together (the samples of one prompt).

        Groups are assumed contiguous (as rollouts produce them); the number of groups per piece
        differs by at most one.
        """
        if key not in self.non_tensors:
            return self.chunk(parts)
        groups = self.group_bounds(key)
        starts = [a for a, _ in groups] + [len(self)]
        cuts = np.linspace(0, len(groups), parts + 1).round().astype(int)
        return [self.select(slice(starts[a], starts[b])) for a, b in zip(cuts[:-1], cuts[1:])]

    def group_bounds(self, key: str = UID) -> list[tuple[int, int]]:
        """`(start, stop)` of each run of rows sharing `key` (contiguous groups); one row each
        without the column."""
        if key not in self.non_tensors:
            return [(i, i + 1) for i in range(len(self))]
        ids = self.non_tensors[key]
        starts = [0] + [i for i in range(1, len(ids)) if ids[i] != ids[i - 1]] + [len(ids)]
        return [(a, b) for a, b in zip(starts[:-1], starts[1:]) if b > a]

    @staticmethod
    def concat(batches: Sequence[Batch]) -> Batch:
        """Rows of all `batches` in order; tensor columns are right-padded to a common width.

        Ranks whose longest response differs produce (B, R) columns of different widths: they are
        padded with zeros (prompt columns on the left, others on the right). Padded positions
        have mask 0; read values through the masks, never the padding.
        """
        batches = [b for b in batches if b is not None]
        if not batches:
            return Batch()
        meta = {k: v for k, v in batches[0].meta.items() if k != SHARD}
        batches = [b for b in batches if len(b)] or batches[:1]   # a rank without rows adds none
        if len(batches) == 1:
            return Batch(dict(batches[0].tensors), dict(batches[0].non_tensors), meta)
        columns = set(batches[0].columns())
        odd = [sorted(columns ^ set(b.columns())) for b in batches[1:] if set(b.columns()) != columns]
        if odd:
            raise ValueError(f"cannot concat batches with different columns (differing: {odd[0]})")
        names = batches[0].tensors.keys()
        tensors = {name: _cat_padded([b.tensors[name] for b in batches], name) for name in names}
        non_tensors = {name: np.concatenate([b.non_tensors[name] for b in batches])
                       for name in batches[0].non_tensors}
        return Batch(tensors, non_tensors, meta)

    def to(self, device: torch.device | str) -> Batch:
        return Batch({k: v.to(device) for k, v in self.tensors.items()},
                     dict(self.non_tensors), dict(self.meta))

    def nbytes(self) -> int:
        """Bytes held by tensor columns (what a transfer of this batch costs)."""
        return sum(v.numel() * v.element_size() for v in self.tensors.values())

    def __repr__(self) -> str:
        cols = ", ".join(f"{k}{tuple(v.shape)}" for k, v in self.tensors.items())
        extra = ", ".join(self.non_tensors)
        return f"Batch(rows={len(self)}, tensors=[{cols}], non_tensors=[{extra}])"


def _cat_padded(tensors: list[torch.Tensor], name: str) -> torch.Tensor:
    if tensors[0].dim() < 2:
        return torch.cat(tensors)
    width = max(t.shape[1] for t in tensors)
    pad = _left_pad if name in (PROMPT_IDS, PROMPT_MASK) else _right_pad
    return torch.cat([pad(t, width) for t in tensors])


def response_attention(tensors) -> torch.Tensor:
    """The response positions a forward pass attends: `response_attention` when the rows have it
    (multi-turn), else `response_mask`."""
    return tensors[RESPONSE_ATTENTION] if RESPONSE_ATTENTION in tensors else tensors[RESPONSE_MASK]


def last_valid_index(mask: torch.Tensor) -> torch.Tensor:
    """`(B, R)` 0/1 mask -> `(B,)` index of each row's last 1 (0 for an all-zero row). Equal to
    `mask.sum(-1) - 1` for the contiguous masks of single-turn rows; multi-turn masks have holes."""
    positions = torch.arange(1, mask.shape[-1] + 1, device=mask.device)
    return ((mask > 0).long() * positions).argmax(-1) if mask.shape[-1] else mask.new_zeros(mask.shape[0]).long()


def pad_right(t: torch.Tensor, width: int, value: float = 0) -> torch.Tensor:
    """`(B, w)` -> `(B, width)`, filled on the right with `value` (unchanged when w == width)."""
    if t.shape[1] >= width:
        return t
    return torch.nn.functional.pad(t, (0, width - t.shape[1]), value=value)


def _right_pad(t: torch.Tensor, width: int) -> torch.Tensor:
    return pad_right(t, width)


def _left_pad(t: torch.Tensor, width: int) -> torch.Tensor:
    if t.shape[1] == width:
        return t
    return torch.nn.functional.pad(t, (width - t.shape[1], 0))


def extra_prompt_batch(prompts: Batch, index: int) -> Batch:
    """The `index`-th (1, 2, ...) extra prompt batch the driver attached to the step's `prompts`
    (`meta[EXTRA_PROMPTS]`), with the step's own meta and no extra batches in it."""
    extra = prompts.meta.get(EXTRA_PROMPTS) or []
    if not 1 <= index <= len(extra):
        raise ValueError(f"extra prompt batch {index} was asked for, but the driver attached {len(extra)}: a graph "
                         "that reads extra prompt batches must be built with the step's InputNode")
    batch = extra[index - 1]
    return Batch(dict(batch.tensors), dict(batch.non_tensors), without_extra_prompts(prompts).meta)


def without_extra_prompts(prompts: Batch) -> Batch:
    """`prompts` without the extra prompt batches in its meta (only `extra_prompt_batch` reads
    them; every shard and result of the step would otherwise carry them along)."""
    if EXTRA_PROMPTS not in prompts.meta:
        return prompts
    meta = {k: v for k, v in prompts.meta.items() if k != EXTRA_PROMPTS}
    return Batch(dict(prompts.tensors), dict(prompts.non_tensors), meta)
