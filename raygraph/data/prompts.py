"""Prompt datasets in the verl-compatible parquet schema, and prompts -> `Batch`.

Schema (one row per prompt; extra columns are ignored)::

    prompt        list of chat messages [{"role": str, "content": str}, ...]   (required)
    data_source   str, selects the rule reward, e.g. "openai/gsm8k"            (required)
    reward_model  {"style": "rule", "ground_truth": str}                         (optional)
    extra_info    dict of anything (split, index, ...)                           (optional)

Policies (never silent):
- A row whose prompt is missing, empty or malformed raises `ValueError` naming the file and the
  row index inside that file.
- A prompt longer than `max_prompt_length` tokens (after the chat template) is dropped, with ONE
  warning giving the count (``overlong="drop"``), or raises (``overlong="error"``). Prompts are
  never truncated: a cut-off question has a different answer.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import torch

from raygraph.batch import (
    DATA_SOURCE,
    EXTRA_INFO,
    GROUND_TRUTH,
    PROMPT_IDS,
    PROMPT_MASK,
    PROMPT_MESSAGES,
    PROMPT_TEXT,
    UID,
    Batch,
)
from raygraph.data.chat import check_messages, encode_text, format_prompt

__all__ = ["PromptRow", "PromptDataset", "collate_prompts", "read_rows", "write_rows", "left_pad"]

logger = logging.getLogger(__name__)
_OVERLONG = ("drop", "error")


@dataclass
class PromptRow:
    """One tokenized prompt. `index` is its position in the dataset (after drops)."""

    index: int
    prompt_ids: list[int]
    prompt_text: str
    data_source: str
    ground_truth: Any
    extra_info: dict = field(default_factory=dict)
    messages: list = field(default_factory=list)   # the chat messages, before the template


def check_overlong(overlong: str) -> None:
    """Reject an `overlong` policy other than "drop" or "error"."""
    if overlong not in _OVERLONG:
        raise ValueError(f"overlong must be one of {_OVERLONG}, got {overlong!r}")


def report_overlong(what: str, overlong: str, remedy: str) -> None:
    """Rows beyond the length limits (`what` counts them): raise with `remedy` ("error") or warn
    once that they were dropped ("drop"); rows are never truncated."""
    if overlong == "error":
        raise ValueError(f"{what}; {remedy} or set overlong='drop'")
    logger.warning("%s; dropped them (never truncated)", what)


def read_rows(files: str | Path | Sequence[str | Path]) -> list[tuple[str, int, dict]]:
    """All rows of the parquet `files` as ``(file, row_index_in_file, row_dict)``, in order."""
    paths = [files] if isinstance(files, (str, Path)) else list(files)
    if not paths:
        raise ValueError("no data files given")
    out = []
    for path in paths:
        path = str(path)
        if not Path(path).is_file():
            raise FileNotFoundError(f"data file not found: {path}")
        try:
            table = pq.read_table(path)
        except (OSError, ValueError) as exc:  # pyarrow's errors for a file that is not parquet
            raise ValueError(f"data file {path} is not a readable parquet file: {exc}") from None
        if table.num_rows == 0:
            raise ValueError(f"data file {path} is empty (0 rows)")
        for i, row in enumerate(table.to_pylist()):
            out.append((path, i, row))
    return out


def write_rows(rows: Sequence[dict], path: str | Path) -> Path:
    """Write dict rows to a parquet file (parent folders created); returns the path.

    Columns are the union of the rows' keys (missing values are null). Dict-valued columns
    become parquet structs, so give every `extra_info` at least one key.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    keys = list(dict.fromkeys(k for row in rows for k in row))
    pq.write_table(pa.table({k: [row.get(k) for row in rows] for k in keys}), path)
    return path


def left_pad(seqs: Sequence[Sequence[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-pad token lists to a common length.

    Returns:
        ids: (B, P) int64, pad_id on the left; mask: (B, P) int64, 1 on real tokens.
    """
    width = max((len(s) for s in seqs), default=0)
    ids = torch.full((len(seqs), width), pad_id, dtype=torch.int64)
    mask = torch.zeros((len(seqs), width), dtype=torch.int64)
    for i, s in enumerate(seqs):
        if len(s):
            ids[i, width - len(s):] = torch.as_tensor(list(s), dtype=torch.int64)
            mask[i, width - len(s):] = 1
    return ids, mask


def _ground_truth(row: dict) -> Any:
    rm = row.get("reward_model")
    gt = rm.get("ground_truth") if isinstance(rm, dict) else None
    return str(gt) if isinstance(gt, (int, float)) and not isinstance(gt, bool) else gt


class PromptDataset:
    """Tokenized prompts from parquet files, validated and length-filtered at construction.

    `to_batch(sampler.next_indices(), epoch=sampler.epoch)` gives a step's prompts.

    Args:
        files: one parquet path or several (rows are concatenated in the order given).
        tokenizer: Hugging Face tokenizer; its pad id is used by `to_batch`.
        max_prompt_length: longest allowed prompt in tokens (after the chat template).
        overlong: "drop" (skip with one counted warning) or "error".
        apply_chat_template: render messages with the tokenizer's chat template (see
            `raygraph.data.chat.format_prompt`).
        chat_template_kwargs: extra variables of the chat template (e.g. enable_thinking).

    Attributes:
        n_dropped: number of over-long prompts dropped.
        rows_per_file: prompts kept from each file, in the order given (rows are in that order).
    """

    def __init__(self, files: str | Path | Sequence[str | Path], tokenizer: Any,
                 max_prompt_length: int, overlong: str = "drop",
                 apply_chat_template: bool = True,
                 chat_template_kwargs: dict[str, Any] | None = None) -> None:
        check_overlong(overlong)
        if max_prompt_length < 1:
            raise ValueError(f"max_prompt_length must be >= 1, got {max_prompt_length}")
        self.tokenizer = tokenizer
        self.max_prompt_length = max_prompt_length
        raw = read_rows(files)
        texts, chats = [], []
        for path, i, row in raw:
            messages = check_messages(row.get("prompt"))
            if messages is None:
                raise ValueError(f"{path}: row {i} has a missing or empty prompt "
                                 f"(expected a non-empty list of {{role, content}} messages), "
                                 f"got {row.get('prompt')!r}")
            if not isinstance(row.get("data_source"), str) or not row["data_source"]:
                raise ValueError(f"{path}: row {i} has no data_source (a non-empty string)")
            texts.append(format_prompt(tokenizer, messages, apply_chat_template, chat_template_kwargs))
            chats.append(messages)
        ids = encode_text(tokenizer, texts, add_special_tokens=not apply_chat_template)
        self.rows: list[PromptRow] = []
        overlong_at = []
        kept: dict[str, int] = {str(p): 0 for p in ([files] if isinstance(files, (str, Path)) else files)}
        for (path, i, row), text, tok, chat in zip(raw, texts, ids, chats):
            if len(tok) > max_prompt_length:
                overlong_at.append((path, i, len(tok)))
                continue
            kept[path] += 1
            self.rows.append(PromptRow(len(self.rows), list(tok), text, row["data_source"],
                                       _ground_truth(row), dict(row.get("extra_info") or {}), chat))
        self.n_dropped = len(overlong_at)
        self.rows_per_file = list(kept.values())
        if overlong_at:
            path, i, n = overlong_at[0]
            what = (f"{len(overlong_at)} of {len(raw)} prompts are longer than "
                    f"max_prompt_length={max_prompt_length} tokens (first: {path} row {i}, "
                    f"{n} tokens)")
            report_overlong(what, overlong, "raise max_prompt_length")
        if not self.rows:
            why = (f": every one is longer than max_prompt_length={max_prompt_length} tokens (first: "
                   f"{overlong_at[0][2]} tokens); raise data.max_prompt_length") if overlong_at else ""
            raise ValueError(f"no prompts left in {sorted({p for p, _, _ in raw})}{why}")

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, index: int) -> PromptRow:
        return self.rows[index]

    def to_batch(self, indices: Sequence[int], epoch: int | str | list = 0) -> Batch:
        """The prompts at `indices` as a `Batch` (see `collate_prompts`)."""
        return collate_prompts([self.rows[i] for i in indices], self.tokenizer.pad_token_id, epoch)


def collate_prompts(rows: Sequence[PromptRow], pad_token_id: int, epoch: int | str | list = 0) -> Batch:
    """Rows -> `Batch` with the prompt columns every workflow starts from.

    Args:
        rows: prompts, e.g. `dataset[i]` for the sampler's indices.
        pad_token_id: left-padding value.
        epoch: part of the uid, so that a prompt seen in two epochs gets two groups; one per
            row when rows come from sources with epochs of their own (`MixedSampler.epochs`).

    Returns:
        Batch with tensors `prompt_ids` (B, P) int64 left-padded and `prompt_mask` (B, P) int64;
        non-tensors `uid` (``f"{epoch}-{index}"``), `data_source`, `ground_truth`,
        `prompt_text`, `extra_info`, `prompt_messages` (the chat messages before the template).
    """
    if not rows:
        raise ValueError("cannot collate an empty list of prompts")
    if pad_token_id is None:
        raise ValueError("the tokenizer has no pad token; set one before batching prompts")
    ids, mask = left_pad([r.prompt_ids for r in rows], pad_token_id)
    return Batch(
        tensors={PROMPT_IDS: ids, PROMPT_MASK: mask},
        non_tensors={
            UID: [f"{e}-{r.index}" for e, r in zip(epoch if isinstance(epoch, list) else [epoch] * len(rows),
                                                    rows, strict=True)],
            DATA_SOURCE: [r.data_source for r in rows],
            GROUND_TRUTH: [r.ground_truth for r in rows],
            PROMPT_TEXT: [r.prompt_text for r in rows],
            EXTRA_INFO: [r.extra_info for r in rows],
            PROMPT_MESSAGES: [r.messages for r in rows],
        },
    )
