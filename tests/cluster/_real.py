"""Test helpers around the real workers (shipped to actors by value, like `_dummies`)."""

from __future__ import annotations

import torch

from raygraph.batch import (
    ADVANTAGES,
    PROMPT_IDS,
    PROMPT_MASK,
    RESPONSE_MASK,
    RESPONSES,
    ROLLOUT_LOGPROBS,
    UID,
    WEIGHT_VERSION,
    Batch,
)
from raygraph.models.loading import load_tokenizer
from raygraph.workers.policy import PolicyWorker
from raygraph.workers.rollout_hf import HFRolloutWorker

PROMPTS = ["<|user|>1+1=?<|end|><|assistant|>", "<|user|>2+3=?<|end|><|assistant|>",
           "<|user|>what is 7*6?<|end|><|assistant|>", "<|user|>x<|end|><|assistant|>"]


class InspectablePolicy(PolicyWorker):
    def state(self) -> dict:
        return {name: t.clone() for bucket in self.weight_buckets() for name, t in bucket}


class InspectableRollout(HFRolloutWorker):
    def state(self) -> dict:
        return {k: v.detach().clone() for k, v in self.model.state_dict().items()}


def prompts(model_path: str) -> Batch:
    tok = load_tokenizer(model_path)
    enc = tok(PROMPTS, padding=True, return_tensors="pt", add_special_tokens=False)
    return Batch({PROMPT_IDS: enc.input_ids, PROMPT_MASK: enc.attention_mask},
                 {UID: [f"p{i}" for i in range(len(PROMPTS))]})


def signed_advantages(batch: Batch) -> Batch:
    """+1 on the first sample of each prompt, -1 on the others (a fixed, non-zero signal)."""
    sign = torch.ones(len(batch))
    sign[1::2] = -1.0
    return batch.with_columns(**{ADVANTAGES: batch[RESPONSE_MASK].float() * sign[:, None]})


def digest(batch: Batch) -> dict:
    return {"responses": batch[RESPONSES].tolist(), "mask": batch[RESPONSE_MASK].tolist(),
            "logprobs": batch[ROLLOUT_LOGPROBS].tolist(), "versions": batch[WEIGHT_VERSION].tolist()}
