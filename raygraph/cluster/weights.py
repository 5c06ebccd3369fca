"""Weight sync: policy -> rollout, bucket by bucket, every bucket verified by the receiver.

Two transports behind one small interface (`WeightTransport`):

* `InProcessTransport` (colocated/fused actors): the policy's buckets are handed to the rollout
  worker in the same process; no copy over the network.
* `CollectiveTransport` (disaggregated): a bucketed broadcast from the policy's rank 0 to every
  rollout rank over a `ray.util.collective` group. Per bucket: a fixed-size header (meta length,
  payload length, then the meta as JSON (never unpickled): names, shapes, dtypes, offsets, checksum, version; a
  meta too long for it continues in a second broadcast) and one flat payload. An end marker
  (a header of zeros) closes a transfer. Each side reuses two payload
  buffers for every bucket of every sync (a fresh 64 MiB buffer costs more in page faults than
  the copy into it) and overlaps the broadcast of one bucket with packing, checksumming or
  loading the next.

Receivers recompute each bucket's checksum (`bucket_checksum`: XXH3-64 of the tensors' bytes on
CPU, integer sums on GPU) and compare it with the one the sender computed before the bytes left;
a mismatch is never loaded. `CollectiveTransport(verify=False)` skips both checksums (reported
as `weights/verified` = 0). Every transfer carries a `weight_version` that increases by one per
sync; the rollout stamps it on the rows it generates. The buckets a receiver hands to `load` may
be views into a reused buffer: `load` must copy a bucket before it asks for the next (see
`WeightTransport`).
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor, wait
from typing import Any, Protocol

import torch
import xxhash

from raygraph.cluster import collective
from raygraph.cluster.errors import WeightSyncError

__all__ = ["Bucket", "WeightTransport", "InProcessTransport", "CollectiveTransport",
           "bucket_checksum", "pack_bucket", "unpack_bucket", "combine_stats"]

Bucket = list[tuple[str, torch.Tensor]]
LoadFn = Callable[[Iterable[Bucket], int], Any]   # rollout_worker.load_weights(buckets, version)
_ALIGN = 16
_HEADER = 16 << 10   # bytes: two int64 lengths + the JSON meta of a typical bucket


def bucket_checksum(tensors: Iterable[torch.Tensor]) -> int:
    """A cheap digest of the tensors' bytes (XXH3-64 on CPU; integer sums on GPU).

    Each tensor's digest seeds the next one's, so a changed byte, a reordering or a missing
    tensor changes the result. Computed by the sender before the bytes leave and by the
    receiver on what it is about to load; both sides of one transport use the same device
    type, hence the same algorithm.
    """
    digest = 0
    for t in tensors:
        digest = _digest(t.detach().contiguous().reshape(-1).view(torch.uint8), digest)
    return digest


def _digest(raw: torch.Tensor, seed: int) -> int:
    # XXH3-64 runs at memory speed (~35 GB/s on one core; zlib's CRC-32: ~7) and xxhash >= 3.0
    # releases the GIL while hashing, so it overlaps the communication thread.
    if raw.is_cuda:
        return _device_digest(raw, seed)
    return xxhash.xxh3_64_intdigest(memoryview(raw.numpy()), seed)


def _device_digest(raw: torch.Tensor, seed: int) -> int:
    # Integer (wrapping) sums are order-independent, so the result is deterministic on GPU.
    pad = (-raw.numel()) % 4
    words = torch.nn.functional.pad(raw, (0, pad)).view(torch.int32).to(torch.int64)
    weights = torch.arange(words.numel(), device=raw.device, dtype=torch.int64) % 65521 + 1
    return hash((seed, int(words.sum()), int((words * weights).sum()), raw.numel())) & 0xFFFFFFFF


def pack_bucket(bucket: Bucket, device: torch.device, out: torch.Tensor | None = None, *,
                checksum: bool = True) -> tuple[dict, torch.Tensor]:
    """Copy a bucket into one flat uint8 payload; meta says how to cut it back into tensors.

    Args:
        bucket: (name, tensor) pairs.
        device: where a new payload is allocated.
        out: a flat uint8 buffer to pack into when it is large enough (the payload is then a
            view of its first bytes); otherwise a new one is allocated.
        checksum: compute `meta["checksum"]` (`bucket_checksum` of the tensors); else None
            (the receivers then load without verifying).
    """
    names, shapes, dtypes, offsets, end = [], [], [], [], 0
    for name, t in bucket:
        names.append(name)
        shapes.append(tuple(t.shape))
        dtypes.append(t.dtype)
        offsets.append(end)
        end += _aligned(t.numel() * t.element_size())
    fits = out is not None and out.numel() >= end
    payload = out[:end] if fits else torch.empty(end, dtype=torch.uint8, device=device)
    digest = 0
    for (_, t), off in zip(bucket, offsets):
        raw = t.detach().contiguous().reshape(-1).view(torch.uint8)
        payload[off:off + raw.numel()].copy_(raw)
        payload[off + raw.numel():off + _aligned(raw.numel())].zero_()   # deterministic padding
        if checksum:   # of the source, right after the copy read it (cache-warm); = bucket_checksum
            digest = _digest(raw, digest)
    meta = {"names": names, "shapes": shapes, "dtypes": dtypes, "offsets": offsets,
            "checksum": digest if checksum else None}
    return meta, payload


def unpack_bucket(meta: dict, payload: torch.Tensor) -> Bucket:
    """Views into `payload` (no copy), one per tensor named in `meta`."""
    out = []
    for name, shape, dtype, off in zip(meta["names"], meta["shapes"], meta["dtypes"], meta["offsets"]):
        n = int(torch.Size(shape).numel()) * torch.empty((), dtype=dtype).element_size()
        out.append((name, payload[off:off + n].view(dtype).view(shape)))
    return out


def _aligned(n: int) -> int:
    return (n + _ALIGN - 1) // _ALIGN * _ALIGN


def _corrupt(t: torch.Tensor) -> torch.Tensor:
    """A copy of `t` with its first byte flipped (tests use this to prove verification works)."""
    bad = t.detach().clone().contiguous()
    bad.reshape(-1).view(torch.uint8)[0] ^= 0xFF
    return bad


class WeightTransport(Protocol):
    """Moves buckets from the sender's worker to the receivers' workers.

    `send` runs on the sending process, `receive` on every receiving process; both return a
    stats dict (`weights/*` keys). New transports (CUDA IPC, engine-native) implement these two.

    Buffer contract: `receive` may hand `load` views into buffers it reuses, so `load` must copy
    (or otherwise finish with) each bucket before it asks the iterator for the next one, and
    must keep no reference to a bucket's tensors after that.
    """

    def send(self, buckets: Iterable[Bucket], version: int, *, corrupt_bucket: int | None = None) -> dict:
        ...

    def receive(self, load: LoadFn, *, strict: bool = True) -> dict:
        ...

    def close(self) -> None:
        ...


class InProcessTransport:
    """Sender and receiver live in one process (fused actor): buckets are handed over by reference.

    `send` only records the bucket stream; `receive` pulls it and hands each bucket to `load`.
    What is loaded is then the very tensors the sender produced, so there are no bytes in
    between to verify; a bucket that is not (the `corrupt_bucket` fault injection) is compared
    by digest with what was produced and loaded only if it matches. Two digests of every bucket
    cost 0.1 s of a 0.5-0.7 s sync of a 538 MB model into vLLM (docs/benchmarks.md, section 14).
    """

    def __init__(self) -> None:
        self._pending: tuple[Iterator[Bucket], int, int | None] | None = None

    def send(self, buckets: Iterable[Bucket], version: int, *, corrupt_bucket: int | None = None) -> dict:
        self._pending = (iter(buckets), version, corrupt_bucket)
        return {}

    def receive(self, load: LoadFn, *, strict: bool = True) -> dict:
        if self._pending is None:
            raise WeightSyncError("in-process receive without a matching send")
        source, version, corrupt = self._pending
        self._pending = None
        start, stats = time.perf_counter(), {"bytes": 0, "buckets": 0, "bad": []}

        def verified() -> Iterator[Bucket]:
            for index, produced in enumerate(source):
                bucket = [(produced[0][0], _corrupt(produced[0][1])), *produced[1:]] if index == corrupt else produced
                stats["buckets"] += 1
                stats["bytes"] += sum(t.numel() * t.element_size() for _, t in bucket)
                if bucket is not produced and (sent := bucket_checksum(t for _, t in produced)) != (
                        got := bucket_checksum(t for _, t in bucket)):
                    problem = _mismatch(version, index, bucket, sent, got)
                    if strict:
                        raise WeightSyncError(problem)
                    stats["bad"].append(problem)
                    continue
                yield bucket

        load(verified(), version)
        return _receiver_stats(version, stats, time.perf_counter() - start)

    def close(self) -> None:
        self._pending = None


def _mismatch(version: int, index: int, bucket: Bucket, sent: int, got: int) -> str:
    names = [name for name, _ in bucket]
    return (f"weight sync v{version}: bucket {index} ({len(names)} tensors, first {names[:3]}) "
            f"failed verification: sender checksum {sent:#018x}, receiver {got:#018x}; "
            f"the bucket was NOT loaded")


def _receiver_stats(version: int, stats: dict, seconds: float) -> dict:
    verified = not stats["bad"] and not stats.get("unchecked")   # unchecked: sent without checksums
    return {"weights/verified": float(verified), "weights/version": float(version),
            "weights/bytes": float(stats["bytes"]), "weights/buckets": float(stats["buckets"]),
            "weights/sync_s": seconds, "weights/errors": list(stats["bad"])}


def combine_stats(sender: dict, receivers: list[dict]) -> dict:
    """One `weights/*` dict for a sync: verified only if every receiver verified the same bytes."""
    versions = {r["weights/version"] for r in receivers}
    sent_bytes = sender.get("weights/bytes", receivers[0]["weights/bytes"] if receivers else 0.0)
    ok = (all(r["weights/verified"] == 1.0 for r in receivers) and len(versions) == 1
          and all(r["weights/bytes"] == sent_bytes for r in receivers))
    seconds = max([sender.get("weights/sync_s", 0.0)] + [r["weights/sync_s"] for r in receivers])
    out = {"weights/verified": 1.0 if ok else 0.0,
           "weights/version": max(versions) if versions else 0.0,
           "weights/bytes": float(sent_bytes), "weights/sync_s": seconds,
           "weights/receivers": float(len(receivers))}
    if seconds > 0:
        out["weights/gbytes_per_s"] = sent_bytes / seconds / 1e9
    return out


class CollectiveTransport:
    """Bucketed broadcast over a `ray.util.collective` group; rank `src` sends, the rest receive.

    Pipelined: a communication thread broadcasts bucket i while the calling thread packs and
    checksums bucket i + 1 (sender) or checks and loads bucket i - 1 (receiver); gloo/NCCL
    waits and xxhash release the GIL. Each side keeps two payload buffers (one on the wire, one
    being packed or loaded), sized to the largest bucket seen and reused by every bucket of
    every sync, so a steady-state sync touches no fresh pages. A receiver's buckets are views
    into those buffers: `load` must copy a bucket before it asks for the next one (the receive
    after next overwrites it).

    Args:
        group_name: a joined `raygraph.cluster.collective.StandaloneGroup` (via ray.util.collective).
        src: the sending rank within the group.
        verify: the sender checksums every bucket (receivers check what the sender chose).
    """

    def __init__(self, group_name: str, src: int = 0, *, verify: bool = True):
        self.group_name, self.src, self.verify = group_name, src, verify
        self._group = collective.group(group_name)
        self._device = self._group.device
        self._bufs = [torch.empty(0, dtype=torch.uint8, device=self._device) for _ in range(2)]
        self._comm = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"weights-{group_name}")
        self._send_failed: BaseException | None = None   # a failed broadcast leaves the group unusable

    def _buffer(self, slot: int, nbytes: int) -> torch.Tensor:
        """The first `nbytes` of payload buffer `slot` (0 or 1), grown when a bucket needs more."""
        if self._bufs[slot].numel() < nbytes:
            self._bufs[slot] = torch.empty(0, dtype=torch.uint8, device=self._device)   # free first
            self._bufs[slot] = torch.empty(nbytes, dtype=torch.uint8, device=self._device)
        return self._bufs[slot][:nbytes]

    def _bcast(self, tensor: torch.Tensor) -> None:
        import ray.util.collective as col

        col.broadcast(tensor, src_rank=self.src, group_name=self.group_name)

    def _send_one(self, parts: list[torch.Tensor]) -> None:
        # Communication thread, in submission order: after one failure, nothing more goes out.
        if self._send_failed is not None:
            raise WeightSyncError(f"weight sync over {self.group_name!r}: an earlier broadcast failed "
                                  f"({self._send_failed!r}); the group is out of step")
        try:
            for part in parts:   # as few broadcasts as possible
                self._bcast(part)
        except BaseException as exc:
            self._send_failed = exc
            raise

    def send(self, buckets: Iterable[Bucket], version: int, *, corrupt_bucket: int | None = None) -> dict:
        start, total, count = time.perf_counter(), 0, 0
        self._group.arrive(f"send v{version}")
        on_wire: list[Future | None] = [None, None]   # the send that last used each buffer
        try:
            for index, bucket in enumerate(buckets):
                slot = index % 2
                if on_wire[slot] is not None:
                    on_wire[slot].result()             # bucket index - 2 has left this buffer
                nbytes = sum(_aligned(t.numel() * t.element_size()) for _, t in bucket)
                meta, payload = pack_bucket(bucket, self._device, self._buffer(slot, nbytes),
                                            checksum=self.verify)
                meta.update(version=version, index=index)
                if index == corrupt_bucket:
                    payload[0] ^= 0xFF
                on_wire[slot] = self._comm.submit(self._send_one, [*_header(meta, payload, self._device), payload])
                total += sum(t.numel() * t.element_size() for _, t in bucket)
                count += 1
            for sent in on_wire:   # a failed bucket raises here, before the end marker goes out
                if sent is not None:
                    sent.result()
            end = torch.zeros(_HEADER, dtype=torch.uint8, device=self._device)
            self._comm.submit(self._send_one, [end]).result()
        finally:
            wait([f for f in on_wire if f is not None])   # never leave a broadcast reading a buffer
        return {"weights/bytes": float(total), "weights/buckets": float(count),
                "weights/version": float(version), "weights/sync_s": time.perf_counter() - start}

    def _recv_one(self, slot: int) -> tuple[dict, torch.Tensor] | None:
        # Communication thread: one bucket into payload buffer `slot`; None at the end marker.
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
        payload = self._buffer(slot, payload_len)
        self._bcast(payload)
        return decode_meta(raw), payload

    def _buckets(self) -> Iterator[tuple[dict, torch.Tensor]]:
        """(meta, payload) per bucket, receiving one bucket ahead into the other buffer.

        Asking for bucket i + 1 starts the receive of bucket i + 2 into bucket i's buffer.
        """
        slot, ahead = 0, self._comm.submit(self._recv_one, 0)
        while (item := ahead.result()) is not None:
            slot ^= 1
            ahead = self._comm.submit(self._recv_one, slot)
            yield item

    def receive(self, load: LoadFn, *, strict: bool = True) -> dict:
        """Receive one transfer and `load(buckets, version)` it.

        `load` gets views into this transport's reused buffers: it must copy a bucket (e.g.
        `param.copy_(tensor)`) before it asks for the next one, and keep no reference to it.
        """
        start, stats = time.perf_counter(), {"bytes": 0, "buckets": 0, "bad": [], "unchecked": 0}
        self._group.arrive("receive")
        stream = self._buckets()
        first = next(stream, None)
        if first is None:
            raise WeightSyncError(f"weight sync over {self.group_name!r}: the sender sent no buckets")
        version = int(first[0]["version"])

        def verified() -> Iterator[Bucket]:
            for meta, payload in _chain(first, stream):
                bucket = unpack_bucket(meta, payload)
                stats["buckets"] += 1
                stats["bytes"] += sum(t.numel() * t.element_size() for _, t in bucket)
                if meta["checksum"] is None:   # the sender chose not to checksum
                    stats["unchecked"] += 1
                    yield bucket
                    continue
                got = bucket_checksum(t for _, t in bucket)
                if got != meta["checksum"]:
                    problem = _mismatch(version, meta["index"], bucket, meta["checksum"], got)
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
        return _receiver_stats(version, stats, time.perf_counter() - start)

    def close(self) -> None:
        self._comm.shutdown(wait=False, cancel_futures=True)   # a broadcast stuck on a dead peer
        self._bufs = []                                         # fails when the group goes
        collective.leave(self.group_name)


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
