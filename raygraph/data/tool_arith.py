"""Multiplication a real instruct model cannot do in its head, with a calculator tool: the data of
the real-model tool-use example (`configs/smollm2_tools.yaml`, docs/agents.md).

    system: how to call the calculator (Hermes-style <tool_call> JSON) and to end with '#### <n>'
    user:   "What is 347 * 29?"                                       ground truth "10063"

The warm start (`warm_start.parquet`) shows both moves, each on half of its problems: the question
answered by the tool call `{"name": "calculator", "arguments": {"expression": "347 * 29"}}`, and the
conversation up to the tool's result (`10063`, a `tool` message) answered by `#### 10063`. RL, under
the `tool_answer` environment (1 for the right final number), then makes the two reliable in one
episode. (Showing the first move only taught the call but not what follows it: RL then found no
episode to reinforce, docs/agents.md.) Train, validation and warm-start problems are disjoint.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

from raygraph.data.prompts import write_rows

__all__ = ["DATA_SOURCE", "SYSTEM_PROMPT", "tool_arith_problems", "write_tool_arith"]

DATA_SOURCE = "tool_arith"
SYSTEM_PROMPT = ("You can use a calculator. To use it, reply with only: <tool_call>{\"name\": \"calculator\", "
                 "\"arguments\": {\"expression\": \"<expression>\"}}</tool_call> and you will get the result. "
                 "Then give the final answer on its own line as '#### <number>'.")


def tool_arith_problems(n: int, seed: int = 0) -> list[tuple[str, str]]:
    """`n` distinct `(expression, answer)` pairs: a 3-digit number times a 2-digit one."""
    rng, seen, out = random.Random(seed), set(), []
    while len(out) < n:
        a, b = rng.randint(100, 999), rng.randint(11, 99)
        if (a, b) not in seen:
            seen.add((a, b))
            out.append((f"{a} * {b}", str(a * b)))
    return out


def _prompt(expression: str) -> list[dict]:
    return [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": f"What is {expression}?"}]


def _warm_row(expression: str, answer: str, answer_move: bool) -> dict:
    """An SFT row of one move: the calculator call, or (`answer_move`) the final answer once the
    call and its result are in the conversation."""
    arguments = json.dumps({"name": "calculator", "arguments": {"expression": expression}})
    call = f"<tool_call>{arguments}</tool_call>"
    if not answer_move:
        return {"prompt": _prompt(expression), "response": call}
    exchange = [{"role": "assistant", "content": call}, {"role": "tool", "content": answer}]
    return {"prompt": _prompt(expression) + exchange, "response": f"#### {answer}"}


def write_tool_arith(out_dir: str | Path, n_train: int = 512, n_val: int = 64, n_warm: int = 256,
                     seed: int = 0) -> tuple[Path, Path]:
    """Write `train.parquet`, `val.parquet` and `warm_start.parquet` (disjoint problems).

    Returns:
        `(train_path, val_path)`.
    """
    problems = tool_arith_problems(n_train + n_val + n_warm, seed)
    val, train, warm = problems[:n_val], problems[n_val:n_val + n_train], problems[n_val + n_train:]
    out_dir = Path(out_dir)

    def rows(part, split):
        return [{"data_source": DATA_SOURCE, "prompt": _prompt(e), "reward_model": {"style": "rule", "ground_truth": a},
                 "extra_info": {"split": split, "index": i}} for i, (e, a) in enumerate(part)]

    write_rows([_warm_row(e, a, answer_move=i % 2 == 1) for i, (e, a) in enumerate(warm)], out_dir / "warm_start.parquet")
    return write_rows(rows(train, "train"), out_dir / "train.parquet"), write_rows(rows(val, "val"), out_dir / "val.parquet")
