"""What the model generates, kept and shown: sample dumps and console samples.

Every `trainer.dump_rollouts.every` steps the step's rollouts (prompt, response, score and the
reward's extras, advantage, uid, weight version) go to `<run>/samples/train_step_<N>.jsonl`;
every validation's generations to `<run>/samples/val_step_<N>.jsonl`. Both are logged to MLflow
as artifacts and as a table (`mlflow.log_table`). At each validation the console shows a few
samples, shortened. The records come from the graph's whole-batch functions
(`step_metrics.sample_records`), so no batch travels to the driver, only text.
"""

from __future__ import annotations

import json
from pathlib import Path

__all__ = ["SampleDumps", "console_lines"]


class SampleDumps:
    """Writes sample records under `<run_dir>/samples/`.

    Args:
        run_dir: the run directory.
        every: dump the training rollouts every N steps (0: never; validation is always dumped).
        rows: rows per dump (None: all).
    """

    def __init__(self, run_dir: Path, every: int, rows: int | None):
        self.dir = Path(run_dir) / "samples"
        self.every, self.rows = every, rows

    def rows_for(self, step: int) -> int:
        """How many rows step `step` should return (`meta[DUMP_ROWS]`): 0 = none, -1 = all."""
        if not self.every or step % self.every:
            return 0
        return -1 if self.rows is None else self.rows

    @property
    def val_rows(self) -> int:
        return -1 if self.rows is None else self.rows

    def write(self, step: int, records: list[dict], kind: str) -> Path:
        """`<run>/samples/<kind>_step_<step>.jsonl`, one record per line (rewritten whole)."""
        self.dir.mkdir(parents=True, exist_ok=True)
        path = self.dir / f"{kind}_step_{step:06d}.jsonl"
        tmp = path.with_suffix(".jsonl.tmp")
        tmp.write_text("".join(json.dumps({"step": step, **r}, default=str) + "\n" for r in records))
        tmp.replace(path)
        return path


def console_lines(records: list[dict], width: int = 100) -> list[str]:
    """A few records as one shortened line each: `score ... | ...end of prompt -> response...`
    (a chat prompt's end holds the question; a response's start says what the model did)."""
    def flat(text) -> str:
        return " ".join(str(text).split())

    def head(text) -> str:
        text = flat(text)
        return text if len(text) <= width else text[:width - 3] + "..."

    def tail(text) -> str:
        text = flat(text)
        return text if len(text) <= width else "..." + text[-(width - 3):]

    lines = []
    for i, r in enumerate(records, start=1):
        score = "n/a" if r.get("score") is None else f"{r['score']:.3g}"
        lines.append(f"[raygraph]   sample {i}: score={score} | {tail(r.get('prompt', ''))!r} -> "
                     f"{head(r.get('response', ''))!r}")
        if r.get("conversation"):   # multi-turn: every message on its own line
            lines += [f"[raygraph]     {m['role']}: {head(m['text'])!r} ({m['tokens']} tokens"
                      + (f", reward {m['reward']:.3g})" if m["role"] == "assistant" else ")")
                      for m in r["conversation"]]
            lines.append(f"[raygraph]     ended: {r.get('truncation', 'none')}")
    return lines
