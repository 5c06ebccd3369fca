"""PromptDataset: schema validation, over-long policy, chat template, and rows -> Batch."""

from __future__ import annotations

import logging

import pytest
import torch

from raygraph.batch import DATA_SOURCE, EXTRA_INFO, GROUND_TRUTH, PROMPT_IDS, PROMPT_MASK, PROMPT_TEXT, UID
from raygraph.data import PromptDataset, write_rows


def _row(content: str, truth: str = "7", source: str = "toy_arith") -> dict:
    return {"data_source": source, "prompt": [{"role": "user", "content": content}],
            "reward_model": {"style": "rule", "ground_truth": truth}, "extra_info": {"index": 0}}


def test_chat_template_and_left_padded_batch(tmp_path, char_tokenizer):
    path = write_rows([_row("3+4="), _row("12+30=", "42")], tmp_path / "p.parquet")
    ds = PromptDataset(path, char_tokenizer, max_prompt_length=32)
    assert ds[0].prompt_text == "<|user|>3+4=<|end|><|assistant|>"
    # Character tokenizer: <|user|>, 4 chars, <|end|>, <|assistant|> = 7 tokens; the second has 9.
    assert [len(r.prompt_ids) for r in ds] == [7, 9]
    batch = ds.to_batch([1, 0], epoch=2)
    ids, mask = batch[PROMPT_IDS], batch[PROMPT_MASK]
    assert ids.dtype == torch.int64 and ids.shape == (2, 9)
    assert mask.tolist() == [[1] * 9, [0, 0] + [1] * 7]
    assert ids[1, :2].tolist() == [char_tokenizer.pad_token_id] * 2
    assert char_tokenizer.decode(ids[1, 2:]) == ds[0].prompt_text
    assert list(batch[UID]) == ["2-1", "2-0"]
    assert list(batch[GROUND_TRUTH]) == ["42", "7"]
    assert list(batch[DATA_SOURCE]) == ["toy_arith", "toy_arith"]
    assert batch[PROMPT_TEXT][1] == ds[0].prompt_text and batch[EXTRA_INFO][0] == {"index": 0}


def test_without_chat_template_uses_the_raw_text(tmp_path, char_tokenizer):
    path = write_rows([_row("3+4=")], tmp_path / "p.parquet")
    ds = PromptDataset(path, char_tokenizer, max_prompt_length=32, apply_chat_template=False)
    assert ds[0].prompt_text == "3+4=" and len(ds[0].prompt_ids) == 4


@pytest.mark.parametrize("bad", [None, [], [{"role": "user", "content": "  "}], [{"content": "x"}]])
def test_missing_or_empty_prompt_names_file_and_row(tmp_path, char_tokenizer, bad):
    rows = [_row("1+1="), _row("2+2="), {**_row("x"), "prompt": bad}]
    path = write_rows(rows, tmp_path / "bad.parquet")
    with pytest.raises(ValueError, match=r"bad\.parquet: row 2 has a missing or empty prompt"):
        PromptDataset(path, char_tokenizer, max_prompt_length=32)


def test_missing_data_source_is_rejected(tmp_path, char_tokenizer):
    path = write_rows([_row("1+1="), _row("2+2=", source="")], tmp_path / "p.parquet")
    with pytest.raises(ValueError, match="row 1 has no data_source"):
        PromptDataset(path, char_tokenizer, max_prompt_length=32)


def test_overlong_prompts_dropped_with_one_counted_warning(tmp_path, char_tokenizer, caplog):
    rows = [_row("1+1="), _row("x" * 50), _row("2+2="), _row("y" * 60)]
    path = write_rows(rows, tmp_path / "p.parquet")
    with caplog.at_level(logging.WARNING, logger="raygraph.data.prompts"):
        ds = PromptDataset(path, char_tokenizer, max_prompt_length=20)
    assert len(ds) == 2 and ds.n_dropped == 2
    assert [r.index for r in ds] == [0, 1]                  # indices are re-numbered after drops
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "2 of 4 prompts" in warnings[0] and "row 1" in warnings[0]
    assert all(len(r.prompt_ids) <= 20 for r in ds)         # kept whole, never truncated


def test_overlong_error_policy(tmp_path, char_tokenizer):
    path = write_rows([_row("1+1="), _row("x" * 50)], tmp_path / "p.parquet")
    with pytest.raises(ValueError, match="1 of 2 prompts are longer than max_prompt_length=20"):
        PromptDataset(path, char_tokenizer, max_prompt_length=20, overlong="error")


def test_a_file_whose_every_prompt_is_dropped_says_why(tmp_path, char_tokenizer):
    path = write_rows([_row("x" * 50), _row("y" * 60)], tmp_path / "p.parquet")
    with pytest.raises(ValueError, match="no prompts left .*every one is longer than max_prompt_length=20 tokens"
                                         ".*raise data.max_prompt_length"):
        PromptDataset(path, char_tokenizer, max_prompt_length=20)


def test_several_files_are_concatenated(tmp_path, char_tokenizer):
    a = write_rows([_row("1+1=")], tmp_path / "a.parquet")
    b = write_rows([_row("2+2="), _row("3+3=")], tmp_path / "b.parquet")
    ds = PromptDataset([a, b], char_tokenizer, max_prompt_length=32)
    assert [r.prompt_text[8:12] for r in ds] == ["1+1=", "2+2=", "3+3="]
