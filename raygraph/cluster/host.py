"""The two actor classes of the runtime: `RoleHost` (hosts role workers) and `Coordinator`.

Neither carries `@ray.remote`: `raygraph.cluster.roles` turns them into actors at creation time
with resources taken from the placement (`ray.remote(num_cpus=..., num_gpus=...)(RoleHost)`).

A `RoleHost` holds one worker per role it hosts (one role normally; several when roles are fused
in colocated mode) and runs actor tasks and direct calls on them. Every exception leaving it is a
`RemoteFailure` that names the role, rank, node and traceback.

Both import the run's plugins (user code: registered losses, estimators, rewards) when they
start, before any worker is constructed or any task runs, so user code reaches every process.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from typing import Any

from raygraph.algos.user_code import import_plugins
from raygraph.cluster import collective, tasks
from raygraph.cluster.collective_transport import CollectiveTransport
from raygraph.cluster.errors import CallSite, RemoteFailure, WeightSyncError
from raygraph.cluster.rendezvous import listening_socket, master_store, member_store
from raygraph.cluster.startup_heap import quiet_heap
from raygraph.cluster.weights import InProcessTransport
from raygraph.workers.freed_memory import keep_freed_memory

__all__ = ["RoleHost", "Coordinator"]


def _node() -> tuple[str, str]:
    import ray

    return ray.get_runtime_context().get_node_id(), ray.util.get_node_ip_address()


class RoleHost:
    """One actor process: role workers of one rank, plus their weight-sync endpoints.

    Args:
        actor_name: `<run>/<role>/<rank>` (or `<run>/<a+b>/<rank>` when fused).
        ranks: role name -> this actor's rank in that role.
        plugins: user modules or absolute `.py` paths to import first.
        env: environment variables set in this process first (OMP_NUM_THREADS: torch's threads).
    """

    def __init__(self, actor_name: str, ranks: dict[str, int], plugins: tuple[str, ...] = (),
                 env: dict[str, str] | None = None):
        import torch

        os.environ.update(env or {})   # before any worker is built (`raygraph.cluster.roles.START_ENV`)
        torch.set_num_threads(max(1, int(os.environ.get("OMP_NUM_THREADS", "1"))))
        if not torch.cuda.is_available():   # a CPU process: its updates and reloads reuse freed memory
            keep_freed_memory()
        node_id, ip = _node()
        self.sites = {role: CallSite(role, rank, actor_name, node_id, ip) for role, rank in ranks.items()}
        with self._guard(next(iter(ranks)), "import plugins"):
            import_plugins(plugins)
        self.workers: dict[str, Any] = {}
        self._transports: dict[str, Any] = {}
        self._versions: dict[str, int] = {}
        self.timings = _StageTimings()

    # --- set-up ---------------------------------------------------------------------------------
    def node_info(self) -> dict:
        node_id, ip = _node()
        return {"node_id": node_id, "node_ip": ip, "pid": os.getpid()}

    def free_port(self) -> tuple[str, int]:
        """The address of the role's torch.distributed rendezvous, hosted by this actor (rank 0):
        a socket listening on this node's own IP, kept until `init_distributed` hands it to the
        store (no other process can take the port in between)."""
        ip = _node()[1]
        self._rendezvous = listening_socket(ip)
        return ip, self._rendezvous.getsockname()[1]

    def init_distributed(self, role: str, rank: int, world: int, addr: str, port: int,
                         timeout_s: float) -> None:
        """Join the role's torch.distributed group (the process's default group)."""
        import datetime

        import torch
        import torch.distributed as dist

        with self._guard(role, "init_distributed"):
            os.environ.update(MASTER_ADDR=addr, MASTER_PORT=str(port), RANK=str(rank),
                              WORLD_SIZE=str(world), LOCAL_RANK="0")
            if dist.is_initialized():
                if dist.get_world_size() != world or dist.get_rank() != rank:
                    raise RuntimeError(f"process already in a group of {dist.get_world_size()} "
                                       f"(rank {dist.get_rank()}); fused roles must share ranks")
                return
            sock, self._rendezvous = getattr(self, "_rendezvous", None), None
            store = (master_store(sock, world, timeout_s) if rank == 0 and sock is not None
                     else member_store(addr, port, world, timeout_s))
            backend = "nccl" if torch.cuda.is_available() else "gloo"
            dist.init_process_group(backend, store=store, rank=rank, world_size=world,
                                    timeout=datetime.timedelta(seconds=timeout_s))

    def construct(self, role: str, factory: Callable, kwargs: dict) -> None:
        # the worker's imports and model build without the collector's repeated full passes
        with quiet_heap(), self._guard(role, "__init__"):
            self.workers[role] = factory(**kwargs)

    # --- direct calls ---------------------------------------------------------------------------
    def call(self, role: str, method: str, *args: Any, **kwargs: Any) -> Any:
        with self._guard(role, method):
            return getattr(self.workers[role], method)(*args, **kwargs)

    def ping(self) -> bool:
        return True

    # --- tasks -------------------------------------------------------------------------------------
    def take_stats(self) -> dict:
        """Seconds per task label since the last call, and this process's peak memory."""
        return {"timings": self.timings.take(), "unit": "+".join(self.sites), **_peak_memory()}

    def run(self, task: tasks.Task, *values: Any) -> Any:
        """Execute one task (see `raygraph.cluster.tasks.Task`), or a whole fused plan ("plan")."""
        if task.op == "plan":
            out = self._run_plan(task, values[0])
        else:
            with self._guard(task.role, task.method or task.op), self.timings.stage(task.label):
                out = self._run_task(task, values)
        return tasks.with_status(task, out)

    def _run_task(self, task: tasks.Task, values: tuple) -> Any:
        if task.op in tasks.WHOLE_OPS:
            return tasks.run_whole(task, values)
        args, kwargs = tasks.resolve(task, values)
        if task.op == "call":
            return getattr(self.workers[task.role], task.method)(*args, **kwargs)
        if task.op not in tasks.WEIGHT_OPS:
            raise ValueError(f"RoleHost cannot run task op {task.op!r}")
        return getattr(self, task.op)(**task.extra)

    def _run_plan(self, task: tasks.Task, x: Any) -> Any:
        """Every task of a fused plan in this process, values passed in memory (`Executor` fuses
        plans whose role tasks all run on one actor into one such task)."""
        values: dict[tuple, Any] = {tasks.INPUT: x}
        host = next(iter(self.sites.values()))
        coordinator = CallSite("coordinator", 0, host.actor_name, host.node_id, host.node_ip)
        for sub, inputs, outputs in task.extra["ops"]:
            # a whole-batch task failing here is the coordinator's work, done in this actor
            guard = (_Guard(coordinator, sub.label) if sub.op in tasks.WHOLE_OPS
                     else self._guard(sub.role, sub.method or sub.op))
            with guard, self.timings.stage(sub.label):
                result = self._run_task(sub, tuple(values[v] for v in inputs))
            values.update(zip(outputs, result if sub.n_out > 1 else (result,)))
        outs = tuple(values[v] for v in task.extra["outputs"])
        return outs if task.n_out > 1 else outs[0]

    # --- weight sync ------------------------------------------------------------------------------
    def weights_open(self, group: str, world: int, timeout_s: float) -> tuple[str, int]:
        return collective.open_store(group, world, timeout_s)

    def weights_join(self, role: str, group: str, rank: int, world: int, addr: str, port: int,
                     timeout_s: float, labels: list[str], verify: bool = True,
                     shared_memory: bool = True) -> None:
        import torch

        with self._guard(role, "weights_join"):
            device = "cuda" if torch.cuda.is_available() else "cpu"
            collective.join(group, rank, world, addr, port, device=device, timeout_s=timeout_s,
                            labels=labels)
            self._transports[group] = CollectiveTransport(group, src=0, verify=verify, shared_memory=shared_memory)

    def _next_version(self, key: str, version: int | None) -> int:
        self._versions[key] = self._versions.get(key, 0) + 1 if version is None else version
        return self._versions[key]

    def weights_local(self, src: str, dst: str, bucket_bytes: int, strict: bool = True,
                      corrupt_bucket: int | None = None, version: int | None = None) -> dict:
        """Colocated: hand the policy's buckets to the rollout worker in this process."""
        with self._guard(dst, "load_weights"):
            v = self._next_version(f"{src}->{dst}", version)
            transport = InProcessTransport()
            transport.send(self.workers[src].weight_buckets(bucket_bytes), v, corrupt_bucket=corrupt_bucket)
            stats = transport.receive(self.workers[dst].load_weights, strict=strict)
            return {"sender": {}, "receiver": stats}

    def weights_send(self, src: str, group: str, bucket_bytes: int, corrupt_bucket: int | None = None,
                     version: int | None = None) -> dict:
        with self._guard(src, "weight_send"):
            v = self._next_version(group, version)
            buckets = self.workers[src].weight_buckets(bucket_bytes)
            return {"sender": self._transport(group).send(buckets, v, corrupt_bucket=corrupt_bucket)}

    def weights_drain(self, src: str, bucket_bytes: int) -> dict:
        """Non-zero sender ranks: walk the buckets too (FSDP all-gathers each tensor on every rank)."""
        with self._guard(src, "weight_buckets"):
            for _ in self.workers[src].weight_buckets(bucket_bytes):
                pass
            return {}

    def weights_recv(self, dst: str, group: str, strict: bool = True) -> dict:
        with self._guard(dst, "weight_recv"):
            stats = self._transport(group).receive(self.workers[dst].load_weights, strict=strict)
            return {"receiver": stats}

    def _transport(self, group: str):
        if group not in self._transports:
            raise WeightSyncError(f"this actor has not joined weight-sync group {group!r}")
        return self._transports[group]

    def _guard(self, role: str, method: str) -> _Guard:
        site = self.sites.get(role) or next(iter(self.sites.values()))
        return _Guard(site, method)


class _Guard:
    """Turns any exception into a `RemoteFailure` naming the site (role, rank, node)."""

    def __init__(self, site: CallSite, method: str):
        self.site, self.method = site, method

    def __enter__(self) -> None:
        return None

    def __exit__(self, exc_type, exc, tb) -> bool:
        if exc is not None and not isinstance(exc, RemoteFailure):
            raise RemoteFailure.wrap(self.site, self.method, exc) from None
        return False


class Coordinator:
    """Runs whole-batch tasks (scatter, gather, apply, sync stats) off the driver."""

    def __init__(self, run_name: str, plugins: tuple[str, ...] = (), env: dict[str, str] | None = None):
        os.environ.update(env or {})
        node_id, ip = _node()
        self.site = CallSite("coordinator", 0, f"{run_name}/coordinator", node_id, ip)
        with _Guard(self.site, "import plugins"):
            import_plugins(plugins)
        self.timings = _StageTimings()

    def ping(self) -> bool:
        return True

    def take_stats(self) -> dict:
        return {"timings": self.timings.take(), "unit": "coordinator", **_peak_memory()}

    def run(self, task: tasks.Task, *values: Any) -> Any:
        with _Guard(self.site, task.label), self.timings.stage(task.label):
            if task.op not in tasks.WHOLE_OPS:
                raise ValueError(f"Coordinator cannot run task op {task.op!r}")
            out = tasks.run_whole(task, values)
        return tasks.with_status(task, out)


def _peak_memory() -> dict[str, int]:
    """Peak resident memory of this process (bytes), and on CUDA the peak allocated by torch."""
    import resource
    import sys

    import torch

    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * (1 if sys.platform == "darwin" else 1024)
    cuda = torch.cuda.max_memory_allocated() if torch.cuda.is_available() and torch.cuda.is_initialized() else 0
    return {"peak_rss_bytes": rss, "cuda_peak_bytes": cuda}


class _StageTimings:
    """Seconds spent in each task label since the last `take()` (per-stage `timing/*`)."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}

    def stage(self, label: str) -> _Timer:
        return _Timer(self.seconds, label)

    def take(self) -> dict[str, float]:
        out, self.seconds = self.seconds, {}
        return out


class _Timer:
    def __init__(self, seconds: dict[str, float], label: str):
        self.seconds, self.label = seconds, label

    def __enter__(self) -> None:
        self.start = time.perf_counter()

    def __exit__(self, *exc) -> None:
        self.seconds[self.label] = self.seconds.get(self.label, 0.0) + time.perf_counter() - self.start
