"""The shared-memory staging of weight buckets for vLLM's engine processes (`vllm_staging`): what a
worker reads is what the caller wrote, across buckets of different sizes; without room in
/dev/shm the RPC path is used; the file goes away with the engine."""

from __future__ import annotations

import os
from types import SimpleNamespace

import pytest
import torch

from raygraph.workers import vllm_staging
from raygraph.workers.vllm_staging import Staging, shared_tensors

pytestmark = pytest.mark.skipif(not os.path.isdir("/dev/shm"), reason="no /dev/shm on this machine")


def _bucket(seed: int, sizes: dict[str, tuple[tuple[int, ...], torch.dtype]]) -> list[tuple[str, torch.Tensor]]:
    gen = torch.Generator().manual_seed(seed)
    return [(name, torch.randn(shape, generator=gen).to(dtype)) for name, (shape, dtype) in sizes.items()]


def test_a_worker_reads_each_bucket_the_caller_wrote_and_the_file_goes_with_the_engine():
    engine = SimpleNamespace()
    small = _bucket(0, {"a.weight": ((3, 5), torch.float32), "a.bias": ((5,), torch.bfloat16)})
    large = _bucket(1, {"b.weight": ((64, 33), torch.float32), "c.weight": ((7,), torch.float16)})
    staging, paths = Staging.for_engine(engine, 1024), set()
    for bucket in (small, large, small):   # a new file for the large bucket, reused after
        layout = staging.write(bucket)
        paths.add(staging.path)
        assert all(offset % 64 == 0 for *_, offset in layout)
        read = list(shared_tensors(staging.path, staging.nbytes, layout))
        staging.mapped()   # read by the worker: the name goes, the mappings stay valid
        assert not os.path.exists(staging.path)
        assert [n for n, _ in read] == [n for n, _ in bucket]
        assert all(torch.equal(r, t) and r.dtype == t.dtype for (_, r), (_, t) in zip(read, bucket))
    assert Staging.for_engine(engine, 1024) is staging and staging.nbytes >= 64 * 33 * 4
    kept = read[0][1].clone()
    layout = staging.write(large)   # what a worker read is its own copy: the next bucket does not change it
    assert torch.equal(read[0][1], kept)
    assert torch.equal(next(shared_tensors(staging.path, staging.nbytes, layout))[1], large[0][1])
    staging.close()
    assert len(paths) == 2 and not any(os.path.exists(p) for p in paths)   # nothing left behind


def test_without_room_in_dev_shm_the_rpc_path_is_used(monkeypatch):
    free = SimpleNamespace(total=1 << 30, used=0, free=32 << 20)   # 32 MiB left: kept for others
    monkeypatch.setattr(vllm_staging.shutil, "disk_usage", lambda path: free)
    assert Staging.for_engine(SimpleNamespace(), 1 << 20) is None
    monkeypatch.undo()
    staging = Staging.for_engine(engine := SimpleNamespace(), 1 << 20)
    assert staging is not None and engine._raygraph_staging is staging
    staging.close()
