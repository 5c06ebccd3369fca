"""`CollectiveTransport` between two plain actors: reused and growing payload buffers, the
one-bucket-ahead receive, unverified sends, multi-tensor buckets, and the loader contract (copy
before asking for more)."""

from __future__ import annotations

import sys

import pytest
import torch


def _fill(n: int, version: int, index: int) -> torch.Tensor:
    """Distinct contents per (sync, bucket), so a bucket overwritten too early is caught."""
    return torch.arange(n, dtype=torch.float32) + 1000.0 * version + index


def _bucket(spec: int | tuple[int, ...], version: int, index: int) -> list[tuple[str, torch.Tensor]]:
    """Bucket `index`: one tensor `t{index}` of `spec` floats, or `t{index}.{j}` per size in a tuple."""
    if isinstance(spec, int):
        return [(f"t{index}", _fill(spec, version, index))]
    return [(f"t{index}.{j}", _fill(n, version, index) + 0.5 * j) for j, n in enumerate(spec)]


class _Peer:
    """Rank 0 sends buckets `t0, t1, ...` of the given sizes; rank 1 receives them."""

    def __init__(self, rank: int, group: str):
        self.rank, self.group = rank, group

    def open(self) -> tuple[str, int]:
        from raygraph.cluster import collective

        return collective.open_store(self.group, 2, 30.0)

    def join(self, addr: str, port: int) -> None:
        from raygraph.cluster import collective
        from raygraph.cluster.weights import CollectiveTransport

        collective.join(self.group, self.rank, 2, addr, port, device="cpu", timeout_s=30.0,
                        labels=["sender", "receiver"])
        self.transport = CollectiveTransport(self.group)

    def send(self, sizes: list, version: int, verify: bool = True, corrupt: int | None = None) -> dict:
        self.transport.verify = verify
        buckets = [_bucket(spec, version, i) for i, spec in enumerate(sizes)]
        stats = self.transport.send(buckets, version, corrupt_bucket=corrupt)
        intact = all(torch.equal(t, u) for i, spec in enumerate(sizes)
                     for (_, t), (_, u) in zip(buckets[i], _bucket(spec, version, i)))
        return {**stats, "sources_intact": intact}

    def receive(self, strict: bool = True, copy: bool = True) -> tuple[dict, dict, list[int], list[int]]:
        got: dict[str, torch.Tensor] = {}

        def load(buckets, version):
            for bucket in buckets:
                got.update({name: t.clone() if copy else t for name, t in bucket})

        stats = self.transport.receive(load, strict=strict)
        bufs = self.transport._bufs
        return stats, got, [b.data_ptr() for b in bufs], [b.numel() for b in bufs]

    def close(self) -> None:
        self.transport.close()


@pytest.fixture(scope="module")
def peers(ray_local):
    ray_local.cloudpickle.register_pickle_by_value(sys.modules[__name__])
    actor = ray_local.remote(num_cpus=0)(_Peer)
    sender, receiver = actor.remote(0, "test-weight-buffers"), actor.remote(1, "test-weight-buffers")
    addr, port = ray_local.get(sender.open.remote())
    ray_local.get([sender.join.remote(addr, port), receiver.join.remote(addr, port)])
    yield sender, receiver
    ray_local.get([sender.close.remote(), receiver.close.remote()])
    for a in (sender, receiver):
        ray_local.kill(a)


def _sync(ray, peers, sizes, version, **send_kwargs):
    sender, receiver = peers
    recv_kwargs = {k: send_kwargs.pop(k) for k in ("strict", "copy") if k in send_kwargs}
    _, received = ray.get([sender.send.remote(sizes, version, **send_kwargs), receiver.receive.remote(**recv_kwargs)])
    return received


def test_buffers_are_reused_grown_and_never_overwritten_before_load(ray_local, peers):
    # 5 buckets through 2 buffers: bucket i + 2 lands where bucket i was, after i was copied.
    sizes = [1000, 50_000, 1000, 20_000, 3000]
    stats, got, ptrs, numels = _sync(ray_local, peers, sizes, 1)
    assert stats["weights/verified"] == 1.0 and stats["weights/buckets"] == 5.0
    for i, n in enumerate(sizes):
        assert torch.equal(got[f"t{i}"], _fill(n, 1, i)), i
    assert numels == [3000 * 4, 50_000 * 4]   # each buffer sized to the largest bucket it carried

    stats, got, ptrs2, _ = _sync(ray_local, peers, sizes, 2)
    assert stats["weights/verified"] == 1.0 and torch.equal(got["t3"], _fill(20_000, 2, 3))
    assert ptrs2 == ptrs   # the second sync reused both buffers

    stats, got, ptrs3, numels3 = _sync(ray_local, peers, [200_000], 3)
    assert stats["weights/verified"] == 1.0 and torch.equal(got["t0"], _fill(200_000, 3, 0))
    assert numels3 == [200_000 * 4, 50_000 * 4] and ptrs3[1] == ptrs[1]   # only the too-small one grew


def test_views_are_reused_so_a_loader_must_copy(ray_local, peers):
    # The contract, pinned: views handed to `load` are overwritten by the receive after next.
    sizes = [1000, 1000, 1000]
    _, got, _, _ = _sync(ray_local, peers, sizes, 4, copy=False)
    assert torch.equal(got["t2"], _fill(1000, 4, 2))
    assert torch.equal(got["t0"], _fill(1000, 4, 2))   # bucket 0's buffer now holds bucket 2


def test_unverified_send_loads_and_says_so_corruption_still_caught(ray_local, peers):
    sizes = [1000, 2000, 3000]
    stats, got, _, _ = _sync(ray_local, peers, sizes, 5, verify=False)
    assert stats["weights/verified"] == 0.0 and not stats["weights/errors"]
    assert all(torch.equal(got[f"t{i}"], _fill(n, 5, i)) for i, n in enumerate(sizes))

    stats, got, _, _ = _sync(ray_local, peers, sizes, 6, corrupt=1, strict=False)
    assert stats["weights/verified"] == 0.0 and "bucket 1" in stats["weights/errors"][0]
    assert set(got) == {"t0", "t2"}   # the bad bucket was not loaded; the ones after it were
    assert _sync(ray_local, peers, sizes, 7)[0]["weights/verified"] == 1.0   # still in lock-step



def test_multi_tensor_buckets_and_corruption_spares_the_senders_tensors(ray_local, peers):
    # Several tensors per bucket, one of them larger than 1 MiB; corruption is applied to the
    # packed copy only, so the sender's tensors (live weights in a real sync) stay intact.
    sizes = [(10, 300_000, 7, 3), (300_000,), 1000]
    sent, (stats, got, _, _) = ray_local.get([peers[0].send.remote(sizes, 8), peers[1].receive.remote()])
    assert stats["weights/verified"] == 1.0 and sent["sources_intact"]
    want = {name: t for i, spec in enumerate(sizes) for name, t in _bucket(spec, 8, i)}
    assert set(got) == set(want) and all(torch.equal(got[k], want[k]) for k in want)

    sent, (stats, got, _, _) = ray_local.get([peers[0].send.remote(sizes, 9, corrupt=0),
                                              peers[1].receive.remote(strict=False)])
    assert stats["weights/verified"] == 0.0 and "bucket 0" in stats["weights/errors"][0]
    assert sent["sources_intact"] and set(got) == {"t1.0", "t2"}


def test_a_failed_broadcast_stops_the_send_and_is_raised():
    """Bucket 1's broadcast fails on the communication thread: send raises it, nothing after it
    (bucket 2, the end marker) goes out, and later sends refuse at once."""
    from concurrent.futures import ThreadPoolExecutor

    from raygraph.cluster.errors import WeightSyncError
    from raygraph.cluster.weights import CollectiveTransport

    class _Group:
        def arrive(self, what: str) -> None:
            pass

    sent: list[int] = []

    def bcast(tensor: torch.Tensor) -> None:
        if len(sent) == 2:   # bucket 0 = header + payload; the next broadcast is bucket 1's header
            raise RuntimeError("gloo: connection reset")
        sent.append(tensor.numel())

    transport = CollectiveTransport.__new__(CollectiveTransport)
    transport.group_name, transport.src, transport.verify = "g", 0, True
    transport._group, transport._device = _Group(), torch.device("cpu")
    transport._bufs = [torch.empty(0, dtype=torch.uint8) for _ in range(2)]
    transport._comm, transport._send_failed = ThreadPoolExecutor(max_workers=1), None
    transport._bcast = bcast
    with pytest.raises(RuntimeError, match="connection reset"):
        transport.send([_bucket(8, 1, i) for i in range(3)], 1)
    assert len(sent) == 2                      # no bucket 2, no end marker
    with pytest.raises(WeightSyncError, match="earlier broadcast failed"):
        transport.send([_bucket(8, 2, 0)], 2)
    assert len(sent) == 2
