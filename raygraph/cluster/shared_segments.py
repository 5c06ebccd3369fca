"""Shared-memory segments that carry weight buckets between processes of one host.

A disaggregated weight sync on CPU sends every byte through gloo's TCP loopback: the kernel
copies each bucket out of the sender and into every receiver, on the same cores that pack and
load it. When sender and receivers share a host (`/dev/shm` is one tmpfs), the sender instead
packs each bucket into a segment there and the group's broadcast carries only its header; the
receivers read the bucket where it lies (docs/runtime.md, docs/benchmarks.md section 14).

A segment is a file named `raygraph-weights-<pid>-<random>` in `/dev/shm`:

* the sender creates it with its space reserved up front (`posix_fallocate`), so a full `/dev/shm`
  is an error at creation (`SegmentUnavailable`), never a SIGBUS while packing;
* receivers map it read-only: a loader that wrote into a bucket would crash its own process
  instead of changing what the other receivers verify and load;
* the sender maps it with its pages populated (`MAP_POPULATE`, Linux): the first bucket packed
  into it takes no page fault per 4 KiB (a 128 MiB segment: 32k faults, 0.06 s -> 0.02 s here);
* the sender removes the name once every receiver has mapped it (the memory lives until the
  last mapping goes), and removes the segments of dead senders it finds when it creates one.
"""

from __future__ import annotations

import logging
import mmap
import os
import uuid
import warnings
from typing import Protocol

import psutil
import torch

from raygraph.cluster.errors import WeightSyncError

__all__ = ["DEFAULT_DIR", "Segment", "SegmentUnavailable", "SenderSegments", "ReceiverViews", "agree",
           "map_readonly", "remove_dead_senders_segments"]

log = logging.getLogger(__name__)

DEFAULT_DIR = "/dev/shm"
_PREFIX = "raygraph-weights-"
_POPULATE = getattr(mmap, "MAP_POPULATE", 0)   # Linux only


class SegmentUnavailable(WeightSyncError):
    """A segment could not be created (no `/dev/shm`, or not enough space in it)."""


class Segment:
    """A writable segment of `nbytes` owned by the sending process; `tensor` is a flat uint8 view."""

    def __init__(self, nbytes: int, directory: str = DEFAULT_DIR):
        self.name = f"{_PREFIX}{os.getpid()}-{uuid.uuid4().hex[:12]}"
        self.path = os.path.join(directory, self.name)
        try:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        except OSError as exc:
            raise SegmentUnavailable(f"cannot create {self.path}: {exc.strerror}") from exc
        try:
            os.posix_fallocate(fd, 0, max(nbytes, 1))
            self._map = mmap.mmap(fd, max(nbytes, 1), flags=mmap.MAP_SHARED | _POPULATE)
        except OSError as exc:
            self.unlink()
            raise SegmentUnavailable(f"cannot reserve {nbytes / 2**20:.0f} MiB in {directory} "
                                     f"({exc.strerror})") from exc
        finally:
            os.close(fd)   # the mapping keeps the memory
        self.tensor = torch.frombuffer(self._map, dtype=torch.uint8)

    def unlink(self) -> None:
        """Remove the name; mappings (ours, the receivers') stay valid until dropped."""
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass


def map_readonly(directory: str, name: str) -> torch.Tensor:
    """A read-only flat uint8 view of segment `name` (raises `FileNotFoundError` if it is gone)."""
    if os.sep in name or not name.startswith(_PREFIX):
        raise ValueError(f"not a weight-bucket segment name: {name!r}")
    with open(os.path.join(directory, name), "rb") as f:
        view = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    with warnings.catch_warnings():   # torch warns that the buffer is not writable: that is the point
        warnings.simplefilter("ignore", UserWarning)
        return torch.frombuffer(view, dtype=torch.uint8)


class _Group(Protocol):
    rank: int
    labels: list[str]

    def exchange(self, what: str, value: str) -> list[str]: ...


def agree(group: _Group, src: int, directory: str = DEFAULT_DIR) -> bool:
    """Whether every member of `group` can read a segment that rank `src` creates (one host).

    Collective over the group's store: every member calls it once, at the same point. The sender
    offers a small segment holding a random token; each member says whether it read that token.
    """
    probe, token = None, uuid.uuid4().hex.encode()
    if group.rank == src:
        remove_dead_senders_segments(directory)
        try:
            probe = Segment(len(token), directory)
            probe.tensor.copy_(torch.frombuffer(bytearray(token), dtype=torch.uint8))
        except SegmentUnavailable as exc:
            log.info("weight sync: no shared memory for buckets (%s)", exc)
    offer = group.exchange("shared-memory offer", f"{probe.name} {token.decode()}" if probe else "")[src]
    readable = False
    if offer:
        name, want = offer.split()
        try:
            with open(os.path.join(directory, name), "rb") as f:
                readable = f.read() == want.encode()
        except OSError:
            pass
    answers = group.exchange("shared-memory answers", "1" if readable else "0")
    if probe is not None:
        probe.unlink()
        lacking = [group.labels[r] for r, a in enumerate(answers) if a != "1"]
        if lacking:
            log.info("weight sync: buckets go over the network: %s cannot read %s (another host?)",
                     ", ".join(lacking), directory)
    return all(a == "1" for a in answers)


class SenderSegments:
    """The sender's segment per payload slot, grown as buckets need, and the names to remove.

    A name is removed once every receiver has mapped its segment: after the next fence (every
    receiver has then read the header naming it) or at the next transfer's start.
    """

    def __init__(self, directory: str = DEFAULT_DIR):
        self.directory = directory
        self._slots: list[Segment | None] = [None, None]
        self._named: list[Segment] = []   # created; some receiver may not have mapped it yet
        self.unavailable: str | None = None

    def for_bucket(self, slot: int, nbytes: int) -> Segment | None:
        """A segment of at least `nbytes` for `slot`, or None if none can be made (said once)."""
        seg = self._slots[slot]
        if seg is not None and seg.tensor.numel() >= nbytes:
            return seg
        try:
            new = Segment(nbytes, self.directory)
        except SegmentUnavailable as exc:
            if self.unavailable is None:
                log.warning("weight sync: %s; buckets that do not fit go over the network "
                            "(weights/via_shared_memory < 1). Give /dev/shm more space (docker: "
                            "--shm-size) or set placement.weight_sync_shared_memory=false.", exc)
            self.unavailable = str(exc)
            return None
        if seg is not None:
            seg.unlink()   # its bucket was read (the slot's fence passed); mappings stay valid
        self._slots[slot] = new
        self._named.append(new)
        return new

    def all_mapped(self) -> None:
        """Every receiver has mapped every segment named so far: remove their names."""
        for seg in self._named:
            seg.unlink()
        self._named.clear()

    def close(self) -> None:
        self.all_mapped()
        for seg in self._slots:
            if seg is not None:
                seg.unlink()
        self._slots = [None, None]


class ReceiverViews:
    """A receiver's read-only mapping per payload slot, remapped when the sender names another."""

    def __init__(self, directory: str = DEFAULT_DIR):
        self.directory = directory
        self._slots: dict[int, tuple[str, torch.Tensor]] = {}

    def view(self, slot: int, name: str) -> torch.Tensor:
        if slot not in self._slots or self._slots[slot][0] != name:
            self._slots.pop(slot, None)
            try:
                self._slots[slot] = (name, map_readonly(self.directory, name))
            except FileNotFoundError as exc:
                raise WeightSyncError(f"weight sync: the sender's segment {name} is gone from "
                                      f"{self.directory} before this receiver mapped it") from exc
        return self._slots[slot][1]

    def close(self) -> None:
        self._slots.clear()


def remove_dead_senders_segments(directory: str = DEFAULT_DIR) -> list[str]:
    """Remove segments whose creating process no longer runs (a sender killed mid-sync); their names."""
    removed = []
    try:
        names = os.listdir(directory)
    except OSError:
        return removed
    for name in names:
        pid = name.removeprefix(_PREFIX).split("-", 1)[0]
        if not name.startswith(_PREFIX) or not pid.isdigit() or psutil.pid_exists(int(pid)):
            continue
        try:
            os.unlink(os.path.join(directory, name))
            removed.append(name)
        except OSError:
            pass
    return removed
