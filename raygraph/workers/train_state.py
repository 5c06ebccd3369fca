"""A trained model's checkpoint: model and optimizer through torch.distributed.checkpoint
(sharded under FSDP2), and each rank's lr-scheduler and RNG state in safetensors + JSON.
Nothing is unpickled on load (`raygraph.workers.safe_load`)."""

from __future__ import annotations

import contextlib
import json
import random
import warnings
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch
from torch import nn

from raygraph.workers.distributed import rank
from raygraph.workers.safe_load import CheckpointError, dcp_load

__all__ = ["load_train_state", "save_train_state"]


def _rng_state() -> dict:
    state = {"torch": torch.get_rng_state(), "python": random.getstate(), "numpy": np.random.get_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _extra_to_file(scheduler_state: dict, rng: dict) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """This rank's scheduler and RNG state as safetensors tensors + string metadata (JSON)."""
    version, mt, gauss = rng["python"]
    kind, keys, pos, has_gauss, cached = rng["numpy"]
    tensors = {"rng/torch": rng["torch"], "rng/numpy": torch.from_numpy(np.asarray(keys, dtype=np.uint32).copy()),
               **{f"rng/cuda/{i}": t for i, t in enumerate(rng.get("cuda", []))}}
    try:
        scheduler_json = json.dumps(scheduler_state)
    except TypeError as exc:
        raise TypeError(f"save_train_state: the lr scheduler's state must be plain JSON data ({exc})") from exc
    meta = {"scheduler": scheduler_json,
            "python_rng": json.dumps([version, list(mt), gauss]),
            "numpy_rng": json.dumps([kind, int(pos), int(has_gauss), float(cached)]),
            "cuda_devices": str(len(rng.get("cuda", [])))}
    return tensors, meta


def _extra_from_file(tensors: dict[str, torch.Tensor], meta: dict[str, str]) -> tuple[dict, dict]:
    """Inverse of `_extra_to_file`: (scheduler state, RNG state)."""
    version, mt, gauss = json.loads(meta["python_rng"])
    kind, pos, has_gauss, cached = json.loads(meta["numpy_rng"])
    rng = {"torch": tensors["rng/torch"], "python": (version, tuple(mt), gauss),
           "numpy": (kind, tensors["rng/numpy"].numpy(), pos, has_gauss, cached)}
    if int(meta["cuda_devices"]):
        rng["cuda"] = [tensors[f"rng/cuda/{i}"] for i in range(int(meta["cuda_devices"]))]
    return json.loads(meta["scheduler"]), rng


@contextlib.contextmanager
def _quiet_single_process() -> Iterator[None]:
    """Silence DCP's "assuming the intent is to save in a single process" (it is)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*single process", category=UserWarning)
        yield


def save_train_state(path: str | Path, model: nn.Module, optimizer: torch.optim.Optimizer, scheduler) -> None:
    """`path/dcp/` (model + optimizer, each rank writes its shards) and `path/extra_rank{r}.safetensors`
    (this rank's lr-scheduler and RNG state: tensors, and JSON in the file's metadata; no pickle)."""
    import torch.distributed.checkpoint as dcp
    from safetensors.torch import save_file
    from torch.distributed.checkpoint.state_dict import get_state_dict

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    model_sd, optim_sd = get_state_dict(model, optimizer)   # sharded under FSDP2
    with _quiet_single_process():
        dcp.save({"model": model_sd, "optimizer": optim_sd}, checkpoint_id=str(path / "dcp"))
    tensors, meta = _extra_to_file(scheduler.state_dict(), _rng_state())
    save_file(tensors, path / f"extra_rank{rank()}.safetensors", metadata=meta)


def load_train_state(path: str | Path, model: nn.Module, optimizer: torch.optim.Optimizer, scheduler) -> None:
    """Inverse of `save_train_state` (same world size). Nothing is unpickled: the sharded state is
    read by `safe_load.dcp_load`, the rest from safetensors + JSON.

    Raises:
        CheckpointError: a file is missing, truncated or unsafe.
    """
    from safetensors import safe_open
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    path = Path(path)
    extra = path / f"extra_rank{rank()}.safetensors"
    if not extra.is_file():
        raise CheckpointError(f"cannot load the training state in {path}: {extra.name} is missing; resume "
                              f"from a checkpoint written by this version, or start a new run from its weights")
    model_sd, optim_sd = get_state_dict(model, optimizer)
    state = {"model": model_sd, "optimizer": optim_sd}
    with _quiet_single_process():
        dcp_load(state, path / "dcp")
    try:
        with safe_open(extra, framework="pt") as f:
            tensors = {name: f.get_tensor(name) for name in f.keys()}
            scheduler_state, rng = _extra_from_file(tensors, f.metadata())
    except Exception as exc:
        raise CheckpointError(f"cannot read {extra}: {type(exc).__name__}: {exc}") from exc
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"])
    scheduler.load_state_dict(scheduler_state)
    _set_rng_state(rng)
