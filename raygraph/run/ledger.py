"""The sample ledger: which prompts each step trained, append-only, across any number of resumes
and recoveries.

`<run_dir>/ledger.jsonl` holds one line per trained step, ``{"step": N, "uids": [...]}``, written
after the step's update (before its checkpoint), and one line per resume, ``{"resume_from": S}``,
which retracts every step after S (their updates were lost with the actors, or never reached a
checkpoint, and are trained again). Nothing is ever rewritten: the file is the history.

`effective_steps` replays it; `check_ledger` compares the result with the data order the
sampler produces for the run's seed (`StepData.load(cfg).next_prompts(...)`, as
tests/run/test_chaos.py does), so "none lost, none repeated" is a check, not a hope.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

__all__ = ["SampleLedger", "effective_steps", "check_ledger", "LEDGER_FILE"]

LEDGER_FILE = "ledger.jsonl"


class SampleLedger:
    """Appends to `<run_dir>/ledger.jsonl` (flushed and fsynced per line: a kill loses nothing)."""

    def __init__(self, run_dir: Path):
        self.path = Path(run_dir) / LEDGER_FILE

    def resumed_from(self, step: int, reason: str = "resume") -> None:
        self._append({"resume_from": int(step), "reason": reason})

    def trained(self, step: int, uids: list[Any]) -> None:
        self._append({"step": int(step), "uids": [str(u) for u in uids]})

    def _append(self, record: dict) -> None:
        import os

        with self.path.open("a") as f:
            f.write(json.dumps(record) + "\n")
            f.flush()
            os.fsync(f.fileno())


def effective_steps(run_dir: Path) -> dict[int, list[str]]:
    """Step -> uids it trained, after applying every resume line (later lines win)."""
    steps: dict[int, list[str]] = {}
    path = Path(run_dir) / LEDGER_FILE
    if not path.is_file():
        return steps
    for line in path.read_text().splitlines():
        if not line.strip():
            continue
        record = json.loads(line)
        if "resume_from" in record:
            steps = {s: u for s, u in steps.items() if s <= record["resume_from"]}
        else:
            if record["step"] in steps:
                raise ValueError(f"{path}: step {record['step']} trained twice without a resume in between")
            steps[record["step"]] = record["uids"]
    return steps


def check_ledger(run_dir: Path, expected: dict[int, list[str]]) -> list[str]:
    """Problems (empty: none) comparing the ledger with `expected` (step -> uids of the data order).

    Reports steps missing or extra, steps whose prompts differ, and any prompt trained more or
    fewer times than the data order says.
    """
    from collections import Counter

    got = effective_steps(run_dir)
    problems = []
    missing = sorted(set(expected) - set(got))
    extra = sorted(set(got) - set(expected))
    if missing:
        problems.append(f"steps never trained: {missing[:10]}{' ...' if len(missing) > 10 else ''}")
    if extra:
        problems.append(f"steps trained beyond the data order: {extra[:10]}")
    differ = [s for s in sorted(set(got) & set(expected)) if sorted(got[s]) != sorted(expected[s])]
    if differ:
        problems.append(f"steps that trained other prompts than the data order: {differ[:10]}")
    counts, want = Counter(u for us in got.values() for u in us), Counter(u for us in expected.values() for u in us)
    off = {u: (counts[u], want[u]) for u in set(counts) | set(want) if counts[u] != want[u]}
    if off:
        sample = ", ".join(f"{u}: {c} times, expected {w}" for u, (c, w) in sorted(off.items())[:5])
        problems.append(f"{len(off)} prompts trained the wrong number of times ({sample})")
    return problems
