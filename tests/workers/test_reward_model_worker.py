"""RewardModelWorker: the score equals a direct forward on the unpadded sequence, lands on the
last response token, survives a reward model with a different tokenizer, and a NaN score follows
`reward.on_non_finite`."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForSequenceClassification

from raygraph.batch import PROMPT_IDS, PROMPT_MASK, RESPONSE_MASK, RESPONSES, TOKEN_LEVEL_SCORES, UID
from raygraph.models.tiny import BOS, build_tiny_tokenizer
from raygraph.rewards.batching import NonFiniteRewardError
from raygraph.workers.reward_model import RewardModelWorker


def _direct_scores(rm_path, batch) -> torch.Tensor:
    rm = AutoModelForSequenceClassification.from_pretrained(rm_path)
    scores = []
    for i in range(len(batch)):
        ids = torch.cat([batch[PROMPT_IDS][i][batch[PROMPT_MASK][i].bool()],
                         batch[RESPONSES][i][batch[RESPONSE_MASK][i].bool()]])
        with torch.no_grad():
            scores.append(rm(input_ids=ids[None]).logits[0, 0])
    return torch.stack(scores)


def test_score_equals_direct_forward_on_the_last_response_token(tiny_rm_path, tiny_model_path, rollout_batch):
    batch = rollout_batch(5, seed=4)
    worker = RewardModelWorker(model_path=tiny_rm_path, policy_tokenizer_path=tiny_model_path, micro_batch_size=2)
    assert worker.same_vocab
    scores = worker.score(batch)[TOKEN_LEVEL_SCORES]
    last = batch[RESPONSE_MASK].sum(-1) - 1
    torch.testing.assert_close(scores[torch.arange(5), last], _direct_scores(tiny_rm_path, batch), atol=1e-5, rtol=0)
    scores[torch.arange(5), last] = 0
    assert (scores == 0).all()


@pytest.fixture(scope="module")
def rm_with_other_tokenizer(tiny_rm_path, tmp_path_factory) -> Path:
    """The tiny RM re-expressed in a tokenizer whose vocabulary is permuted: embedding rows
    move with their tokens, so it must give identical scores on the same text."""
    path = tmp_path_factory.mktemp("rm_permuted")
    tok = build_tiny_tokenizer()
    tok.save_pretrained(path)
    tok_json = json.loads((path / "tokenizer.json").read_text())
    vocab = tok_json["model"]["vocab"]
    first = len(tok.all_special_tokens)
    chars = sorted((t for t, i in vocab.items() if i >= first), key=vocab.get)
    new_vocab = {**{t: i for t, i in vocab.items() if i < first},
                 **{t: first + k for k, t in enumerate(reversed(chars))}}
    tok_json["model"]["vocab"] = new_vocab
    (path / "tokenizer.json").write_text(json.dumps(tok_json))
    rm = AutoModelForSequenceClassification.from_pretrained(tiny_rm_path)
    perm = torch.tensor([vocab[t] for t in sorted(new_vocab, key=new_vocab.get)])  # new id -> old id
    with torch.no_grad():
        rm.model.embed_tokens.weight.copy_(rm.model.embed_tokens.weight[perm].clone())
    rm.save_pretrained(path)
    return path


def test_different_reward_tokenizer_is_handled_by_retokenizing(tiny_rm_path, tiny_model_path,
                                                               rm_with_other_tokenizer, rollout_batch):
    batch = rollout_batch(4, seed=6)
    worker = RewardModelWorker(model_path=str(rm_with_other_tokenizer), policy_tokenizer_path=tiny_model_path)
    assert not worker.same_vocab
    got = worker.score(batch)[TOKEN_LEVEL_SCORES].sum(-1)
    torch.testing.assert_close(got, _direct_scores(tiny_rm_path, batch), atol=1e-5, rtol=0)


@pytest.fixture(scope="module")
def rm_nan_on_bos(tiny_rm_path, tmp_path_factory) -> str:
    """The tiny RM with a NaN embedding for the `<|start|>` token: a sequence holding it scores NaN
    (attention spreads the NaN to the last position), any other scores as the tiny RM does."""
    path = tmp_path_factory.mktemp("rm_nan")
    rm = AutoModelForSequenceClassification.from_pretrained(tiny_rm_path)
    tok = build_tiny_tokenizer()
    with torch.no_grad():
        rm.model.embed_tokens.weight[tok.convert_tokens_to_ids(BOS)] = float("nan")
    rm.save_pretrained(path)
    tok.save_pretrained(path)
    return str(path)


def _row_1_holds_bos(rollout_batch):
    batch = rollout_batch(3, seed=2).with_columns(**{UID: ["a", "b", "c"]})
    responses = batch[RESPONSES].clone()
    responses[1, 0] = build_tiny_tokenizer().convert_tokens_to_ids(BOS)   # every response has >= 1 token
    return batch.with_columns(**{RESPONSES: responses})


def test_a_nan_score_fails_by_default_naming_the_model_row_and_uid(rm_nan_on_bos, rollout_batch):
    worker = RewardModelWorker(model_path=rm_nan_on_bos)
    with pytest.raises(NonFiniteRewardError) as info:
        worker.score(_row_1_holds_bos(rollout_batch))
    assert str(info.value) == (f"reward model {rm_nan_on_bos} returned a non-finite score for 1 of 3 samples: "
                               "row 1 (uid 'b'): nan; fix the reward, or set reward.on_non_finite=zero to score "
                               "such samples 0 (counted in reward/non_finite)")


def test_a_nan_score_is_zeroed_and_counted_under_on_non_finite_zero(rm_nan_on_bos, tiny_rm_path, rollout_batch,
                                                                    caplog):
    batch = _row_1_holds_bos(rollout_batch)
    out = RewardModelWorker(model_path=rm_nan_on_bos, on_non_finite="zero").score(batch)
    healthy = RewardModelWorker(model_path=tiny_rm_path).score(batch)[TOKEN_LEVEL_SCORES]
    assert out["reward_extra.non_finite"].tolist() == [0.0, 1.0, 0.0]
    assert (out[TOKEN_LEVEL_SCORES][1] == 0).all()
    torch.testing.assert_close(out[TOKEN_LEVEL_SCORES][[0, 2]], healthy[[0, 2]], atol=0, rtol=0)
    assert healthy[[0, 2]].abs().sum() > 0   # the untouched rows did score something
    assert [r.getMessage() for r in caplog.records if r.levelname == "WARNING"] == [
        f"reward model {rm_nan_on_bos} returned a non-finite score for 1 of 3 samples: row 1 (uid 'b'): nan; "
        "scored 0 (reward.on_non_finite=zero)"]
