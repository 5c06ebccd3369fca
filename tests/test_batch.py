"""Batch: row selection, group-preserving splits, padded concatenation."""

import numpy as np
import pytest
import torch

from raygraph.batch import PROMPT_IDS, PROMPT_MASK, RESPONSE_MASK, RESPONSES, UID, Batch


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


def test_token_budget_micro_batches_pack_rows_and_trim_padding():
    # prompt lengths 1, 3, 2, 3 (left-padded to 3); response lengths 2, 1, 4, 1 (right-padded to 4)
    prompt_mask = torch.tensor([[0, 0, 1], [1, 1, 1], [0, 1, 1], [1, 1, 1]])
    response_mask = torch.tensor([[1, 1, 0, 0], [1, 0, 0, 0], [1, 1, 1, 1], [1, 0, 0, 0]])
    batch = Batch({PROMPT_IDS: prompt_mask * 7, PROMPT_MASK: prompt_mask, RESPONSES: response_mask * 5,
                   RESPONSE_MASK: response_mask, "advantages": response_mask.float() * 2})
    micros = batch.micro_batches(max_rows=3, max_tokens=10)
    # rows 0-1: 2 x (3 + 2) = 10 fits; + row 2 would be 3 x (3 + 4) = 21; row 2 + 3: 2 x (3 + 4) = 14 > 10
    assert [len(m) for m in micros] == [2, 1, 1]
    assert micros[0][PROMPT_IDS].shape == (2, 3) and micros[0][RESPONSES].shape == (2, 2)
    assert micros[1][PROMPT_MASK].tolist() == [[1, 1]] and micros[1]["advantages"].shape == (1, 4)
    assert micros[2][RESPONSE_MASK].tolist() == [[1]]
    assert Batch.concat(micros)["advantages"].tolist() == batch["advantages"].tolist()   # widths restored
    assert [len(m) for m in batch.micro_batches(max_rows=3)] == [3, 1]                   # rows only


def test_a_missing_column_is_one_error_with_a_plain_message():
    from raygraph.errors import ConfigInvalid, MissingColumn

    batch = Batch({"a": torch.zeros(2, 1)}, {UID: np.array(["x", "y"], dtype=object)})
    with pytest.raises(MissingColumn) as caught:
        batch["advantages"]
    assert isinstance(caught.value, KeyError) and isinstance(caught.value, ConfigInvalid)
    assert caught.value.exit_code == 2
    assert str(caught.value) == "Batch has no column 'advantages'; it has ['a', 'uid']"


def test_selecting_no_rows_gives_an_empty_batch_with_every_column():
    batch = Batch({"x": torch.arange(6).reshape(3, 2)}, {"s": ["a", "b", "c"]})
    empty = batch.select([])
    assert len(empty) == 0 and empty["x"].shape == (0, 2) and list(empty["s"]) == []
