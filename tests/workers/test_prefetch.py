"""The rollout engines' shared prefetch buffer and checkpoint (`raygraph.workers.prefetch`), with a
fake sampler: which batches are kept, what is handed over and how stale it is, and a checkpoint
that round-trips in safe formats only."""

from __future__ import annotations

import json
import pickle
import struct

import numpy as np
import pytest
import torch

from raygraph.batch import (
    NEXT_PROMPTS,
    PROMPT_IDS,
    PROMPT_MASK,
    RESPONSE_TEXT,
    RESPONSES,
    SHARD,
    STALENESS,
    UID,
    WEIGHT_VERSION,
    Batch,
)
from raygraph.workers.prefetch import KEPT_COLUMNS, KEPT_TENSORS, STATE_FILE, PrefetchedRollouts


class FakeSampler:
    """Stands for a worker's `generate`: 2 rows per prompt, responses numbered by call, the
    version it was set to, a text column and a column of numpy values."""

    def __init__(self) -> None:
        self.version, self.calls = 0, 0

    def __call__(self, prompts: Batch) -> Batch:
        self.calls += 1
        rows = prompts.repeat_interleave(2)
        b = len(rows)
        return rows.with_columns(**{
            RESPONSES: torch.full((b, 3), self.calls, dtype=torch.int64),
            WEIGHT_VERSION: torch.full((b,), self.version, dtype=torch.int64),
            RESPONSE_TEXT: [f"call {self.calls} row {i}: é ✓" for i in range(b)],
            "extra_info": [{"i": np.int64(i), "score": np.float32(0.5), "ids": np.arange(2), "tag": "x"}
                           for i in range(b)],
        })


def _prompts(*uids: str) -> Batch:
    ids = torch.arange(len(uids) * 3).reshape(len(uids), 3)
    return Batch({PROMPT_IDS: ids, PROMPT_MASK: torch.ones_like(ids)}, {UID: list(uids)})


def test_at_most_slots_batches_are_kept_and_the_oldest_goes_first():
    buffer, sample = PrefetchedRollouts(slots=2), FakeSampler()
    assert buffer.prefetch(_prompts("a", "b"), sample) == 4          # 2 prompts x 2 samples
    buffer.prefetch(_prompts("c"), sample)
    buffer.prefetch(_prompts("a", "b"), sample)                      # sampled again: now the newest
    assert list(buffer.kept) == [("c",), ("a", "b")]
    buffer.prefetch(_prompts("d"), sample)                           # a third batch evicts ("c",)
    assert list(buffer.kept) == [("a", "b"), ("d",)]
    assert buffer.kept[("a", "b")][RESPONSES][0, 0] == 3             # the third call's rows


def test_take_hands_kept_rollouts_over_once_with_their_staleness():
    buffer, sample = PrefetchedRollouts(), FakeSampler()
    sample.version = 3
    buffer.prefetch(_prompts("a", "b"), sample)                      # sampled with version 3 (call 1)
    sample.version = 5
    taken = buffer.take_or_generate(_prompts("a", "b"), sample, weight_version=5)
    # staleness = held version - sampling version = 5 - 3 = 2 on all 4 rows; no new sampling
    assert taken[STALENESS].tolist() == [2] * 4 and taken[STALENESS].dtype == torch.int64
    assert sample.calls == 1 and (taken[RESPONSES] == 1).all() and buffer.kept == {}
    again = buffer.take_or_generate(_prompts("a", "b"), sample, weight_version=5)   # handed over already
    assert sample.calls == 2 and again[STALENESS].tolist() == [0] * 4             # sampled now: 5 - 5
    buffer.prefetch(_prompts("c"), sample)
    other = buffer.take_or_generate(_prompts("c", "d"), sample, weight_version=5)  # uids must match exactly
    assert list(other[UID]) == ["c", "c", "d", "d"] and list(buffer.kept) == [("c",)] and sample.calls == 4


def test_prefetch_next_samples_this_ranks_next_share_and_meta_stops_there():
    buffer, sample = PrefetchedRollouts(), FakeSampler()
    share = _prompts("a", "b")
    share.meta[NEXT_PROMPTS] = {("x",): _prompts("y"), ("a", "b"): _prompts("c", "d")}
    assert buffer.prefetch_next(share, sample) == {"rollout/prefetched": 4.0}
    assert list(buffer.kept) == [("c", "d")]
    assert buffer.prefetch_next(_prompts("q"), sample) == {"rollout/prefetched": 0.0}  # nothing attached
    now = _prompts("c", "d")
    now.meta.update(step=7, **{NEXT_PROMPTS: {("c", "d"): _prompts("e")}})
    assert buffer.take_or_generate(now, sample, 0).meta == {"step": 7}


def test_the_next_share_of_a_dispatched_share_is_a_dispatch_round_of_its_own():
    """Least-loaded agent dispatch (`raygraph.agents.dispatch`): the ranks' next shares, sampled
    ahead, find each other by a round derived from this step's (same rank, same world)."""
    seen = []
    share = _prompts("a", "b")
    share.meta.update({SHARD: {"round": "r7", "rank": 1, "world": 2}, NEXT_PROMPTS: {("a", "b"): _prompts("c")}})
    PrefetchedRollouts().prefetch_next(share, lambda batch: seen.append(batch.meta[SHARD]) or FakeSampler()(batch))
    assert seen == [{"round": "r7/next", "rank": 1, "world": 2}]


def test_checkpoint_round_trip_keeps_rollouts_order_generator_and_version(tmp_path):
    buffer, sample = PrefetchedRollouts(), FakeSampler()
    buffer.prefetch(_prompts("a", "b"), sample)
    buffer.prefetch(_prompts("c"), sample)
    generator = torch.Generator().manual_seed(11)
    torch.rand(3, generator=generator)
    buffer.save(tmp_path, generator, weight_version=7)
    expected = torch.rand(5, generator=generator)

    restored, other = PrefetchedRollouts(), torch.Generator().manual_seed(0)
    assert restored.load(tmp_path, other) == 7
    assert torch.equal(torch.rand(5, generator=other), expected)    # the generator continues where it was
    assert list(restored.kept) == [("a", "b"), ("c",)]              # oldest first: eviction order survives
    for uids, kept in buffer.kept.items():
        back = restored.kept[uids]
        assert list(back.tensors) == list(kept.tensors)
        assert all(torch.equal(back[k], kept[k]) and back[k].dtype == kept[k].dtype for k in kept.tensors)
        assert list(back[UID]) == list(kept[UID]) and list(back[RESPONSE_TEXT]) == list(kept[RESPONSE_TEXT])
        assert back[RESPONSE_TEXT].dtype == object
    # numpy values come back as Python ones: np.int64 -> int, np.float32(0.5) -> 0.5, arange(2) -> [0, 1]
    assert list(restored.kept[("c",)]["extra_info"]) == [
        {"i": 0, "score": 0.5, "ids": [0, 1], "tag": "x"}, {"i": 1, "score": 0.5, "ids": [0, 1], "tag": "x"}]
    assert type(restored.kept[("c",)]["extra_info"][1]["i"]) is int


def test_a_checkpoint_holds_only_safetensors_and_json_and_loads_without_unpickling(tmp_path, monkeypatch):
    buffer, sample = PrefetchedRollouts(), FakeSampler()
    buffer.prefetch(_prompts("a"), sample)
    buffer.save(tmp_path, torch.Generator(), weight_version=1)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([STATE_FILE, KEPT_TENSORS, KEPT_COLUMNS])
    for name in (STATE_FILE, KEPT_TENSORS):       # safetensors: u64 header length, then a JSON header
        raw = (tmp_path / name).read_bytes()
        (length,) = struct.unpack("<Q", raw[:8])
        assert json.loads(raw[8:8 + length])
    assert json.loads((tmp_path / KEPT_COLUMNS).read_text())[0]["uids"] == ["a"]

    def refuse(*args, **kwargs):
        raise AssertionError("a checkpoint was unpickled")

    for module, name in ((pickle, "load"), (pickle, "loads"), (torch, "load")):
        monkeypatch.setattr(module, name, refuse)
    assert PrefetchedRollouts().load(tmp_path, torch.Generator()) == 1


def test_an_empty_buffer_saves_only_the_state_and_removes_older_kept_files(tmp_path):
    buffer = PrefetchedRollouts()
    buffer.prefetch(_prompts("a"), FakeSampler())
    buffer.save(tmp_path, torch.Generator(), weight_version=1)
    buffer.kept.clear()
    buffer.save(tmp_path, torch.Generator(), weight_version=2)
    assert [p.name for p in tmp_path.iterdir()] == [STATE_FILE]
    restored = PrefetchedRollouts()
    restored.kept[("z",)] = Batch()
    assert restored.load(tmp_path, torch.Generator()) == 2 and restored.kept == {}


def test_a_cell_json_cannot_hold_is_refused_before_anything_is_written(tmp_path):
    buffer = PrefetchedRollouts()
    buffer.prefetch(_prompts("a"), lambda p: FakeSampler()(p).with_columns(extra_info=[object()] * 2))
    with pytest.raises(TypeError, match="extra_info"):
        buffer.save(tmp_path / "ckpt", torch.Generator(), weight_version=0)
    assert not (tmp_path / "ckpt" / STATE_FILE).exists()


def test_a_directory_without_the_state_file_is_refused_and_its_pickles_never_read(tmp_path, monkeypatch):
    (tmp_path / "rollout_state.pt").write_bytes(b"pickled")
    (tmp_path / "prefetched.pkl").write_bytes(pickle.dumps({"never": "loaded"}))

    def refuse(*args, **kwargs):
        raise AssertionError("a checkpoint was unpickled")

    for module, name in ((pickle, "load"), (pickle, "loads"), (torch, "load")):
        monkeypatch.setattr(module, name, refuse)
    with pytest.raises(FileNotFoundError, match=STATE_FILE):
        PrefetchedRollouts().load(tmp_path, torch.Generator())
