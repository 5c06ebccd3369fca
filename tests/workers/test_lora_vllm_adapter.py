"""LoRA policy -> vLLM engine (CPU build) with vLLM's own adapter support: adapter-only syncs,
verified like full weights, and the engine's log-probs of its samples equal the LoRA policy's own,
for every synced adapter (a new adapter is never served stale).

One engine serves the module (~15-30 s to start on 2 cores).
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("vllm")
pytestmark = pytest.mark.slow

from raygraph.batch import OLD_LOGPROBS, PROMPT_IDS, PROMPT_MASK, RESPONSE_MASK, ROLLOUT_LOGPROBS, Batch  # noqa: E402,I001
from raygraph.cluster.weights import InProcessTransport  # noqa: E402
from raygraph.models.loading import load_tokenizer  # noqa: E402
from raygraph.models.lora import LoraSpec, is_adapter_name  # noqa: E402
from raygraph.models.tiny import build_tiny_lm  # noqa: E402
from raygraph.workers.policy import PolicyWorker  # noqa: E402
from raygraph.workers.rollout_vllm import VLLMRolloutWorker  # noqa: E402

SPEC = LoraSpec(rank=4, alpha=16.0)
PROMPTS = ["<|user|>1+1=?<|end|><|assistant|>", "<|user|>x<|end|><|assistant|>", "<|user|>abc?<|end|><|assistant|>"]
TOLERANCE = 1e-4   # fp32 on both sides; measured 2.4e-7 (see docs/lora.md)


@pytest.fixture(scope="module")
def model_path(tmp_path_factory) -> str:
    return str(build_tiny_lm(tmp_path_factory.mktemp("lora_vllm") / "small", size="small", seed=0))  # head_dim 32


@pytest.fixture(scope="module")
def engine(model_path):
    assert VLLMRolloutWorker.lora_sync_for(model_path, SPEC)[0] == "adapter"   # this vLLM build serves LoRA
    worker = VLLMRolloutWorker(model_path=model_path, seed=3, n=2, temperature=0.8, max_new_tokens=8,
                               enforce_eager=True, lora=SPEC, lora_sync="adapter")
    yield worker
    worker.close()


def _randomise_adapters(policy: PolicyWorker, seed: int) -> None:
    """Random non-zero A and B (a fresh adapter has B = 0, which would test nothing)."""
    gen = torch.Generator().manual_seed(seed)
    for name, param in policy.model.named_parameters():
        if is_adapter_name(name):
            param.data.copy_(0.1 * torch.randn(param.shape, generator=gen))


def _sync(policy: PolicyWorker, engine: VLLMRolloutWorker, version: int) -> dict:
    transport = InProcessTransport()
    transport.send(policy.weight_buckets(bucket_bytes=1 << 16), version=version)   # several buckets
    return transport.receive(engine.load_weights)


def _prompts(model_path: str) -> Batch:
    enc = load_tokenizer(model_path)(PROMPTS, padding=True, return_tensors="pt", add_special_tokens=False)
    return Batch({PROMPT_IDS: enc.input_ids, PROMPT_MASK: enc.attention_mask})


def _gap(policy: PolicyWorker, out: Batch) -> float:
    diff = (policy.logprobs(out)[OLD_LOGPROBS] - out[ROLLOUT_LOGPROBS]).abs() * out[RESPONSE_MASK]
    return float(diff.max())


def test_adapter_syncs_drive_vllm_lora_and_a_new_adapter_is_never_stale(model_path, engine):
    policy = PolicyWorker(model_path=model_path, lr=1e-2, temperature=0.8, lora=SPEC, lora_sync="adapter")
    prompts = _prompts(model_path)
    base = engine.generate(prompts, greedy=True)
    gaps, greedy = [], []
    for version, seed in ((1, 0), (2, 1)):
        _randomise_adapters(policy, seed)
        stats = _sync(policy, engine, version)
        assert stats["weights/verified"] == 1.0
        assert stats["weights/bytes"] == policy.adapter.adapter_bytes < policy.adapter.full_bytes / 2
        gaps.append(_gap(policy, engine.generate(prompts)))
        greedy.append(engine.generate(prompts, greedy=True))
        gaps.append(_gap(policy, greedy[-1]))
        assert set(greedy[-1]["weight_version"].tolist()) == {version}
    assert max(gaps) < TOLERANCE, gaps
    # each adapter changed what the engine computes: not the base model, not the previous adapter
    for before, after in ((base, greedy[0]), (greedy[0], greedy[1])):
        assert not torch.equal(before[ROLLOUT_LOGPROBS], after[ROLLOUT_LOGPROBS])


def test_an_adapter_sync_must_be_complete(model_path, engine):
    policy = PolicyWorker(model_path=model_path, lr=1e-2, lora=SPEC, lora_sync="adapter")
    buckets = list(policy.weight_buckets(bucket_bytes=1 << 16))
    with pytest.raises(ValueError, match="lacks"):
        engine.load_weights(buckets[:-1], version=9)
    with pytest.raises(KeyError, match="not a LoRA adapter tensor"):
        engine.load_weights([[("model.embed_tokens.weight", torch.zeros(1))]], version=9)
    assert engine.weight_version != 9
