"""SFT and DPO datasets: rollout layout, loss masks over response tokens, pairs kept together."""

from __future__ import annotations

import pytest
import torch

from raygraph.batch import ATTENTION_MASK, INPUT_IDS, LOSS_MASK, PROMPT_IDS, RESPONSE_MASK, RESPONSES, UID
from raygraph.data import DPODataset, SFTDataset, load_offline_dataset, write_rows
from raygraph.data.offline import CHOSEN_MASK


def _user(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


def test_sft_batch_masks_only_the_response_and_eos(char_tokenizer):
    rows = [{"prompt": _user("3+4="), "response": "7"}, {"prompt": _user("10+2="), "response": "12"}]
    ds = SFTDataset(rows, char_tokenizer, max_prompt_length=16, max_response_length=4)
    batch = ds.to_batch([0, 1])
    eos, pad = char_tokenizer.eos_token_id, char_tokenizer.pad_token_id
    # prompts: 7 and 8 tokens -> P = 8 (left-padded); responses "7"+eos, "12"+eos -> R = 3.
    assert batch[INPUT_IDS].shape == (2, 11)
    assert batch[RESPONSES].tolist()[0] == [*char_tokenizer("7", add_special_tokens=False).input_ids, eos, pad]
    assert batch[RESPONSE_MASK].tolist() == [[1, 1, 0], [1, 1, 1]]
    assert batch[LOSS_MASK].tolist() == [[0] * 8 + [1, 1, 0], [0] * 8 + [1, 1, 1]]
    assert batch[ATTENTION_MASK].tolist()[0] == [0] + [1] * 9 + [0]
    assert torch.equal(batch[INPUT_IDS], torch.cat([batch[PROMPT_IDS], batch[RESPONSES]], 1))
    text = char_tokenizer.decode(batch[INPUT_IDS][1][batch[ATTENTION_MASK][1].bool()])
    assert text == "<|user|>10+2=<|end|><|assistant|>12<|end|>"


def test_sft_falls_back_to_ground_truth_and_drops_overlong(tmp_path, char_tokenizer):
    rows = [{"prompt": _user("3+4="), "data_source": "toy_arith",
             "reward_model": {"style": "rule", "ground_truth": "7"}},
            {"prompt": _user("3+5="), "response": "a very long answer"}]
    path = write_rows(rows, tmp_path / "sft.parquet")
    ds = load_offline_dataset("sft", path, char_tokenizer, max_prompt_length=16, max_response_length=4)
    assert len(ds) == 1 and ds.n_dropped == 1
    assert ds.to_batch([0])[RESPONSE_MASK].tolist() == [[1, 1]]
    with pytest.raises(ValueError, match="row 1"):
        SFTDataset(rows, char_tokenizer, max_prompt_length=16, max_response_length=4, overlong="error")


def test_dpo_rows_alternate_chosen_rejected_and_share_uid(char_tokenizer):
    rows = [{"prompt": _user("3+4="), "chosen": "7", "rejected": "8"},
            {"prompt": _user("1+1="), "chosen": [{"role": "assistant", "content": "2"}],
             "rejected": [*_user("1+1="), {"role": "assistant", "content": "11"}]}]
    ds = DPODataset(rows, char_tokenizer, max_prompt_length=16, max_response_length=4)
    batch = ds.to_batch([0, 1])
    assert len(batch) == 4
    assert batch[CHOSEN_MASK].tolist() == [1, 0, 1, 0]
    assert list(batch[UID]) == ["dpo-0", "dpo-0", "dpo-1", "dpo-1"]
    texts = char_tokenizer.batch_decode([r[m.bool()] for r, m in zip(batch[RESPONSES], batch[RESPONSE_MASK])],
                                        skip_special_tokens=True)
    assert texts == ["7", "8", "2", "11"]
    assert torch.equal(batch[PROMPT_IDS][0], batch[PROMPT_IDS][1])
    assert [len(p) for p in batch.chunk_by_group(2)] == [2, 2]


def test_dpo_message_list_must_end_with_the_assistant(char_tokenizer):
    rows = [{"prompt": _user("3+4="), "chosen": _user("7"), "rejected": "8"}]
    with pytest.raises(ValueError, match="<rows>: row 0: chosen must be"):
        DPODataset(rows, char_tokenizer, max_prompt_length=16, max_response_length=4)
    with pytest.raises(ValueError, match="valid: sft, dpo"):
        load_offline_dataset("ppo", rows, char_tokenizer, max_prompt_length=16, max_response_length=4)
