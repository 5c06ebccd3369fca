"""A role worker is constructed with the garbage collector off; its start-up leaves no cyclic
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
    yield
    gc.unfreeze()
    gc.enable()


def test_the_block_runs_without_the_collector_and_its_garbage_cycles_are_collected_not_frozen(clean_gc):
    frozen_before = gc.get_freeze_count()
    with quiet_heap():
        assert not gc.isenabled()
        garbage = _Node()
        dead = weakref.ref(garbage)
        del garbage
        kept = [_Node() for _ in range(1000)]
        assert dead() is not None   # no pass ran in the block
    assert gc.isenabled()
    assert dead() is None   # collected once at the end, not frozen with the rest
    assert gc.get_freeze_count() >= frozen_before + len(kept)
    assert all(gc.is_tracked(n) for n in kept)


def test_the_collector_stays_off_after_the_block_when_it_was_off(clean_gc):
    gc.disable()
    with quiet_heap():
        pass
    assert not gc.isenabled()


def test_a_role_worker_is_constructed_with_the_collector_off(clean_gc):
    host = object.__new__(RoleHost)   # no actor: construct alone
    host.sites, host.workers = {"policy": CallSite("policy", 0, "run/policy/0")}, {}
    seen = {}

    def factory(**kwargs):
        seen["collector_on"] = gc.isenabled()
        return kwargs

    host.construct("policy", factory, {"lr": 0.1})
    assert host.workers["policy"] == {"lr": 0.1} and seen == {"collector_on": False}
    assert gc.isenabled() and gc.get_freeze_count() > 0
