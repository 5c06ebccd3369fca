"""The toy task: disjoint splits, schema, warm-start rows, and ~0 accuracy of a random model."""

from __future__ import annotations

import pyarrow.parquet as pq
import pytest
import torch

from raygraph.data import PromptDataset, SFTDataset
from raygraph.data.toy import split_toy_problems, toy_dpo_rows, toy_problems, toy_sft_rows, write_toy_dataset
from raygraph.rewards import score_for_source


def test_problems_and_disjoint_seeded_split():
    problems = toy_problems()
    assert len(problems) == 100 and ("3+4=", "7") in problems and ("8+5=", "3") in problems
    train, val = split_toy_problems(80, 20, seed=0)
    assert len(set(train)) == 80 and len(set(val)) == 20 and not set(train) & set(val)
    assert split_toy_problems(80, 20, seed=0) == (train, val) != split_toy_problems(80, 20, seed=1)
    assert ("3+4=", "7") in toy_problems(modulo=None) and ("9+9=", "18") in toy_problems(modulo=None)
    with pytest.raises(ValueError, match="has 100 distinct problems"):
        split_toy_problems(2000, 100)


def test_written_files_load_and_score(tmp_path, char_tokenizer):
    train_path, val_path = write_toy_dataset(tmp_path, n_train=30, n_val=10, seed=1)
    train = PromptDataset(train_path, char_tokenizer, max_prompt_length=16)
    val = PromptDataset(val_path, char_tokenizer, max_prompt_length=16)
    assert len(train) == 30 and len(val) == 10
    row = pq.read_table(val_path).to_pylist()[0]
    question, truth = row["prompt"][0]["content"], row["reward_model"]["ground_truth"]
    a, b = int(question[0]), int(question[2])
    assert row["data_source"] == "toy_arith" and truth == str((a + b) % 10)
    assert score_for_source("toy_arith")(truth, truth, None).score == 1.0
    warm = SFTDataset(tmp_path / "warm_start.parquet", char_tokenizer, max_prompt_length=16,
                      max_response_length=4)
    assert len(warm) == 320


def test_warm_start_rows_are_copy_rows_not_task_problems():
    rows = toy_sft_rows(n=25, seed=0)
    assert len(rows) == 25
    questions = {r["prompt"][0]["content"] for r in rows}
    assert questions == {f"{v}=" for v in range(10)}
    assert all(r["response"] + "=" == r["prompt"][0]["content"] for r in rows)
    assert not questions & {q for q, _ in toy_problems()}


def test_dpo_pairs_prefer_the_right_answer(tmp_path, char_tokenizer):
    rows = toy_dpo_rows([("3+4=", "7"), ("8+5=", "3")], seed=0)
    assert [r["chosen"] for r in rows] == ["7", "3"]
    assert all(r["rejected"] != r["chosen"] and r["rejected"].isdigit() for r in rows)
    write_toy_dataset(tmp_path, n_train=10, n_val=5)
    assert len(pq.read_table(tmp_path / "train_dpo.parquet")) == 10


def test_random_init_tiny_model_scores_about_zero(tiny_model_path, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model_path)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_path).eval()
    _, val_path = write_toy_dataset(tmp_path, n_train=80, n_val=20, seed=0)
    val = PromptDataset(val_path, tok, max_prompt_length=16)
    batch = val.to_batch(range(len(val)))
    with torch.no_grad():
        out = model.generate(input_ids=batch["prompt_ids"], attention_mask=batch["prompt_mask"],
                             max_new_tokens=4, do_sample=False, pad_token_id=tok.pad_token_id)
    texts = tok.batch_decode(out[:, batch["prompt_ids"].shape[1]:], skip_special_tokens=True)
    reward = score_for_source("toy_arith")
    acc = sum(reward(t, gt, None).score for t, gt in zip(texts, batch["ground_truth"])) / len(texts)
    assert acc <= 0.1
