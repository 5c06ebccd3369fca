"""Loading checkpoint files without running code from them.

A checkpoint is data, but two of torch's loaders unpickle: `torch.load(weights_only=False)` and
torch.distributed.checkpoint (DCP), whose `.metadata` file is read with `pickle.load` and whose
non-tensor entries (optimizer hyperparameters) with `torch.load(weights_only=False)`. Unpickling
a planted file runs whatever it names. Here DCP reads `.metadata` with an unpickler that only
builds DCP's own metadata classes (and `torch.Size`, dtypes, layouts, paths, and the members of
those enums), and its non-tensor entries with `torch.load(weights_only=True)`; anything else is a `CheckpointError`.

`CheckpointError` is the one error type for a checkpoint that cannot be trusted or read
(damaged, truncated, unsafe, or written by an incompatible version); `raygraph.run.checkpoint`
raises it too.
"""

from __future__ import annotations

import enum
import io
import pickle
from pathlib import Path
from typing import Any

import torch

from raygraph.errors import CheckpointInvalid

__all__ = ["CheckpointError", "dcp_load"]


class CheckpointError(CheckpointInvalid, ValueError):
    """A checkpoint is damaged, truncated, unsafe to load or of an incompatible format."""


# (module, name) pairs that DCP's metadata pickle may name; everything else is refused.
_DCP_METADATA = "torch.distributed.checkpoint.metadata"
_ALLOWED = {
    *((_DCP_METADATA, name) for name in (
        "Metadata", "MetadataIndex", "StorageMeta", "TensorProperties", "TensorStorageMetadata",
        "BytesStorageMetadata", "ChunkStorageMetadata", "_MEM_FORMAT_ENCODING")),
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),   # maps a layout's name ("torch.strided") to the layout
    ("pathlib", "PosixPath"), ("pathlib", "PurePosixPath"), ("pathlib", "WindowsPath"),
    ("collections", "OrderedDict"),
}


def _enum_member(cls: Any, name: Any) -> enum.Enum:
    """`getattr(cls, name)`, as some Python 3.11 releases pickle an enum member (Debian 12's 3.11.2;
    3.11.7 pickles it by value), for a member of an enum the unpickler already allowed, nothing else."""
    if isinstance(cls, enum.EnumMeta) and isinstance(name, str) and name in cls.__members__:
        return cls[name]
    raise pickle.UnpicklingError(f"refusing to load getattr({cls!r}, {name!r}): only an enum member of a "
                                 "checkpoint's metadata is loaded by name")


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _ALLOWED:
            return super().find_class(module, name)
        if (module, name) == ("builtins", "getattr"):
            return _enum_member
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise pickle.UnpicklingError(f"refusing to load {module}.{name}: not part of a checkpoint's metadata")


def _safe_reader(path: Path):
    from torch.distributed.checkpoint import FileSystemReader

    class _Reader(FileSystemReader):
        def read_metadata(self, *args: Any, **kwargs: Any):
            # FileSystemReader.read_metadata with the restricted unpickler (same file, same fields).
            from torch.distributed.checkpoint.metadata import StorageMeta

            file = self._get_metadata_path(kwargs.get("rank"))
            with self.fs.create_stream(file, "rb") as stream:
                metadata = _MetadataUnpickler(stream).load()
            if getattr(metadata, "storage_meta", None) is None:
                metadata.storage_meta = StorageMeta()
            metadata.storage_meta.load_id = self.load_id
            return metadata

    return _Reader(str(path))


def _safe_planner():
    from torch.distributed.checkpoint import DefaultLoadPlanner
    from torch.distributed.checkpoint.planner import ReadItem

    class _Planner(DefaultLoadPlanner):
        def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
            # DefaultLoadPlanner.load_bytes with weights_only=True: tensors and primitives only.
            loaded = torch.load(value, weights_only=True)
            if self.flatten_state_dict:
                from torch.distributed.checkpoint._traverse import set_element

                set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], loaded)
            else:
                self.state_dict[read_item.dest_index.fqn] = loaded

    return _Planner()


def dcp_load(state: dict, path: str | Path) -> None:
    """`torch.distributed.checkpoint.load(state, checkpoint_id=path)`, without unpickling code.

    Raises:
        CheckpointError: a file names something other than checkpoint data (a planted pickle),
            or the checkpoint cannot be read (missing or truncated files).
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    path = Path(path)
    try:
        dcp.load(state, storage_reader=_safe_reader(path), planner=_safe_planner())
    except (Exception, CheckpointException) as exc:  # a BaseException: it wraps each rank's error
        raise CheckpointError(f"cannot load the sharded state in {path}: {_root_cause(exc)}") from exc


def _root_cause(exc: BaseException) -> str:
    failures = getattr(exc, "failures", None)  # DCP's CheckpointException: {rank: exception}
    if failures:
        exc = next(iter(failures.values()))
        exc = exc[0] if isinstance(exc, tuple) else exc
    while exc.__cause__ is not None:
        exc = exc.__cause__
    return f"{type(exc).__name__}: {exc}"
