"""Weight-sync time and bandwidth: the tiny model and a ~100M-parameter random model, over gloo.

For each model (saved with `raygraph.models.tiny.build_tiny_lm`, size "tiny" and "100m"; or an HF
directory given with `--model`, e.g. SmolLM2-135M-Instruct):

* disaggregated: `PolicyWorker` (1 rank) -> the rollout engine's worker (1 and 2 ranks) through the
  verified, bucketed `CollectiveTransport`: payloads through /dev/shm, headers over gloo (`--transports
  shm`, what a run on one host does), or every byte over gloo (`gloo`, as between hosts);
* colocated: the same pair fused in one actor (`InProcessTransport`);
* per engine (`--engines hf,vllm`): `HFRolloutWorker` copies into its model's parameters,
  `VLLMRolloutWorker` loads into the running engine (vLLM's layerwise reload, re-packing each
  layer); the HF engine alone also gets the raw and paired transport figures below;
* raw: a bare `ray.util.collective` gloo broadcast of the same number of bytes as one flat
  buffer between plain actors (no packing, checksums or loading): the floor for the transport;
* transport_paired_1rx: one policy/rollout actor pair (`TransportPeer`, no `build_roles`) timing,
  interleaved, a raw broadcast over the sync's own group and `CollectiveTransport` syncs with
  checksums (verified) and without (`verify=False`), with the CPU seconds of both processes.

    .venv/bin/python benchmarks/weight_sync.py [--repeats 3] [--sizes tiny,100m] [--engines hf,vllm]
    HF_HUB_OFFLINE=1 .venv/bin/python benchmarks/weight_sync.py --sizes "" --model runs/models/smollm2-135m-instruct \
        --engines vllm

Prints one JSON object (seconds are medians over the repeats; GB/s = weight bytes / seconds).
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time

import ray
import torch

from raygraph.cluster import PoolSpec, RoleSpec, build_roles
from raygraph.models.tiny import build_tiny_lm
from raygraph.workers.policy import PolicyWorker
from raygraph.workers.rollout_hf import HFRolloutWorker
from raygraph.workers.rollout_vllm import VLLMRolloutWorker

# the receiving worker per engine: its class and what it is built with besides the model path
ENGINES = {"hf": (HFRolloutWorker, {"max_new_tokens": 1}),
           "vllm": (VLLMRolloutWorker, {"max_new_tokens": 1, "max_model_len": 256, "gpu_memory_utilization": 0.05})}


class RawPeer:
    """A plain actor in a built-in `ray.util.collective` gloo group."""

    def setup(self, world: int, rank: int, group: str) -> None:
        import ray.util.collective as col

        col.init_collective_group(world, rank, backend="gloo", group_name=group)

    def broadcast(self, nbytes: int, group: str, repeats: int) -> list[float]:
        import ray.util.collective as col

        buf = torch.ones(nbytes, dtype=torch.uint8)
        times = []
        for _ in range(repeats):
            col.barrier(group_name=group)
            start = time.perf_counter()
            col.broadcast(buf, src_rank=0, group_name=group)
            times.append(time.perf_counter() - start)
        return times


def raw_broadcast(nbytes: int, receivers: int, repeats: int) -> float:
    peer = ray.remote(num_cpus=0.5)(RawPeer)
    actors = [peer.remote() for _ in range(receivers + 1)]
    group = f"raw-{nbytes}-{receivers}"
    ray.get([a.setup.remote(len(actors), r, group) for r, a in enumerate(actors)])
    times = ray.get([a.broadcast.remote(nbytes, group, repeats) for a in actors])
    for a in actors:
        ray.kill(a)
    return statistics.median(max(ts[i] for ts in times) for i in range(repeats))


class TransportPeer:
    """One end of a disaggregated sync outside `build_roles`: a worker and a `CollectiveTransport`.

    Rank 0 holds a `PolicyWorker` and sends; rank 1 holds an `HFRolloutWorker` and receives.
    The same pair also times a raw broadcast of the same bytes over the same group, so the
    three variants (raw, verified, unverified) are measured back to back under the same load.
    """

    def __init__(self, model_path: str, rank: int, group: str):
        torch.set_num_threads(1)
        self.rank, self.group = rank, group
        self.worker = (PolicyWorker(model_path=model_path, lr=1e-6) if rank == 0
                       else HFRolloutWorker(model_path=model_path, max_new_tokens=1))

    def open(self) -> tuple[str, int]:
        from raygraph.cluster import collective

        return collective.open_store(self.group, 2, 120.0)

    def join(self, addr: str, port: int) -> None:
        from raygraph.cluster import collective
        from raygraph.cluster.collective_transport import CollectiveTransport

        collective.join(self.group, self.rank, 2, addr, port, device="cpu", timeout_s=120.0,
                        labels=["policy rank 0", "rollout rank 0"])
        self.transport = CollectiveTransport(self.group, src=0)
        self.raw_buf = None

    def sync(self, verify: bool, version: int, bucket_bytes: int) -> tuple[float, float]:
        """(seconds, CPU seconds of this process) for one sync."""
        self.transport.verify = verify
        cpu = time.process_time()
        if self.rank == 0:
            out = self.transport.send(self.worker.weight_buckets(bucket_bytes), version)
        else:
            out = self.transport.receive(self.worker.load_weights)
            assert out["weights/verified"] == float(verify), out
        return out["weights/sync_s"], time.process_time() - cpu

    def raw(self, nbytes: int) -> tuple[float, float]:
        import ray.util.collective as col

        if self.raw_buf is None or self.raw_buf.numel() != nbytes:
            self.raw_buf = torch.ones(nbytes, dtype=torch.uint8)
        self.transport._group.arrive("raw")
        start, cpu = time.perf_counter(), time.process_time()
        col.broadcast(self.raw_buf, src_rank=0, group_name=self.group)
        return time.perf_counter() - start, time.process_time() - cpu


def transport_sync(model_path: str, nbytes: int, repeats: int, bucket_bytes: int) -> dict:
    """Median seconds (and CPU seconds, both processes) of raw / verified / unverified, interleaved."""
    peer = ray.remote(num_cpus=0.5)(TransportPeer)
    group = f"bench-transport-{nbytes}"
    actors = [peer.remote(model_path, r, group) for r in range(2)]
    addr, port = ray.get(actors[0].open.remote())
    ray.get([a.join.remote(addr, port) for a in actors])
    runs: dict[str, list[tuple[float, float]]] = {"raw": [], "verified": [], "unverified": []}
    version = 0
    for i in range(repeats + 1):   # the first round warms the buffers up and is dropped
        for what in ("raw", "verified", "unverified"):
            if what == "raw":
                out = ray.get([a.raw.remote(nbytes) for a in actors])
            else:
                version += 1
                out = ray.get([a.sync.remote(what == "verified", version, bucket_bytes) for a in actors])
            if i:
                runs[what].append((max(s for s, _ in out), sum(c for _, c in out)))
    for a in actors:
        ray.kill(a)
    result = {what: {"sync_s": round(statistics.median(s for s, _ in r), 4),
                     "cpu_s_both": round(statistics.median(c for _, c in r), 4)} for what, r in runs.items()}
    for what in ("verified", "unverified"):
        result[what]["vs_raw"] = round(result["raw"]["sync_s"] / result[what]["sync_s"], 3)
    return result


def roles_sync(model_path: str, mode: str, receivers: int, repeats: int, bucket_bytes: int,
               engine: str = "hf", cpus: float = 1.0, shared_memory: bool = True) -> dict:
    rollout_cls, rollout_kwargs = ENGINES[engine]
    pools = {"train": PoolSpec(bundles=receivers + (mode == "disaggregated"), cpus_per_bundle=cpus)}
    specs = {"policy": RoleSpec(PolicyWorker, {"model_path": model_path, "lr": 1e-6}, pool="train"),
             "rollout": RoleSpec(rollout_cls, {"model_path": model_path, **rollout_kwargs},
                                 world_size=receivers, pool="train")}
    if mode == "colocated":
        specs["policy"] = RoleSpec(PolicyWorker, {"model_path": model_path, "lr": 1e-6},
                                   world_size=receivers, pool="train")
    with build_roles(f"bench-sync/{engine}/{mode}/{receivers}", pools, specs, weight_sync=[("policy", "rollout")],
                     colocate=[("policy", "rollout")] if mode == "colocated" else [],
                     bucket_bytes=bucket_bytes, placement_timeout_s=120, weight_sync_timeout_s=300,
                     weight_sync_shared_memory=shared_memory) as roles:
        roles.weights.sync_now()   # warm-up
        stats, walls = [], []
        for _ in range(repeats):
            start = time.perf_counter()
            stats.append(roles.weights.sync_now())
            walls.append(time.perf_counter() - start)
    sync_s = statistics.median(s["weights/sync_s"] for s in stats)
    wall_s = statistics.median(walls)
    nbytes = stats[0]["weights/bytes"]
    return {"bytes": int(nbytes), "sync_s": round(sync_s, 4), "driver_wall_s": round(wall_s, 4),
            "gbytes_per_s": round(nbytes / sync_s / 1e9, 3),
            "verified": min(s["weights/verified"] for s in stats),
            **({"via_shared_memory": stats[0]["weights/via_shared_memory"]}
               if "weights/via_shared_memory" in stats[0] else {})}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--sizes", default="tiny,100m")
    parser.add_argument("--bucket-mb", type=int, default=64)
    parser.add_argument("--engines", default="hf", help="rollout engines to receive: hf, vllm or hf,vllm")
    parser.add_argument("--model", default=None, help="an HF model directory, measured after --sizes")
    parser.add_argument("--transports", default="shm",
                        help="disaggregated payloads: shm (through /dev/shm, the default), gloo, or shm,gloo "
                             "(each measured; keys of gloo runs end in _gloo)")
    parser.add_argument("--cpus-per-rank", type=float, default=1.0,
                        help="CPUs of each rank's bundle; its torch threads follow (OMP_NUM_THREADS)")
    args = parser.parse_args()
    ray.init(num_cpus=8, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}})
    bucket_bytes, engines = args.bucket_mb << 20, args.engines.split(",")
    result: dict = {"bucket_bytes": bucket_bytes, "repeats": args.repeats, "backend": "gloo (CPU)",
                    "cpus_per_rank": args.cpus_per_rank}
    with tempfile.TemporaryDirectory() as tmp:
        models = {size: str(build_tiny_lm(f"{tmp}/{size}", size=size, seed=0)) for size in filter(None, args.sizes.split(","))}
        models.update({args.model: args.model} if args.model else {})
        for name, path in models.items():
            entry: dict = {}
            for engine in engines:
                suffix = "" if engine == "hf" else f"_{engine}"
                for receivers in (1, 2):
                    for transport in args.transports.split(","):
                        key = f"disaggregated_{receivers}rx{suffix}" + ("_gloo" if transport == "gloo" else "")
                        entry[key] = roles_sync(path, "disaggregated", receivers, args.repeats, bucket_bytes,
                                                engine, args.cpus_per_rank, shared_memory=transport == "shm")
                entry[f"colocated_1rank{suffix}"] = roles_sync(path, "colocated", 1, args.repeats, bucket_bytes, engine,
                                                               args.cpus_per_rank)
            nbytes = next(v["bytes"] for k, v in entry.items() if k.startswith("disaggregated_1rx"))
            entry["params"] = nbytes // 4
            if "hf" in engines:
                entry["transport_paired_1rx"] = transport_sync(path, nbytes, args.repeats, bucket_bytes)
            for receivers in (1, 2):
                raw_s = raw_broadcast(nbytes, receivers, args.repeats)
                entry[f"raw_collective_{receivers}rx"] = {"sync_s": round(raw_s, 4),
                                                          "gbytes_per_s": round(nbytes / raw_s / 1e9, 3)}
            result[name] = entry
    print(json.dumps(result, indent=1))
    ray.shutdown()


if __name__ == "__main__":
    main()
