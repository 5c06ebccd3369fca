"""Multi-turn episodes under a long-tail environment latency: raygraph's concurrent agent loop
against a lock-step turn loop, in episodes/s and generated tokens/s.

    python benchmarks/agent_throughput.py [--episodes 64] [--turns 3] [--new-tokens 16]
        [--latency-median-ms 20] [--latency-sigma 1.0] [--env-workers 16] [--size tiny] [--repeats 2]

One `VLLMRolloutWorker(agent=...)` engine, one batch of toy prompts, one seed per episode; two ways
of running the same episodes (`agent_rollout.generate_episodes`, what the worker's `generate` runs):

* "concurrent": `AgentLoop` over `VLLMTurns`, as `generate` does: a finished turn's environment
  step goes to the loop's thread pool while vLLM keeps decoding the other episodes' turns.
* "lock_step": the same adapter, but `lock_step = True` and `poll` runs the engine until every
  submitted turn is done (what TRL-style loops do); the loop then awaits every environment step
  before the next wave, so each turn waits for the slowest episode.

Both go through `_Turns`, a pass-through that also counts engine steps ("engine_steps") and the
seconds the loop spent in them ("engine_s"; the rest is waiting for environment steps and the
loop's own work). vLLM only: the HF engine (`HFTurns`) is lock-step already, so it has nothing to compare.

The environment (`LongTailEnv`) ends an episode after `--turns` steps, answers with an observation
of a few tokens, and sleeps a lognormal latency (median `--latency-median-ms`, log-sd
`--latency-sigma`) that is a function of (seed, episode uid, turn) only: both modes do the same
work, and an episode's tokens must come out equal ("same_tokens"). The env-only lower bounds (no
thread limit, zero generation time) are max over episodes of the sum of their latencies
(concurrent) and the sum over turns of the slowest latency (lock-step). Runs alternate the modes;
"best" is the fastest of `--repeats` after a warm-up. The JSON is the last line of stdout (vLLM
logs there too).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
import zlib

import numpy as np
import psutil
import torch

from raygraph.agents.env import register_env
from raygraph.batch import RESPONSE_MASK, RESPONSES
from raygraph.data.prompts import PromptDataset
from raygraph.data.toy import write_toy_dataset
from raygraph.models.loading import load_tokenizer
from raygraph.models.tiny import build_tiny_lm
from raygraph.workers.agent_rollout import VLLMTurns, generate_episodes

MAX_MODEL_LEN = 512   # the tiny models' max_position_embeddings


def latency_s(seed: int, uid: str, turn: int, median_ms: float, sigma: float) -> float:
    """The environment's latency at `turn` of episode `uid`: lognormal, median `median_ms`."""
    rng = np.random.default_rng([seed, zlib.crc32(uid.encode()), turn])
    return median_ms / 1000 * float(np.exp(sigma * rng.standard_normal()))


class LongTailEnv:
    """`turns` steps of `latency_s` each; a short observation between them, reward 1 at the end."""

    def __init__(self, row: dict, turns: int = 3, median_ms: float = 20.0, sigma: float = 1.0, seed: int = 0) -> None:
        self.uid, self.turns, self.turn = str(row["uid"]), turns, 0
        self.median_ms, self.sigma, self.seed = median_ms, sigma, seed

    def step(self, response: str):
        self.turn += 1
        time.sleep(latency_s(self.seed, self.uid, self.turn, self.median_ms, self.sigma))
        done = self.turn >= self.turns
        return (None if done else f"ok {self.turn}"), float(done), done


class _Turns:
    """`VLLMTurns` as the loop sees it, counting engine steps and the seconds spent in them.
    `lock_step=True` generates in waves: `poll` runs the engine until every submitted turn is done."""

    def __init__(self, turns: VLLMTurns, lock_step: bool) -> None:
        self.turns, self.lock_step = turns, lock_step
        self.steps, self.engine_s = 0, 0.0

    def submit(self, key: int, prompt: list[int], max_tokens: int, seed: int | None) -> None:
        self.turns.submit(key, prompt, max_tokens, seed)

    def pending(self) -> int:
        return self.turns.pending()

    def poll(self) -> list[tuple[int, list[int], list[float]]]:
        start, out = time.perf_counter(), self.turns.poll()   # one engine step
        self.steps += 1
        while self.lock_step and self.turns.pending():
            out += self.turns.poll()
            self.steps += 1
        self.engine_s += time.perf_counter() - start
        return out


def _run(worker, lock_step: bool, rows, seeds: list[int]) -> tuple[dict, torch.Tensor, torch.Tensor]:
    turns = _Turns(VLLMTurns(worker, greedy=False, temperature=None), lock_step)
    start = time.perf_counter()
    out = generate_episodes(worker.agent, turns, rows, seeds, weight_version=0)
    seconds = time.perf_counter() - start
    generated = int(out[RESPONSE_MASK].sum())
    return ({"seconds": round(seconds, 3), "episodes_per_s": round(len(rows) / seconds, 2),
             "generated_tokens": generated, "generated_tokens_per_s": round(generated / seconds, 1),
             "engine_steps": turns.steps, "engine_s": round(turns.engine_s, 3)},
            out[RESPONSES], out[RESPONSE_MASK])


def _bounds(uids: list[str], args) -> dict:
    lat = np.array([[latency_s(args.seed, u, t, args.latency_median_ms, args.latency_sigma)
                     for t in range(1, args.turns + 1)] for u in uids])   # (episodes, turns)
    return {"latency_ms": {q: round(float(np.percentile(lat, p)) * 1000, 1)
                           for q, p in (("p50", 50), ("p90", 90), ("p99", 99), ("max", 100))},
            "latency_sum_s": round(float(lat.sum()), 3),
            "env_bound_concurrent_s": round(float(lat.sum(axis=1).max()), 3),
            "env_bound_lock_step_s": round(float(lat.max(axis=0).sum()), 3)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model")
    parser.add_argument("--size", default="tiny")
    parser.add_argument("--episodes", type=int, default=64)
    parser.add_argument("--turns", type=int, default=3)
    parser.add_argument("--new-tokens", type=int, default=16)
    parser.add_argument("--latency-median-ms", type=float, default=20.0)
    parser.add_argument("--latency-sigma", type=float, default=1.0)
    parser.add_argument("--env-workers", type=int, default=16, help="the loop's thread pool (raygraph's default)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    from raygraph.workers.rollout_vllm import VLLMRolloutWorker

    tmp = tempfile.mkdtemp()
    model = args.model or str(build_tiny_lm(tmp + "/m", size=args.size))
    train, _ = write_toy_dataset(tmp + "/data", n_train=args.episodes, n_val=1)
    rows = PromptDataset(train, load_tokenizer(model), max_prompt_length=32).to_batch(range(args.episodes))
    seeds = torch.randint(0, 2**31 - 1, (args.episodes,), generator=torch.Generator().manual_seed(args.seed)).tolist()
    register_env("bench_long_tail", LongTailEnv)
    env_args = {"turns": args.turns, "median_ms": args.latency_median_ms, "sigma": args.latency_sigma,
                "seed": args.seed}
    budgets = {"max_turns": args.turns, "max_new_tokens": args.new_tokens, "max_total_tokens": MAX_MODEL_LEN,
               "max_message_tokens": 16}
    worker = VLLMRolloutWorker(model_path=model, seed=args.seed, n=1, max_new_tokens=args.new_tokens,
                               max_model_len=MAX_MODEL_LEN, enforce_eager=True,
                               agent={"budgets": budgets, "env": "bench_long_tail", "env_args": env_args,
                                      "env_workers": args.env_workers})
    _run(worker, False, rows.select(range(min(8, args.episodes))), seeds[:8])   # warm-up
    runs: dict[str, list[dict]] = {"concurrent": [], "lock_step": []}
    tokens: dict[str, list[tuple[torch.Tensor, torch.Tensor]]] = {"concurrent": [], "lock_step": []}
    for r in range(args.repeats):
        for mode in ("concurrent", "lock_step") if r % 2 == 0 else ("lock_step", "concurrent"):
            figures, responses, mask = _run(worker, mode == "lock_step", rows, seeds)
            runs[mode].append(figures)
            tokens[mode].append((responses, mask))
    worker.close()
    first = tokens["concurrent"][0]
    same = all(torch.equal(first[0], resp) and torch.equal(first[1], mask)
               for mode in tokens for resp, mask in tokens[mode])
    best = {mode: min(runs[mode], key=lambda f: f["seconds"]) for mode in runs}
    result = {"model": f"build_tiny_lm size={args.size}" if not args.model else model, "engine": "vllm",
              "episodes": args.episodes, "turns": args.turns, "new_tokens_per_turn": args.new_tokens,
              "env_workers": args.env_workers,
              "latency": {"distribution": "lognormal", "median_ms": args.latency_median_ms,
                          "sigma": args.latency_sigma, "seed": args.seed, **_bounds(rows["uid"], args)},
              "cpus": psutil.cpu_count(), "torch_threads": torch.get_num_threads(),
              "runs": runs, "best": best, "same_tokens": same,
              "speedup_episodes_per_s": round(best["concurrent"]["episodes_per_s"] / best["lock_step"]["episodes_per_s"], 2)}
    print(json.dumps(result), file=sys.stdout)


if __name__ == "__main__":
    main()
