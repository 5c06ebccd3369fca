"""ReferenceWorker and CriticWorker on one batch."""

from __future__ import annotations

import torch

from raygraph.batch import OLD_LOGPROBS, REF_LOGPROBS, RESPONSE_MASK, RETURNS, VALUES
from raygraph.workers import CriticWorker, PolicyWorker, ReferenceWorker


def test_reference_equals_policy_before_training(tiny_model_path, rollout_batch):
    batch = rollout_batch(5, seed=8)
    ref = ReferenceWorker(model_path=tiny_model_path, micro_batch_size=2, temperature=0.8).logprobs(batch)
    policy = PolicyWorker(model_path=tiny_model_path, lr=1e-3, temperature=0.8, micro_batch_size=3)
    assert ref.columns() == [REF_LOGPROBS]
    torch.testing.assert_close(ref[REF_LOGPROBS], policy.logprobs(batch)[OLD_LOGPROBS], atol=1e-6, rtol=0)


def test_critic_values_update_and_checkpoint(tiny_model_path, rollout_batch, tmp_path):
    batch = rollout_batch(6, seed=9)
    critic = CriticWorker(model_path=tiny_model_path, lr=1e-4, micro_batch_size=4, ppo_epochs=2)
    values = critic.values(batch)[VALUES]
    assert values.shape == batch[RESPONSE_MASK].shape and (values[batch[RESPONSE_MASK] == 0] == 0).all()
    returns = values + 1.0
    train = batch.with_columns(**{VALUES: values, RETURNS: returns})
    metrics = critic.update(train)
    assert set(metrics) == {"critic/vf_loss", "critic/vf_clipfrac", "critic/grad_norm", "critic/lr",
                            "critic/skipped_steps", "critic/optimizer_steps", "critic/empty_updates"}
    assert metrics["critic/empty_updates"] == 0
    assert metrics["critic/vf_loss"] > 0
    moved = critic.values(batch)[VALUES] - values
    assert (moved[batch[RESPONSE_MASK] == 1] > 0).float().mean() > 0.8  # values moved towards the returns

    critic.save_checkpoint(tmp_path / "ckpt")
    expected = critic.update(train)
    resumed = CriticWorker(model_path=tiny_model_path, lr=1e-4, micro_batch_size=4, ppo_epochs=2, seed=5)
    resumed.load_checkpoint(tmp_path / "ckpt")
    assert resumed.update(train) == expected
    critic.save_pretrained(tmp_path / "hf")
    reloaded = CriticWorker(model_path=str(tmp_path / "hf"), lr=1e-4)
    torch.testing.assert_close(reloaded.values(batch)[VALUES], critic.values(batch)[VALUES], atol=0, rtol=0)
