"""Which rollout engine makes the training *step* faster: prints JSON, one entry per model and length.

    .venv/bin/python benchmarks/engine_choice.py [--cases small-16,25m-128,...] [--steps 3] [--warmup 1]

Each case is one model and one response length; each engine (`rollout.engine=hf`, `=vllm`) runs
the same GRPO steps with `benchmarks/step_time.py` in its own process (a fresh local Ray each
time), the engines alternating when `--rounds` > 1. The answer is the ratio of the step medians
(vllm / hf): below 1 vLLM makes the step faster. `rollout.engine=auto` follows these figures
(docs/benchmarks.md, "Which engine makes the step faster").
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

# name -> (config, overrides). Tiny models are random: their responses run to max_new_tokens.
_MODELS = {
    "small": ("configs/grpo_toy.yaml", ["model.tiny=small", "data.prompts_per_step=8", "rollout.n=8"]),
    "25m": ("configs/grpo_toy.yaml", ["model.tiny=25m", "data.prompts_per_step=8", "rollout.n=8"]),
    "smollm2": ("configs/smollm2_format.yaml", ["model.path=runs/models/smollm2-135m-instruct",
                                                "data.prompts_per_step=4", "rollout.n=8", "actor.kl_loss_coef=0.04"]),
}
_COMMON = ["placement.cpus_per_worker=2"]   # the whole machine for the one rank, either engine


def _case(name: str) -> tuple[str, list[str]]:
    model, _, tokens = name.rpartition("-")
    if model not in _MODELS or not tokens.isdigit():
        raise SystemExit(f"unknown case {name!r}: <model>-<max_new_tokens>, model one of {sorted(_MODELS)}")
    config, overrides = _MODELS[model]
    return config, [*overrides, *_COMMON, f"rollout.max_new_tokens={tokens}"]


def _step(config: str, overrides: list[str], engine: str, steps: int, warmup: int) -> dict:
    cmd = [sys.executable, str(REPO / "benchmarks" / "step_time.py"), config, *overrides,
           f"rollout.engine={engine}", "--steps", str(steps), "--warmup", str(warmup)]
    out = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, check=False)
    if out.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout[out.stdout.index("{"):])


def measure(case: str, steps: int, warmup: int, rounds: int) -> dict:
    config, overrides = _case(case)
    runs: dict[str, list[dict]] = {"hf": [], "vllm": []}
    for r in range(rounds):
        for engine in (("hf", "vllm") if r % 2 == 0 else ("vllm", "hf")):
            runs[engine].append(_step(config, overrides, engine, steps, warmup))
    result: dict = {"case": case, "config": config, "overrides": overrides, "rounds": rounds}
    for engine, results in runs.items():
        stages = results[-1]["stages_mean_s"]
        result[engine] = {
            "step_s_median": statistics.median(r["step_s_median"] for r in results),
            "generate_s": stages.get("timing/rollout.generate_s"),
            "update_s": stages.get("timing/policy.update_s"),
            "load_weights_s": stages.get("timing/rollout.load_weights_s"),
        }
    result["vllm_over_hf"] = result["vllm"]["step_s_median"] / result["hf"]["step_s_median"]
    result["machine"] = runs["hf"][-1]["machine"]
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cases", default="small-16,small-128,25m-16,25m-128,smollm2-48,smollm2-128")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=1)
    args = parser.parse_args()
    for case in args.cases.split(","):
        print(json.dumps(measure(case, args.steps, args.warmup, args.rounds)), flush=True)


if __name__ == "__main__":
    main()
