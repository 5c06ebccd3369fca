"""LoRA policy -> vLLM engine (CPU build) in the fallback mode, merged weights (what a vLLM without
usable LoRA support gets): verified, and the engine's log-probs of its samples equal the LoRA
policy's own. The adapter mode is tested in test_lora_vllm_adapter.py."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("vllm")
pytestmark = pytest.mark.slow   # one engine start (~15-30 s on 2 cores)

from raygraph.batch import ADVANTAGES, OLD_LOGPROBS, PROMPT_IDS, PROMPT_MASK, RESPONSE_MASK, ROLLOUT_LOGPROBS, Batch  # noqa: E402,I001
from raygraph.cluster.weights import InProcessTransport  # noqa: E402
from raygraph.models.loading import load_tokenizer  # noqa: E402
from raygraph.models.lora import LoraSpec  # noqa: E402
from raygraph.models.tiny import build_tiny_lm  # noqa: E402
from raygraph.workers.policy import PolicyWorker  # noqa: E402
from raygraph.workers.rollout_vllm import VLLMRolloutWorker  # noqa: E402


def test_merged_lora_weights_drive_the_vllm_engine(tmp_path, rollout_batch):
    path = str(build_tiny_lm(tmp_path / "small", size="small", seed=0))   # head_dim 32 for vLLM's CPU attention
    policy = PolicyWorker(model_path=path, lr=1e-2, temperature=0.8, lora=LoraSpec(rank=8, alpha=16.0),
                          lora_sync="merged")
    batch = rollout_batch(6, seed=0)
    batch = batch.union(policy.logprobs(batch)).with_columns(
        **{ADVANTAGES: torch.randn(batch[RESPONSE_MASK].shape, generator=torch.Generator().manual_seed(0))})
    for _ in range(3):
        policy.update(batch)
    engine = VLLMRolloutWorker(model_path=path, seed=3, n=2, temperature=0.8, max_new_tokens=8, enforce_eager=True)
    try:
        transport = InProcessTransport()
        transport.send(policy.weight_buckets(bucket_bytes=1 << 20), version=1)
        stats = transport.receive(engine.load_weights)
        assert stats["weights/verified"] == 1.0
        assert stats["weights/bytes"] == policy.adapter.full_bytes   # every tensor, adapters merged in
        tok = load_tokenizer(path)
        enc = tok(["<|user|>1+1=?<|end|><|assistant|>", "<|user|>x<|end|><|assistant|>"], padding=True,
                  return_tensors="pt", add_special_tokens=False)
        out = engine.generate(Batch({PROMPT_IDS: enc.input_ids, PROMPT_MASK: enc.attention_mask}))
    finally:
        engine.close()
    diff = (policy.logprobs(out)[OLD_LOGPROBS] - out[ROLLOUT_LOGPROBS]).abs() * out[RESPONSE_MASK]
    assert diff.max() < 1e-4
