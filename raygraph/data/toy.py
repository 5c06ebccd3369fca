"""The toy verifiable task: single-digit addition modulo 10, e.g. ``"3+4="`` -> ``"7"``,
``"8+5="`` -> ``"3"``.

Why this task (for the CPU demo with `raygraph.models.tiny` and its character tokenizer):
- Every prompt is one user message ``"a+b="`` (the chat template is the tokenizer's), and every
  answer is ONE digit token followed by eos, so credit assignment is trivial and a rollout
  needs only ``max_new_tokens`` of 2-4.
- A random-init model scores ~0: it must emit exactly the right digit and then stop.
- Chance level is 10 %, so GRPO groups of 4-8 samples regularly contain a correct answer once
  the model emits digits at all, and the policy gradient has a signal from step one.
- Train and validation are disjoint sets of the 100 distinct problems, drawn from the same
  distribution; addition is commutative and regular, so a policy that learns it on the train
  problems is right on held-out ones too (a tiny model trained by SFT on 80 of them gets all
  20 held-out ones right).

Warm start (`toy_sft_rows`, written as ``warm_start.parquet``): *copy* rows ``"7="`` -> ``"7"``.
They teach the answer format (a bare number, then stop) and to read a digit off the prompt, but
contain no addition and no task prompt, so they cannot leak validation answers; RL has to learn
the addition itself. Measured with `tests/data/toy_learnability.py` (a minimal GRPO loop over
this package's data and reward code; tiny model, 2 CPU cores): 100 copy-SFT steps of 32 rows at
lr 1e-3, then 300 GRPO steps of 32 prompts x 8 samples, lr 5e-4 with 20 warmup steps, 4
mini-batches per step, PPO clip 0.2, temperature 1, no KL. Held-out greedy accuracy over seeds
0-3: 0 at random init, 10-25 % after the warm start, 40-70 % after RL (+25 to +60 points).
An RL lr of 1e-3 was less stable (one seed collapsed to reward ~0 and did not recover); a
warm start on random digits (format only, no copying) left GRPO stuck at chance.

Raise `max_operand` for more distinct problems: the answer still depends on the units digits
only and the warm start still copies 0-9, so held-out problems share their answer rule with many
training ones (``configs/demo.yaml`` uses ``max_operand=29``: 900 problems, 800 train / 100
held out). Set ``modulo=None`` for plain sums (answers 0-18, up to two tokens; harder).
"""

from __future__ import annotations

import random
from pathlib import Path

from raygraph.data.prompts import write_rows

__all__ = ["DATA_SOURCE", "toy_problems", "split_toy_problems", "toy_rows", "toy_two_turn_rows", "write_toy_dataset",
           "toy_sft_rows", "toy_dpo_rows"]

DATA_SOURCE = "toy_arith"


def toy_problems(max_operand: int = 9, modulo: int | None = 10) -> list[tuple[str, str]]:
    """Every ``(question, answer)`` with operands ``0 <= a, b <= max_operand``, in order.

    Args:
        max_operand: largest operand.
        modulo: answers are ``(a + b) % modulo``; None = plain sums.
    """
    if max_operand < 1 or (modulo is not None and modulo < 2):
        raise ValueError(f"need max_operand >= 1 and modulo >= 2 (or None), got {max_operand}, {modulo}")
    return [(f"{a}+{b}=", str((a + b) % modulo if modulo else a + b))
            for a in range(max_operand + 1) for b in range(max_operand + 1)]


def split_toy_problems(n_train: int, n_val: int, seed: int = 0, **task_args
                       ) -> tuple[list[tuple[str, str]], list[tuple[str, str]]]:
    """Disjoint train and validation problems, a seeded shuffle of `toy_problems(**task_args)`.

    Raises:
        ValueError: when ``n_train + n_val`` exceeds the number of distinct problems.
    """
    problems = toy_problems(**task_args)
    if n_train < 1 or n_val < 1 or n_train + n_val > len(problems):
        raise ValueError(f"the toy task {task_args or '(defaults)'} has {len(problems)} distinct "
                         f"problems; n_train={n_train} + n_val={n_val} must be between 2 and that "
                         f"(raise max_operand for more problems)")
    random.Random(seed).shuffle(problems)
    return problems[n_val:n_val + n_train], problems[:n_val]


def toy_rows(problems: list[tuple[str, str]], split: str) -> list[dict]:
    """Problems as dataset rows in the verl-compatible schema (see `raygraph.data.prompts`)."""
    return [{
        "data_source": DATA_SOURCE,
        "prompt": [{"role": "user", "content": question}],
        "ability": "arithmetic",
        "reward_model": {"style": "rule", "ground_truth": answer},
        "extra_info": {"split": split, "index": i},
    } for i, (question, answer) in enumerate(problems)]


def toy_two_turn_rows(problems: list[tuple[str, str]], split: str) -> list[dict]:
    """The problems split over two turns for the multi-turn demo (`configs/demo_multiturn.yaml`): the
    prompt holds the first operand (``"3+"``), the environment `reveal_then_answer` reveals the
    rest (``extra_info.reveal = "4="``) after the model's first turn, and scores the second turn.
    No answer can be right before the second turn."""
    rows = toy_rows(problems, split)
    for row, (question, _) in zip(rows, problems):
        head, _, tail = question.partition("+")
        row["prompt"] = [{"role": "user", "content": head + "+"}]
        row["extra_info"]["reveal"] = tail
    return rows


def toy_sft_rows(n: int = 320, seed: int = 0, **task_args) -> list[dict]:
    """Warm-start rows ``{"prompt": [user "7="], "response": "7"}``: copy a number, then stop.

    The numbers are every possible answer of the task (0-9 by default), repeated in shuffled
    rounds up to `n` rows. No row is an addition problem (see the module docstring).
    """
    modulo = task_args.get("modulo", 10)
    max_operand = task_args.get("max_operand", 9)
    values = list(range(modulo if modulo else 2 * max_operand + 1))
    rng, rows = random.Random(seed), []
    while len(rows) < n:
        rng.shuffle(values)
        rows.extend({"prompt": [{"role": "user", "content": f"{v}="}], "response": str(v)}
                    for v in values)
    return rows[:n]


def toy_dpo_rows(problems: list[tuple[str, str]], seed: int = 0, **task_args) -> list[dict]:
    """Preference pairs for the same problems: chosen = the right answer, rejected = a wrong one."""
    modulo = task_args.get("modulo", 10)
    answers = [str(v) for v in range(modulo if modulo else 2 * task_args.get("max_operand", 9) + 1)]
    rng = random.Random(seed)
    return [{"prompt": [{"role": "user", "content": question}], "chosen": answer,
             "rejected": rng.choice([a for a in answers if a != answer])}
            for question, answer in problems]


def write_toy_dataset(out_dir: str | Path, n_train: int = 80, n_val: int = 20, seed: int = 0,
                      two_turns: bool = False, **task_args) -> tuple[Path, Path]:
    """Write ``train.parquet``, ``val.parquet``, ``warm_start.parquet`` and ``train_dpo.parquet``.

    ``train.parquet`` also serves as SFT data (its ground truth is the response);
    ``train_dpo.parquet`` holds preference pairs over the same training problems.

    Args:
        out_dir: folder (created if missing).
        n_train, n_val: distinct problems in each split (the default task has 100 in all).
        seed: shuffle seed of the split and of the warm-start rows.
        two_turns: write the prompts split over two turns (`toy_two_turn_rows`).
        **task_args: `max_operand`, `modulo` (see `toy_problems`).

    Returns:
        ``(train_path, val_path)``; the warm-start file is ``out_dir / "warm_start.parquet"``.
    """
    out_dir = Path(out_dir)
    train, val = split_toy_problems(n_train, n_val, seed, **task_args)
    rows = toy_two_turn_rows if two_turns else toy_rows
    train_path = write_rows(rows(train, "train"), out_dir / "train.parquet")
    val_path = write_rows(rows(val, "val"), out_dir / "val.parquet")
    write_rows(toy_sft_rows(seed=seed, **task_args), out_dir / "warm_start.parquet")
    write_rows(toy_dpo_rows(train, seed=seed, **task_args), out_dir / "train_dpo.parquet")
    return train_path, val_path
