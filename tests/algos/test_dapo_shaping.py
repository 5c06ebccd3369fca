"""DAPO's batch shaping (raygraph.graph.dapo), numbers derived by hand in the comments."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from raygraph.batch import RESPONSE_LENGTH, RESPONSE_MASK, TOKEN_LEVEL_SCORES, UID, Batch
from raygraph.graph import dapo

ACC = "reward_extra.acc"


def _batch(lengths, scores, uids, acc=None, width=10) -> Batch:
    lengths = torch.tensor(lengths)
    mask = (torch.arange(width) < lengths[:, None]).long()
    token_scores = torch.zeros(len(lengths), width)
    token_scores[torch.arange(len(lengths)), lengths - 1] = torch.tensor(scores, dtype=torch.float32)
    tensors = {RESPONSE_MASK: mask, RESPONSE_LENGTH: lengths, TOKEN_LEVEL_SCORES: token_scores}
    if acc is not None:
        tensors[ACC] = torch.tensor(acc, dtype=torch.float32)
    return Batch(tensors, {UID: np.array(uids)})


def test_overlong_penalty_falls_linearly_over_the_buffer():
    # max_len 10, buffer 4: no penalty up to 6 tokens; 7 -> -0.25 f, 8 -> -0.5 f, 10 -> -f (f = 0.5)
    batch = _batch([3, 6, 7, 8, 10], [1.0, 1.0, 1.0, 0.0, 1.0], ["a"] * 5)
    out = dapo.overlong_penalty(batch, max_len=10, buffer=4, factor=0.5)
    scores = out[TOKEN_LEVEL_SCORES].sum(-1)
    torch.testing.assert_close(scores, torch.tensor([1.0, 1.0, 0.875, -0.25, 0.5]))
    # the penalty sits on the last response token, where the outcome score is
    assert out[TOKEN_LEVEL_SCORES][3, 7] == -0.25 and out[TOKEN_LEVEL_SCORES][3, :7].abs().sum() == 0
    assert out.meta["overlong_penalty"] == pytest.approx((0 + 0 - 0.125 - 0.25 - 0.5) / 5)


def test_truncated_rows_get_a_zero_mask_and_keep_their_score():
    batch = _batch([3, 10, 9], [1.0, 1.0, 0.0], ["a", "a", "b"])
    out = dapo.mask_truncated(batch, max_len=10)
    assert out[RESPONSE_MASK].sum(-1).tolist() == [3, 0, 9]
    assert out[TOKEN_LEVEL_SCORES].sum(-1).tolist() == [1.0, 1.0, 0.0]
    assert out.meta["truncated_rows"] == 1


def test_groups_whose_accuracy_does_not_vary_are_dropped_whole():
    # groups a (1, 0): kept; b (1, 1): dropped; c (0, 0): dropped; d (0, 1): kept
    batch = _batch([2] * 8, [1.0, 0.0, 1.0, 1.0, 0.0, 0.0, 0.0, 1.0], list("aabbccdd"),
                   acc=[1, 0, 1, 1, 0, 0, 0, 1])
    out = dapo.filter_groups(batch, metric="acc")
    assert list(out[UID]) == list("aadd") and out[ACC].tolist() == [1, 0, 0, 1]
    assert (out.meta["groups_total"], out.meta["groups_kept"]) == (4, 2)
    assert list(dapo.filter_groups(batch, metric="acc", max_groups=1)[UID]) == list("aa")
    metrics = dapo.shaping_metrics(out)
    assert metrics["rollout/groups_filtered"] == 2 and metrics["rollout/train_rows"] == 4


def test_the_filter_reads_raw_accuracy_not_the_penalised_score():
    # both samples correct (acc 1, 1) but one is penalised for length: the scores differ, the
    # accuracy does not, so the group goes (DAPO filters on accuracy)
    batch = _batch([4, 10], [1.0, 1.0], ["a", "a"], acc=[1, 1])
    shaped = dapo.overlong_penalty(batch, max_len=10, buffer=4, factor=1.0)
    assert len(dapo.filter_groups(shaped, metric="acc")) == 0
    assert len(dapo.filter_groups(shaped, metric="score")) == 2
    with pytest.raises(KeyError, match="no 'reward_extra.nope'"):
        dapo.filter_groups(shaped, metric="nope")


def test_an_empty_batch_passes_through_every_step():
    empty = _batch([2, 2], [1.0, 1.0], ["a", "a"], acc=[1, 1])
    out = dapo.filter_groups(dapo.mask_truncated(dapo.overlong_penalty(empty, max_len=10, buffer=2, factor=1.0),
                                                 max_len=10), metric="acc")
    assert len(out) == 0 and dapo.shaping_metrics(out)["rollout/groups_kept"] == 0
    # split over two ranks, the empty batch gives two empty shards with the columns' shapes
    assert [tuple(s[RESPONSE_MASK].shape) for s in out.chunk_by_group(2)] == [(0, 10), (0, 10)]
