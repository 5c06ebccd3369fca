"""Weight sync: policy -> rollout, bucket by bucket, every bucket verified by the receiver.

Two transports behind one small interface (`WeightTransport`):

* `InProcessTransport` (colocated/fused actors): the policy's buckets are handed to the rollout
  worker in the same process; no copy over the network.
* `CollectiveTransport` (disaggregated, `raygraph.cluster.collective_transport`): a bucketed
  broadcast from the policy's rank 0 to every rollout rank over a `ray.util.collective` group;
  between processes of one host the buckets themselves go through shared memory.

Receivers recompute each bucket's checksum (`bucket_checksum`: XXH3-64 of the tensors' bytes on
CPU, integer sums on GPU) and compare it with the one the sender computed before the bytes left;
a mismatch is never loaded. `CollectiveTransport(verify=False)` skips both checksums (reported
as `weights/verified` = 0). Every transfer carries a `weight_version` that increases by one per
sync; the rollout stamps it on the rows it generates. The buckets a receiver hands to `load` may
be views into a reused buffer: `load` must copy a bucket before it asks for the next (see
`WeightTransport`).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any, Protocol

import torch
import xxhash

from raygraph.cluster.errors import WeightSyncError

__all__ = ["Bucket", "WeightTransport", "InProcessTransport", "bucket_checksum", "pack_bucket",
           "unpack_bucket", "combine_stats", "aligned", "mismatch", "receiver_stats"]

Bucket = list[tuple[str, torch.Tensor]]
LoadFn = Callable[[Iterable[Bucket], int], Any]   # rollout_worker.load_weights(buckets, version)
_ALIGN = 16


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
        end += aligned(t.numel() * t.element_size())
    fits = out is not None and out.numel() >= end
    payload = out[:end] if fits else torch.empty(end, dtype=torch.uint8, device=device)
    digest = 0
    for (_, t), off in zip(bucket, offsets):
        raw = t.detach().contiguous().reshape(-1).view(torch.uint8)
        payload[off:off + raw.numel()].copy_(raw)
        payload[off + raw.numel():off + aligned(raw.numel())].zero_()   # deterministic padding
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


def aligned(n: int) -> int:
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
                    problem = mismatch(version, index, bucket, sent, got)
                    if strict:
                        raise WeightSyncError(problem)
                    stats["bad"].append(problem)
                    continue
                yield bucket

        load(verified(), version)
        return receiver_stats(version, stats, time.perf_counter() - start)

    def close(self) -> None:
        self._pending = None


def mismatch(version: int, index: int, bucket: Bucket, sent: int, got: int) -> str:
    names = [name for name, _ in bucket]
    return (f"weight sync v{version}: bucket {index} ({len(names)} tensors, first {names[:3]}) "
            f"failed verification: sender checksum {sent:#018x}, receiver {got:#018x}; "
            f"the bucket was NOT loaded")


def receiver_stats(version: int, stats: dict, seconds: float) -> dict:
    verified = not stats["bad"] and not stats.get("unchecked")   # unchecked: sent without checksums
    out = {"weights/verified": float(verified), "weights/version": float(version),
           "weights/bytes": float(stats["bytes"]), "weights/buckets": float(stats["buckets"]),
           "weights/sync_s": seconds, "weights/errors": list(stats["bad"])}
    if "shared" in stats:   # a collective group: the share of buckets read from shared memory
        out["weights/via_shared_memory"] = stats["shared"] / max(stats["buckets"], 1)
    return out


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
    shared = [r["weights/via_shared_memory"] for r in receivers if "weights/via_shared_memory" in r]
    if shared:
        out["weights/via_shared_memory"] = min(shared)
    if seconds > 0:
        out["weights/gbytes_per_s"] = sent_bytes / seconds / 1e9
    return out
