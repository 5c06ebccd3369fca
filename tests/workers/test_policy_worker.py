"""PolicyWorker: exact gradient accumulation, non-finite skips, checkpoints, HF export, SFT/DPO."""

from __future__ import annotations

import math

import pytest
import torch
from transformers import AutoModelForCausalLM

from raygraph.batch import (
    ADVANTAGES,
    ATTENTION_MASK,
    ENTROPY,
    INPUT_IDS,
    LOSS_MASK,
    OLD_LOGPROBS,
    REF_LOGPROBS,
    RESPONSE_MASK,
    ROLLOUT_LOGPROBS,
    STALENESS,
    WEIGHT_VERSION,
    Batch,
)
from raygraph.errors import MissingColumn
from raygraph.graph import corrections
from raygraph.workers.optim import lr_factor
from raygraph.workers.policy import PolicyWorker
from raygraph.workers.rollout_hf import HFRolloutWorker

METRICS = {"actor/pg_loss", "actor/grad_norm", "actor/clipfrac", "actor/clipfrac_lower", "actor/approx_kl", "actor/entropy",
           "actor/kl_loss", "actor/lr", "actor/skipped_steps", "actor/optimizer_steps", "actor/empty_updates"}


def _policy(path, **kw) -> PolicyWorker:
    return PolicyWorker(model_path=path, **({"lr": 1e-2, "temperature": 0.9} | kw))


def _train_batch(worker: PolicyWorker, rollout_batch, rows: int = 6, seed: int = 0) -> Batch:
    batch = rollout_batch(rows, seed=seed)
    gen = torch.Generator().manual_seed(seed)
    advantages = torch.randn(batch[RESPONSE_MASK].shape, generator=gen)
    batch = batch.union(worker.logprobs(batch)).with_columns(**{ADVANTAGES: advantages})
    return batch.with_columns(**{REF_LOGPROBS: batch[OLD_LOGPROBS] + 0.1 * torch.randn(advantages.shape, generator=gen)})


def _weights(worker: PolicyWorker) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in worker.model.state_dict().items()}


def _record_gradients(worker: PolicyWorker) -> list[list[torch.Tensor]]:
    """The gradients each optimizer step of `worker` applies, recorded just before the step."""
    steps: list[list[torch.Tensor]] = []
    params = [p for group in worker.trained.optimizer.param_groups for p in group["params"]]
    worker.trained.optimizer.register_step_pre_hook(
        lambda *_: steps.append([torch.zeros_like(p) if p.grad is None else p.grad.clone() for p in params]))
    return steps


@pytest.mark.parametrize("loss_agg, split_by", [
    ("token-mean", {"micro_batch_size": 4}),                                     # 4 + 2 rows
    ("seq-mean-token-mean", {"micro_batch_size": 4}),
    ("token-mean", {"micro_batch_size": 6, "max_tokens_per_micro_batch": 24}),   # token budget, trimmed
    ("seq-mean-token-mean", {"micro_batch_size": 6, "max_tokens_per_micro_batch": 24}),
])
def test_micro_batches_accumulate_to_the_full_batch_gradient(tiny_model_path, rollout_batch, loss_agg, split_by):
    kw = {"loss_agg": loss_agg, "kl_loss_coef": 0.1, "entropy_coef": 0.01, "ppo_epochs": 2, "lr": 1e-4}
    whole = _policy(tiny_model_path, micro_batch_size=6, **kw)
    initial = _weights(whole)
    split = _policy(tiny_model_path, **split_by, **kw)
    g_whole, g_split = _record_gradients(whole), _record_gradients(split)
    batch = _train_batch(whole, rollout_batch)
    m_whole, m_split = whole.update(batch), split.update(batch)
    assert set(m_whole) == METRICS and m_whole["actor/skipped_steps"] == 0
    for name in METRICS:
        assert m_split[name] == pytest.approx(m_whole[name], rel=1e-4, abs=1e-6), name
    assert max((w - initial[k]).abs().max() for k, w in _weights(whole).items()) > 1e-4  # two steps of ~lr
    # The gradients each step applies are compared, not the weights after AdamW: Adam divides by
    # sqrt(v), so an entry whose gradient is near zero moves by up to ~lr whichever its sign, and
    # float32 rounding of a sum taken in another order (per micro-batch) can decide that sign.
    # Tolerance: summing the same terms in another order changes the result by a few float32
    # ulps (2**-23 ~ 1.2e-7) of the largest term per addition; over the dozen micro-batch and
    # sequence sums here that is ~1e-6 of the largest gradient (measured: <= 7e-7), so 1e-5 of it
    # leaves a 10x margin, while a mis-weighted micro-batch is off by a sizeable fraction of it.
    assert len(g_whole) == len(g_split) == 2   # ppo_epochs optimizer steps, none skipped
    for whole_grads, split_grads in zip(g_whole, g_split, strict=True):
        scale = max(float(g.abs().max()) for g in whole_grads)
        for a, b in zip(split_grads, whole_grads, strict=True):
            torch.testing.assert_close(a, b, rtol=0, atol=1e-5 * scale)


def test_one_step_update_without_old_logprobs_equals_the_recomputed_pass(tiny_model_path, rollout_batch):
    """One optimizer step: old log-probs = the update's own detached ones, exactly the same step as
    with a separate `logprobs` pass (ratio 1 either way); several steps need the pass."""
    kw = {"kl_loss_coef": 0.1, "micro_batch_size": 4, "lr": 1e-4}
    recomputed, skipped = _policy(tiny_model_path, **kw), _policy(tiny_model_path, **kw)
    batch = _train_batch(recomputed, rollout_batch)
    noise = 1e-3 * torch.randn(batch[OLD_LOGPROBS].shape, generator=torch.Generator().manual_seed(5))
    batch = batch.with_columns(**{ROLLOUT_LOGPROBS: batch[OLD_LOGPROBS] + noise * batch[RESPONSE_MASK]})
    initial = _weights(recomputed)
    m_full = recomputed.update(batch)
    m_skip = skipped.update(batch.select_columns([c for c in batch.columns() if c != OLD_LOGPROBS]))
    for name in METRICS:
        assert m_skip[name] == pytest.approx(m_full[name], rel=1e-4, abs=1e-6), name
    assert m_skip["actor/clipfrac"] == 0.0 and abs(m_skip["actor/approx_kl"]) < 1e-12   # ratio exactly 1
    # the rollout engine's log-probs vs the policy's, at the weights that sampled
    expected_gap = float((noise * batch[RESPONSE_MASK]).abs().max())
    assert m_skip["rollout/logprob_diff_max"] == pytest.approx(expected_gap, abs=1e-5)
    mask = batch[RESPONSE_MASK] == 1
    assert m_skip["rollout/logprob_diff_mean"] == pytest.approx(float(noise[mask].abs().mean()), abs=1e-6)
    w_full, w_skip = _weights(recomputed), _weights(skipped)
    assert max((w_full[k] - initial[k]).abs().max() for k in initial) > 1e-5
    for k in w_full:
        torch.testing.assert_close(w_skip[k], w_full[k], atol=1e-6, rtol=0)
    two_steps = _policy(tiny_model_path, mini_batch_size=3, **kw)
    with pytest.raises(MissingColumn, match="1 epoch\\(s\\) x 2 mini-batch.*actor.old_logprobs=recompute"):
        two_steps.update(batch.select_columns([c for c in batch.columns() if c != OLD_LOGPROBS]))


def test_async_is_weights_scale_the_policy_gradient_term_only(tiny_model_path, rollout_batch):
    """docs/async.md: the truncated IS weights of stale rows multiply the policy-gradient term; the
    KL-loss and entropy terms are not reweighted."""
    kw = {"kl_loss_coef": 0.1, "entropy_coef": 0.01, "lr": 1e-4}
    plain, weighted = _policy(tiny_model_path, **kw), _policy(tiny_model_path, **kw)   # the same weights
    batch = rollout_batch(4, seed=3)
    batch = batch.union(plain.logprobs(batch))
    old, mask = batch[OLD_LOGPROBS], batch[RESPONSE_MASK]
    # rows 0, 1 are stale, sampled at log-probs 0.5 and 2 below pi_old: w = e^0.5 and min(e^2, 2) = 2;
    # rows 2, 3 are fresh (w = 1). ref = old + 0.5: k3 = e^0.5 - 1 - 0.5 on every token.
    lag = torch.tensor([[0.5], [2.0], [3.0], [3.0]])
    batch = batch.with_columns(**{ADVANTAGES: mask.float(), ROLLOUT_LOGPROBS: (old - lag) * mask,
                                  REF_LOGPROBS: old + 0.5, STALENESS: torch.tensor([1, 1, 0, 0])})
    reweighted = corrections.truncated_importance_weights(batch, cap=2.0)
    # ratio pi / pi_old = 1 before the single step: pg_loss = -token-mean(w * A), with A = 1
    tokens = mask.sum(-1).float()
    pg_weighted = -float((torch.tensor([math.exp(0.5), 2.0, 1.0, 1.0]) * tokens).sum() / tokens.sum())
    # the whole loss, pg - 0.01 entropy + 0.1 kl, moves by the pg term's change alone
    loss_plain, loss_weighted = plain._ppo_loss(batch).loss, plain._ppo_loss(reweighted).loss
    assert float((loss_weighted - loss_plain).detach()) == pytest.approx(pg_weighted + 1.0, abs=1e-5)
    m_plain, m_weighted = plain.update(batch), weighted.update(reweighted)
    assert m_plain["actor/pg_loss"] == pytest.approx(-1.0, abs=1e-5)
    assert m_weighted["actor/pg_loss"] == pytest.approx(pg_weighted, abs=1e-5)
    entropy = float((batch[ENTROPY] * mask).sum() / mask.sum())
    for m in (m_plain, m_weighted):
        assert m["actor/kl_loss"] == pytest.approx(math.exp(0.5) - 1.5, abs=1e-5)   # 0.1487
        assert m["actor/entropy"] == pytest.approx(entropy, abs=1e-5)


def test_non_finite_loss_skips_the_step_and_keeps_weights(tiny_model_path, rollout_batch):
    worker = _policy(tiny_model_path, micro_batch_size=3, mini_batch_size=3, warmup_steps=4)
    batch = _train_batch(worker, rollout_batch)
    before = _weights(worker)
    advantages = batch[ADVANTAGES].clone()
    advantages[1, 0] = float("nan")  # poisons the first mini-batch only
    metrics = worker.update(batch.with_columns(**{ADVANTAGES: advantages}))
    assert metrics["actor/skipped_steps"] == 1 and metrics["actor/optimizer_steps"] == 2
    assert metrics["actor/lr"] == pytest.approx(1e-2 * 2 / 4)  # 2 optimizer steps of warmup (skips count)
    after = _weights(worker)
    assert all(torch.isfinite(v).all() for v in after.values())
    assert any(not torch.equal(before[k], after[k]) for k in before)  # the second mini-batch stepped

    worker = _policy(tiny_model_path, micro_batch_size=6)
    before = _weights(worker)
    metrics = worker.update(batch.with_columns(**{ADVANTAGES: advantages}))
    assert metrics["actor/skipped_steps"] == 1 and metrics["actor/optimizer_steps"] == 1  # all skipped
    assert all(torch.equal(before[k], v) for k, v in _weights(worker).items())
    assert not worker.trained.optimizer.state  # AdamW moments untouched too


def test_checkpoint_round_trip_restores_model_optimizer_and_schedule(tiny_model_path, rollout_batch, tmp_path):
    kw = {"lr_schedule": "cosine", "total_steps": 3, "micro_batch_size": 6}
    worker = _policy(tiny_model_path, **kw)
    batch = _train_batch(worker, rollout_batch)
    worker.update(batch)
    worker.save_checkpoint(tmp_path / "ckpt")
    expected = worker.update(batch)
    resumed = _policy(tiny_model_path, **kw)
    resumed.load_checkpoint(tmp_path / "ckpt")
    got = resumed.update(batch)
    assert got["actor/lr"] == expected["actor/lr"] < 1e-2
    for k, v in _weights(worker).items():
        assert torch.equal(_weights(resumed)[k], v), k


def test_save_pretrained_is_loadable_by_hf(tiny_model_path, rollout_batch, tmp_path):
    worker = _policy(tiny_model_path)
    worker.update(_train_batch(worker, rollout_batch))
    worker.save_pretrained(tmp_path)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path)
    assert loaded.config.architectures == ["Qwen2ForCausalLM"]
    for k, v in loaded.state_dict().items():
        assert torch.equal(v, worker.model.state_dict()[k]), k
    assert (tmp_path / "tokenizer_config.json").exists()


def test_weight_sync_to_rollout_is_bit_exact(tiny_model_path, rollout_batch):
    worker = _policy(tiny_model_path)
    worker.update(_train_batch(worker, rollout_batch))
    buckets = list(worker.weight_buckets(bucket_bytes=50_000))
    names = [n for b in buckets for n, _ in b]
    assert len(buckets) > 2 and len(names) == len(set(names))
    assert set(names) == set(worker.model.state_dict()) - {"lm_head.weight"}  # tied: sent once
    assert all(sum(t.numel() * 4 for _, t in b) <= 50_000 or len(b) == 1 for b in buckets)

    rollout = HFRolloutWorker(model_path=tiny_model_path, max_new_tokens=5, temperature=0.9, n=2)
    assert rollout.load_weights(iter(buckets), version=1)["loaded"] == len(names)
    policy_state = worker.model.state_dict()
    assert all(torch.equal(t, policy_state[k]) for k, t in rollout.model.state_dict().items())
    out = rollout.generate(rollout_batch(3, seed=2))
    assert out[WEIGHT_VERSION].tolist() == [1] * 6
    assert (worker.logprobs(out)[OLD_LOGPROBS] - out[ROLLOUT_LOGPROBS]).abs().max() < 1e-4


def test_a_warm_start_sft_step_leaves_the_policys_optimizer_and_schedule_as_built(tiny_model_path):
    """`sft_update(lr=)`: the same SFT loss and loop, stepped by a constant-lr AdamW of its own."""
    worker = _policy(tiny_model_path, lr=1e-2, warmup_steps=3, weight_decay=0.1, micro_batch_size=2)
    ids = torch.randint(6, 90, (4, 10))
    sft = Batch({INPUT_IDS: ids, ATTENTION_MASK: torch.ones_like(ids), LOSS_MASK: torch.ones_like(ids)})
    before = _weights(worker)
    for _ in range(2):
        metrics = worker.sft_update(sft, lr=5e-3)
    assert metrics["actor/lr"] == 5e-3 and metrics["actor/optimizer_steps"] == 1   # not the warmup's 1e-2 / 3
    assert max((w - before[k]).abs().max() for k, w in _weights(worker).items()) > 1e-3
    assert worker.trained.optimizer.state == {} and worker.trained.scheduler.last_epoch == 0
    assert worker.trained.optimizer.param_groups[0]["lr"] == pytest.approx(1e-2 / 3)   # warmup step 1 of 3


def test_sft_and_dpo_updates(tiny_model_path, rollout_batch):
    worker = _policy(tiny_model_path, lr=3e-2, micro_batch_size=2, temperature=1.0)
    ids = torch.randint(6, 90, (4, 10))
    mask = torch.ones_like(ids)
    sft = Batch({INPUT_IDS: ids, ATTENTION_MASK: mask, LOSS_MASK: mask})
    first = worker.sft_update(sft)["actor/sft_loss"]
    for _ in range(3):
        last = worker.sft_update(sft)["actor/sft_loss"]
    assert last < first
    pairs = rollout_batch(4, seed=5)
    pairs = pairs.union(Batch({REF_LOGPROBS: worker.logprobs(pairs)[OLD_LOGPROBS]}))
    metrics = worker.dpo_update(pairs, beta=0.1)
    assert metrics["actor/dpo_loss"] == pytest.approx(0.6931, abs=1e-3)  # -log sigmoid(0) at the reference
    assert {"actor/rewards/accuracy", "actor/grad_norm", "actor/lr"} <= set(metrics)


def test_lr_schedule():
    kw = {"warmup_steps": 2, "total_steps": 6, "min_lr_ratio": 0.1}
    assert [lr_factor(s, lr_schedule="constant", **kw) for s in range(4)] == [0.5, 1.0, 1.0, 1.0]
    cosine = [lr_factor(s, lr_schedule="cosine", **kw) for s in range(8)]
    assert cosine[:3] == [0.5, 1.0, 1.0] and cosine[4] == pytest.approx(0.55) and cosine[6:] == [0.1, 0.1]
    assert lr_factor(4, lr_schedule="linear", **kw) == pytest.approx(0.55)


def test_a_resume_with_another_total_steps_stretches_the_lr_schedule_from_the_resumed_step(
        tiny_model_path, rollout_batch, tmp_path):
    """docs/guarantees.md, resume policy: `trainer.total_steps` may change on resume and a decaying
    schedule stretches to the new length. Linear decay, one optimizer step per update, peak 1e-3:
    lr_k = 1e-3 (1 - k / total). Steps 0, 1 at total 4; resumed at step 2 with total 8:
    1 - 2/8 = 0.75 and 1 - 3/8 = 0.625 (before: 0.5, the old schedule's value, then 0.625)."""
    def policy(total_steps):
        return _policy(tiny_model_path, lr=1e-3, lr_schedule="linear", total_steps=total_steps)

    batch = rollout_batch(4, seed=1)
    batch = batch.with_columns(**{ADVANTAGES: torch.ones(batch[RESPONSE_MASK].shape)})
    first = policy(4)
    assert [first.update(batch)["actor/lr"] for _ in range(2)] == pytest.approx([1e-3, 0.75e-3])
    first.save_checkpoint(tmp_path / "ckpt")
    for total_steps, expected in ((4, [0.5e-3, 0.25e-3]), (8, [0.75e-3, 0.625e-3])):
        resumed = policy(total_steps)
        resumed.load_checkpoint(tmp_path / "ckpt")
        assert [resumed.update(batch)["actor/lr"] for _ in range(2)] == pytest.approx(expected), total_steps


def test_token_budget_micro_batches_give_the_same_logprobs(tiny_model_path, rollout_batch):
    batch = rollout_batch(9, prompt_len=7, response_len=6, seed=3)
    fixed = _policy(tiny_model_path, micro_batch_size=9).logprobs(batch)
    budget = _policy(tiny_model_path, micro_batch_size=9, max_tokens_per_micro_batch=20)
    assert len(batch.micro_batches(9, 20)) > 2        # the budget really splits this batch
    for name in fixed.columns():
        torch.testing.assert_close(budget.logprobs(batch)[name], fixed[name], atol=1e-5, rtol=0)
