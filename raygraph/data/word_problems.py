"""Arithmetic word problems for a real instruct model: learning an answer FORMAT by RL.

    "Tom has 7 apples and buys 5 more. How many apples does he have now?"  ->  "12"

SmolLM2-135M-Instruct usually gets these right in prose but almost never ends with the
`#### <number>` line the system prompt asks for (measured: 6 % of greedy answers formatted, 1.6 %
correct AND formatted, on 64 held-out problems). The `word_problems` rule reward
(`raygraph.rewards.rules`) pays 1 for a correct final answer in that format and 0.5 for the
format alone, so GRPO has a signal from the first step and mainly has to teach the format (see
docs/real-model.md and `configs/smollm2_format.yaml`).

Four kinds of problem, in turn: addition, subtraction, multiplication (boxes of items), and
add-then-subtract. Train and validation come from different seeds and share no question.
"""

from __future__ import annotations

import random
from pathlib import Path

from raygraph.data.prompts import write_rows

__all__ = ["DATA_SOURCE", "SYSTEM_PROMPT", "word_problems", "write_word_problems"]

DATA_SOURCE = "word_problems"
SYSTEM_PROMPT = ("You are a careful math tutor. Solve the problem in one or two short sentences, "
                 "then write the final answer on its own line as '#### <number>'.")
_NAMES = (("Tom", "he"), ("Anna", "she"), ("Ben", "he"), ("Lucy", "she"), ("Sam", "he"), ("Mia", "she"),
          ("Jack", "he"), ("Emma", "she"))
_ITEMS = ("apples", "pencils", "stickers", "marbles", "cookies", "books")


def word_problems(n: int, seed: int = 0) -> list[tuple[str, str]]:
    """`n` `(question, answer)` pairs, the four kinds in turn, drawn with `seed`."""
    rng, out = random.Random(seed), []
    for i in range(n):
        name, pron = rng.choice(_NAMES)
        item = rng.choice(_ITEMS)
        kind = i % 4
        if kind == 0:
            a, b = rng.randint(2, 20), rng.randint(2, 20)
            q, answer = f"{name} has {a} {item} and buys {b} more. How many {item} does {pron} have now?", a + b
        elif kind == 1:
            a = rng.randint(8, 30)
            b = rng.randint(2, a - 2)
            q, answer = (f"{name} has {a} {item} and gives {b} of them to a friend. "
                         f"How many {item} does {pron} have left?"), a - b
        elif kind == 2:
            a, b = rng.randint(2, 9), rng.randint(2, 9)
            q, answer = (f"{name} buys {a} boxes of {item}. Each box holds {b} {item}. "
                         f"How many {item} does {pron} have?"), a * b
        else:
            a, b = rng.randint(5, 20), rng.randint(2, 10)
            c = rng.randint(1, a + b - 1)
            q, answer = (f"{name} has {a} {item}, buys {b} more, and then loses {c}. "
                         f"How many {item} does {pron} have now?"), a + b - c
        out.append((q, str(answer)))
    return out


def _rows(problems: list[tuple[str, str]], split: str) -> list[dict]:
    return [{
        "data_source": DATA_SOURCE,
        "prompt": [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": question}],
        "ability": "arithmetic",
        "reward_model": {"style": "rule", "ground_truth": answer},
        "extra_info": {"split": split, "index": i},
    } for i, (question, answer) in enumerate(problems)]


def write_word_problems(out_dir: str | Path, n_train: int = 512, n_val: int = 64, seed: int = 0) -> tuple[Path, Path]:
    """Write `train.parquet` and `val.parquet` (validation questions never appear in train).

    Returns:
        `(train_path, val_path)`.
    """
    val = word_problems(n_val, seed=seed)
    seen = {q for q, _ in val}
    train = [p for p in word_problems(n_train + n_val, seed=seed + 1) if p[0] not in seen][:n_train]
    out_dir = Path(out_dir)
    return (write_rows(_rows(train, "train"), out_dir / "train.parquet"),
            write_rows(_rows(val, "val"), out_dir / "val.parquet"))
