"""Does a vLLM engine beside the training slow the update? Prints JSON, one line per run.

    .venv/bin/python benchmarks/update_beside_engine.py [--model runs/models/smollm2-135m-instruct] [--rounds 2]
        [--engine-core auto|in_process|own_process]

Each run is a fresh process doing the same update-like work on the same rows (forward, backward
and an AdamW step on 8 x 160 tokens, fp32, `--threads` torch threads; 4 iterations, the first
one a warm-up): `none` (no vLLM), `engine` (a `VLLMRolloutWorker` on the same model started and
idle) and `engine_gen` (the engine generates 32 x 40-token prompts before each iteration, as a
colocated step does before its update). `engine_cpu_s` is what the engine's processes burn during
each timed iteration. Modes alternate over `--rounds`.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

MODES = ("none", "engine", "engine_gen")


def _one(model: str, mode: str, threads: int, engine_core: str) -> dict:
    import psutil
    import torch
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(threads)
    worker = None
    if mode != "none":
        from raygraph.workers.rollout_vllm import VLLMRolloutWorker

        worker = VLLMRolloutWorker(model_path=model, seed=0, n=1, max_new_tokens=8, max_model_len=256,
                                   engine_core=engine_core)
    policy = AutoModelForCausalLM.from_pretrained(model, torch_dtype=torch.float32)
    optim = torch.optim.AdamW(policy.parameters(), lr=1e-6)
    rows = torch.randint(100, 1000, (8, 160), generator=torch.Generator().manual_seed(0))
    engine_procs = psutil.Process().children(recursive=True)
    times, engine_cpu = [], []
    for i in range(4):
        if mode == "engine_gen":
            from raygraph.batch import PROMPT_IDS, PROMPT_MASK, Batch

            ids = torch.randint(100, 1000, (32, 40), generator=torch.Generator().manual_seed(i))
            worker.generate(Batch({PROMPT_IDS: ids, PROMPT_MASK: torch.ones_like(ids)}))
        cpu0 = sum(sum(p.cpu_times()[:2]) for p in engine_procs)
        start = time.perf_counter()
        policy(input_ids=rows, labels=rows).loss.backward()
        optim.step()
        optim.zero_grad()
        times.append(time.perf_counter() - start)
        engine_cpu.append(sum(sum(p.cpu_times()[:2]) for p in engine_procs) - cpu0)   # 0 in-process: no child
    if worker is not None:
        worker.close()
    return {"mode": mode, "update_s_median": statistics.median(times[1:]), "update_s": times[1:],
            "engine_cpu_s": engine_cpu[1:], "threads": threads, "engine_core": engine_core}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="runs/models/smollm2-135m-instruct")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--engine-core", default="auto", choices=("auto", "in_process", "own_process"),
                        help="rollout.vllm_engine_core of the engine (auto: in the process on the CPU build)")
    parser.add_argument("--mode", choices=MODES, help=argparse.SUPPRESS)   # one run, in this process
    args = parser.parse_args()
    if args.mode is not None:
        print(json.dumps(_one(args.model, args.mode, args.threads, args.engine_core)), flush=True)
        return
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads), "VLLM_CPU_KVCACHE_SPACE": "1"}
    for _ in range(args.rounds):
        for mode in MODES:
            out = subprocess.run([sys.executable, __file__, "--model", args.model, "--threads", str(args.threads),
                                  "--engine-core", args.engine_core, "--mode", mode],
                                 capture_output=True, text=True, env=env, check=True)
            print(next(line for line in out.stdout.splitlines() if line.startswith("{")), flush=True)


if __name__ == "__main__":
    main()
