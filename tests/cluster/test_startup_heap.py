"""A role worker is constructed without full garbage collections; its start-up leaves no cyclic
garbage behind and the rest out of the collector's view (raygraph.cluster.startup_heap)."""

from __future__ import annotations

import gc
import weakref

import pytest

from raygraph.cluster.errors import CallSite
from raygraph.cluster.host import RoleHost
from raygraph.cluster.startup_heap import quiet_heap


class _Node:
    def __init__(self):
        self.me = self   # a reference cycle: only the cyclic collector frees it


@pytest.fixture
def clean_gc():
    gc.collect()
    gc.unfreeze()
    thresholds = gc.get_threshold()
    yield
    gc.unfreeze()
    gc.set_threshold(*thresholds)


def _full_passes() -> int:
    return gc.get_stats()[2]["collections"]


def test_the_block_makes_no_full_pass_frees_young_cycles_and_freezes_what_is_left(clean_gc):
    frozen_before, full_before = gc.get_freeze_count(), _full_passes()
    with quiet_heap():
        young = _Node()
        dead_young = weakref.ref(young)
        del young
        kept = [_Node() for _ in range(300_000)]   # grows the heap well past a quarter: a full pass without the block
        assert dead_young() is None   # the young generations were collected
        late = _Node()
        dead_late = weakref.ref(late)
        del late
        assert _full_passes() == full_before
    assert dead_late() is None   # the one pass at the end collects it, it is not frozen
    assert _full_passes() == full_before + 1
    assert gc.get_freeze_count() >= frozen_before + len(kept)
    assert gc.get_threshold()[2] < 1000   # the thresholds are back


def test_a_role_worker_is_constructed_without_a_full_pass(clean_gc):
    host = object.__new__(RoleHost)   # no actor: construct alone
    host.sites, host.workers = {"policy": CallSite("policy", 0, "run/policy/0")}, {}
    seen = {}

    def factory(**kwargs):
        full_before = _full_passes()
        kwargs["objects"] = [_Node() for _ in range(300_000)]
        seen["full_passes"] = _full_passes() - full_before
        return kwargs

    host.construct("policy", factory, {"lr": 0.1})
    assert host.workers["policy"]["lr"] == 0.1 and seen == {"full_passes": 0}
    assert gc.get_freeze_count() >= 300_000
