"""What putting off SciPy and Triton saves (`raygraph.models.lean_imports`): a whole process that
starts as an actor does.

    .venv/bin/python benchmarks/lean_imports.py [--rounds 4]

Each measurement is a fresh Python process, as an actor is: it imports what a `RoleHost` imports and
constructs the workers of `configs/grpo_toy.yaml` (the child of `benchmarks/startup_heap.py`, code as
it is). "lean" is raygraph's default; "plain" sets `RAYGRAPH_LEAN_IMPORTS=0`, so SciPy and Triton are
imported with the model class as transformers and torch do by themselves. The two alternate,
`--rounds` times each. Printed: JSON with the CPU seconds of the whole process (user + system) per
variant and their ratio.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from transformers_index import alternate  # noqa: E402 - the same actor-like child, measured the same way


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=4)
    args = parser.parse_args()
    result = alternate({"plain": {"RAYGRAPH_LEAN_IMPORTS": "0"}, "lean": {}}, args.rounds, "raygraph-bench-lean-")
    med = result["cpu_s_median"]
    print(json.dumps({"benchmark": "lean_imports", "rounds": args.rounds, **result,
                      "lean_over_plain": round(med["lean"] / med["plain"], 3)}, indent=1))


if __name__ == "__main__":
    main()
