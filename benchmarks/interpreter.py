"""Which Python interpreter runs raygraph's processes faster: the same code under two venvs.

    .venv/bin/python benchmarks/interpreter.py OTHER_VENV/bin/python [--rounds 4]

Compares this interpreter (`sys.executable`) with OTHER (a venv with raygraph installed the same
way, e.g. built by `make venv PYTHON=/usr/bin/python3.11` in another checkout). Each measurement
is a fresh process, alternating between the two, `--rounds` times each:

- `actor_start`: what an actor's process does when a run starts (imports what a `RoleHost`
  imports and constructs the workers of `configs/grpo_toy.yaml`; the child of
  `benchmarks/startup_heap.py`);
- `pure_python`: a loop of dict updates and object creation, no imports.

Printed: JSON with the CPU seconds of the whole child process (user + system, from the parent's
view of its ended child) per interpreter and task, their medians and OTHER's median over this one's.
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from startup_heap import CHILD, ROOT  # noqa: E402 - the same actor-like child process

PURE = r'''
counts = {}
for i in range(3_000_000):
    counts[i % 1000] = counts.get(i % 1000, 0) + i


class Point:
    def __init__(self, x):
        self.x = x


points = [Point(i) for i in range(500_000)]
'''


def _cpu_s(argv: list[str]) -> float:
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    done = subprocess.run(argv, capture_output=True, text=True, cwd=ROOT, timeout=600)
    if done.returncode != 0:
        raise RuntimeError(f"{argv[0]} failed:\n{done.stderr[-3000:]}")
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime


def _version(python: str) -> str:
    return subprocess.run([python, "-c", "import sys; print(sys.version.split()[0])"], capture_output=True,
                          text=True, check=True).stdout.strip()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("other", help="the other venv's python")
    parser.add_argument("--rounds", type=int, default=4)
    args = parser.parse_args()
    from raygraph.models.tiny import build_tiny_lm

    tmp = Path(tempfile.mkdtemp(prefix="raygraph-bench-interpreter-"))
    model = str(build_tiny_lm(tmp / "tiny-lm"))
    tasks = {"actor_start": ["-c", CHILD, "quiet", "workers", model, str(ROOT / "configs" / "grpo_toy.yaml"),
                             str(tmp / "out")],
             "pure_python": ["-c", PURE]}
    pythons = {"this": sys.executable, "other": args.other}
    for python in pythons.values():   # warm: each venv stores its transformers index once
        _cpu_s([python, *tasks["actor_start"]])
    cpu = {name: {task: [] for task in tasks} for name in pythons}
    for _ in range(args.rounds):
        for task, argv in tasks.items():
            for name, python in pythons.items():
                cpu[name][task].append(round(_cpu_s([python, *argv]), 3))
    med = {name: {task: round(statistics.median(xs), 3) for task, xs in per.items()} for name, per in cpu.items()}
    print(json.dumps({"benchmark": "interpreter", "rounds": args.rounds,
                      "pythons": {name: {"path": p, "version": _version(p)} for name, p in pythons.items()},
                      "cpu_s_median": med, "cpu_s": cpu,
                      "other_over_this": {task: round(med["other"][task] / med["this"][task], 3) for task in tasks}},
                     indent=1))


if __name__ == "__main__":
    main()
