"""The workers' column contract (docs/internals.md, "Workers"): every method that returns rows
returns a `Batch` with ONLY the new columns, one row per input row; the caller unions."""

from __future__ import annotations

import torch

from raygraph.batch import (
    DATA_SOURCE,
    ENTROPY,
    GROUND_TRUTH,
    OLD_LOGPROBS,
    REF_LOGPROBS,
    RESPONSE_LENGTH,
    RESPONSE_MASK,
    RESPONSE_TEXT,
    ROLLOUT_LOGPROBS,
    TOKEN_LEVEL_SCORES,
    UID,
    VALUES,
    WEIGHT_VERSION,
)
from raygraph.models.lora import LoraSpec
from raygraph.workers import CriticWorker, PolicyWorker, ReferenceWorker
from raygraph.workers.reward_model import RewardModelWorker
from raygraph.workers.reward_rule import RuleRewardWorker


def _generated_rows(rollout_batch):
    """4 rows as a rollout returns them: the sequence columns plus what the engine adds."""
    batch = rollout_batch(4, seed=3)
    mask = batch[RESPONSE_MASK]
    return batch.with_columns(**{
        RESPONSE_LENGTH: mask.sum(-1), ROLLOUT_LOGPROBS: -torch.ones(mask.shape) * mask,
        WEIGHT_VERSION: torch.zeros(4, dtype=torch.int64), UID: ["a", "a", "b", "b"],
        DATA_SOURCE: ["toy_arith"] * 4, GROUND_TRUTH: ["2"] * 4, RESPONSE_TEXT: ["x"] * 4})


def test_role_methods_return_only_their_new_columns(tiny_model_path, tiny_rm_path, rollout_batch):
    batch = _generated_rows(rollout_batch)
    policy = PolicyWorker(model_path=tiny_model_path, lr=1e-3)
    lora_policy = PolicyWorker(model_path=tiny_model_path, lr=1e-3, lora=LoraSpec(rank=2, alpha=4.0))
    outputs = {
        "PolicyWorker.logprobs": (policy.logprobs(batch), [OLD_LOGPROBS, ENTROPY]),
        "PolicyWorker.ref_logprobs (LoRA)": (lora_policy.ref_logprobs(batch), [REF_LOGPROBS]),
        "ReferenceWorker.logprobs": (ReferenceWorker(model_path=tiny_model_path).logprobs(batch), [REF_LOGPROBS]),
        "CriticWorker.values": (CriticWorker(model_path=tiny_model_path, lr=1e-3).values(batch), [VALUES]),
        "RewardModelWorker.score": (RewardModelWorker(model_path=tiny_rm_path, policy_tokenizer_path=tiny_model_path)
                                    .score(batch), [TOKEN_LEVEL_SCORES]),
        "RuleRewardWorker.score": (RuleRewardWorker(tiny_model_path, function="toy_arith").score(batch),
                                   [TOKEN_LEVEL_SCORES, "reward_extra.acc", "reward_extra.format_ok"]),
    }
    for method, (out, expected) in outputs.items():
        assert (method, out.columns()) == (method, expected)
        assert (method, len(out), out.meta) == (method, 4, {})
        assert all(out[c].shape[0] == 4 for c in expected)
