"""Does streaming learn as well? The demo (configs/demo.yaml: warm start, then GRPO on held-out
addition mod 10) trained synchronously and with streaming rollouts k steps ahead, the same number of
optimizer steps each; held-out greedy accuracy at every validation. Prints JSON.

    .venv/bin/python benchmarks/streaming_learning.py [--ks 2] [--steps 400] [--seeds 0,1]
        [--plot docs/img/streaming_learning.png]

Both settings are disaggregated (one training rank, one rollout rank, 0.5 CPU each) with
`actor.old_logprobs=auto` (streaming needs the policy's own old log-probs), so streaming and the
staleness it brings are the only difference. Each setting is one `raygraph train` run in-process.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
BASE = ["placement.mode=disaggregated", "placement.cpus_per_worker=0.5", "actor.old_logprobs=auto",
        "logging.mlflow=false", "trainer.save_every=0", "checkpoint.save_hf=false", "run_name=curve"]


def _run(extra: list[str], steps: int) -> dict:
    from raygraph.config import load_config
    from raygraph.run.trainer import run

    cfg = load_config(REPO / "configs" / "demo.yaml", [*BASE, *extra, f"trainer.total_steps={steps}",
                                                       f"trainer.output_dir={tempfile.mkdtemp(prefix='rg-curve-')}"])
    started = time.perf_counter()
    summary = run(cfg)
    wall = time.perf_counter() - started
    rows = [json.loads(line) for line in (summary.run_dir / "metrics.jsonl").read_text().splitlines()]
    curve = {0: summary.val_accuracy_start} if summary.val_accuracy_start is not None else {}
    curve.update({r["step"]: r["val/accuracy"] for r in rows if "val/accuracy" in r})
    return {"val_accuracy": curve, "final": curve[max(curve)], "wall_s": wall,
            "staleness_max": max(r.get("rollout/staleness_max", 0.0) for r in rows),
            "train_reward_last25": sum(r["reward/mean"] for r in rows[-25:]) / len(rows[-25:])}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ks", default="2", help="streaming settings to run beside the synchronous one")
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--seeds", default="0", help="trainer.seed values: one run per setting and seed")
    parser.add_argument("--plot", default=None, help="write a PNG of the curves here")
    args = parser.parse_args()
    settings = {"synchronous (k=0)": []}
    for k in (int(x) for x in args.ks.split(",")):
        settings[f"streaming k={k}"] = ["rollout.streaming=true", f"placement.max_staleness={k}"]
    results = {}
    for seed in (int(x) for x in args.seeds.split(",")):
        for name, extra in settings.items():   # alternating: settings of one seed run back to back
            results[f"{name}, seed {seed}"] = result = _run([*extra, f"trainer.seed={seed}"], args.steps)
            print(f"[streaming learning] {name}, seed {seed}: final held-out accuracy {result['final']:.2f} "
                  f"({result['wall_s']:.0f} s)", flush=True)
    print(json.dumps({"steps": args.steps, "results": results,
                      "machine": f"{platform.machine()} {platform.system()}, {os.cpu_count()} CPUs"}, indent=1))
    if args.plot:
        _plot(results, args.plot)


def _plot(results: dict, path: str) -> None:
    """Per setting, the mean held-out accuracy over its seeds, with the range of the seeds shaded."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    by_setting: dict[str, list[dict]] = {}
    for name, result in results.items():
        by_setting.setdefault(name.split(", seed ")[0], []).append(
            {int(step): acc for step, acc in result["val_accuracy"].items()})
    fig, ax = plt.subplots(figsize=(6, 3.5))
    for name, curves in by_setting.items():
        steps = sorted(set.intersection(*(set(c) for c in curves)))
        values = [[c[s] for c in curves] for s in steps]
        ax.plot(steps, [sum(v) / len(v) for v in values], marker="o", markersize=3,
                label=f"{name} (mean of {len(curves)} seeds)")
        ax.fill_between(steps, [min(v) for v in values], [max(v) for v in values], alpha=0.2)
    ax.set_xlabel("optimizer step (policy version)")
    ax.set_ylabel("held-out accuracy (greedy)")
    ax.set_title("The demo: synchronous vs streaming rollouts")
    ax.legend()
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)


if __name__ == "__main__":
    main()
