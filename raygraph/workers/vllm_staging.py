"""Weight buckets handed to vLLM's engine processes through shared memory, not through its RPC.

    staging = Staging.for_engine(engine, nbytes)    # one file in /dev/shm per engine, reused
    layout = staging.write(bucket)                  # the bucket's tensors copied into it, once
    engine.collective_rpc("raygraph_load_shared", args=(staging.path, staging.nbytes, layout))
    staging.mapped()                                # the workers hold it: its name goes
    # in each engine worker:  model.load_weights(shared_tensors(path, nbytes, layout))

vLLM's `collective_rpc` serialises its arguments into ZeroMQ messages: a bucket's bytes were
copied into Python bytes, into the message, through the socket and out again before the engine
loaded them (538 MB of SmolLM2 took 0.73 s in transport alone, 1.27 s per full reload). Here the
caller copies each tensor once into a file in /dev/shm that every engine worker maps; the RPC
carries names, dtypes, shapes and offsets only, and each worker copies the tensors out of the
mapping into `load_weights` (`shared_tensors`). The file is made at the first sync (a new one
when a bucket is larger) and its name removed as soon as the engine's workers have mapped it, so
its memory goes back when the processes holding it exit, also when they are killed. Where
/dev/shm is missing or too small for a bucket, `Staging.for_engine` gives None and the RPC path
is used.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import weakref
from typing import Any

import torch

__all__ = ["Staging", "shared_tensors"]

_SHM = "/dev/shm"
_ALIGN = 64
Layout = list[tuple[str, str, list[int], int]]   # (name, dtype, shape, byte offset)


def _aligned(n: int) -> int:
    return (n + _ALIGN - 1) // _ALIGN * _ALIGN


class Staging:
    """One shared-memory file holding the bucket in flight to an engine's workers."""

    def __init__(self) -> None:
        self.path, self.nbytes, self._buffer = "", 0, torch.empty(0, dtype=torch.uint8)
        self._cleanup = None

    @classmethod
    def for_engine(cls, engine: Any, bucket_bytes: int) -> Staging | None:
        """The engine's staging file (made at the first call), or None without room in /dev/shm."""
        staging = getattr(engine, "_raygraph_staging", None)
        grow = bucket_bytes - (staging.nbytes if staging is not None else 0)
        if grow > 0 and (not os.path.isdir(_SHM) or shutil.disk_usage(_SHM).free < grow + (64 << 20)):
            return None   # keep 64 MiB of /dev/shm for others (Ray's object store may live there too)
        if staging is None:
            staging = cls()
            engine._raygraph_staging = staging
        return staging

    def write(self, bucket: list[tuple[str, torch.Tensor]]) -> Layout:
        """Copy `bucket` into the file; returns where each tensor lies."""
        layout, offset = [], 0
        for name, tensor in bucket:
            layout.append((name, str(tensor.dtype).removeprefix("torch."), list(tensor.shape), offset))
            offset += _aligned(tensor.nbytes)
        if offset > self.nbytes:
            self._resize(offset)
        for (_, _, _, start), (_, tensor) in zip(layout, bucket):
            self._buffer[start:start + tensor.nbytes].view(tensor.dtype).view(tensor.shape).copy_(tensor.detach())
        return layout

    def _resize(self, nbytes: int) -> None:
        """A new, larger file (the engine's workers map it at the next bucket; `mapped` unlinks it)."""
        self.close()
        fd, self.path = tempfile.mkstemp(prefix="raygraph-weights-", dir=_SHM)
        os.ftruncate(fd, nbytes)
        os.close(fd)
        self._cleanup = weakref.finalize(self, _unlink, self.path)
        self.nbytes = nbytes
        self._buffer = torch.from_file(self.path, shared=True, size=nbytes, dtype=torch.uint8)

    def mapped(self) -> None:
        """Every engine worker has mapped the file (an RPC that read it returned): remove its name,
        so that its memory goes back when the last process holding it exits, even by kill -9."""
        if self._cleanup is not None:
            self._cleanup()

    def close(self) -> None:
        self._buffer = torch.empty(0, dtype=torch.uint8)
        self.mapped()


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


_MAPPED: dict[str, tuple[int, torch.Tensor]] = {}   # in an engine worker: the newest path -> (size, mapping)


def shared_tensors(path: str, nbytes: int, layout: Layout):
    """In an engine worker: the bucket's tensors, copied out of the caller's staging file.

    Copied, not viewed: vLLM's layerwise reload keeps the tensors of a layer that is not complete
    yet (a layer split over two buckets; attention layers until the end of the update), and the
    caller writes the next bucket into the same file."""
    size, buffer = _MAPPED.get(path, (0, None))
    if buffer is None or size != nbytes:   # first bucket, or the caller grew the file: a new one
        _MAPPED.clear()                     # the previous file's memory goes back
        buffer = torch.from_file(path, shared=True, size=nbytes, dtype=torch.uint8)
        _MAPPED[path] = (nbytes, buffer)
    for name, dtype, shape, offset in layout:
        dt = getattr(torch, dtype)
        yield name, buffer[offset:offset + torch.Size(shape).numel() * dt.itemsize].view(dt).view(shape).clone()
