"""RuleRewardWorker: decoding, per-source rewards, placement on the last response token."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoTokenizer

from raygraph.batch import TOKEN_LEVEL_SCORES
from raygraph.workers.reward_rule import RuleRewardWorker


def test_scores_sit_on_the_last_valid_token(tokenizer_path, make_response_batch):
    tok = AutoTokenizer.from_pretrained(tokenizer_path)
    batch = make_response_batch(tok, ["7", "8", "so #### 12", ""],
                           ["7", "7", "12", "7"], ["toy_arith", "toy_arith", "openai/gsm8k", "toy_arith"])
    out = RuleRewardWorker(tokenizer_path).score(batch)
    scores = out[TOKEN_LEVEL_SCORES]
    assert scores.dtype == torch.float32 and scores.shape == batch["responses"].shape
    # "7"+eos: 2 tokens -> index 1; "8"+eos -> index 1 (wrong: 0); "so #### 12"+eos: 11 tokens -> 10;
    # the empty response has no token to hold a score: its row stays zero.
    expected = torch.zeros_like(scores)
    expected[0, 1] = 1.0
    expected[2, 10] = 1.0
    assert torch.equal(scores, expected)
    assert out["reward_extra.acc"].tolist() == [1.0, 0.0, 1.0, 0.0]
    assert out["reward_extra.format_ok"].tolist() == [1.0, 1.0, 1.0, 0.0]
    assert out["reward_extra.acc"].dtype == torch.float32
    assert set(out.columns()) == {TOKEN_LEVEL_SCORES, "reward_extra.acc", "reward_extra.format_ok"}


def test_response_without_eos_and_a_fixed_function(tokenizer_path, make_response_batch):
    tok = AutoTokenizer.from_pretrained(tokenizer_path)
    batch = make_response_batch(tok, ["the answer is 12"], ["12"], ["not/registered"], eos=False)
    out = RuleRewardWorker(tokenizer_path, function="gsm8k_flexible").score(batch)
    assert out[TOKEN_LEVEL_SCORES][0, 15].item() == 1.0 and out[TOKEN_LEVEL_SCORES].sum().item() == 1.0


def test_unknown_source_and_function_are_rejected(tokenizer_path, make_response_batch):
    tok = AutoTokenizer.from_pretrained(tokenizer_path)
    batch = make_response_batch(tok, ["7"], ["7"], ["no/such"])
    with pytest.raises(ValueError, match="known data sources"):
        RuleRewardWorker(tokenizer_path).score(batch)
    with pytest.raises(ValueError, match="valid names"):
        RuleRewardWorker(tokenizer_path, function="nope")
