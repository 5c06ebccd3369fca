"""Batch: row selection, group-preserving splits, padded concatenation."""

import numpy as np
import pytest
import torch

from raygraph.batch import PROMPT_IDS, RESPONSE_MASK, RESPONSES, UID, Batch


def _batch(uids, width=3):
    n = len(uids)
    return Batch({RESPONSES: torch.arange(n * width).view(n, width),
                  RESPONSE_MASK: torch.ones(n, width, dtype=torch.long)},
                 {UID: uids}, {"step": 1})


def test_rows_disagreeing_raise():
    with pytest.raises(ValueError, match="disagree"):
        Batch({RESPONSES: torch.zeros(2, 3)}, {UID: ["a"]})


def test_chunk_by_group_keeps_groups_together_and_balances():
    b = _batch(["a", "a", "b", "b", "c", "c", "d", "d", "e", "e"])
    parts = b.chunk_by_group(2)
    assert [list(p[UID]) for p in parts] == [["a", "a", "b", "b"], ["c", "c", "d", "d", "e", "e"]]
    assert sum(len(p) for p in parts) == len(b)
    assert parts[0].meta == {"step": 1}


def test_concat_pads_to_widest_and_restores_rows():
    left, right = _batch(["a"], width=2), _batch(["b", "b"], width=4)
    whole = Batch.concat([left, right])
    assert whole[RESPONSES].shape == (3, 4)
    # row 0 came from the width-2 batch: values 0, 1 then zero padding with mask 0
    assert whole[RESPONSES][0].tolist() == [0, 1, 0, 0]
    assert whole[RESPONSE_MASK][0].tolist() == [1, 1, 0, 0]
    assert list(whole[UID]) == ["a", "b", "b"]


def test_prompt_columns_are_left_padded_on_concat():
    a = Batch({PROMPT_IDS: torch.tensor([[7, 8]])})
    b = Batch({PROMPT_IDS: torch.tensor([[5, 6, 9]])})
    assert Batch.concat([a, b])[PROMPT_IDS].tolist() == [[0, 7, 8], [5, 6, 9]]


def test_select_union_repeat():
    b = _batch(["a", "b", "c"])
    picked = b.select(np.array([2, 0]))
    assert list(picked[UID]) == ["c", "a"]
    assert picked[RESPONSES][0].tolist() == [6, 7, 8]
    merged = picked.union(Batch({"score": torch.tensor([1.0, 2.0])}))
    assert merged["score"].tolist() == [1.0, 2.0] and RESPONSES in merged
    assert list(b.repeat_interleave(2)[UID]) == ["a", "a", "b", "b", "c", "c"]
    assert [len(p) for p in b.split(2)] == [2, 1]
