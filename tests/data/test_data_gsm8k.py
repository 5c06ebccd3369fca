"""GSM8K conversion from a local jsonl written by the test."""

from __future__ import annotations

import json

import pyarrow.parquet as pq
import pytest

from raygraph.data import PromptDataset
from raygraph.data.gsm8k import INSTRUCTION, convert_gsm8k


def _write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_convert_jsonl_to_schema_and_load_it(tmp_path, char_tokenizer):
    src = _write_jsonl(tmp_path / "train.jsonl", [
        {"question": "Tom has 3 apples and buys 4. How many?", "answer": "3+4=<<3+4=7>>7\n#### 7"},
        {"question": "A farm sells 1,000 eggs twice.", "answer": "It sells 2,000.\n#### 2,000"},
    ])
    assert convert_gsm8k(src, tmp_path / "out" / "train.parquet") == 2
    rows = pq.read_table(tmp_path / "out" / "train.parquet").to_pylist()
    assert [r["reward_model"] for r in rows] == [{"style": "rule", "ground_truth": "7"},
                                                 {"style": "rule", "ground_truth": "2000"}]
    assert rows[0]["data_source"] == "openai/gsm8k"
    assert rows[0]["prompt"] == [{"role": "user", "content": f"Tom has 3 apples and buys 4. How many? {INSTRUCTION}"}]
    assert "####" in INSTRUCTION and rows[1]["extra_info"]["index"] == 1
    ds = PromptDataset(tmp_path / "out" / "train.parquet", char_tokenizer, max_prompt_length=512)
    assert ds[1].ground_truth == "2000"


def test_convert_parquet_input(tmp_path):
    import pyarrow as pa

    pq.write_table(pa.Table.from_pylist([{"question": "1+1?", "answer": "#### 2"}]), tmp_path / "in.parquet")
    assert convert_gsm8k(tmp_path / "in.parquet", tmp_path / "out.parquet") == 1


def test_answer_without_marker_names_the_row(tmp_path):
    src = _write_jsonl(tmp_path / "bad.jsonl", [{"question": "q", "answer": "#### 1"},
                                                 {"question": "q", "answer": "no final answer"}])
    with pytest.raises(ValueError, match=r"bad\.jsonl: row 1: answer has no '####'"):
        convert_gsm8k(src, tmp_path / "out.parquet")
