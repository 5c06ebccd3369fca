"""What the stored transformers index saves: a whole process that starts as an actor does.

    .venv/bin/python benchmarks/transformers_index.py [--rounds 4]

Each measurement is a fresh Python process, as an actor is: it imports what a `RoleHost` imports
and constructs the workers of `configs/grpo_toy.yaml` (the child of `benchmarks/startup_heap.py`,
code as it is). "stored" reads transformers' model index from the stored copy
(`raygraph.models.transformers_index`, built before the first round); "scanned" sets
`RAYGRAPH_TRANSFORMERS_INDEX=0`, so transformers reads its ~1,100 model files as it does by itself.
The two alternate, `--rounds` times each. Printed: JSON with the CPU seconds of the whole process
(user + system, from the parent's view of its ended child) per variant and their ratio.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from startup_heap import CHILD, ROOT  # noqa: E402 - the same actor-like child process


def _process_cpu_s(env: dict, model: str, out: str) -> float:
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    done = subprocess.run([sys.executable, "-c", CHILD, "quiet", "workers", model,
                           str(ROOT / "configs" / "grpo_toy.yaml"), out],
                          capture_output=True, text=True, cwd=ROOT, timeout=600, env={**os.environ, **env})
    if done.returncode != 0:
        raise RuntimeError(done.stderr[-3000:])
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime


def alternate(variants: dict[str, dict], rounds: int, prefix: str) -> dict:
    """CPU seconds of actor-like processes on a fresh tiny model, one per variant (its extra env)
    per round, alternating; one unmeasured warm-up with the last variant first (stores caches)."""
    from raygraph.models.tiny import build_tiny_lm

    tmp = Path(tempfile.mkdtemp(prefix=prefix))
    model = str(build_tiny_lm(tmp / "tiny-lm"))
    _process_cpu_s(list(variants.values())[-1], model, str(tmp / "out"))
    cpu = {name: [] for name in variants}
    for _ in range(rounds):
        for name, env in variants.items():
            cpu[name].append(round(_process_cpu_s(env, model, str(tmp / "out")), 3))
    return {"cpu_s_median": {name: statistics.median(xs) for name, xs in cpu.items()}, "cpu_s": cpu}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=4)
    args = parser.parse_args()
    # the warm-up stores the index if it is not yet
    result = alternate({"scanned": {"RAYGRAPH_TRANSFORMERS_INDEX": "0"}, "stored": {}}, args.rounds,
                       "raygraph-bench-index-")
    med = result["cpu_s_median"]
    print(json.dumps({"benchmark": "transformers_index", "rounds": args.rounds, **result,
                      "stored_over_scanned": round(med["stored"] / med["scanned"], 3)}, indent=1))


if __name__ == "__main__":
    main()
