"""Rollout tokens/s of the vLLM worker inside training steps, against bare `vllm.LLM.generate`.

    python benchmarks/rollout_in_training.py [--config configs/demo.yaml] [--size 25m] [--steps 6]
        [--new-tokens N] [--hf] [--out /tmp/raygraph-bench/rollout-in-training] [key=value ...]

1. Trains with `raygraph.run.trainer.run` on the config with `rollout.engine=vllm`,
   `model.tiny=<size>` (built under `--out`, apart from the demo's model), no warm start, no
   MLflow, `--steps` steps, plus any `key=value` overrides. From its metrics.jsonl, per step:
   `rollout/tokens / timing/rollout.generate_s`. `timing/rollout.generate_s` is the seconds the
   rollout actor spent in `VLLMRolloutWorker.generate` (Batch -> requests, one seeded request
   per sample, the engine, padding, response text), measured on the actor.
2. Replays the trainer's data feed (same config, same seed: the same prompts in the same order)
   and generates each step's prompts with a bare `vllm.LLM` on the same model files, dtype,
   `enforce_eager`, seed and memory setting, with the same `SamplingParams` (n, temperature,
   top-p, top-k, max_tokens, stop ids + eos, one log-prob per token, no detokenisation), one
   request per prompt with `n`: vLLM's own best case.
3. With `--hf`, trains once more with `rollout.engine=hf` (same settings otherwise) for the
   engines' in-training figures side by side.
4. Prints JSON: per-step figures, medians over steps 2.. (step 1 warms both up), and
   `ratio` = in-training median / bare median; the target is >= 0.9.

The trained weights change every step, so the in-training responses are not those of the bare
run; rows may stop early on eos, so both count tokens. Logs go to stderr, the JSON to stdout.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def _config(args, engine: str = "vllm"):
    from raygraph.config import load_config

    out = Path(args.out)
    overrides = {
        "rollout.engine": engine, "model.tiny": args.size,   # built at <out>/runs/models/tiny-<size>
        "data.train_files": f"[{out / 'data' / 'train.parquet'}]", "data.val_files": f"[{out / 'data' / 'val.parquet'}]",
        "trainer.warm_start": "null", "logging.mlflow": "false", "trainer.output_dir": out / "runs",
        "trainer.total_steps": args.steps, "trainer.val_every": 0, "trainer.save_every": 0,
        "data.val_prompts": 8, "run_name": f"{engine}-{args.size}",
    }
    if args.new_tokens:
        overrides["rollout.max_new_tokens"] = args.new_tokens
    items = [f"{k}={v}" for k, v in overrides.items()] + list(args.overrides)
    return load_config(args.config, items), items


def _in_training(cfg) -> tuple[list[dict], str]:
    import ray

    from raygraph.run.trainer import run

    summary = run(cfg)
    ray.shutdown()  # the bare engine then runs without Ray's daemons beside it
    rows = [json.loads(line) for line in (summary.run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = []
    for row in rows:
        seconds = row.get("timing/rollout.generate_s")
        if seconds is None:
            raise KeyError(f"metrics.jsonl has no timing/rollout.generate_s; timing keys: "
                           f"{sorted(k for k in row if k.startswith('timing/'))}")
        steps.append({"step": row["step"], "tokens": row["rollout/tokens"], "seconds": round(seconds, 4),
                      "tokens_per_s": round(row["rollout/tokens"] / seconds, 1),
                      "step_s": round(row["timing/step_s"], 3)})
    return steps, str(summary.run_dir)


def _bare(cfg, steps: int) -> tuple[list[dict], float]:
    from transformers import GenerationConfig
    from vllm import LLM, SamplingParams

    from raygraph.batch import PROMPT_IDS, PROMPT_MASK
    from raygraph.config.workflow_ref import load_workflow
    from raygraph.run.feed import StepData
    from raygraph.workers import vllm_compat

    data = StepData.load(cfg, load_workflow(cfg.workflow).data_format)
    batches = [data.next_prompts(step=s, kl_coef=0.0) for s in range(1, steps + 1)]
    r, path = cfg.rollout, str(cfg.model.path)
    start = time.perf_counter()
    llm = LLM(model=path, dtype=cfg.model.dtype, seed=cfg.trainer.seed, enforce_eager=r.enforce_eager,
              max_model_len=r.max_model_len, generation_config="vllm",
              gpu_memory_utilization=r.gpu_memory_utilization or (0.15 if vllm_compat.on_cpu() else 0.9))
    engine_start_s = time.perf_counter() - start
    # vLLM stops on the tokenizer's eos itself; the worker also stops on the generation config's
    eos = GenerationConfig.from_pretrained(path).eos_token_id if (Path(path) / "generation_config.json").is_file() else None
    eos = [] if eos is None else [eos] if isinstance(eos, int) else list(eos)
    params = SamplingParams(n=r.n, temperature=r.temperature, top_p=r.top_p, top_k=r.top_k, max_tokens=r.max_new_tokens,
                            stop_token_ids=sorted({*eos, *r.stop_token_ids}), logprobs=0, detokenize=False)
    figures = []
    for step, batch in enumerate(batches, 1):
        ids, mask = batch[PROMPT_IDS], batch[PROMPT_MASK].bool()
        requests = [{"prompt_token_ids": ids[i][mask[i]].tolist()} for i in range(len(batch))]
        t0 = time.perf_counter()
        results = llm.generate(requests, params, use_tqdm=False)
        seconds = time.perf_counter() - t0
        tokens = sum(len(c.token_ids) for res in results for c in res.outputs)
        figures.append({"step": step, "tokens": tokens, "seconds": round(seconds, 4),
                        "tokens_per_s": round(tokens / seconds, 1)})
    vllm_compat.shutdown(llm)
    return figures, engine_start_s


def _median(figures: list[dict]) -> float:
    later = figures[1:] or figures
    return round(statistics.median(f["tokens_per_s"] for f in later), 1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default=str(REPO / "configs" / "demo.yaml"))
    parser.add_argument("--size", default="25m", help="model.tiny preset of the trained model")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--new-tokens", type=int, help="rollout.max_new_tokens (default: the config's)")
    parser.add_argument("--hf", action="store_true", help="also train with rollout.engine=hf")
    parser.add_argument("--out", default="/tmp/raygraph-bench/rollout-in-training")
    parser.add_argument("overrides", nargs="*", help="more key=value config overrides")
    args = parser.parse_args()
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    stdout = os.dup(1)
    os.dup2(2, 1)  # vLLM, Ray and the trainer log to stdout: all of it goes to stderr
    cfg, overrides = _config(args)
    training, run_dir = _in_training(cfg)
    bare, engine_start_s = _bare(cfg, args.steps)
    import torch
    import vllm

    result = {
        "command": " ".join([Path(sys.argv[0]).name, *sys.argv[1:]]), "config": args.config, "overrides": overrides,
        "prompts_per_step": cfg.data.prompts_per_step, "n": cfg.rollout.n, "max_new_tokens": cfg.rollout.max_new_tokens,
        "dtype": cfg.model.dtype, "enforce_eager": cfg.rollout.enforce_eager, "placement": cfg.placement.mode,
        "in_training": {"steps": training, "median_tokens_per_s": _median(training), "run_dir": run_dir},
        "bare_vllm": {"steps": bare, "median_tokens_per_s": _median(bare), "engine_start_s": round(engine_start_s, 1)},
        "vllm": vllm.__version__, "torch": torch.__version__, "cpu_cores": os.cpu_count(),
    }
    result["ratio"] = round(result["in_training"]["median_tokens_per_s"] / result["bare_vllm"]["median_tokens_per_s"], 3)
    result["target_met"] = result["ratio"] >= 0.9
    if args.hf:
        hf_steps, hf_dir = _in_training(_config(args, engine="hf")[0])
        result["hf_in_training"] = {"steps": hf_steps, "median_tokens_per_s": _median(hf_steps), "run_dir": hf_dir}
    sys.stdout.flush()
    os.dup2(stdout, 1)
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
