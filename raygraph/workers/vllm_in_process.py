"""A vLLM engine core in the rollout worker's own process (`rollout.vllm_engine_core`).

By default vLLM starts its engine core in a process of its own, which imports vLLM, torch and the
model code again: on the 2-core CPU machine a tiny model's engine start took 24 s and ~27 CPU-seconds that
way, against 13 s and ~16 CPU-seconds with the engine core in the caller (docs/benchmarks.md,
section 14). There is then no second process to die, hang a `generate` or outlive its actor.

It is possible when vLLM runs on its CPU build with one rank (`tensor_parallel_size` 1), and the
process is in no torch.distributed group of more than one rank: vLLM's engine sets up its own
world group on the default process group, and a trained role's group of N ranks there would become
the engine's world (colocated policy ranks > 1 keep the engine in its own process). On GPUs the
engine keeps its process (CUDA contexts, NCCL, tensor parallelism).

What vLLM does to a process it runs in, and `engine_here` undoes: it reseeds the global RNGs
(torch, random, numpy) with the engine's seed, replaces `torch.set_num_threads` by a no-op (and
asks for 1 torch thread "for serving"), freezes the garbage collector's heap (`gc.freeze`) and
its own environment variables (`vllm.envs`: cleared before a build). Each engine step draws from
the global torch RNG (the CPU sampler's per-step seeds; raygraph's rows are seeded, so not what
is sampled): `vllm_deaths` runs the steps under `torch.random.fork_rng`. Closing an engine would
destroy the process's torch.distributed state, which a world-1 policy in the same process shares
with it: `engine_here` makes vLLM's shutdown keep it. It also binds the process's memory to the
NUMA node of its first CPU: `auto` keeps the engine in its own process on a host with several
NUMA nodes.
"""

from __future__ import annotations

import contextlib
import gc
import os
import random
from collections.abc import Iterator

import numpy as np
import torch

__all__ = ["CHOICES", "engine_here", "in_process_problem", "resolve", "runs_here"]

CHOICES = ("auto", "in_process", "own_process")
_ENV = "VLLM_ENABLE_V1_MULTIPROCESSING"


def in_process_problem(tensor_parallel_size: int) -> str | None:
    """Why the engine core cannot run in this process (None: it can)."""
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return f"vLLM runs on {current_platform.device_type!r}, not on its CPU build"
    if tensor_parallel_size != 1:
        return f"tensor_parallel_size={tensor_parallel_size} (one rank only)"
    from vllm.utils.cpu_resource_utils import get_visible_memory_node

    if len(nodes := get_visible_memory_node()) > 1:
        return (f"this host has {len(nodes)} NUMA memory nodes, and vLLM would bind the whole process's memory "
                "to one of them")
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        return (f"this process is rank {dist.get_rank()} of a torch.distributed group of {dist.get_world_size()} "
                "(a colocated trained role), which vLLM would take as its own world")
    return None


def runs_here(engine) -> bool:
    """True when the `vllm.LLM` engine's core runs in this process."""
    from vllm.v1.engine.core_client import InprocClient

    return isinstance(engine.llm_engine.engine_core, InprocClient)


def resolve(choice: str, tensor_parallel_size: int) -> bool:
    """True: run the engine core here. `choice` is one of `CHOICES`.

    Raises:
        ValueError: `in_process` asked for where it cannot be (the reason is named).
    """
    if choice not in CHOICES:
        raise ValueError(f"vllm_engine_core={choice!r}; valid: {', '.join(CHOICES)}")
    if choice == "own_process":
        return False
    problem = in_process_problem(tensor_parallel_size)
    if problem is not None and choice == "in_process":
        raise ValueError(f"rollout.vllm_engine_core=in_process is not possible: {problem}; "
                         "use auto or own_process")
    return problem is None


@contextlib.contextmanager
def engine_here(in_process: bool) -> Iterator[None]:
    """Build a `vllm.LLM` inside: in this process when `in_process`, else in a process of its
    own; this process's RNG states and `torch.set_num_threads` are as before afterwards."""
    from vllm import envs

    envs.disable_envs_cache()   # an engine built here before froze them; read this one's choice
    if in_process:
        _keep_distributed_state_at_shutdown()
        # the engine's start-up calls gc.collect() five times: with the heap so far frozen they walk
        # only what the build makes (~1 s less per engine start here; unfrozen again below)
        gc.freeze()
    before = os.environ.get(_ENV)
    os.environ[_ENV] = "0" if in_process else "1"
    rng = (torch.get_rng_state(), random.getstate(), np.random.get_state())
    set_num_threads, threads = torch.set_num_threads, torch.get_num_threads()
    try:
        yield
    finally:
        torch.set_num_threads = set_num_threads
        # its start-up asks for 1 thread "for serving" (`set_torch_threads_for_runtime`; today only its own
        # no-op stops it): the caller's count is put back whatever happened
        torch.set_num_threads(threads)
        if in_process:
            gc.unfreeze()   # vLLM froze the heap at its start (shorter GC pauses in its own process)
        torch.set_rng_state(rng[0])
        random.setstate(rng[1])
        np.random.set_state(rng[2])
        if before is None:
            os.environ.pop(_ENV, None)
        else:
            os.environ[_ENV] = before


def _keep_distributed_state_at_shutdown() -> None:
    """vLLM's engine shutdown ends with `cleanup_dist_env_and_memory`, which destroys the process's
    default torch.distributed group and vLLM's own groups (right in a process of its own). In the
    rollout worker's process they may be the policy's group (world 1) and another live engine's:
    only the garbage collector and vLLM's env cache are reset there."""
    from vllm import envs
    from vllm.v1.engine import core

    def reset_without_destroying(shutdown_ray: bool = False) -> None:
        envs.disable_envs_cache()
        gc.unfreeze()

    core.cleanup_dist_env_and_memory = reset_without_destroying
