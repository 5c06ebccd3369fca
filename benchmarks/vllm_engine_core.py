"""The vLLM engine core in the rollout worker's process or in its own (`rollout.vllm_engine_core`):
engine start, full-weight reload and generation, each mode in a fresh process.

For each mode: the wall and CPU seconds of building `VLLMRolloutWorker` (CPU seconds of this
process and its children, the engine core process included once it has exited), the median of
`--reloads` full-weight `load_weights` calls (the model's own tensors in `--bucket-mb` buckets, the
way a policy's sync hands them over) with GB/s, and one `generate` of `--prompts` x `--n` samples.

    HF_HUB_OFFLINE=1 .venv/bin/python benchmarks/vllm_engine_core.py \\
        [--model runs/models/smollm2-135m-instruct] [--modes in_process,own_process] [--reloads 3]

Without `--model` a random "small" tiny model is built. Prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def _cpu_s() -> float:
    own, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime


def _buckets(model_path: str, bucket_mb: int) -> list[list]:
    from safetensors.torch import load_file

    tensors = {}
    for f in sorted(Path(model_path).glob("*.safetensors")):
        tensors.update(load_file(str(f)))
    out, current, size = [], [], 0
    for name, t in tensors.items():
        current.append((name, t.float().contiguous()))
        size += t.numel() * 4
        if size >= bucket_mb << 20:
            out.append(current)
            current, size = [], 0
    return out + ([current] if current else [])


def measure(mode: str, model_path: str, reloads: int, bucket_mb: int, prompts: int, n: int, tokens: int) -> dict:
    """One mode, in this process."""
    import torch

    from raygraph.batch import PROMPT_IDS, PROMPT_MASK, UID, Batch
    from raygraph.workers.rollout_vllm import VLLMRolloutWorker

    torch.set_num_threads(2)
    start, cpu = time.perf_counter(), _cpu_s()
    worker = VLLMRolloutWorker(model_path=model_path, max_new_tokens=tokens, n=n, max_model_len=256,
                               engine_core=mode)
    built_s = time.perf_counter() - start
    buckets = _buckets(model_path, bucket_mb)
    nbytes = sum(t.numel() * t.element_size() for b in buckets for _, t in b)
    times = []
    for version in range(1, reloads + 1):
        t = time.perf_counter()
        worker.load_weights(buckets, version)
        times.append(time.perf_counter() - t)
    ids = torch.randint(10, 60, (prompts, 32))
    batch = Batch({PROMPT_IDS: ids, PROMPT_MASK: torch.ones_like(ids)}, {UID: [f"p{i}" for i in range(prompts)]})
    t = time.perf_counter()
    worker.generate(batch)
    generate_s = time.perf_counter() - t
    worker.close()
    reload_s = statistics.median(times)
    return {"mode": mode, "build_s": round(built_s, 2), "reload_s": round(reload_s, 3),
            "reload_gb_s": round(nbytes / reload_s / 1e9, 2), "weights_mb": round(nbytes / 2**20),
            "generate_s": round(generate_s, 2), "cpu_s_total": round(_cpu_s() - cpu, 1)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="HF model directory (default: a random tiny 'small')")
    parser.add_argument("--modes", default="in_process,own_process")
    parser.add_argument("--reloads", type=int, default=3)
    parser.add_argument("--bucket-mb", type=int, default=64)
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--n", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--one", default=None, help=argparse.SUPPRESS)   # run one mode here (the child)
    args = parser.parse_args()
    if args.one:
        print("RESULT " + json.dumps(measure(args.one, args.model, args.reloads, args.bucket_mb, args.prompts,
                                             args.n, args.tokens)), flush=True)
        return
    model = args.model
    if model is None:
        from raygraph.models.tiny import build_tiny_lm

        model = str(build_tiny_lm(tempfile.mkdtemp(prefix="vllm-core-"), size="small", seed=0))
    results = []
    for mode in args.modes.split(","):
        cmd = [sys.executable, __file__, "--one", mode, "--model", model, "--reloads", str(args.reloads),
               "--bucket-mb", str(args.bucket_mb), "--prompts", str(args.prompts), "--n", str(args.n),
               "--tokens", str(args.tokens)]
        out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
        results.append(json.loads(next(line[7:] for line in out.splitlines() if line.startswith("RESULT "))))
    print(json.dumps({"model": model, "results": results}, indent=1))


if __name__ == "__main__":
    main()
