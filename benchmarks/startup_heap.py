"""What the quiet start-up heap saves: a role worker's construction, and a vLLM engine's start.

    .venv/bin/python benchmarks/startup_heap.py [--rounds 4] [--what workers vllm]

Each measurement is a fresh Python process, as an actor is: it imports what a `RoleHost` imports,
then constructs the workers of `configs/grpo_toy.yaml` (tiny model, colocated: policy, rollout,
reward) through `RoleHost.construct`, or one vLLM rollout worker with its engine core in the
process (`vllm_engine_core=in_process`). "quiet" is the code as it is (`raygraph.cluster.startup_heap`
around each construction, and the heap frozen while vLLM's engine starts); "plain" replaces both
by nothing. The two alternate, `--rounds` times each. Printed: JSON with the process CPU seconds of
the constructions (median, and each round) per variant and their ratio.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

CHILD = r'''
import contextlib, gc, sys, time
variant, what, model = sys.argv[1:4]
import raygraph.cluster.host as host_module
from raygraph.cluster.errors import CallSite
if variant == "plain":
    host_module.quiet_heap = contextlib.nullcontext
    import raygraph.workers.vllm_in_process as vip

    class _NoFreeze:
        def __getattr__(self, name):
            return getattr(gc, name)

        @staticmethod
        def freeze():
            pass

    vip.gc = _NoFreeze()
host = object.__new__(host_module.RoleHost)
host.workers = {}
start = time.process_time()
if what == "workers":
    from raygraph.config import load_config
    from raygraph.config.workflow_ref import load_workflow
    from raygraph.run.role_specs import role_specs

    cfg = load_config(sys.argv[4], [f"model.path={model}", "model.tiny=null", "trainer.output_dir=" + sys.argv[5],
                                    "logging.mlflow=false"])
    specs = role_specs(cfg, load_workflow(cfg.workflow).roles)
    for role, spec in specs.items():
        host.sites = {role: CallSite(role, 0, "bench")}
        host.construct(role, spec.factory, spec.kwargs)
else:
    from raygraph.workers.rollout_vllm import VLLMRolloutWorker

    host.sites = {"rollout": CallSite("rollout", 0, "bench")}
    host.construct("rollout", VLLMRolloutWorker, dict(model_path=model, max_new_tokens=8, max_model_len=256,
                                                       engine_core="in_process"))
print("CPU_S", time.process_time() - start, flush=True)
'''


def _one(variant: str, what: str, model: str, out: str) -> float:
    env_cmd = [sys.executable, "-c", CHILD, variant, what, model, str(ROOT / "configs" / "grpo_toy.yaml"), out]
    done = subprocess.run(env_cmd, capture_output=True, text=True, cwd=ROOT, timeout=600)
    lines = [line for line in done.stdout.splitlines() if line.startswith("CPU_S ")]
    if done.returncode != 0 or not lines:
        raise RuntimeError(f"{variant} {what} failed:\n{done.stderr[-3000:]}")
    return float(lines[-1].split()[1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--what", nargs="+", default=["workers", "vllm"], choices=["workers", "vllm"])
    args = parser.parse_args()
    from raygraph.models.tiny import build_tiny_lm

    tmp = Path(tempfile.mkdtemp(prefix="raygraph-bench-heap-"))
    model = str(build_tiny_lm(tmp / "tiny-lm"))   # head_dim 32: vLLM's CPU attention takes it
    results = {}
    for what in args.what:
        cpu = {"quiet": [], "plain": []}
        for _ in range(args.rounds):
            for variant in ("plain", "quiet"):
                cpu[variant].append(round(_one(variant, what, model, str(tmp / "out")), 3))
        med = {v: statistics.median(xs) for v, xs in cpu.items()}
        results[what] = {"cpu_s_median": med, "cpu_s": cpu, "quiet_over_plain": round(med["quiet"] / med["plain"], 3)}
    print(json.dumps({"benchmark": "startup_heap", "rounds": args.rounds, "results": results}, indent=1))


if __name__ == "__main__":
    main()
