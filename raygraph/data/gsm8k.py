"""GSM8K -> the raygraph/verl parquet schema, from a file the user already has.

Input: a local ``.jsonl`` (one JSON object per line) or ``.parquet`` file with the standard
GSM8K fields ``question`` and ``answer`` (worked solution ending in ``#### <number>``), e.g. the
``main`` config's ``train``/``test`` splits. Nothing is downloaded.

Output row::

    data_source   "openai/gsm8k"
    prompt        [{"role": "user", "content": question + " " + INSTRUCTION}]
    ability       "math"
    reward_model  {"style": "rule", "ground_truth": "<number after ####, commas removed>"}
    extra_info    {"index": i, "question": ..., "answer": <full solution>}

The instruction asks for the final answer after ``####``, which is what the strict GSM8K rule
reward (`raygraph.rewards`, name "gsm8k") looks for.
"""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow.parquet as pq

from raygraph.data.prompts import write_rows

__all__ = ["convert_gsm8k", "gsm8k_ground_truth", "INSTRUCTION", "DATA_SOURCE"]

INSTRUCTION = "Let's think step by step and output the final answer after '####'."
DATA_SOURCE = "openai/gsm8k"


def gsm8k_ground_truth(answer: str) -> str:
    """The final answer of a GSM8K solution: text after the last ``####``, commas removed.

    Raises:
        ValueError: when there is no ``####`` or nothing after it.
    """
    if "####" not in answer:
        raise ValueError("answer has no '####' final-answer marker")
    final = answer.rsplit("####", 1)[1].strip().replace(",", "")
    if not final:
        raise ValueError("answer has nothing after '####'")
    return final


def _read(input_path: Path) -> list[dict]:
    if input_path.suffix == ".parquet":
        return pq.read_table(input_path).to_pylist()
    rows = []
    with input_path.open(encoding="utf-8") as f:
        for line_no, line in enumerate(f, 1):
            if line.strip():
                try:
                    rows.append(json.loads(line))
                except json.JSONDecodeError as e:
                    raise ValueError(f"{input_path}: line {line_no} is not JSON: {e}") from None
    return rows


def convert_gsm8k(input_path: str | Path, out_path: str | Path) -> int:
    """Convert a local GSM8K file (jsonl or parquet) to schema parquet at `out_path`.

    Args:
        input_path: ``.jsonl`` or ``.parquet`` with ``question`` and ``answer`` fields.
        out_path: parquet file to write (parent folders are created).

    Returns:
        The number of rows written.

    Raises:
        ValueError: naming the file and row when a field is missing or has no ``####``.
    """
    input_path = Path(input_path)
    out = []
    for i, row in enumerate(_read(input_path)):
        question, answer = row.get("question"), row.get("answer")
        if not isinstance(question, str) or not question.strip() or not isinstance(answer, str):
            raise ValueError(f"{input_path}: row {i} needs string 'question' and 'answer' fields")
        try:
            truth = gsm8k_ground_truth(answer)
        except ValueError as e:
            raise ValueError(f"{input_path}: row {i}: {e}") from None
        out.append({
            "data_source": DATA_SOURCE,
            "prompt": [{"role": "user", "content": f"{question.strip()} {INSTRUCTION}"}],
            "ability": "math",
            "reward_model": {"style": "rule", "ground_truth": truth},
            "extra_info": {"index": i, "question": question, "answer": answer},
        })
    if not out:
        raise ValueError(f"{input_path} has no rows")
    write_rows(out, out_path)
    return len(out)
