"""PolicyWorker with LoRA: adapter-only training, the base model as the reference, adapter-only
weight sync (verified), merged sync, exact resume and the merged HF export + PEFT adapter."""

from __future__ import annotations

import torch
from transformers import AutoModelForCausalLM

from raygraph.batch import (
    ADVANTAGES,
    OLD_LOGPROBS,
    REF_LOGPROBS,
    RESPONSE_MASK,
    ROLLOUT_LOGPROBS,
    Batch,
)
from raygraph.cluster.weights import InProcessTransport
from raygraph.models.lora import LoraSpec
from raygraph.workers.adapter import adapter_dir
from raygraph.workers.policy import PolicyWorker
from raygraph.workers.reference import ReferenceWorker
from raygraph.workers.rollout_hf import HFRolloutWorker

SPEC = LoraSpec(rank=4, alpha=8.0)
ADAPTER_PARAMS = 2 * (512 + 384 + 384 + 512 + 768 + 768 + 768)   # tests/models/test_lora.py derives it


def _policy(path, **kw) -> PolicyWorker:
    return PolicyWorker(model_path=path, **({"lr": 1e-2, "temperature": 0.9, "lora": SPEC} | kw))


def _train_batch(worker: PolicyWorker, rollout_batch, rows: int = 6, seed: int = 0) -> Batch:
    batch = rollout_batch(rows, seed=seed)
    advantages = torch.randn(batch[RESPONSE_MASK].shape, generator=torch.Generator().manual_seed(seed))
    return batch.union(worker.logprobs(batch)).with_columns(**{ADVANTAGES: advantages})


def _state(worker: PolicyWorker) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in worker.model.state_dict().items()}


def test_only_adapters_get_gradients_and_optimizer_state(tiny_model_path, rollout_batch):
    worker = _policy(tiny_model_path)
    before = _state(worker)
    batch = _train_batch(worker, rollout_batch)

    def changed() -> set[str]:
        return {k for k, v in _state(worker).items() if not torch.equal(before[k], v)}

    metrics = worker.update(batch)
    # B starts at 0, so A's first gradient (B^T ...) is 0: only the 14 B matrices move
    assert len(changed()) == 14 and all(".lora_B." in k for k in changed())
    worker.update(batch)
    assert len(changed()) == 28 and all(".lora_A." in k or ".lora_B." in k for k in changed())
    optimizer = worker.trained.optimizer
    states = [optimizer.state[p] for group in optimizer.param_groups for p in group["params"]]
    assert sum(s["exp_avg"].numel() for s in states) == ADAPTER_PARAMS   # AdamW moments: adapters only
    assert metrics["weights/lora_sync_bytes"] == 4 * ADAPTER_PARAMS
    assert metrics["weights/full_bytes"] == 4 * sum(p.numel() for p in
                                                    AutoModelForCausalLM.from_pretrained(tiny_model_path).parameters())


def test_ref_logprobs_are_the_base_models_exactly(tiny_model_path, rollout_batch):
    worker = _policy(tiny_model_path, micro_batch_size=3)
    batch = rollout_batch(5, seed=8)
    reference = ReferenceWorker(model_path=tiny_model_path, micro_batch_size=3, temperature=0.9).logprobs(batch)
    for _ in range(2):
        worker.update(_train_batch(worker, rollout_batch))
    policy = worker.logprobs(batch)[OLD_LOGPROBS]
    ref = worker.ref_logprobs(batch)
    assert ref.columns() == [REF_LOGPROBS]
    assert torch.equal(ref[REF_LOGPROBS], reference[REF_LOGPROBS])
    assert (policy - ref[REF_LOGPROBS]).abs().max() > 1e-2   # the policy itself has moved away from the base
    assert torch.equal(worker.logprobs(batch)[OLD_LOGPROBS], policy)   # and the adapter is back on


def test_adapter_only_sync_to_hf_rollout_is_verified_and_exact(tiny_model_path, rollout_batch):
    worker = _policy(tiny_model_path)
    worker.update(_train_batch(worker, rollout_batch))
    rollout = HFRolloutWorker(model_path=tiny_model_path, max_new_tokens=5, temperature=0.9, n=2, lora=SPEC)
    transport = InProcessTransport()
    transport.send(worker.weight_buckets(bucket_bytes=20_000), version=1)
    stats = transport.receive(rollout.load_weights)
    assert stats["weights/verified"] == 1.0 and stats["weights/bytes"] == 4 * ADAPTER_PARAMS
    assert stats["weights/buckets"] > 1
    policy_state = worker.model.state_dict()
    assert all(torch.equal(t, policy_state[k]) for k, t in rollout.model.state_dict().items())
    out = rollout.generate(rollout_batch(3, seed=2))
    assert (worker.logprobs(out)[OLD_LOGPROBS] - out[ROLLOUT_LOGPROBS]).abs().max() < 1e-5


def test_merged_sync_to_a_rollout_without_adapters(tiny_model_path, rollout_batch):
    """What the vLLM engine receives: full weights in HF names with the adapters merged in."""
    worker = _policy(tiny_model_path, lora_sync="merged")
    worker.update(_train_batch(worker, rollout_batch))
    rollout = HFRolloutWorker(model_path=tiny_model_path, max_new_tokens=5, temperature=0.9, n=2)
    transport = InProcessTransport()
    transport.send(worker.weight_buckets(bucket_bytes=50_000), version=3)
    stats = transport.receive(rollout.load_weights)
    full = sum(p.numel() * 4 for p in rollout.model.parameters())
    assert stats["weights/verified"] == 1.0 and stats["weights/bytes"] == full
    out = rollout.generate(rollout_batch(3, seed=2))
    assert (worker.logprobs(out)[OLD_LOGPROBS] - out[ROLLOUT_LOGPROBS]).abs().max() < 1e-4


def test_checkpoint_resume_is_exact(tiny_model_path, rollout_batch, tmp_path):
    kw = {"lr_schedule": "cosine", "total_steps": 3}
    worker = _policy(tiny_model_path, **kw)
    batch = _train_batch(worker, rollout_batch)
    worker.update(batch)
    worker.save_checkpoint(tmp_path / "ckpt")
    expected = worker.update(batch)
    resumed = _policy(tiny_model_path, seed=7, **kw)   # another seed: a different fresh adapter A
    resumed.load_checkpoint(tmp_path / "ckpt")
    assert resumed.update(batch) == expected
    for k, v in _state(worker).items():
        assert torch.equal(_state(resumed)[k], v), k


def test_hf_export_is_merged_and_the_adapter_is_in_peft_format(tiny_model_path, rollout_batch, tmp_path):
    from peft import PeftModel

    worker = _policy(tiny_model_path)
    worker.update(_train_batch(worker, rollout_batch))
    worker.save_pretrained(tmp_path / "hf")
    ids = torch.randint(6, 93, (3, 9), generator=torch.Generator().manual_seed(1))
    worker.model.eval()
    with torch.no_grad():
        expected = worker.model(ids).logits
        merged = AutoModelForCausalLM.from_pretrained(tmp_path / "hf")   # plain HF, no peft
        torch.testing.assert_close(merged(ids).logits, expected, atol=1e-5, rtol=1e-5)
        assert not any("lora" in k for k in merged.state_dict())
        adapter = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_model_path),
                                            str(adapter_dir(tmp_path / "hf")))
        assert torch.equal(adapter(ids).logits, expected)
    assert (tmp_path / "hf_adapter" / "adapter_config.json").is_file()


def test_bf16_keeps_the_frozen_base_in_bf16_and_the_adapters_in_float32(tiny_model_path, rollout_batch):
    worker = _policy(tiny_model_path, dtype="bfloat16")
    dtypes = {n: p.dtype for n, p in worker.model.named_parameters()}
    assert {d for n, d in dtypes.items() if ".lora_" not in n} == {torch.bfloat16}
    assert {d for n, d in dtypes.items() if ".lora_" in n} == {torch.float32}
    assert worker.adapter.full_bytes == 2 * sum(p.numel() for p in
                                                AutoModelForCausalLM.from_pretrained(tiny_model_path).parameters())
    batch = _train_batch(worker, rollout_batch)
    norms = [worker.update(batch)["actor/grad_norm"] for _ in range(2)]
    assert all(0 < n < float("inf") for n in norms)
    reference = ReferenceWorker(model_path=tiny_model_path, dtype="bfloat16", temperature=0.9).logprobs(batch)
    # same bf16 weights; the policy runs under autocast, the reference in plain bf16
    torch.testing.assert_close(worker.ref_logprobs(batch)[REF_LOGPROBS], reference[REF_LOGPROBS], atol=0.05, rtol=0)
