"""ResumableSampler: seeded order, epochs, and a mid-epoch state round-trip."""

from __future__ import annotations

import pytest

from raygraph.data import ResumableSampler


def _take(sampler: ResumableSampler, steps: int) -> list[list[int]]:
    return [sampler.next_indices() for _ in range(steps)]


def test_same_seed_same_order_and_each_epoch_is_a_permutation():
    a, b = ResumableSampler(10, 3, seed=7), ResumableSampler(10, 3, seed=7)
    first, second = _take(a, 9), _take(b, 9)
    assert first == second
    # 10 // 3 = 3 batches per epoch; the leftover item is skipped for that epoch only.
    epoch0 = [i for batch in first[:3] for i in batch]
    assert len(set(epoch0)) == 9 and set(epoch0) <= set(range(10))
    assert a.epoch == 2 and a.position == 9
    assert first[:3] != first[3:6]  # the next epoch is reshuffled
    assert _take(ResumableSampler(10, 3, seed=8), 3) != first[:3]


def test_no_shuffle_is_in_order():
    s = ResumableSampler(5, 2, seed=0, shuffle=False)
    assert _take(s, 3) == [[0, 1], [2, 3], [0, 1]]


def test_state_round_trip_mid_epoch_continues_the_exact_order():
    uninterrupted = ResumableSampler(11, 4, seed=3)
    expected = _take(uninterrupted, 7)

    first = ResumableSampler(11, 4, seed=3)
    before = _take(first, 4)          # stops mid-epoch 1 (2 batches per epoch)
    state = first.state_dict()
    resumed = ResumableSampler(11, 4, seed=3)
    resumed.load_state_dict(state)
    assert before + _take(resumed, 3) == expected


def test_state_from_another_dataset_is_rejected():
    state = ResumableSampler(10, 2, seed=0).state_dict()
    with pytest.raises(ValueError, match="n_items=10"):
        ResumableSampler(12, 2, seed=0).load_state_dict(state)
    with pytest.raises(ValueError, match="batch_size"):
        ResumableSampler(3, 5, seed=0)
