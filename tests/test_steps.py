"""Whole-batch steps: advantages with the KL-in-reward penalty, rollout and validation metrics."""

import math

import numpy as np
import pytest
import torch

from raygraph.batch import (
    ADVANTAGES,
    OLD_LOGPROBS,
    REF_LOGPROBS,
    RESPONSE_MASK,
    RESPONSE_TEXT,
    ROLLOUT_LOGPROBS,
    TOKEN_LEVEL_REWARDS,
    TOKEN_LEVEL_SCORES,
    UID,
    Batch,
)
from raygraph.graph import corrections, report, step_metrics, whole_batch

_PLAIN = {"gamma": 1.0, "lam": 1.0, "eps": 1e-6, "kl_kind": "k1", "old_from_rollout": False}


def _scored(scores, uids, width=3, lengths=None):
    n = len(scores)
    lengths = lengths or [width] * n
    mask = torch.tensor([[1] * k + [0] * (width - k) for k in lengths])
    token_scores = torch.zeros(n, width)
    for i, (s, k) in enumerate(zip(scores, lengths)):
        token_scores[i, k - 1] = s
    return Batch({TOKEN_LEVEL_SCORES: token_scores, RESPONSE_MASK: mask}, {UID: uids})


def test_validation_accuracy_on_a_hand_made_case():
    # 4 prompts, greedy answers right for rows 0 and 3: accuracy 2/4 = 0.5.
    batch = _scored([1.0, 0.0, 0.0, 1.0], ["a", "b", "c", "d"])
    batch = batch.with_columns(**{"reward_extra.acc": torch.tensor([1.0, 0.0, 0.0, 1.0]),
                                  "data_source": np.array(["x", "x", "y", "y"], dtype=object)})
    m = step_metrics.validation_metrics(batch)
    assert m["val/accuracy"] == 0.5
    assert m["val/accuracy@x"] == 0.5 and m["val/accuracy@y"] == 0.5
    assert m["val/reward/mean"] == 0.5


def test_validation_accuracy_without_acc_column_counts_positive_scores():
    m = step_metrics.validation_metrics(_scored([0.5, -1.0, 0.0], ["a", "b", "c"]))
    assert m["val/accuracy"] == pytest.approx(1 / 3)


def test_grpo_advantages_are_global_over_the_batch_groups():
    # group a: scores 1, 0 -> mean 0.5, unbiased std 0.7071 -> +0.7071, -0.7071 on every valid token
    batch = _scored([1.0, 0.0, 1.0, 1.0], ["a", "a", "b", "b"], lengths=[3, 2, 3, 3])
    out = whole_batch.compute_advantages(batch, Batch(meta={}), estimator="grpo", **_PLAIN)
    adv = out[ADVANTAGES]
    assert adv[0].tolist() == pytest.approx([0.70710, 0.70710, 0.70710], abs=1e-4)
    assert adv[1].tolist() == pytest.approx([-0.70710, -0.70710, 0.0], abs=1e-4)
    assert adv[2:].abs().max() == 0  # zero-variance group b
    assert torch.equal(out[TOKEN_LEVEL_REWARDS], batch[TOKEN_LEVEL_SCORES])


def test_kl_in_reward_penalty_uses_the_driver_coefficient():
    batch = _scored([1.0, 0.0], ["a", "a"], width=2)
    batch = batch.with_columns(**{OLD_LOGPROBS: torch.tensor([[-1.0, -1.0], [-2.0, -2.0]]),
                                  REF_LOGPROBS: torch.tensor([[-1.5, -1.0], [-2.0, -1.0]])})
    out = whole_batch.compute_advantages(batch, Batch(meta={"kl_coef": 0.1}), estimator="grpo", **_PLAIN)
    # k1 = old - ref per token: row 0 [0.5, 0.0], row 1 [0.0, -1.0]; reward -= 0.1 * k1
    assert torch.allclose(out[TOKEN_LEVEL_REWARDS], torch.tensor([[-0.05, 1.0], [0.0, 0.1]]))
    assert out.meta["kl_in_reward"] == pytest.approx((0.5 + 0.0 + 0.0 - 1.0) / 4)


def test_old_logprobs_from_the_rollout_or_standing_in_for_the_kl_metric():
    batch = _scored([1.0, 0.0], ["a", "a"], width=2)
    batch = batch.with_columns(**{ROLLOUT_LOGPROBS: torch.tensor([[-1.0, -1.0], [-2.0, -2.0]]),
                                  REF_LOGPROBS: torch.tensor([[-1.5, -1.0], [-2.0, -1.0]])})
    taken = whole_batch.compute_advantages(batch, Batch(meta={"kl_coef": 0.1}), estimator="grpo",
                                           **{**_PLAIN, "old_from_rollout": True})
    assert torch.equal(taken[OLD_LOGPROBS], batch[ROLLOUT_LOGPROBS])
    assert torch.allclose(taken[TOKEN_LEVEL_REWARDS], torch.tensor([[-0.05, 1.0], [0.0, 0.1]]))
    # no old_logprobs at all (the update computes its own): the metric uses the rollout's, no penalty
    metric_only = whole_batch.compute_advantages(batch, Batch(meta={}), estimator="grpo", **_PLAIN)
    assert OLD_LOGPROBS not in metric_only
    assert metric_only.meta["kl_in_reward"] == pytest.approx((0.5 + 0.0 + 0.0 - 1.0) / 4)
    assert torch.equal(metric_only[TOKEN_LEVEL_REWARDS], batch[TOKEN_LEVEL_SCORES])


def test_rollout_metrics_report_reward_and_lengths():
    batch = _scored([1.0, 0.0, 0.5], ["a", "a", "b"], width=4, lengths=[4, 1, 2])
    m = step_metrics.rollout_metrics(batch)
    assert m["reward/mean"] == pytest.approx(0.5)
    assert m["rollout/response_length_max"] == 4 and m["rollout/response_length_min"] == 1
    assert m["rollout/clip_ratio"] == pytest.approx(1 / 3)
    assert m["rollout/tokens"] == 7


def test_sample_records_are_the_rows_as_text_with_their_scores_and_mean_advantage():
    batch = Batch(
        {TOKEN_LEVEL_SCORES: torch.tensor([[0.0, 1.0, 0.0], [0.0, 0.0, 0.0]]),
         RESPONSE_MASK: torch.tensor([[1, 1, 0], [1, 1, 1]]),
         ADVANTAGES: torch.tensor([[0.5, 0.5, 9.0], [-1.0, -2.0, -3.0]]),
         "reward_extra.acc": torch.tensor([1.0, 0.0])},
        {UID: np.array(["a", "b"], dtype=object), RESPONSE_TEXT: np.array(["4", "7"], dtype=object)},
        {step_metrics.DUMP_ROWS: 1})
    records = step_metrics.sample_records(batch)
    assert records[0] == {"uid": "a", "score": 1.0, "acc": 1.0, "advantage": 0.5, "response": "4"}
    assert records[1]["advantage"] == pytest.approx(-2.0)   # (-1 - 2 - 3) / 3 response tokens
    # the step report carries the rows the driver asked for (meta); metrics hold numbers only
    assert report.step_report(batch, n_batches=1).records == records[:1]
    no_dump = Batch(batch.tensors, batch.non_tensors, {})
    assert report.step_report(no_dump, n_batches=1).records == []
    assert all(isinstance(v, float) for v in step_metrics.rollout_metrics(batch).values())


def test_sampled_validation_pass_at_k_and_majority_vote_by_hand():
    # prompt a: 1 of 4 correct; answers "7", "3", "3", "7" -> a tie, the first sampled ("7", correct) wins
    # prompt b: none correct
    acc = torch.tensor([1.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0])
    batch = Batch({"reward_extra.acc": acc, TOKEN_LEVEL_SCORES: acc[:, None], RESPONSE_MASK: torch.ones(8, 1)},
                  {UID: np.array(["a"] * 4 + ["b"] * 4, dtype=object),
                   RESPONSE_TEXT: np.array(["7", "3", " 3", "7 ", "1", "2", "2", "5"], dtype=object)})
    m = step_metrics.sampled_validation_metrics(batch, n=4)
    # a: pass@1 = 1/4, pass@2 = 1 - C(3,2)/C(4,2) = 1/2, pass@4 = 1, maj@4 = 1; b: all 0
    assert m == pytest.approx({"val/pass@1": 0.125, "val/pass@2": 0.25, "val/pass@4": 0.5, "val/maj@4": 0.5})


def _mismatched_batch():
    # one row, three tokens; log-ratios old - rollout = ln 3, 0, -ln 4 (r = 3, 1, 1/4); the last token is padding
    old = torch.tensor([[math.log(3.0), 0.0, -math.log(4.0), 0.0]])
    return Batch({OLD_LOGPROBS: old, ROLLOUT_LOGPROBS: torch.zeros(1, 4), RESPONSE_MASK: torch.tensor([[1, 1, 1, 0]]),
                  ADVANTAGES: torch.tensor([[1.0, 1.0, 1.0, 1.0]])})


def test_truncated_rollout_correction_weights_every_token_by_the_capped_ratio():
    out = corrections.correct_rollouts(_mismatched_batch(), mode="truncated_is", cap=2.0)
    assert out[ADVANTAGES][0].tolist() == pytest.approx([2.0, 1.0, 0.25, 1.0])   # min(3, 2), 1, 1/4; padding untouched
    m = corrections.rollout_correction_metrics(_mismatched_batch(), mode="truncated_is", cap=2.0)
    assert m["rollout/correction_weight_mean"] == pytest.approx((2.0 + 1.0 + 0.25) / 3)
    assert m["rollout/correction_capped_frac"] == pytest.approx(1 / 3)
    # k3 of KL(rollout || old) per token: r - 1 - ln r with r = pi_old / pi_rollout
    k3 = [3 - 1 - math.log(3), 0.0, 0.25 - 1 - math.log(0.25)]
    assert m["rollout/mismatch_kl"] == pytest.approx(sum(k3) / 3, rel=1e-5)


def test_masked_rollout_correction_drops_tokens_outside_the_band():
    out = corrections.correct_rollouts(_mismatched_batch(), mode="masked_is", cap=2.0)
    assert out[RESPONSE_MASK].tolist() == [[0, 1, 0, 0]]          # r = 3 and r = 1/4 are outside [1/2, 2]
    assert out[ADVANTAGES].tolist() == [[0.0, 1.0, 0.0, 1.0]]      # padding untouched (masked anyway)
    m = corrections.rollout_correction_metrics(_mismatched_batch(), mode="masked_is", cap=2.0)
    assert m["rollout/correction_capped_frac"] == pytest.approx(2 / 3)
    assert m["rollout/correction_weight_mean"] == pytest.approx(1 / 3)
