"""Datasets in the verl-compatible parquet schema, a resumable sampler, and the toy task.

- `PromptDataset` + `collate_prompts`: RL prompts -> `Batch` (prompt_ids, prompt_mask, uid, ...).
- `ResumableSampler`: seeded per-epoch shuffle whose position survives a checkpoint.
- `SFTDataset`, `DPODataset`, `load_offline_dataset`: offline data in the rollout layout.
- `raygraph.data.gsm8k.convert_gsm8k`, `raygraph.data.toy.write_toy_dataset`: data preparation.
"""

from __future__ import annotations

from raygraph.data.chat import check_messages, format_prompt
from raygraph.data.offline import DPODataset, SFTDataset, collate_pairs, load_offline_dataset
from raygraph.data.prompts import PromptDataset, PromptRow, collate_prompts, read_rows, write_rows
from raygraph.data.sampler import ResumableSampler

__all__ = [
    "PromptDataset", "PromptRow", "collate_prompts", "read_rows", "write_rows",
    "ResumableSampler", "SFTDataset", "DPODataset", "load_offline_dataset", "collate_pairs",
    "check_messages", "format_prompt",
]
