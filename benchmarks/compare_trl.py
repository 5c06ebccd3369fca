"""raygraph GRPO vs TRL `GRPOTrainer` on identical work: ratio of median step times.

    HF_HUB_OFFLINE=1 .venv/bin/python benchmarks/compare_trl.py [--sizes 25m,tiny] [--rounds 2] \\
        [--steps 8] [--warmup 2] [--trl-threads 1] [--executors interpreted] [--setups 1x1,2x1] \
        [--dtype float32] [--model runs/models/smollm2-135m-instruct]

Needs the `bench` extra (`pip install -e '.[bench]'`, i.e. TRL). Both sides get:

* the same random-init Qwen2 model and character tokenizer, built locally with
  `raygraph.models.tiny.build_tiny_lm` (size "25m": 18.9M parameters; "tiny": 80k), or with
  `--model DIR` a real Hugging Face model directory as well (e.g. SmolLM2-135M-Instruct from
  `raygraph model fetch-smollm2`, reported under "model"), computing
  in float32 (`--dtype bfloat16`: TRL's bf16 autocast, which `GRPOConfig` turns on by default,
  against raygraph's `model.dtype=bfloat16`);
* the same prompts (the toy task's training parquet, chat template applied), 8 prompts x 8
  samples per step, at most 16 new tokens, temperature 1, the toy exact-match rule reward;
* GRPO advantages (group mean and std), a token-mean clipped policy loss, a k3 KL loss term
  with coefficient 0.04 against a frozen reference model, AdamW at a constant lr of 1e-6, one
  optimizer step per batch (TRL: `steps_per_generation=1`, `num_iterations=1`; raygraph: the
  whole batch is one mini-batch and one micro-batch), no gradient checkpointing (TRL's
  `GRPOConfig` turns it on by default; raygraph's `model.gradient_checkpointing` is off).

raygraph runs as shipped (`benchmarks/step_time.py`: `raygraph train`, colocated, old log-probs
per `actor.old_logprobs=auto`, i.e. the update's own since it is one optimizer step), once per
executor in `--executors` and placement in `--setups`: `1x1` one rank with one thread, `1x2` one
rank with two threads (`placement.cpus_per_worker=2`), `2x1` two data-parallel ranks with one
thread each (FSDP2 over gloo, a rollout engine beside each). TRL runs in one process on the CPU
(`use_cpu=True`) with `--trl-threads` torch threads (0: torch's default, all cores). Runs alternate (raygraph, TRL, then the reverse order) in fresh
subprocesses; a step is timed from
`on_step_begin` to `on_step_end` (TRL) or by the trainer's `timing/step_s` (raygraph), skipping
`--warmup` steps. The JSON has each side's per-stage seconds: raygraph's `timing/*`, and for TRL
the time inside its generation, reward, reference log-prob and loss methods (`policy_logprobs`
is the forward inside `compute_loss`; the rest of a TRL step is the backward pass, the optimizer
step and bookkeeping).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

SIZES = ("25m", "tiny")
STEP_TIME = Path(__file__).with_name("step_time.py")
TRAIN_FILE = "runs/data/demo/train.parquet"   # written by `raygraph train configs/demo.yaml` (ensure_assets)
LR = 1e-6


SETUPS = {
    "1x1": ["placement.train_workers=1", "placement.rollout_workers=1", "placement.cpus_per_worker=1"],
    "1x2": ["placement.train_workers=1", "placement.rollout_workers=1", "placement.cpus_per_worker=2"],
    "2x1": ["placement.train_workers=2", "placement.rollout_workers=2", "placement.cpus_per_worker=1"],
}


ENGINE = "hf"   # raygraph's rollout engine here (--engine): TRL generates with transformers too


def raygraph_overrides(model_path: str, size: str, dtype: str) -> list[str]:
    # a real model's chat template adds a system prompt: the toy prompts are ~40 BPE tokens then
    model = ["data.max_prompt_length=128"] if size == "model" else []   # tiny sizes: built by build_tiny_lm
    engine = os.environ.get("RAYGRAPH_BENCH_ENGINE", ENGINE)
    return [f"model.path={model_path}", "model.tiny=null", *model, f"model.dtype={dtype}", f"rollout.engine={engine}",
            "data.prompts_per_step=8", "rollout.n=8", "rollout.max_new_tokens=16", "rollout.micro_batch_size=64",
            "actor.kl_loss_coef=0.04", "actor.kl_loss_kind=k3", "actor.mini_batch_size=64",
            "actor.micro_batch_size=64", f"actor.optim.lr={LR}", "actor.optim.warmup_steps=0",
            "actor.old_logprobs=auto",
            "trainer.warm_start=null", "algorithm.advantage=grpo", "actor.loss_agg=token-mean"]


def run_raygraph(model_path: str, size: str, steps: int, warmup: int, executor: str, setup: str,
                 dtype: str) -> dict:
    with tempfile.TemporaryDirectory(prefix="raygraph-cmp-") as tmp:
        # RAY_CGRAPH_get_timeout: Ray's compiled graphs give up on a step after 10 s by default,
        # which a 25M-parameter step on a loaded 2-core machine exceeds (see docs/benchmarks.md).
        env = {**os.environ, "TMPDIR": tmp, "RAY_TMPDIR": os.environ.get("RAY_TMPDIR", "/tmp"),
               "RAY_CGRAPH_get_timeout": os.environ.get("RAY_CGRAPH_get_timeout", "3600")}
        proc = subprocess.run([sys.executable, str(STEP_TIME), "configs/demo.yaml",
                               *raygraph_overrides(model_path, size, dtype), *SETUPS[setup],
                               f"trainer.executor={executor}",
                               "--steps", str(steps),
                               "--warmup", str(warmup)], capture_output=True, text=True, env=env)
        if proc.returncode:
            raise RuntimeError(f"step_time.py failed:\n{proc.stderr[-3000:]}")
        result = json.loads(proc.stdout[proc.stdout.rfind("\n{") + 1:])
    return {"step_s": result["step_s"], "stages_mean_s": result["stages_mean_s"],
            "completion_tokens_mean": result["response_length_mean"], "reward_mean": result["reward_mean"]}


# ---------------------------------------------------------------------------------------------- TRL side


def _toy_reward(prompts, completions, reward_model, data_source, **_):
    """The toy task's rule reward (raygraph.rewards), on TRL's conversational completions."""
    from raygraph.rewards import score_for_source

    return [score_for_source(src)(c[0]["content"], rm["ground_truth"], None).score
            for c, rm, src in zip(completions, reward_model, data_source)]


def trl_worker(model_path: str, steps: int, warmup: int, threads: int, dtype: str) -> dict:
    """One TRL GRPOTrainer run in this process; returns step times and where they went."""
    import torch
    from datasets import Dataset
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    if threads:
        torch.set_num_threads(threads)
    stages: dict[str, float] = {}

    def timed(name, fn):
        def wrapper(*args, **kwargs):
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                stages[name] = stages.get(name, 0.0) + time.perf_counter() - start
        return wrapper

    class Timed(GRPOTrainer):
        """GRPOTrainer with stopwatches on its generation, reward, log-prob and loss methods."""

        def _generate(self, prompts):
            return timed("generate", super()._generate)(prompts)

        def _calculate_rewards(self, *args, **kwargs):
            return timed("rewards", super()._calculate_rewards)(*args, **kwargs)

        def _get_per_token_logps_and_entropies(self, model, *args, **kwargs):
            name = "ref_logprobs" if model is self.ref_model else "policy_logprobs"
            return timed(name, super()._get_per_token_logps_and_entropies)(model, *args, **kwargs)

        def compute_loss(self, *args, **kwargs):
            return timed("compute_loss (policy forward + loss)", super().compute_loss)(*args, **kwargs)

    class StepClock(TrainerCallback):
        def __init__(self):
            self.steps: list[dict] = []

        def on_step_begin(self, args, state, control, **kw):
            stages.clear()
            self.start = time.perf_counter()

        def on_step_end(self, args, state, control, **kw):
            self.steps.append({"step_s": time.perf_counter() - self.start, **stages})

    rows = Dataset.from_parquet(TRAIN_FILE).to_list()
    dataset = Dataset.from_list([{"prompt": r["prompt"], "reward_model": r["reward_model"],
                                  "data_source": r["data_source"]} for r in rows])
    with tempfile.TemporaryDirectory(prefix="trl-cmp-") as out:
        config = GRPOConfig(
            output_dir=out, use_cpu=True, seed=0, report_to="none", save_strategy="no", logging_steps=1,
            max_steps=warmup + steps, per_device_train_batch_size=64, gradient_accumulation_steps=1,
            num_generations=8, steps_per_generation=1, num_iterations=1, max_completion_length=16,
            temperature=1.0, beta=0.04, learning_rate=LR, lr_scheduler_type="constant", warmup_steps=0,
            max_grad_norm=1.0, loss_type="dapo", scale_rewards="group", dataloader_num_workers=0,
            disable_tqdm=True,
            # identical work: GRPOConfig defaults to bf16=True and gradient_checkpointing=True;
            # raygraph computes in model.dtype and checkpoints only with model.gradient_checkpointing
            bf16=dtype == "bfloat16", gradient_checkpointing=False)
        clock = StepClock()
        trainer = Timed(model=model_path, reward_funcs=_toy_reward, args=config, train_dataset=dataset,
                        callbacks=[clock])
        trainer.train()
        logs = [h for h in trainer.state.log_history if "completions/mean_length" in h]
    timed_steps = clock.steps[warmup:]
    keys = sorted({k for s in timed_steps for k in s if k != "step_s"})
    stage_means = {k: statistics.fmean(s.get(k, 0.0) for s in timed_steps) for k in keys}
    step_mean = statistics.fmean(s["step_s"] for s in timed_steps)
    stage_means["rest (backward, optimizer, bookkeeping)"] = step_mean - sum(
        v for k, v in stage_means.items() if k in ("generate", "rewards", "ref_logprobs", "compute_loss "
                                                   "(policy forward + loss)"))
    return {"step_s": [s["step_s"] for s in timed_steps], "stages_mean_s": stage_means,
            "threads": torch.get_num_threads(),
            "completion_tokens_mean": statistics.fmean(h["completions/mean_length"] for h in logs[warmup:]),
            "reward_mean": statistics.fmean(h["reward"] for h in logs[warmup:])}


def run_trl(model_path: str, steps: int, warmup: int, threads: int, dtype: str) -> dict:
    args = json.dumps({"model_path": model_path, "steps": steps, "warmup": warmup, "threads": threads,
                       "dtype": dtype})
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    proc = subprocess.run([sys.executable, __file__, "--trl-worker", args], capture_output=True, text=True, env=env)
    if proc.returncode:
        raise RuntimeError(f"TRL run failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


# ---------------------------------------------------------------------------------------------- driver


def compare(size: str, model_path: str, rounds: int, steps: int, warmup: int, trl_threads: int,
            executors: list[str], setups: list[str], dtype: str) -> dict:
    sides = [f"raygraph/{e}/{s}" for e in executors for s in setups] + ["trl"]
    runs: dict[str, list[dict]] = {side: [] for side in sides}
    loads = []
    for r in range(rounds):
        for side in sides if r % 2 == 0 else reversed(sides):
            loads.append((side, round(os.getloadavg()[0], 2)))
            if side == "trl":
                runs[side].append(run_trl(model_path, steps, warmup, trl_threads, dtype))
            else:
                _, executor, setup = side.split("/")
                runs[side].append(run_raygraph(model_path, size, steps, warmup, executor, setup, dtype))
            print(f"[compare_trl] {size} {side}: median {statistics.median(runs[side][-1]['step_s']):.3f}s",
                  file=sys.stderr, flush=True)
    medians = {side: statistics.median(t for run in rs for t in run["step_s"]) for side, rs in runs.items()}
    out: dict = {f"{side}_step_s_median": round(m, 4) for side, m in medians.items()}
    for side in sides[:-1]:
        out[f"ratio_{side}_over_trl"] = round(medians[side] / medians["trl"], 3)
        out[f"ratio_per_round_{side}"] = [round(statistics.median(g["step_s"]) / statistics.median(t["step_s"]), 3)
                                          for g, t in zip(runs[side], runs["trl"])]
        out[f"{side}_stages_mean_s"] = runs[side][-1]["stages_mean_s"]
    out.update({
        "trl_stages_mean_s": runs["trl"][-1]["stages_mean_s"], "trl_threads": runs["trl"][-1]["threads"],
        "completion_tokens_mean": {s: round(statistics.fmean(r["completion_tokens_mean"] for r in rs), 2)
                                   for s, rs in runs.items()},
        "load_avg_1min_before_each_run": loads, "runs": runs,
    })
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", default=",".join(SIZES))
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--trl-threads", type=int, default=1,
                        help="torch threads for TRL (default 1, as raygraph's actors); 0 = torch's default")
    parser.add_argument("--executors", default="interpreted", help="raygraph trainer.executor values")
    parser.add_argument("--setups", default="1x1,2x1",
                        help=f"raygraph placements: {', '.join(SETUPS)} (ranks x threads per rank)")
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"),
                        help="compute dtype of both sides (TRL: bf16 autocast; raygraph: model.dtype)")
    parser.add_argument("--engine", default=ENGINE, choices=("hf", "vllm", "auto"),
                        help="raygraph's rollout.engine (default hf, as in docs/benchmarks.md)")
    parser.add_argument("--model", help="also compare on this Hugging Face model directory (reported as 'model')")
    parser.add_argument("--trl-worker", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.trl_worker:
        print(json.dumps(trl_worker(**json.loads(args.trl_worker))))
        return
    os.environ["HF_HUB_OFFLINE"] = "1"
    os.environ["RAYGRAPH_BENCH_ENGINE"] = args.engine   # read by raygraph_overrides
    if not Path(TRAIN_FILE).is_file():
        from raygraph.config import load_config
        from raygraph.run.setup import ensure_assets

        ensure_assets(load_config("configs/demo.yaml"))
    from raygraph.models.tiny import build_tiny_lm

    unknown = set(args.setups.split(",")) - set(SETUPS)
    if unknown:
        raise SystemExit(f"unknown --setups {sorted(unknown)}; choose from {', '.join(SETUPS)}")
    result = {"date": time.strftime("%Y-%m-%d %H:%M %Z"), "machine": f"{os.cpu_count()} CPUs",
              "dtype": args.dtype,
              "steps": args.steps, "warmup": args.warmup, "rounds": args.rounds}
    with tempfile.TemporaryDirectory(prefix="cmp-models-") as tmp:
        for size in [s for s in args.sizes.split(",") if s]:   # --sizes "" with --model: the real model only
            path = str(build_tiny_lm(Path(tmp) / size, size=size, seed=0))
            result[size] = compare(size, path, args.rounds, args.steps, args.warmup, args.trl_threads,
                                   args.executors.split(","), args.setups.split(","), args.dtype)
        if args.model:
            result["model"] = compare("model", str(Path(args.model).resolve()), args.rounds, args.steps,
                                      args.warmup, args.trl_threads, args.executors.split(","),
                                      args.setups.split(","), args.dtype)
            result["model_path"] = args.model
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
