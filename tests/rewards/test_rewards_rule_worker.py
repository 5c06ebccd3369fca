"""RuleRewardWorker: decoding, per-source rewards, placement on the last response token."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoTokenizer

from raygraph.batch import TOKEN_LEVEL_SCORES, UID
from raygraph.rewards import RewardResult
from raygraph.rewards.batching import NonFiniteRewardError
from raygraph.rewards.terms import RewardFunctionError
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


def _nan_for_eights(text, truth, info):
    """A rule reward that breaks on one input: NaN for the response "8"."""
    return RewardResult(score=float("nan") if text == "8" else float(text == truth), extras={"acc": 1.0})


@pytest.fixture
def sixteen_rows(tokenizer_path, make_response_batch):
    tok = AutoTokenizer.from_pretrained(tokenizer_path)
    texts = ["7"] * 15 + ["8"]                     # one row in 16 is enough to poison a step
    batch = make_response_batch(tok, texts, ["7"] * 16, ["toy_arith"] * 16)
    return batch.with_columns(**{UID: [f"p{i // 4}" for i in range(16)]})


def test_a_nan_reward_fails_naming_the_function_and_uid(tokenizer_path, sixteen_rows, monkeypatch):
    # before: the NaN went into the batch, every optimizer step was skipped and the run said "done"
    monkeypatch.setattr("raygraph.workers.reward_rule.get", lambda name: _nan_for_eights)
    worker = RuleRewardWorker(tokenizer_path, function="flaky")
    with pytest.raises(NonFiniteRewardError, match=r"reward function 'flaky' returned a non-finite score for "
                                                   r"1 of 16 samples: row 15 \(uid 'p3'\): nan"):
        worker.score(sixteen_rows)


def test_policy_zero_scores_the_row_zero_and_counts_it(tokenizer_path, sixteen_rows, monkeypatch):
    monkeypatch.setattr("raygraph.workers.reward_rule.get", lambda name: _nan_for_eights)
    out = RuleRewardWorker(tokenizer_path, function="flaky", on_non_finite="zero").score(sixteen_rows)
    per_row = out[TOKEN_LEVEL_SCORES].sum(dim=1)
    assert per_row.tolist() == [1.0] * 15 + [0.0]
    assert out["reward_extra.non_finite"].tolist() == [0.0] * 15 + [1.0]   # reward/non_finite = 1/16


def test_a_string_score_names_the_function_and_row(tokenizer_path, sixteen_rows, monkeypatch):
    monkeypatch.setattr("raygraph.workers.reward_rule.get",
                        lambda name: lambda text, truth, info: RewardResult(score="1.0"))
    with pytest.raises(RewardFunctionError, match=r"reward function 'str' on row 0 \(uid 'p0'\): TypeError: "
                                                   r"returned '1.0' \(str\) as the score; a score must be a number"):
        RuleRewardWorker(tokenizer_path, function="str").score(sixteen_rows)
