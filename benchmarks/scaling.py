"""Scaling checks: weight sync vs model size, step time vs batch size, and the placement table.

    .venv/bin/python benchmarks/scaling.py sync [--sizes tiny,100m,500m] [--repeats 3]
    .venv/bin/python benchmarks/scaling.py batch [--prompts 8,16,32,64,128] [--rounds 2] [--executor interpreted]
    .venv/bin/python benchmarks/scaling.py placement [--rounds 2] [--steps 20] [--warmup 3]

sync: for each random-init model size, the verified weight sync of `raygraph.cluster` (policy ->
  one rollout over the gloo collective group, disaggregated; and in-process, colocated) against
  a raw `ray.util.collective` gloo broadcast of the same bytes; `vs_raw` = raw seconds / sync
  seconds (1.0 = as fast as the bare broadcast). The measuring code is `benchmarks/weight_sync.py`
  (imported). `transport_paired`: one policy/rollout actor pair times, interleaved, a raw
  broadcast over the sync's own group and the sync with and without checksums (CPU seconds of
  both processes too). Also, without Ray, the single operations a disaggregated sync is made of,
  timed on the same model in this process (1 thread): `weight_buckets` (no copy when unsharded),
  `pack_bucket` into a reused buffer (copy alone, copy + XXH3-64 digest) and into a fresh one
  (the old path), the digest alone, the receiver's `unpack_bucket` + digest, and `load_weights`
  (copy into the rollout model).
batch: `benchmarks/step_time.py` on configs/demo.yaml with data.prompts_per_step = each value
  (rollout.n = 8, so 8x the samples; the demo's 64-sample mini-batch is kept, so the work per
  sample is constant), `--rounds` times in alternating order; reports the median over runs of
  each run's median step time, and milliseconds per sample.
placement: `benchmarks/step_time.py` on configs/demo.yaml for colocated / disaggregated x
  compiled / interpreted, alternating, `--rounds` times each.

Each prints one JSON object; load averages are recorded because the machine is shared.
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

HERE = Path(__file__).parent


def _load() -> float:
    return round(os.getloadavg()[0], 2)


def _median_time(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def sync_components(model_path: str, repeats: int, bucket_bytes: int) -> dict:
    """Seconds of each single operation of a disaggregated sync, in this process (1 thread)."""
    import torch

    from raygraph.cluster.weights import bucket_checksum, pack_bucket, unpack_bucket
    from raygraph.workers.policy import PolicyWorker
    from raygraph.workers.rollout_hf import HFRolloutWorker

    torch.set_num_threads(1)   # as in the actors (OMP_NUM_THREADS=1)
    policy = PolicyWorker(model_path=model_path, lr=1e-6)
    rollout = HFRolloutWorker(model_path=model_path, max_new_tokens=1)
    cpu = torch.device("cpu")
    buckets = list(policy.weight_buckets(bucket_bytes))
    packed = [pack_bucket(b, cpu) for b in buckets]
    buf = torch.empty(max(p.numel() for _, p in packed), dtype=torch.uint8)
    out = {
        "weight_buckets_s": _median_time(lambda: [None for _ in policy.weight_buckets(bucket_bytes)], repeats),
        "pack_reused_copy_s": _median_time(lambda: [pack_bucket(b, cpu, buf, checksum=False) for b in buckets],
                                           repeats),
        "pack_reused_copy_and_digest_s": _median_time(lambda: [pack_bucket(b, cpu, buf) for b in buckets],
                                                      repeats),
        "digest_one_side_s": _median_time(lambda: [bucket_checksum(t for _, t in b) for b in buckets], repeats),
        "receiver_unpack_and_digest_s": _median_time(
            lambda: [bucket_checksum(t for _, t in unpack_bucket(m, p)) for m, p in packed], repeats),
        "load_weights_copy_s": _median_time(
            lambda: rollout.load_weights((unpack_bucket(m, p) for m, p in packed), 1), repeats),
    }
    # the serial work of one verified sync (the transport overlaps sender and receiver parts)
    out["sum_s"] = sum(out[k] for k in ("weight_buckets_s", "pack_reused_copy_and_digest_s",
                                        "receiver_unpack_and_digest_s", "load_weights_copy_s"))
    out["pack_fresh_copy_and_digest_s"] = _median_time(lambda: [pack_bucket(b, cpu) for b in buckets], repeats)
    return {k: round(v, 4) for k, v in out.items()}


def run_sync(args) -> dict:
    import ray

    sys.path.insert(0, str(HERE))
    from weight_sync import raw_broadcast, roles_sync, transport_sync  # benchmarks/weight_sync.py

    from raygraph.models.tiny import build_tiny_lm

    bucket_bytes = args.bucket_mb << 20
    result: dict = {"bucket_bytes": bucket_bytes, "repeats": args.repeats, "backend": "gloo (CPU, loopback)"}
    with tempfile.TemporaryDirectory(prefix="scaling-sync-") as tmp:
        for size in args.sizes.split(","):
            path = str(build_tiny_lm(f"{tmp}/{size}", size=size, seed=0))
            entry: dict = {"load_avg_1min": _load()}
            entry["components_in_process"] = sync_components(path, args.repeats, bucket_bytes)
            ray.init(num_cpus=8, include_dashboard=False, log_to_driver=False,
                     runtime_env={"env_vars": {"OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}})
            try:
                entry["disaggregated_1rx"] = roles_sync(path, "disaggregated", 1, args.repeats, bucket_bytes)
                entry["colocated_in_process"] = roles_sync(path, "colocated", 1, args.repeats, bucket_bytes)
                nbytes = entry["disaggregated_1rx"]["bytes"]
                raw_s = raw_broadcast(nbytes, 1, args.repeats)
                entry["transport_paired"] = transport_sync(path, nbytes, args.repeats, bucket_bytes)
            finally:
                ray.shutdown()
            entry["raw_collective_1rx"] = {"sync_s": round(raw_s, 4), "gbytes_per_s": round(nbytes / raw_s / 1e9, 3)}
            entry["params"] = nbytes // 4
            entry["vs_raw"] = round(raw_s / entry["disaggregated_1rx"]["sync_s"], 3)
            result[size] = entry
            print(f"[scaling] {size}: {json.dumps(entry)}", file=sys.stderr, flush=True)
    return result


def step_time(overrides: list[str], steps: int, warmup: int) -> dict:
    """`benchmarks/step_time.py configs/demo.yaml OVERRIDES` in a subprocess; its JSON."""
    proc = subprocess.run([sys.executable, str(HERE / "step_time.py"), "configs/demo.yaml", *overrides,
                           "--steps", str(steps), "--warmup", str(warmup)], capture_output=True, text=True)
    if proc.returncode:
        raise RuntimeError(f"step_time.py {overrides} failed:\n{proc.stderr[-3000:]}")
    out = json.loads(proc.stdout[proc.stdout.rfind("\n{") + 1:])
    return {k: out[k] for k in ("step_s_median", "step_s_mean", "samples_per_step", "tokens_per_s_mean",
                                "stages_mean_s")}


def run_batch(args) -> dict:
    sizes = [int(p) for p in args.prompts.split(",")]
    runs: dict[int, list[dict]] = {p: [] for p in sizes}
    for r in range(args.rounds):
        for prompts in sizes if r % 2 == 0 else reversed(sizes):
            # the demo's mini-batch (64 samples per optimizer step) is kept: the work per sample is constant
            load = _load()
            out = step_time([f"data.prompts_per_step={prompts}", f"trainer.executor={args.executor}"],
                            args.steps, args.warmup)
            runs[prompts].append({**out, "load_avg_1min": load})
            print(f"[scaling] batch {prompts}: {out['step_s_median']:.3f}s/step", file=sys.stderr, flush=True)
    result: dict = {"config": "configs/demo.yaml", "executor": args.executor, "steps": args.steps,
                    "warmup": args.warmup, "rounds": args.rounds}
    for prompts, rs in runs.items():
        step_s = statistics.median(r["step_s_median"] for r in rs)
        samples = rs[0]["samples_per_step"]
        result[f"prompts_{prompts}"] = {"samples_per_step": samples, "step_s_median_of_runs": round(step_s, 4),
                                        "ms_per_sample": round(1000 * step_s / samples, 3),
                                        "per_run": [round(r["step_s_median"], 4) for r in rs], "runs": rs}
    return result


def run_placement(args) -> dict:
    combos = [(m, e) for m in ("colocated", "disaggregated") for e in ("compiled", "interpreted")]
    runs: dict[str, list[dict]] = {f"{m}/{e}": [] for m, e in combos}
    for r in range(args.rounds):
        for m, e in combos if r % 2 == 0 else reversed(combos):
            load = _load()
            out = step_time([f"placement.mode={m}", f"trainer.executor={e}"], args.steps, args.warmup)
            runs[f"{m}/{e}"].append({**out, "load_avg_1min": load})
            print(f"[scaling] {m}/{e}: {out['step_s_median']:.3f}s/step", file=sys.stderr, flush=True)
    return {"config": "configs/demo.yaml", "steps": args.steps, "warmup": args.warmup, "rounds": args.rounds,
            "summary": {k: {"step_s_median_of_runs": round(statistics.median(x["step_s_median"] for x in v), 4),
                            "per_run": [round(x["step_s_median"], 4) for x in v]} for k, v in runs.items()},
            "runs": runs}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="what", required=True)
    s = sub.add_parser("sync")
    s.add_argument("--sizes", default="tiny,100m,500m")
    s.add_argument("--repeats", type=int, default=3)
    s.add_argument("--bucket-mb", type=int, default=64)
    b = sub.add_parser("batch")
    b.add_argument("--prompts", default="8,16,32,64,128")
    b.add_argument("--steps", type=int, default=10)
    b.add_argument("--warmup", type=int, default=2)
    b.add_argument("--rounds", type=int, default=2)
    b.add_argument("--executor", default="interpreted", choices=("compiled", "interpreted"))
    p = sub.add_parser("placement")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3)
    args = parser.parse_args()
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    started = time.strftime("%Y-%m-%d %H:%M %Z")
    result = {"sync": run_sync, "batch": run_batch, "placement": run_placement}[args.what](args)
    result.update(date=started, machine=f"{os.cpu_count()} CPUs")
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
