"""Streaming rollouts on a long-tail workload: samples/s and idle fractions for k = 0, 1, 2, 4 with
and without partial rollouts, beside the synchronous step, in one invocation. Prints JSON.

    .venv/bin/python benchmarks/streaming.py --steps 10 --warmup 2 [--ks 0,1,2,4] [--preset small]
        [--plot docs/img/streaming.png] [--engine vllm] [--agent]

The workload is the demo's task (configs/demo.yaml's data) on a random-init tiny model whose
responses end at any of `--stop-ids` token ids besides eos: at random init each token ends a
response with probability ~ (stops + 1) / vocab, so lengths are geometric (mean ~13 tokens with 6
stop ids) and capped at `--max-new-tokens` (96, ~8x the mean): every batch has a few responses
many times longer than the typical one, the case where a synchronous step waits for its slowest
sample. Disaggregated: one training rank, two rollout ranks. Each setting is one training run
(same trainer, same DAG as `raygraph train`); statistics skip the first `--warmup` steps.

`--agent` runs multi-turn episodes instead (configs/demo_multiturn.yaml's task and environment:
a wrong first answer gets feedback and a second turn), each turn as long-tailed as above; a
"sample" is then an episode.

    samples_per_s      timed steps x samples per step / their summed step time
    trainer_idle_frac  streaming: the step's wait for its groups / step time (mean); synchronous:
                       the generate stage / step time (the trainer waits for the whole rollout)
    rollout_busy_frac  streaming: the rollout ranks' generation time / wall time (mean)
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def _run(config: str, base: list[str], extra: list[str], steps: int, warmup: int) -> dict:
    from raygraph.config import load_config
    from raygraph.run.trainer import run

    out = tempfile.mkdtemp(prefix="raygraph-stream-")
    cfg = load_config(REPO / "configs" / config, [
        *base, *extra, f"trainer.total_steps={steps + warmup}", f"trainer.output_dir={out}", "run_name=bench"])
    started = time.perf_counter()
    summary = run(cfg)
    wall = time.perf_counter() - started
    rows = [json.loads(line) for line in (summary.run_dir / "metrics.jsonl").read_text().splitlines()]
    timed = [r for r in rows if r["step"] > warmup]
    step_s = [r["timing/step_s"] for r in timed]
    streaming = "stream/wait_s" in timed[0]
    idle = [r["stream/trainer_idle_frac"] if streaming else
            r.get("timing/rollout.generate_s", 0.0) / r["timing/step_s"] for r in timed]
    return {"samples_per_s": len(timed) * cfg.samples_per_step / sum(step_s),
            "step_s_median": statistics.median(step_s), "trainer_idle_frac": statistics.fmean(idle),
            "rollout_busy_frac": statistics.fmean(r["stream/rollout_busy_frac"] for r in timed) if streaming else None,
            "response_length_mean": statistics.fmean(r["rollout/response_length_mean"] for r in timed),
            "response_length_max": max(r["rollout/response_length_max"] for r in timed),
            "turns_mean": statistics.fmean(r.get("agent/turns_mean", 1.0) for r in timed),
            "staleness_max": max(r.get("rollout/staleness_max", 0.0) for r in timed),
            "mixed_version_samples": statistics.fmean(r.get("stream/mixed_version_samples", 0.0) for r in timed),
            "wall_s": wall}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--ks", default="0,1,2,4")
    parser.add_argument("--preset", default="small", help="tiny model preset (raygraph.models.tiny)")
    parser.add_argument("--max-new-tokens", type=int, default=96)
    parser.add_argument("--stop-ids", default="40,41,42,43,44,45", help="token ids (a-f of the tiny tokenizer)")
    parser.add_argument("--plot", default=None, help="write a PNG of samples/s per setting here")
    parser.add_argument("--engine", default="hf", help="rollout.engine (hf or vllm)")
    parser.add_argument("--agent", action="store_true", help="multi-turn episodes (configs/demo_multiturn.yaml)")
    args = parser.parse_args()
    config = "demo_multiturn.yaml" if args.agent else "demo.yaml"
    base = [f"model.tiny={args.preset}", "trainer.warm_start=null", "trainer.val_every=0",
            "trainer.val_before_train=false", "data.val_files=[]", "trainer.save_every=0",
            "checkpoint.save_hf=false", "logging.mlflow=false", "actor.old_logprobs=auto",
            f"rollout.max_new_tokens={args.max_new_tokens}", f"rollout.stop_token_ids=[{args.stop_ids}]",
            "data.prompts_per_step=16", "placement.mode=disaggregated", "placement.train_workers=1",
            "placement.rollout_workers=2", f"rollout.engine={args.engine}"]
    settings = [("synchronous", [])]
    for k in (int(x) for x in args.ks.split(",")):
        for partial in (True, False):
            settings.append((f"k={k}{' partial' if partial else ''}", [
                "rollout.streaming=true", f"placement.max_staleness={k}", f"rollout.partial_rollouts={str(partial).lower()}"]))
    results = {}
    for name, extra in settings:
        results[name] = _run(config, base, extra, args.steps, args.warmup)
        print(f"[streaming bench] {name}: {results[name]['samples_per_s']:.1f} samples/s", flush=True)
    sync = results["synchronous"]["samples_per_s"]
    out = {"config": config, "preset": args.preset, "engine": args.engine, "max_new_tokens": args.max_new_tokens, "stop_ids": args.stop_ids,
           "steps": args.steps, "warmup": args.warmup, "results": results,
           "speedup_vs_synchronous": {name: r["samples_per_s"] / sync for name, r in results.items()},
           "machine": f"{platform.machine()} {platform.system()}, {__import__('os').cpu_count()} CPUs"}
    print(json.dumps(out, indent=1))
    if args.plot:
        _plot(results, args.plot)


def _plot(results: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(results)
    fig, ax = plt.subplots(figsize=(8, 3.5))
    ax.bar(names, [results[n]["samples_per_s"] for n in names], color=["gray"] + ["tab:blue", "tab:orange"] * 8)
    ax.set_ylabel("samples / s")
    ax.set_title("Streaming rollouts on a long-tail workload (2 CPU cores)")
    ax.tick_params(axis="x", rotation=30)
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)


if __name__ == "__main__":
    main()
