"""Rendezvous stores listen on the node's own address, never on every interface."""

from __future__ import annotations

import os

import psutil
import torch.distributed as dist

from raygraph.cluster.rendezvous import listening_socket, master_store, member_store


def _listening_addresses(port: int) -> list[str]:
    return [c.laddr.ip for c in psutil.Process(os.getpid()).net_connections(kind="tcp")
            if c.status == psutil.CONN_LISTEN and c.laddr.port == port]


def test_torch_alone_listens_on_every_interface_and_ours_on_one():
    import datetime

    theirs = dist.TCPStore("127.0.0.1", 0, 1, True, datetime.timedelta(seconds=5), wait_for_workers=False)
    assert set(_listening_addresses(theirs.port)) <= {"0.0.0.0", "::"}      # what we had before

    store = master_store(listening_socket("127.0.0.1"), world_size=2, timeout_s=5)
    assert _listening_addresses(store.port) == ["127.0.0.1"]
    member = member_store("127.0.0.1", store.port, world_size=2, timeout_s=5)
    member.set("weights/version", "3")
    assert store.get("weights/version") == b"3"


def test_weight_sync_meta_travels_as_json_and_is_never_unpickled():
    import pickle

    import pytest
    import torch

    from raygraph.cluster.collective_transport import decode_meta, encode_meta
    from raygraph.cluster.errors import WeightSyncError
    from raygraph.cluster.weights import pack_bucket, unpack_bucket

    bucket = [("w", torch.arange(6, dtype=torch.bfloat16).reshape(2, 3)), ("b", torch.ones(4))]
    meta, payload = pack_bucket(bucket, torch.device("cpu"), checksum=True)
    back = decode_meta(encode_meta(meta))
    assert back == meta
    assert [(n, t.dtype, tuple(t.shape)) for n, t in unpack_bucket(back, payload)] == \
           [("w", torch.bfloat16, (2, 3)), ("b", torch.float32, (4,))]
    with pytest.raises(ValueError):       # a pickle (what a hostile peer could send) is not JSON
        decode_meta(pickle.dumps(meta))
    with pytest.raises(WeightSyncError, match="unknown dtypes"):
        decode_meta(encode_meta(meta).replace(b'"float32"', b'"Tensor"'))
