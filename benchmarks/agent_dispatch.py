"""Episodes over two rollout ranks under a long-tail environment latency: the even split against
least-loaded dispatch (`rollout.agent.dispatch`), in seconds of `rollout.generate` per step.

    python benchmarks/agent_dispatch.py [--steps 4] [--prompts 16] [--n 4] [--turns 3]
        [--latency-median-ms 20] [--latency-sigma 1.5] [--groups-in-flight 1 2] [--env-workers 16]
        [--rank1-extra-ms 0] [--out /tmp/agent_dispatch] [key=value ...]

Real training runs (`raygraph.run.trainer.run`) of the multi-turn demo (configs/demo_multiturn.yaml,
the tiny model, no warm start) with the vLLM engine, disaggregated: one policy rank, two rollout
ranks. The environment is `benchmarks/agent_throughput.py:LongTailEnv` (`--turns` steps, each
sleeping a lognormal latency that is a function of the episode's uid and turn only), so every mode
does the same work; `--rank1-extra-ms` makes every step on rollout rank 1 that much slower, and
`--env-workers` bounds the steps a rank runs at once (a rank bound by its capacity). Per mode: the mean over steps 2.. of `timing/rollout.generate_s` and
`timing/step_s`, `agent/ran_elsewhere` (share of episodes another rank ran), and whether every
metric that is not a timing equals the even run's ("same_metrics"; dispatch must not change a
sample). With `placement.max_staleness=1` "generate_s" is the rollout's `take_or_generate` plus
its `prefetch_next` (the next step's episodes, sampled during the update). The JSON is the last
line of stdout.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))


class LongTailOnRanks:
    """`agent_throughput.LongTailEnv`, plus `rank1_extra_ms` per step on rollout rank 1 (a slower
    rank: another machine, a busier host)."""

    def __init__(self, row: dict, turns: int = 3, median_ms: float = 20.0, sigma: float = 1.0,
                 rank1_extra_ms: float = 0.0) -> None:
        import ray
        from agent_throughput import LongTailEnv

        self.env = LongTailEnv(row, turns=turns, median_ms=median_ms, sigma=sigma)
        on_rank1 = (ray.get_runtime_context().get_actor_name() or "").endswith("/1")
        self.extra_s = rank1_extra_ms / 1000 if on_rank1 else 0.0

    def step(self, response: str):
        time.sleep(self.extra_s)
        return self.env.step(response)


TIMING = ("timing/", "perf/", "agent/env_s_mean", "agent/ran_elsewhere", "weights/", "recovery/")


def run_mode(args, dispatch: str, groups_in_flight: int) -> list[dict]:
    from raygraph.config import load_config
    from raygraph.run.trainer import run

    env = f"{ROOT / 'benchmarks' / 'agent_dispatch.py'}:LongTailOnRanks"
    name = f"{dispatch}-{groups_in_flight}"
    cfg = load_config(str(ROOT / "configs" / "demo_multiturn.yaml"), [
        f"trainer.output_dir={args.out}", f"run_name={name}", f"trainer.total_steps={args.steps}",
        "trainer.val_every=0", "trainer.save_every=0", "trainer.warm_start=null", "logging.mlflow=false",
        "trainer.resume=never", f"data.prompts_per_step={args.prompts}", f"rollout.n={args.n}",
        f"actor.mini_batch_size={args.prompts * args.n}", f"actor.micro_batch_size={args.prompts * args.n}",
        "rollout.engine=vllm", f"rollout.agent.env={env}", f"rollout.agent.max_turns={args.turns}",
        "rollout.agent.max_message_tokens=16", f"rollout.agent.env_workers={args.env_workers}",
        f"rollout.agent.env_args={{turns: {args.turns}, median_ms: {args.latency_median_ms}, "
        f"sigma: {args.latency_sigma}, rank1_extra_ms: {args.rank1_extra_ms}}}", f"rollout.agent.dispatch={dispatch}",
        f"rollout.agent.groups_in_flight={groups_in_flight}", "placement.mode=disaggregated",
        "placement.train_workers=1", "placement.rollout_workers=2", "reward.kind=env", *args.overrides])
    summary = run(cfg)
    return [json.loads(line) for line in (summary.run_dir / "metrics.jsonl").read_text().splitlines()]


def summarize(lines: list[dict], reference: list[dict]) -> dict:
    later = lines[1:] or lines

    def same(m):
        return {k: v for k, v in m.items() if not k.startswith(TIMING)}

    def rollout_s(m):   # pipelined (max_staleness=1): the step's take_or_generate plus the next step's prefetch
        return sum(m.get(f"timing/rollout.{method}_s", 0.0) for method in ("generate", "take_or_generate",
                                                                            "prefetch_next"))

    return {"generate_s": round(statistics.mean(rollout_s(m) for m in later), 3),
            "step_s": round(statistics.mean(m["timing/step_s"] for m in later), 3),
            "ran_elsewhere": round(statistics.mean(m.get("agent/ran_elsewhere", 0.0) for m in later), 3),
            "same_metrics": [same(m) for m in lines] == [same(m) for m in reference]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--n", type=int, default=4)
    parser.add_argument("--turns", type=int, default=3)
    parser.add_argument("--latency-median-ms", type=float, default=20.0)
    parser.add_argument("--latency-sigma", type=float, default=1.5)
    parser.add_argument("--groups-in-flight", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--env-workers", type=int, default=16, help="threads per rank for environment steps")
    parser.add_argument("--rank1-extra-ms", type=float, default=0.0, help="added to every step on rollout rank 1")
    parser.add_argument("--out", default="/tmp/agent_dispatch")
    parser.add_argument("overrides", nargs="*", help="more config overrides, e.g. placement.max_staleness=1")
    args = parser.parse_args()
    even = run_mode(args, "even", 1)
    result = {"config": vars(args), "even": summarize(even, even)}
    for k in args.groups_in_flight:
        result[f"least_loaded_{k}"] = summarize(run_mode(args, "least_loaded", k), even)
    for key, value in result.items():
        if key.startswith("least_loaded"):
            value["generate_speedup"] = round(result["even"]["generate_s"] / value["generate_s"], 2)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
