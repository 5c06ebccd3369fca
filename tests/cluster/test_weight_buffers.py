"""`CollectiveTransport` between two plain actors, with payloads over gloo (as between hosts) and
through shared memory (one host): reused and growing payload memory, the one-bucket-ahead
receive, unverified sends, multi-tensor buckets, the loader contract (copy before asking for
more); and, for shared memory, the fence that keeps a slow loader's bucket intact, segment names
removed once mapped, and the fallbacks (another host, a full /dev/shm)."""

from __future__ import annotations

import os
import sys
import time

import pytest
import torch

from raygraph.cluster.shared_segments import Segment, remove_dead_senders_segments


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

    def __init__(self, rank: int, group: str, shared_memory: bool = False, shm_dir: str = "/dev/shm"):
        self.rank, self.group = rank, group
        self.shared_memory, self.shm_dir = shared_memory, shm_dir

    def open(self) -> tuple[str, int]:
        from raygraph.cluster import collective

        return collective.open_store(self.group, 2, 30.0)

    def join(self, addr: str, port: int) -> None:
        from raygraph.cluster import collective
        from raygraph.cluster.collective_transport import CollectiveTransport

        collective.join(self.group, self.rank, 2, addr, port, device="cpu", timeout_s=30.0,
                        labels=["sender", "receiver"])
        self.transport = CollectiveTransport(self.group, shared_memory=self.shared_memory, shm_dir=self.shm_dir)

    def send(self, sizes: list, version: int, verify: bool = True, corrupt: int | None = None) -> dict:
        self.transport.verify = verify
        buckets = [_bucket(spec, version, i) for i, spec in enumerate(sizes)]
        stats = self.transport.send(buckets, version, corrupt_bucket=corrupt)
        intact = all(torch.equal(t, u) for i, spec in enumerate(sizes)
                     for (_, t), (_, u) in zip(buckets[i], _bucket(spec, version, i)))
        return {**stats, "sources_intact": intact}

    def send_counting_threads(self, sizes: list, version: int) -> tuple[list[int], list[int], int]:
        """Send with 2 torch threads set: the threads in effect as each bucket was taken, as it was
        packed, and after."""
        from raygraph.cluster import collective_transport

        before, pack = torch.get_num_threads(), collective_transport.pack_bucket
        taking, packing = [], []

        def buckets():
            for i, spec in enumerate(sizes):
                taking.append(torch.get_num_threads())
                yield _bucket(spec, version, i)

        def counted(*args, **kwargs):
            packing.append(torch.get_num_threads())
            return pack(*args, **kwargs)

        torch.set_num_threads(2)
        collective_transport.pack_bucket = counted
        try:
            self.transport.send(buckets(), version)
            return taking, packing, torch.get_num_threads()
        finally:
            collective_transport.pack_bucket = pack
            torch.set_num_threads(before)

    def receive(self, strict: bool = True, copy: bool = True,
                pause_s: float = 0.0) -> tuple[dict, dict, list[int], list[int]]:
        got: dict[str, torch.Tensor] = {}

        def load(buckets, version):
            for bucket in buckets:
                time.sleep(pause_s)   # a slow loader: the sender must not reuse its bucket's memory
                got.update({name: t.clone() if copy else t for name, t in bucket})

        stats = self.transport.receive(load, strict=strict)
        slots = self.slots()
        return stats, got, [b.data_ptr() for b in slots], [b.numel() for b in slots]

    def slots(self) -> list[torch.Tensor]:
        """The receiver's payload memory per slot: its buffers, or its mappings of the sender's segments."""
        if self.transport.shared:
            views = self.transport._views._slots
            return [views[slot][1] for slot in sorted(views)]
        return self.transport._bufs

    def shared(self) -> bool:
        return self.transport.shared

    def pid(self) -> int:
        return os.getpid()

    def segments_unavailable(self) -> None:
        """From now on no segment can be made (as with a full /dev/shm)."""
        self.transport._segments.directory = "/nonexistent/raygraph-test"

    def close(self) -> None:
        self.transport.close()


def _pair(ray, name: str, shared_memory: bool, dirs: tuple[str, str]):
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
    actor = ray.remote(num_cpus=0)(_Peer)
    sender, receiver = (actor.remote(rank, name, shared_memory, d) for rank, d in enumerate(dirs))
    addr, port = ray.get(sender.open.remote())
    ray.get([sender.join.remote(addr, port), receiver.join.remote(addr, port)])
    return sender, receiver


def _close(ray, pair) -> None:
    ray.get([a.close.remote() for a in pair])
    for a in pair:
        ray.kill(a)


@pytest.fixture(scope="module")
def gloo_peers(ray_local):
    """A sender and a receiver whose payloads go over gloo (as between hosts)."""
    pair = _pair(ray_local, "test-weight-buffers-gloo", False, ("/dev/shm", "/dev/shm"))
    assert ray_local.get([a.shared.remote() for a in pair]) == [False, False]
    yield pair
    _close(ray_local, pair)


@pytest.fixture(scope="module")
def shm_dir(tmp_path_factory) -> str:
    return str(tmp_path_factory.mktemp("shm"))


@pytest.fixture(scope="module")
def shm_peers(ray_local, shm_dir):
    """A sender and a receiver that agreed on payloads through shared memory (segments in `shm_dir`)."""
    pair = _pair(ray_local, "test-weight-buffers-shm", True, (shm_dir, shm_dir))
    assert ray_local.get([a.shared.remote() for a in pair]) == [True, True]
    yield pair
    _close(ray_local, pair)
    assert os.listdir(shm_dir) == []   # closing removed every segment's name


@pytest.fixture(params=["gloo_peers", "shm_peers"])
def peers(request):
    return request.getfixturevalue(request.param)


def _sync(ray, peers, sizes, version, **send_kwargs):
    sender, receiver = peers
    recv_kwargs = {k: send_kwargs.pop(k) for k in ("strict", "copy", "pause_s") if k in send_kwargs}
    _, received = ray.get([sender.send.remote(sizes, version, **send_kwargs), receiver.receive.remote(**recv_kwargs)])
    return received


def test_buffers_are_reused_grown_and_never_overwritten_before_load(ray_local, peers):
    # 5 buckets through 2 buffers: bucket i + 2 lands where bucket i was, after i was copied.
    sizes = [1000, 50_000, 1000, 20_000, 3000]
    stats, got, ptrs, numels = _sync(ray_local, peers, sizes, 1)
    assert stats["weights/verified"] == 1.0 and stats["weights/buckets"] == 5.0
    assert stats["weights/via_shared_memory"] == float(ray_local.get(peers[1].shared.remote()))
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

    from raygraph.cluster.collective_transport import CollectiveTransport
    from raygraph.cluster.errors import WeightSyncError
    from raygraph.cluster.shared_segments import SenderSegments

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
    transport.shared, transport._segments = False, SenderSegments()
    transport._bcast = bcast
    with pytest.raises(RuntimeError, match="connection reset"):
        transport.send([_bucket(8, 1, i) for i in range(3)], 1)
    assert len(sent) == 2                      # no bucket 2, no end marker
    with pytest.raises(WeightSyncError, match="earlier broadcast failed"):
        transport.send([_bucket(8, 2, 0)], 2)
    assert len(sent) == 2


def test_a_slow_loader_still_loads_every_bucket_as_sent(ray_local, peers):
    # Through shared memory the sender reuses bucket i's segment for bucket i + 2 only after the
    # fence that the receiver reaches when it asks for bucket i + 1: a loader that dawdles before
    # copying (the bucket already verified) still copies what was sent.
    sizes = [4000] * 5
    stats, got, _, _ = _sync(ray_local, peers, sizes, 10, pause_s=0.25)
    assert stats["weights/verified"] == 1.0
    assert all(torch.equal(got[f"t{i}"], _fill(n, 10, i)) for i, n in enumerate(sizes))


def test_segment_names_go_once_mapped_and_a_dead_senders_segments_are_removed(ray_local, shm_peers, shm_dir):
    sizes = [1000, 60_000, 1000]   # bucket 1 outgrows slot 1's segment: a new one is made
    for version in (20, 21):
        stats, got, _, _ = _sync(ray_local, shm_peers, sizes, version)
        assert stats["weights/via_shared_memory"] == 1.0 and torch.equal(got["t1"], _fill(60_000, version, 1))
    assert os.listdir(shm_dir) == []   # the second sync needed no new segment; the old names are gone

    sender_pid = ray_local.get(shm_peers[0].pid.remote())
    dead = f"raygraph-weights-{2**22 + 12345}-0badc0de"   # above Linux's largest pid: never running
    live = f"raygraph-weights-{sender_pid}-0badc0de"
    for name in (dead, live):
        open(os.path.join(shm_dir, name), "wb").close()
    assert remove_dead_senders_segments(shm_dir) == [dead]
    assert os.listdir(shm_dir) == [live]
    os.unlink(os.path.join(shm_dir, live))


def test_through_shared_memory_the_sender_packs_with_one_thread(ray_local, peers):
    # On one host the receivers' loads share the sender's cores: a second packing thread only
    # competed with them (docs/benchmarks.md section 22). Producing the buckets keeps the
    # sender's threads; between hosts nothing changes.
    sender, receiver = peers
    shared = ray_local.get(sender.shared.remote())
    (taking, packing, after), _ = ray_local.get([sender.send_counting_threads.remote([1000, 2000, 3000], 40),
                                                 receiver.receive.remote()])
    assert packing == ([1, 1, 1] if shared else [2, 2, 2])
    assert taking == [2, 2, 2] and after == 2


def test_a_senders_segment_is_mapped_with_its_pages_in_place():
    # MAP_POPULATE: packing the first bucket into a new 64 MiB segment takes no page fault per
    # 4 KiB page (16k faults without it).
    import mmap
    import resource

    if not (os.path.isdir("/dev/shm") and hasattr(mmap, "MAP_POPULATE")):
        pytest.skip("needs /dev/shm and MAP_POPULATE (Linux)")
    segment = Segment(64 << 20, "/dev/shm")
    try:
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        segment.tensor.fill_(7)
        faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
    finally:
        segment.unlink()
    assert faults < (64 << 20) // 4096 // 20


def test_a_receiver_that_cannot_read_the_senders_memory_gets_every_byte_over_gloo(ray_local, tmp_path):
    # Another host: the receiver does not see the sender's /dev/shm (here: another folder).
    mine, theirs = tmp_path / "sender", tmp_path / "receiver"
    mine.mkdir(), theirs.mkdir()
    pair = _pair(ray_local, "test-weight-buffers-hosts", True, (str(mine), str(theirs)))
    try:
        assert ray_local.get([a.shared.remote() for a in pair]) == [False, False]
        stats, got, _, _ = _sync(ray_local, pair, [1000, 2000, 3000], 1)
        assert stats["weights/verified"] == 1.0 and stats["weights/via_shared_memory"] == 0.0
        assert all(torch.equal(got[f"t{i}"], _fill(n, 1, i)) for i, n in enumerate([1000, 2000, 3000]))
    finally:
        _close(ray_local, pair)
    assert os.listdir(mine) == [] and os.listdir(theirs) == []


def test_a_bucket_that_finds_no_shared_memory_goes_over_gloo_and_is_counted(ray_local, shm_peers):
    # As with a full /dev/shm: segments already made are still used; a bucket that needs a new
    # one is broadcast instead, the sync stays verified and weights/via_shared_memory says so.
    _sync(ray_local, shm_peers, [1000, 1000], 30)
    ray_local.get(shm_peers[0].segments_unavailable.remote())
    sizes = [1000, 1000, 500_000]
    stats, got, _, _ = _sync(ray_local, shm_peers, sizes, 31)
    assert stats["weights/verified"] == 1.0 and stats["weights/via_shared_memory"] == pytest.approx(2 / 3)
    assert all(torch.equal(got[f"t{i}"], _fill(n, 31, i)) for i, n in enumerate(sizes))
    assert _sync(ray_local, shm_peers, [1000], 32)[0]["weights/via_shared_memory"] == 1.0
