"""A weight update into a running vLLM engine with prefix caching on (docs/vllm.md, "Weight
updates into the running engine"): the cached KV of a prompt seen before the update is dropped,
and vLLM's per-update "Failed to load weights" warnings (rotary embeddings, the tied lm_head)
are filtered out of the engine's log.

The engine is started inside the test so that its process writes to the test's captured stdout.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("vllm")
pytestmark = pytest.mark.slow   # one engine start (~15 s on 2 cores)

from test_freed_memory import PAGES, reuse_faults  # noqa: E402

from raygraph.batch import PROMPT_IDS, PROMPT_MASK, RESPONSE_MASK, ROLLOUT_LOGPROBS, UID, Batch  # noqa: E402
from raygraph.models.loading import load_causal_lm, load_tokenizer  # noqa: E402
from raygraph.models.logprobs import response_logprobs  # noqa: E402
from raygraph.models.tiny import build_tiny_lm  # noqa: E402
from raygraph.workers.rollout_vllm import VLLMRolloutWorker  # noqa: E402

# 219 tokens of the character tokenizer: one full KV block of the CPU backend (128 tokens) is cached.
PROMPT = "<|user|>" + "the quick brown fox jumps over the lazy dog. " * 6 + "<|end|><|assistant|>"


def test_a_prompt_seen_before_a_weight_update_is_recomputed_under_the_new_weights(tmp_path, capfd, monkeypatch):
    old, new = (str(build_tiny_lm(tmp_path / name, size="small", seed=seed)) for name, seed in (("a", 0), ("b", 1)))
    ids = torch.tensor([load_tokenizer(old)(PROMPT, add_special_tokens=False).input_ids])
    assert ids.shape == (1, 219)
    prompt = Batch({PROMPT_IDS: ids, PROMPT_MASK: torch.ones_like(ids)}, {UID: ["p"]})
    worker = VLLMRolloutWorker(model_path=old, max_new_tokens=8, enable_prefix_caching=True, enforce_eager=True,
                               gpu_memory_utilization=0.03)
    try:
        worker.generate(prompt, greedy=True)   # the prompt's first block is now in the prefix cache
        capfd.readouterr()
        packed = _embedding_packs(monkeypatch)
        worker.load_weights([list(load_causal_lm(new, dtype="float32").named_parameters())], version=1)
        log = capfd.readouterr()
        after = worker.generate(prompt, greedy=True)
    finally:
        worker.close()
    recomputed = response_logprobs(load_causal_lm(new, dtype="float32"), after, temperature=1.0)[0]
    # Measured: 2.4e-7 with the reset; 0.055 with the KV of the old weights for the first 128 tokens.
    assert (after[ROLLOUT_LOGPROBS] - recomputed).abs()[after[RESPONSE_MASK] == 1].max() < 1e-4
    # Unfiltered, the engine logs "RotaryEmbedding: Failed to load weights" and the same for ParallelLMHead.
    assert "Failed to load weights" not in log.out + log.err
    # The engine's process keeps freed memory for the next reload (raygraph.workers.freed_memory)
    assert max(reuse_faults()[1:]) < PAGES // 20
    # The tied head's GEMM weight is re-packed once; the input embedding's, never used, is not.
    assert packed == ["ParallelLMHead"]


def _embedding_packs(monkeypatch) -> list[str]:
    """The class of every vocabulary embedding whose CPU GEMM weight vLLM packs from now on."""
    from vllm.model_executor.layers import utils
    from vllm.model_executor.layers.vocab_parallel_embedding import VocabParallelEmbedding

    packed, dispatch = [], utils.dispatch_cpu_unquantized_gemm

    def recording(layer, *args, **kwargs):
        if isinstance(layer, VocabParallelEmbedding):
            packed.append(type(layer).__name__)
        return dispatch(layer, *args, **kwargs)

    monkeypatch.setattr(utils, "dispatch_cpu_unquantized_gemm", recording)   # vLLM looks it up at each call
    return packed


def _through_one_reused_buffer(named: list[tuple[str, torch.Tensor]], per_bucket: int):
    """`per_bucket` tensors a bucket, each a view into the same buffer, which is overwritten with
    NaN when the next bucket is asked for: what a collective transport's reused payload buffers
    hand over (`raygraph.cluster.weights`: a load must copy what it keeps)."""
    buffer = torch.empty(sum(t.numel() for _, t in named))
    for first in range(0, len(named), per_bucket):
        bucket, offset = [], 0
        for name, tensor in named[first:first + per_bucket]:
            view = buffer[offset:offset + tensor.numel()].view(tensor.shape)
            view.copy_(tensor)
            bucket.append((name, view))
            offset += tensor.numel()
        yield bucket
        buffer.fill_(float("nan"))


def _tiny_with_vocab(path, seed: int, vocab: int) -> str:
    """The small tiny model with its tokenizer grown to `vocab` tokens (vLLM pads a vocabulary to
    a multiple of 64: the tiny tokenizer's 93 are padded, 128 are not)."""
    from transformers import AutoModelForCausalLM

    from raygraph.models.tiny import build_tiny_tokenizer, tiny_config

    tok = build_tiny_tokenizer()
    tok.add_tokens([f"<extra_{i}>" for i in range(vocab - len(tok))])
    config = tiny_config("small")
    config.vocab_size = len(tok)
    torch.manual_seed(seed)
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(path)
    tok.save_pretrained(path)
    return str(path)


@pytest.mark.parametrize("per_bucket,vocab", [(1, 93), (5, 93), (1, 128)])
def test_an_update_through_a_reused_buffer_loads_every_layer_whole(tmp_path, monkeypatch, per_bucket, vocab):
    """vLLM's layerwise reload keeps the tensors of a layer until its last one arrives (one tensor
    a bucket: q, k and v of one attention come in three buckets; five a bucket: a decoder layer
    of 12 tensors straddles two or three buckets, and the layers a bucket completes are re-packed
    from its tensors without a copy; a padded vocabulary's embedding until the end of the update):
    the engine must copy what it keeps, or the layer is built from a buffer the next bucket
    overwrote, and only that (an embedding whose vocabulary is not padded is built during its own
    bucket's load). After the update the engine's log-probs are the new model's."""
    from raygraph.workers import vllm_worker_extension

    old, new = (_tiny_with_vocab(tmp_path / name, seed, vocab) for name, seed in (("a", 0), ("b", 1)))
    ids = torch.tensor([load_tokenizer(old)("<|user|>1+2=<|end|><|assistant|>", add_special_tokens=False).input_ids])
    prompt = Batch({PROMPT_IDS: ids, PROMPT_MASK: torch.ones_like(ids)}, {UID: ["p"]})
    copied, own = [], vllm_worker_extension.own_buffered_tensors
    monkeypatch.setattr(vllm_worker_extension, "own_buffered_tensors", lambda: copied.extend(own()) or copied)
    worker = VLLMRolloutWorker(model_path=old, max_new_tokens=8, enforce_eager=True, gpu_memory_utilization=0.03)
    try:
        named = [(n, p.detach()) for n, p in load_causal_lm(new, dtype="float32").named_parameters()]
        assert worker.load_weights(_through_one_reused_buffer(named, per_bucket), version=1)["loaded"] == len(named)
        after = worker.generate(prompt, greedy=True)
    finally:
        worker.close()
    recomputed = response_logprobs(load_causal_lm(new, dtype="float32"), after, temperature=1.0)[0]
    diff = (after[ROLLOUT_LOGPROBS] - recomputed).abs()[after[RESPONSE_MASK] == 1]
    assert torch.isfinite(after[ROLLOUT_LOGPROBS]).all() and diff.max() < 1e-4
    assert ("VocabParallelEmbedding" in copied) == (vocab % 64 != 0)
    if per_bucket == 1:   # q and k wait for v in every one of the 4 layers, gate for up
        assert copied.count("QKVParallelLinear") >= 8 and copied.count("MergedColumnParallelLinear") == 4
