"""The word-problem task for a real instruct model: answers by construction, disjoint splits, and
the format reward by hand."""

from __future__ import annotations

import pyarrow.parquet as pq

from raygraph.data.word_problems import DATA_SOURCE, SYSTEM_PROMPT, word_problems, write_word_problems
from raygraph.rewards import score_for_source


def test_problems_have_their_answers_and_cycle_through_four_kinds():
    problems = word_problems(8, seed=3)
    assert problems == word_problems(8, seed=3)                  # seeded
    q, a = problems[0]                                           # "X has a items and buys b more."
    numbers = [int(t) for t in q.replace("?", " ").split() if t.isdigit()]
    assert int(a) == numbers[0] + numbers[1]
    q, a = problems[2]                                           # boxes: a x b
    numbers = [int(t) for t in q.replace(".", " ").split() if t.isdigit()]
    assert int(a) == numbers[0] * numbers[1]
    assert all(int(a) > 0 for _, a in word_problems(200, seed=0))


def test_written_splits_are_disjoint_and_carry_the_system_prompt(tmp_path):
    train, val = write_word_problems(tmp_path, n_train=100, n_val=20, seed=0)
    train_rows, val_rows = pq.read_table(train).to_pylist(), pq.read_table(val).to_pylist()
    assert len(train_rows) == 100 and len(val_rows) == 20
    questions = lambda rows: {r["prompt"][1]["content"] for r in rows}  # noqa: E731
    assert not questions(train_rows) & questions(val_rows)
    assert val_rows[0]["prompt"][0] == {"role": "system", "content": SYSTEM_PROMPT}
    assert val_rows[0]["data_source"] == DATA_SOURCE


def test_the_format_reward_pays_the_last_line_once():
    score = score_for_source(DATA_SOURCE)
    assert score("She has 12 now.\n#### 12", "12").score == 1.0
    assert score("#### 12.", "12").score == 1.0                  # a closing period is fine
    assert score("#### 11", "12").score == 0.5                   # the format, a wrong number
    assert score("She has 12 apples.", "12").score == 0.0        # right in prose: no format
    assert score("#### 12\n#### 12\n#### 12", "12").score == 0.0   # repeating until the cap does not pay
    assert score("#### 12\nHope this helps!", "12").score == 0.0     # the answer must be the last line
