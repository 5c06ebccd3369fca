"""`CollectiveTransport`: a policy rank's weights to every rollout rank of a collective group.

Per bucket the sender broadcasts a fixed-size header (meta length, payload length, then the
meta as JSON, never unpickled: names, shapes, dtypes, offsets, checksum, version, segment; a
meta too long for it continues in a second broadcast), then the flat payload. An end marker (a
header of zeros) closes a transfer.

Where the payload goes:

* **through shared memory** when every receiver can read a segment the sender creates in
  `/dev/shm` (one host; checked once per group by `shared_segments.agree`, and switched off by
  `placement.weight_sync_shared_memory=false`). The sender packs each bucket into one of two
  segments and the broadcast carries only the header that names it; receivers checksum and load
  the bucket where it lies. A fence (a barrier in the group's stream) before bucket i + 2 reuses
  bucket i's segment holds the sender back until every receiver has asked for bucket i + 1, that
  is, finished with bucket i. A bucket with no segment to go in (a full `/dev/shm`) is broadcast.
* **over the group** otherwise (other hosts; GPUs, where NCCL moves it): each side reuses two
  payload buffers for every bucket of every sync (a fresh 64 MiB buffer costs more in page
  faults than the copy into it).

Either way the sender packs and checksums bucket i + 1 while bucket i is on its way, and a
receiver receives bucket i + 1 while it checks and loads bucket i (gloo/NCCL waits and xxhash
release the GIL). A bucket going through shared memory is packed with one torch thread: the
receivers share the sender's host and cores, their loads are the slower side (a loaded bucket is
re-packed by the engine), and a second packing thread only competed with them for cores
(docs/benchmarks.md, section 22); producing the buckets keeps the sender's threads.

What a receiver hands to `load` are views into reused memory: `load` must copy a bucket before it
asks for the next one (the receive after next overwrites it).
"""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor, wait
from typing import Any

import torch

from raygraph.cluster import collective, shared_segments
from raygraph.cluster.errors import WeightSyncError
from raygraph.cluster.weights import (
    Bucket,
    LoadFn,
    aligned,
    bucket_checksum,
    mismatch,
    pack_bucket,
    receiver_stats,
    unpack_bucket,
)

__all__ = ["CollectiveTransport", "encode_meta", "decode_meta"]

_HEADER = 16 << 10   # bytes: two int64 lengths + the JSON meta of a typical bucket


class CollectiveTransport:
    """Bucketed weight transfer over a `ray.util.collective` group; rank `src` sends, the rest receive.

    Args:
        group_name: a joined `raygraph.cluster.collective.StandaloneGroup` (via ray.util.collective).
        src: the sending rank within the group.
        verify: the sender checksums every bucket (receivers check what the sender chose).
        shared_memory: carry payloads through `shm_dir` when every member can read it (CPU only).
            Every member of the group must pass the same value: they agree on it collectively.
        shm_dir: where segments are made (tests point it elsewhere).
    """

    def __init__(self, group_name: str, src: int = 0, *, verify: bool = True, shared_memory: bool = True,
                 shm_dir: str = shared_segments.DEFAULT_DIR):
        self.group_name, self.src, self.verify = group_name, src, verify
        self._group = collective.group(group_name)
        self._device = self._group.device
        self._bufs = [torch.empty(0, dtype=torch.uint8, device=self._device) for _ in range(2)]
        self._comm = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"weights-{group_name}")
        self._send_failed: BaseException | None = None   # a failed broadcast leaves the group unusable
        self.shared = (shared_memory and self._device.type == "cpu"
                       and shared_segments.agree(self._group, src, shm_dir))
        self._segments = shared_segments.SenderSegments(shm_dir)
        self._views = shared_segments.ReceiverViews(shm_dir)

    def _buffer(self, slot: int, nbytes: int) -> torch.Tensor:
        """The first `nbytes` of payload buffer `slot` (0 or 1), grown when a bucket needs more."""
        if self._bufs[slot].numel() < nbytes:
            self._bufs[slot] = torch.empty(0, dtype=torch.uint8, device=self._device)   # free first
            self._bufs[slot] = torch.empty(nbytes, dtype=torch.uint8, device=self._device)
        return self._bufs[slot][:nbytes]

    def _bcast(self, tensor: torch.Tensor) -> None:
        import ray.util.collective as col

        col.broadcast(tensor, src_rank=self.src, group_name=self.group_name)

    def _fenced(self, index: int) -> bool:
        # Bucket `index` (or the end marker at that index) reuses bucket index - 2's segment.
        return self.shared and index >= 2

    def _send_one(self, parts: list[torch.Tensor], fence: bool = False) -> None:
        # Communication thread, in submission order: after one failure, nothing more goes out.
        if self._send_failed is not None:
            raise WeightSyncError(f"weight sync over {self.group_name!r}: an earlier broadcast failed "
                                  f"({self._send_failed!r}); the group is out of step")
        try:
            if fence:
                self._group.fence()
            for part in parts:   # as few broadcasts as possible
                self._bcast(part)
        except BaseException as exc:
            self._send_failed = exc
            raise

    def send(self, buckets: Iterable[Bucket], version: int, *, corrupt_bucket: int | None = None) -> dict:
        start, total, count = time.perf_counter(), 0, 0
        self._group.arrive(f"send v{version}")
        self._segments.all_mapped()   # every receiver finished the last transfer
        on_wire: list[Future | None] = [None, None]   # the send that last used each buffer
        try:
            for index, bucket in enumerate(buckets):
                slot = index % 2
                if self._fenced(index):   # every receiver is done with bucket index - 2
                    self._comm.submit(self._send_one, [], fence=True).result()
                    self._segments.all_mapped()
                if on_wire[slot] is not None:
                    on_wire[slot].result()             # bucket index - 2 has left this buffer
                nbytes = sum(aligned(t.numel() * t.element_size()) for _, t in bucket)
                segment = self._segments.for_bucket(slot, nbytes) if self.shared else None
                target = segment.tensor[:nbytes] if segment else self._buffer(slot, nbytes)
                with _torch_threads(1) if segment else contextlib.nullcontext():
                    meta, payload = pack_bucket(bucket, self._device, target, checksum=self.verify)
                meta.update(version=version, index=index, segment=segment.name if segment else None)
                if index == corrupt_bucket:
                    payload[0] ^= 0xFF
                parts = _header(meta, payload, self._device) + ([] if segment else [payload])
                on_wire[slot] = self._comm.submit(self._send_one, parts)
                total += sum(t.numel() * t.element_size() for _, t in bucket)
                count += 1
            for sent in on_wire:   # a failed bucket raises here, before the end marker goes out
                if sent is not None:
                    sent.result()
            end = torch.zeros(_HEADER, dtype=torch.uint8, device=self._device)
            self._comm.submit(self._send_one, [end], fence=self._fenced(count)).result()
        finally:
            wait([f for f in on_wire if f is not None])   # never leave a broadcast reading a buffer
        return {"weights/bytes": float(total), "weights/buckets": float(count),
                "weights/version": float(version), "weights/sync_s": time.perf_counter() - start}

    def _recv_one(self, slot: int, index: int) -> tuple[dict, Bucket, int | None] | None:
        # Communication thread: bucket `index` (into payload slot `slot`) and the checksum of what
        # arrived, computed here while the caller loads the bucket before; None at the end marker.
        if self._fenced(index):   # pairs with the sender's fence: bucket index - 2 is done with
            self._group.fence()
        header = torch.empty(_HEADER, dtype=torch.uint8, device=self._device)
        self._bcast(header)
        header = header.cpu()
        meta_len, payload_len = (int(x) for x in header[:16].view(torch.int64))
        if meta_len == 0:
            return None
        raw = header[16:16 + meta_len].numpy().tobytes()
        if meta_len > _HEADER - 16:
            rest = torch.empty(meta_len - (_HEADER - 16), dtype=torch.uint8, device=self._device)
            self._bcast(rest)
            raw += rest.cpu().numpy().tobytes()
        meta = decode_meta(raw)
        if meta.get("segment"):
            payload = self._views.view(slot, meta["segment"])[:payload_len]
        else:
            payload = self._buffer(slot, payload_len)
            self._bcast(payload)
        bucket = unpack_bucket(meta, payload)
        got = None if meta["checksum"] is None else bucket_checksum(t for _, t in bucket)
        return meta, bucket, got

    def _buckets(self) -> Iterator[tuple[dict, Bucket, int | None]]:
        """(meta, bucket, checksum) per bucket, receiving one bucket ahead into the other slot.

        Asking for bucket i + 1 starts the receive of bucket i + 2 into bucket i's slot.
        """
        index, ahead = 0, self._comm.submit(self._recv_one, 0, 0)
        while (item := ahead.result()) is not None:
            index += 1
            ahead = self._comm.submit(self._recv_one, index % 2, index)
            yield item

    def receive(self, load: LoadFn, *, strict: bool = True) -> dict:
        """Receive one transfer and `load(buckets, version)` it.

        `load` gets views into this transport's reused memory: it must copy a bucket (e.g.
        `param.copy_(tensor)`) before it asks for the next one, and keep no reference to it.
        """
        start = time.perf_counter()
        stats = {"bytes": 0, "buckets": 0, "bad": [], "unchecked": 0, "shared": 0}
        self._group.arrive("receive")
        stream = self._buckets()
        first = next(stream, None)
        if first is None:
            raise WeightSyncError(f"weight sync over {self.group_name!r}: the sender sent no buckets")
        version = int(first[0]["version"])

        def verified() -> Iterator[Bucket]:
            for meta, bucket, got in _chain(first, stream):
                stats["buckets"] += 1
                stats["shared"] += bool(meta.get("segment"))
                stats["bytes"] += sum(t.numel() * t.element_size() for _, t in bucket)
                if meta["checksum"] is None:   # the sender chose not to checksum
                    stats["unchecked"] += 1
                    yield bucket
                    continue
                if got != meta["checksum"]:
                    problem = mismatch(version, meta["index"], bucket, meta["checksum"], got)
                    if strict:
                        raise WeightSyncError(problem)
                    stats["bad"].append(problem)
                    continue
                yield bucket

        try:
            load(verified(), version)
        finally:
            for _ in stream:   # keep the group in lock-step even if loading stopped early
                pass
        return receiver_stats(version, stats, time.perf_counter() - start)

    def close(self) -> None:
        self._comm.shutdown(wait=False, cancel_futures=True)   # a broadcast stuck on a dead peer
        self._bufs = []                                         # fails when the group goes
        self._segments.close()
        self._views.close()
        collective.leave(self.group_name)


@contextlib.contextmanager
def _torch_threads(n: int) -> Iterator[None]:
    """torch's intra-op threads of the calling thread set to `n` for the block, then restored."""
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def _header(meta: dict, payload: torch.Tensor, device: torch.device) -> list[torch.Tensor]:
    """The header broadcast(s) of one bucket: lengths + JSON meta in `_HEADER` bytes (+ the rest)."""
    raw = encode_meta(meta)
    header = torch.zeros(_HEADER, dtype=torch.uint8)
    header[:16].view(torch.int64)[:] = torch.tensor([len(raw), payload.numel()])
    head = raw[:_HEADER - 16]
    header[16:16 + len(head)] = torch.frombuffer(bytearray(head), dtype=torch.uint8)
    parts = [header.to(device)]
    if len(raw) > len(head):
        parts.append(torch.frombuffer(bytearray(raw[len(head):]), dtype=torch.uint8).to(device))
    return parts


def encode_meta(meta: dict) -> bytes:
    """A bucket's meta as JSON bytes: dtypes by name, shapes as lists (a receiver never unpickles
    what a peer sent, so a process that joins the group cannot run code in the rollout)."""
    return json.dumps({**meta, "dtypes": [str(d).removeprefix("torch.") for d in meta["dtypes"]],
                       "shapes": [list(s) for s in meta["shapes"]]}).encode()


def decode_meta(raw: bytes) -> dict:
    """Inverse of `encode_meta`; a dtype that is not a torch dtype is refused."""
    meta = json.loads(raw)
    dtypes = [getattr(torch, name, None) for name in meta["dtypes"]]
    if not all(isinstance(d, torch.dtype) for d in dtypes):
        raise WeightSyncError(f"weight-sync bucket names unknown dtypes {meta['dtypes']}")
    return {**meta, "dtypes": dtypes, "shapes": [tuple(s) for s in meta["shapes"]]}


def _chain(first: Any, rest: Iterator[Any]) -> Iterator[Any]:
    # Not `yield from`: closing this generator must not close `rest`, which is drained after.
    yield first
    for item in rest:  # noqa: UP028
        yield item
