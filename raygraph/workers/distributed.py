"""torch.distributed helpers shared by the data-parallel workers (no Ray).

The caller (the Ray cluster layer, or a test that spawns processes) initialises the process
group; workers only ask `world_size()` / `rank()` and wrap their model with `fsdp_wrap` when
the world is larger than one. Every helper is a no-op in a plain single process.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Callable, Sequence
from typing import TypeVar

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from raygraph.batch import Batch

__all__ = [
    "all_reduce", "default_device", "dummy_row", "find_free_port", "fsdp_wrap", "full_tensor",
    "init_process_group_from_env", "is_distributed", "lockstep", "rank", "world_size",
]

T = TypeVar("T")


def init_process_group_from_env(backend: str | None = None) -> None:
    """`init_process_group` from RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT (no-op if done).

    Args:
        backend: "gloo" or "nccl"; default nccl when CUDA is available, else gloo.
    """
    if dist.is_initialized():
        return
    backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
    if backend == "nccl" and "LOCAL_RANK" in os.environ:
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group(backend, rank=int(os.environ["RANK"]), world_size=int(os.environ["WORLD_SIZE"]))


def world_size() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def is_distributed() -> bool:
    return world_size() > 1


def default_device(device: str | torch.device | None = None) -> torch.device:
    """`device` if given; else the current CUDA device when CUDA is available; else CPU."""
    if device is not None:
        return torch.device(device)
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def find_free_port() -> int:
    """A free TCP port on 127.0.0.1 (for MASTER_PORT in tests)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def all_reduce(tensor: torch.Tensor, op: str = "sum") -> torch.Tensor:
    """In-place all-reduce over the default group ("sum" | "max" | "min"); returns `tensor`.

    Small bookkeeping tensors live on the CPU; under NCCL they travel via the current GPU.
    """
    if is_distributed():
        reduce_op = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}[op]
        comm = tensor
        if "nccl" in str(dist.get_backend()) and tensor.device.type != "cuda":
            comm = tensor.to(torch.device("cuda", torch.cuda.current_device()))
        dist.all_reduce(comm, op=reduce_op)
        if comm is not tensor:
            tensor.copy_(comm)
    return tensor


def lockstep(items: Sequence[T], make_dummy: Callable[[], T]) -> list[tuple[T, bool]]:
    """Pad `items` with dummies to the largest length over all ranks.

    Sharded models run collectives inside every forward/backward, so every rank must run the
    same number of them even when its shard is smaller. Returns `(item, is_dummy)` pairs.
    """
    count = int(all_reduce(torch.tensor([len(items)]), "max").item())
    return [(item, False) for item in items] + [(make_dummy(), True) for _ in range(count - len(items))]


def dummy_row(batch: Batch) -> Batch:
    """One row to run with weight 0 where this rank's shard is shorter than another's (FSDP's
    collectives must match): a real row when the shard has one, else a neutral row built from the
    columns' shapes (a rank left with no rows by a filtered batch), with every `*mask` column 1 so
    that no attention row is fully masked (some kernels give NaN there, and NaN * 0 is NaN)."""
    if len(batch):
        return batch.select(slice(0, 1))
    tensors = {name: (torch.ones if name.endswith("mask") else torch.zeros)((1, *t.shape[1:]), dtype=t.dtype)
               for name, t in batch.tensors.items()}
    return Batch(tensors, {name: np.resize(v, 1) for name, v in batch.non_tensors.items()}, dict(batch.meta))


def _decoder_layers(model: nn.Module) -> list[nn.Module]:
    """The repeated blocks to shard one by one: HF's `_no_split_modules`, else ModuleList items."""
    names: set[str] = set()
    for module in model.modules():
        names.update(getattr(module, "_no_split_modules", None) or [])
    layers = [m for m in model.modules() if type(m).__name__ in names]
    if layers:
        return layers
    lists = [m for m in model.modules() if isinstance(m, nn.ModuleList)]
    return list(max(lists, key=len)) if lists else []


def fsdp_wrap(model: nn.Module, param_dtype: torch.dtype | None = None) -> nn.Module:
    """FSDP2: `fully_shard` each decoder layer, then the root (embeddings, norm, heads).

    Args:
        model: on its target device, identical on every rank.
        param_dtype: compute dtype for the all-gathered parameters (mixed precision: master
            weights stay in their own dtype, gradients are reduced in float32); None keeps them.
    """
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32) if param_dtype else None
    kwargs = {"mp_policy": mp} if mp is not None else {}
    for layer in _decoder_layers(model):
        fully_shard(layer, **kwargs)
    fully_shard(model, **kwargs)
    return model


def full_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """The whole tensor of a DTensor shard (a collective: every rank must call it), else itself."""
    from torch.distributed.tensor import DTensor

    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor
