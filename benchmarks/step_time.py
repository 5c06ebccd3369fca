"""Step time of a real `raygraph train` run: prints JSON (median/mean step time, tokens/s, stages).

    .venv/bin/python benchmarks/step_time.py configs/demo.yaml --steps 20 --warmup 3 [key=value ...]

The run is an ordinary training run (same trainer, same DAG) with MLflow and checkpoints off and
no validation between steps; statistics skip the first `--warmup` steps.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import tempfile
import time
from pathlib import Path


def _stage_means(rows: list[dict]) -> dict[str, float]:
    keys = sorted({k for row in rows for k in row if k.startswith("timing/") and k != "timing/step_s"})
    return {k: statistics.fmean(row[k] for row in rows if k in row) for k in keys}


def measure(config: str, overrides: list[str], steps: int, warmup: int) -> dict:
    from raygraph.config import load_config
    from raygraph.run.trainer import run

    # The run's directory goes when the measurement is done: its final checkpoint alone is
    # 1.7 GB for a 135M-parameter model (weights and optimizer state).
    with tempfile.TemporaryDirectory(prefix="raygraph-bench-") as out_dir:
        cfg = load_config(config, [*overrides, f"trainer.total_steps={steps + warmup}", "trainer.val_every=0",
                                   "trainer.resume=never", "logging.mlflow=false", "checkpoint.save_hf=false",
                                   f"trainer.output_dir={out_dir}", "run_name=bench", "data.val_files=[]"])
        started = time.perf_counter()
        summary = run(cfg)
        wall = time.perf_counter() - started
        rows = [json.loads(line) for line in (Path(summary.run_dir) / "metrics.jsonl").read_text().splitlines()]
    timed = [r for r in rows if r["step"] > warmup]
    step_s = [r["timing/step_s"] for r in timed]
    # Of rollout workflows only (an SFT or DPO run has neither): absent rather than 0.
    rollout_means = {out: statistics.fmean(r[key] for r in timed)
                     for out, key in (("response_length_mean", "rollout/response_length_mean"),
                                      ("reward_mean", "reward/mean")) if all(key in r for r in timed)}
    return {
        "config": config, "overrides": overrides, "steps": len(timed), "warmup": warmup,
        "step_s": step_s, "step_s_median": statistics.median(step_s), "step_s_mean": statistics.fmean(step_s),
        **rollout_means,
        "tokens_per_s_mean": statistics.fmean(r.get("perf/tokens_per_s", 0.0) for r in timed),
        "samples_per_step": cfg.samples_per_step, "stages_mean_s": _stage_means(timed),
        "wall_s": wall, "machine": f"{platform.machine()} {platform.system()}, {_cpus()} CPUs",
    }


def _cpus() -> int:
    import os

    return os.cpu_count() or 0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("config")
    parser.add_argument("overrides", nargs="*", help="key.path=value overrides")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    args = parser.parse_args()
    print(json.dumps(measure(args.config, args.overrides, args.steps, args.warmup), indent=1))


if __name__ == "__main__":
    main()
