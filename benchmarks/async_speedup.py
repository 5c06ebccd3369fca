"""Step time of synchronous vs asynchronous (one-step off-policy) GRPO, disaggregated: prints JSON.

    .venv/bin/python benchmarks/async_speedup.py --steps 25 --repeats 4 [key=value ...]

Both modes run the same config (`configs/toy/grpo_kl_loss.yaml`: policy + reference on one
worker, rollout + reward on another) with `placement.max_staleness` 0 and 1, alternating
(sync, async, sync, ...) so that load from other jobs hits both alike. The defaults make sampling
and training comparable in cost (8 prompts x 8 samples of 64 tokens), which is where overlapping
them can pay; `speedup_bound_from_sync_stages` says what overlap could give at most. Statistics
skip the first `--warmup` steps of each run (the first asynchronous step samples synchronously).
Trainer output goes to stderr; stdout is the JSON.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from step_time import measure  # noqa: E402 - the shared single-run measurement

CONFIG = "configs/toy/grpo_kl_loss.yaml"
DEFAULTS = ["data.prompts_per_step=8", "rollout.n=8", "rollout.max_new_tokens=64"]
STAGES = ("rollout.generate", "rollout.take_or_generate", "rollout.prefetch_next", "reward.score",
          "policy.logprobs", "reference.logprobs", "policy.update")


def _summary(runs: list[dict]) -> dict:
    medians = [r["step_s_median"] for r in runs]
    stages = {s: statistics.median(r["stages_mean_s"].get(f"timing/{s}_s", 0.0) for r in runs) for s in STAGES}
    return {"step_s_median": statistics.median(medians), "step_s_median_per_run": medians,
            "stages_median_s": {k: round(v, 4) for k, v in stages.items() if v}}


def _overlap_bound(stages: dict[str, float]) -> float:
    """What overlap could give at most, from synchronous stage times: (sampling + training) /
    max(sampling, training), ignoring the sync and the coordinator's steps (the same in both)."""
    sampling = stages.get("rollout.generate", 0.0) + stages.get("reward.score", 0.0)
    training = sum(stages.get(s, 0.0) for s in ("policy.logprobs", "reference.logprobs", "policy.update"))
    return round((sampling + training) / max(sampling, training), 3)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("overrides", nargs="*", help="key.path=value overrides for both modes")
    parser.add_argument("--config", default=CONFIG)
    parser.add_argument("--steps", type=int, default=25)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=4)
    args = parser.parse_args()
    overrides = [*DEFAULTS, *args.overrides]
    runs: dict[int, list[dict]] = {0: [], 1: []}
    load_before = os.getloadavg()[0]
    with contextlib.redirect_stdout(sys.stderr):
        for _ in range(args.repeats):
            for staleness in (0, 1):
                runs[staleness].append(measure(args.config, [*overrides, f"placement.max_staleness={staleness}"],
                                               args.steps, args.warmup))
    sync, pipelined = _summary(runs[0]), _summary(runs[1])
    print(json.dumps({
        "config": args.config, "overrides": overrides, "steps": args.steps, "warmup": args.warmup,
        "repeats": args.repeats, "machine": runs[0][0]["machine"], "samples_per_step": runs[0][0]["samples_per_step"],
        "load_avg_1m": [round(load_before, 1), round(os.getloadavg()[0], 1)],  # other jobs on the machine
        "synchronous": sync, "asynchronous": pipelined,
        "speedup": round(sync["step_s_median"] / pipelined["step_s_median"], 3),
        "speedup_bound_from_sync_stages": _overlap_bound(sync["stages_median_s"]),
    }, indent=1))


if __name__ == "__main__":
    main()
