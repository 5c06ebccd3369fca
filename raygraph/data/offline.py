"""Offline datasets: SFT (prompt -> response) and DPO (prompt, chosen, rejected) as tensors.

Parquet (or in-memory) rows:

    SFT:  prompt (messages or str), response (str); without a `response` column the row's
          reward_model.ground_truth is the response (so RL data can serve a warm start)
    DPO:  prompt (messages or str), chosen, rejected (each a str, or a message list whose last
          message is the assistant's answer; earlier messages, if any, must repeat the prompt)

Each example is tokenized as ``prompt_ids = encode(format_prompt(prompt))`` and
``response_ids = encode(response) + [eos]`` (the eos teaches the model to stop). Both are laid
out like rollouts (see `raygraph.batch`), so the policy's log-prob code applies unchanged:

    prompt_ids, prompt_mask      (B, P) int64, left-padded
    responses, response_mask     (B, R) int64, right-padded; response_mask is the loss mask
    input_ids, attention_mask    (B, P+R) = cat(prompt_*, response*)
    loss_mask                    (B, P+R) = cat(zeros, response_mask): 1 on response tokens

A DPO batch holds 2 rows per pair, chosen then rejected, sharing `uid` (a group of 2, so
`Batch.chunk_by_group` keeps pairs together); tensor `chosen_mask` (B,) is 1 on chosen rows.
Examples whose prompt is longer than `max_prompt_length` or whose response (with eos) is longer
than `max_response_length` are dropped with one counted warning or raise, like prompts in
`raygraph.data.prompts`; nothing is truncated. `load_offline_dataset` picks the class by name.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from raygraph.batch import (
    ATTENTION_MASK,
    INPUT_IDS,
    LOSS_MASK,
    PROMPT_IDS,
    PROMPT_MASK,
    RESPONSE_MASK,
    RESPONSES,
    UID,
    Batch,
)
from raygraph.data.chat import check_messages, encode_text, format_prompt
from raygraph.data.prompts import check_overlong, left_pad, read_rows, report_overlong

__all__ = ["SFTDataset", "DPODataset", "load_offline_dataset", "collate_pairs", "CHOSEN_MASK"]


CHOSEN_MASK = "chosen_mask"          # (B,) int64, DPO only: 1 on chosen rows, 0 on rejected

Example = tuple[list[int], list[int]]  # (prompt_ids, response_ids)


def _load(source: str | Path | Sequence[Any]) -> list[tuple[str, int, dict]]:
    """Rows from parquet path(s), or from a list of dicts (named "<rows>" in errors)."""
    if isinstance(source, (str, Path)) or (source and isinstance(source[0], (str, Path))):
        return read_rows(source)
    return [("<rows>", i, row) for i, row in enumerate(source)]


def _response_text(row: dict, prompt: list[dict], where: str, column: str) -> str:
    value = row.get(column)
    if column == "response" and value is None and isinstance(row.get("reward_model"), dict):
        value = row["reward_model"].get("ground_truth")
        value = None if value is None else str(value)
    if isinstance(value, str):
        text = value
    else:
        messages = check_messages(value)
        if messages is None or messages[-1]["role"] != "assistant" \
                or (len(messages) > 1 and messages[:-1] != prompt):
            raise ValueError(f"{where}: {column} must be a string or messages ending with the "
                             f"assistant's answer (after the prompt), got {value!r}")
        text = messages[-1]["content"]
    if not text.strip():
        raise ValueError(f"{where}: {column} is empty")
    return text


class _Tokenized:
    """Shared tokenization and length policy for SFT and DPO (one response column or two)."""

    def __init__(self, source, tokenizer, max_prompt_length, max_response_length, overlong,
                 apply_chat_template, columns, chat_template_kwargs=None):
        check_overlong(overlong)
        if tokenizer.eos_token_id is None or tokenizer.pad_token_id is None:
            raise ValueError("the tokenizer needs eos and pad tokens")
        self.tokenizer = tokenizer
        raw = _load(source)
        prompts, responses = [], {c: [] for c in columns}
        for path, i, row in raw:
            where = f"{path}: row {i}"
            messages = check_messages(row.get("prompt"))
            if messages is None:
                raise ValueError(f"{where} has a missing or empty prompt, got {row.get('prompt')!r}")
            prompts.append(format_prompt(tokenizer, messages, apply_chat_template, chat_template_kwargs))
            for c in columns:
                responses[c].append(_response_text(row, messages, where, c))
        p_ids = encode_text(tokenizer, prompts, add_special_tokens=not apply_chat_template)
        r_ids = {c: encode_text(tokenizer, responses[c], add_special_tokens=False) for c in columns}
        eos = tokenizer.eos_token_id
        self.examples: list[list[Example]] = []
        too_long = []
        for k, (path, i, _) in enumerate(raw):
            ex = [(list(p_ids[k]), list(r_ids[c][k]) + [eos]) for c in columns]
            if len(ex[0][0]) > max_prompt_length or max(len(r) for _, r in ex) > max_response_length:
                too_long.append(f"{path} row {i}")
                continue
            self.examples.append(ex)
        self.n_dropped = len(too_long)
        if too_long:
            what = (f"{len(too_long)} of {len(raw)} examples have a prompt longer than "
                    f"max_prompt_length={max_prompt_length} or a response (with eos) longer than "
                    f"max_response_length={max_response_length} tokens (first: {too_long[0]})")
            report_overlong(what, overlong, "raise the limits")
        if not self.examples:
            raise ValueError(f"no examples left out of {len(raw)} rows")

    def __len__(self) -> int:
        return len(self.examples)


def _layout(examples: Sequence[Example], pad_id: int) -> dict[str, torch.Tensor]:
    prompt_ids, prompt_mask = left_pad([p for p, _ in examples], pad_id)
    width = max(len(r) for _, r in examples)
    responses = torch.full((len(examples), width), pad_id, dtype=torch.int64)
    response_mask = torch.zeros_like(responses)
    for i, (_, r) in enumerate(examples):
        responses[i, :len(r)] = torch.as_tensor(r, dtype=torch.int64)
        response_mask[i, :len(r)] = 1
    return {
        PROMPT_IDS: prompt_ids, PROMPT_MASK: prompt_mask,
        RESPONSES: responses, RESPONSE_MASK: response_mask,
        INPUT_IDS: torch.cat([prompt_ids, responses], 1),
        ATTENTION_MASK: torch.cat([prompt_mask, response_mask], 1),
        LOSS_MASK: torch.cat([torch.zeros_like(prompt_mask), response_mask], 1),
    }


class SFTDataset(_Tokenized):
    """Prompt/response pairs for supervised fine-tuning (e.g. a warm start before RL).

    Args:
        source: parquet path(s) with `prompt` and `response` columns, or a list of such dicts.
        tokenizer: Hugging Face tokenizer with eos and pad tokens.
        max_prompt_length: longest allowed prompt in tokens (after the chat template).
        max_response_length: longest allowed response in tokens, eos included.
        overlong: "drop" (one counted warning) or "error".
        apply_chat_template: render the prompt with the tokenizer's chat template.
        chat_template_kwargs: extra variables of the chat template (e.g. enable_thinking).
    """

    def __init__(self, source: str | Path | Sequence[Any], tokenizer: Any, max_prompt_length: int,
                 max_response_length: int, overlong: str = "drop",
                 apply_chat_template: bool = True, chat_template_kwargs: dict | None = None) -> None:
        super().__init__(source, tokenizer, max_prompt_length, max_response_length, overlong,
                         apply_chat_template, ("response",), chat_template_kwargs)

    def to_batch(self, indices: Sequence[int]) -> Batch:
        """Examples at `indices` as a `Batch` (columns in the module docstring)."""
        examples = [self.examples[i][0] for i in indices]
        return Batch(_layout(examples, self.tokenizer.pad_token_id),
                     {UID: [f"sft-{i}" for i in indices]})


class DPODataset(_Tokenized):
    """Preference pairs for DPO; arguments as `SFTDataset`, columns `chosen` and `rejected`.

    A pair is dropped (or raises) when its prompt or either response exceeds its limit.
    """

    def __init__(self, source: str | Path | Sequence[Any], tokenizer: Any, max_prompt_length: int,
                 max_response_length: int, overlong: str = "drop",
                 apply_chat_template: bool = True, chat_template_kwargs: dict | None = None) -> None:
        super().__init__(source, tokenizer, max_prompt_length, max_response_length, overlong,
                         apply_chat_template, ("chosen", "rejected"), chat_template_kwargs)

    def to_batch(self, indices: Sequence[int]) -> Batch:
        """Pairs at `indices` as a `Batch` of 2 * len(indices) rows (see `collate_pairs`)."""
        return collate_pairs([self.examples[i] for i in indices], self.tokenizer.pad_token_id,
                             [f"dpo-{i}" for i in indices])


def load_offline_dataset(kind: str, source: str | Path | Sequence[Any], tokenizer: Any, *,
                         max_prompt_length: int, max_response_length: int, overlong: str = "drop",
                         apply_chat_template: bool = True,
                         chat_template_kwargs: dict | None = None) -> SFTDataset | DPODataset:
    """`SFTDataset` for ``kind="sft"``, `DPODataset` for ``kind="dpo"`` (same arguments)."""
    classes = {"sft": SFTDataset, "dpo": DPODataset}
    if kind not in classes:
        raise ValueError(f"unknown offline dataset kind {kind!r}; valid: {', '.join(classes)}")
    return classes[kind](source, tokenizer, max_prompt_length, max_response_length, overlong,
                         apply_chat_template, chat_template_kwargs)


def collate_pairs(pairs: Sequence[Sequence[Example]], pad_token_id: int,
                  uids: Sequence[str]) -> Batch:
    """DPO pairs -> rows ``[chosen_0, rejected_0, chosen_1, ...]`` sharing a uid per pair.

    Returns:
        Batch with the module-docstring tensors plus `chosen_mask` (B,) int64 and `uid`.
    """
    rows = [ex for pair in pairs for ex in pair]
    tensors = _layout(rows, pad_token_id)
    tensors[CHOSEN_MASK] = torch.tensor([1, 0] * len(pairs), dtype=torch.int64)
    return Batch(tensors, {UID: [u for u in uids for _ in range(2)]})
