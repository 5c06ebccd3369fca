"""Variable-size batches: a batch filtered by group (DAPO dynamic sampling) trains exactly as its
kept rows alone, on 1 rank and split over 2 FSDP2 ranks (gloo, spawned processes), including a
rank left with no rows; an update with no rows on any rank makes no optimizer step."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from raygraph.batch import PROMPT_IDS, PROMPT_MASK, RESPONSE_MASK, TOKEN_LEVEL_SCORES, UID, Batch
from raygraph.graph import dapo, whole_batch
from raygraph.workers.distributed import find_free_port, init_process_group_from_env
from raygraph.workers.policy import PolicyWorker

WORLD = 2
# SGD-like comparisons need the raw gradient: grad_norm is reported before clipping, and with
# kl 0 and entropy 0 the loss is the PPO term alone, whose gradient at ratio 1 is -A * grad logp.
POLICY_KW = {"lr": 1e-3, "micro_batch_size": 2, "kl_loss_coef": 0.0, "entropy_coef": 0.0, "loss_agg": "token-mean"}
ACC = "reward_extra.acc"


def _scored(rollout_batch, acc: list[int]) -> Batch:
    """len(acc) rows in groups of 2 (uid g0, g0, g1, g1, ...), scored 1.0 where acc is 1."""
    rows = len(acc)
    prompts = rollout_batch(rows // 2, seed=12)
    batch = rollout_batch(rows, seed=11).with_columns(**{
        name: prompts[name].repeat_interleave(2, 0) for name in (PROMPT_IDS, PROMPT_MASK)})
    scores = torch.zeros(batch[RESPONSE_MASK].shape)
    last = batch[RESPONSE_MASK].sum(-1) - 1
    scores[torch.arange(rows), last] = torch.tensor(acc, dtype=torch.float32)
    return batch.with_columns(**{TOKEN_LEVEL_SCORES: scores, ACC: torch.tensor(acc, dtype=torch.float32),
                                 UID: np.array([f"g{i // 2}" for i in range(rows)])})


def _advantages(batch: Batch) -> Batch:
    out = whole_batch.compute_advantages(batch, Batch(), estimator="grpo", gamma=1.0, lam=1.0, eps=1e-6, kl_kind="k1",
                                         old_from_rollout=False)
    return out.select_columns([c for c in out.columns() if c not in (ACC, TOKEN_LEVEL_SCORES)])


def _weights(policy: PolicyWorker) -> dict[str, torch.Tensor]:
    return {n: t for bucket in policy.weight_buckets(bucket_bytes=100_000) for n, t in bucket}


def _update(model_path: str, batch: Batch) -> tuple[dict, dict]:
    policy = PolicyWorker(model_path=model_path, **POLICY_KW)
    metrics = policy.update(batch)
    return metrics, _weights(policy)


# groups g0 (1,0) g1 (1,1) g2 (0,1) g3 (0,0): the filter keeps g0 and g2
MIXED = [1, 0, 1, 1, 0, 1, 0, 0]
ONE_GROUP = [1, 1, 0, 1, 0, 0, 1, 1]     # only g1 varies: 2 ranks -> one of them gets no rows
NONE = [1, 1, 0, 0, 1, 1, 0, 0]          # nothing varies: the step has nothing to train


def test_the_filtered_batch_trains_as_its_kept_rows_alone(tiny_model_path, rollout_batch):
    scored = _scored(rollout_batch, MIXED)
    filtered = _advantages(dapo.filter_groups(scored, metric="acc"))
    kept_alone = _advantages(scored.select([0, 1, 4, 5]))
    unfiltered = _advantages(scored)
    m_filtered, w_filtered = _update(tiny_model_path, filtered)
    m_alone, w_alone = _update(tiny_model_path, kept_alone)
    m_all, _ = _update(tiny_model_path, unfiltered)
    assert list(filtered[UID]) == ["g0", "g0", "g2", "g2"]
    for name, tensor in w_alone.items():
        torch.testing.assert_close(w_filtered[name], tensor, atol=0, rtol=0)
    assert m_filtered["actor/grad_norm"] == m_alone["actor/grad_norm"] > 0
    # Unfiltered, the dropped groups have zero advantage but count in the token-mean's denominator:
    # the gradient is the kept rows' scaled by kept tokens / all tokens (what the filter undoes).
    tokens = scored[RESPONSE_MASK].sum(-1)
    share = float(tokens[[0, 1, 4, 5]].sum() / tokens.sum())
    assert abs(m_all["actor/grad_norm"] - share * m_alone["actor/grad_norm"]) < 1e-5 * m_alone["actor/grad_norm"]


def test_an_update_with_no_rows_makes_no_optimizer_step(tiny_model_path, rollout_batch):
    empty = _advantages(dapo.filter_groups(_scored(rollout_batch, NONE), metric="acc"))
    policy = PolicyWorker(model_path=tiny_model_path, **POLICY_KW)
    before = _weights(policy)
    metrics = policy.update(empty)
    assert len(empty) == 0
    assert metrics["actor/empty_updates"] == 1 and metrics["actor/optimizer_steps"] == 0
    assert policy.trained.scheduler.last_epoch == 0 and not policy.trained.optimizer.state
    assert all(torch.equal(t, before[n]) for n, t in _weights(policy).items())


def _rank_main(rank: int, port: int, model_path: str, cases: dict, out_dir: str) -> None:
    torch.set_num_threads(1)
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(WORLD), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    init_process_group_from_env("gloo")
    try:
        results = {}
        for name, batch in cases.items():
            shard = batch.chunk_by_group(WORLD)[rank]   # as the coordinator splits a whole batch
            metrics, weights = _update(model_path, shard)
            results[name] = {"rows": len(shard), "metrics": metrics, "weights": weights}
        torch.save(results, Path(out_dir) / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()


@pytest.mark.slow   # a subprocess (or two torch ranks): not in `make test-fast`
def test_two_ranks_train_a_filtered_batch_as_one_rank_trains_its_kept_rows(tiny_model_path, rollout_batch,
                                                                            tmp_path):
    cases = {name: _advantages(dapo.filter_groups(_scored(rollout_batch, acc), metric="acc"))
             for name, acc in (("mixed", MIXED), ("one_group", ONE_GROUP), ("none", NONE))}
    mp.start_processes(_rank_main, args=(find_free_port(), tiny_model_path, cases, str(tmp_path)), nprocs=WORLD,
                       start_method="spawn")
    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(WORLD)]
    assert [r["mixed"]["rows"] for r in ranks] == [2, 2]        # groups whole, split evenly
    assert sorted(r["one_group"]["rows"] for r in ranks) == [0, 2]   # a rank with no rows
    assert [r["none"]["rows"] for r in ranks] == [0, 0]
    for name in ("mixed", "one_group"):
        single_metrics, single_weights = _update(tiny_model_path, cases[name])
        for r in ranks:
            assert r[name]["metrics"]["actor/optimizer_steps"] == 1
            assert abs(r[name]["metrics"]["actor/grad_norm"] - single_metrics["actor/grad_norm"]) < 1e-5
            for key, tensor in single_weights.items():
                torch.testing.assert_close(r[name]["weights"][key], tensor, atol=1e-6, rtol=0)
    initial = PolicyWorker(model_path=tiny_model_path, **POLICY_KW)
    for r in ranks:   # nothing anywhere: no optimizer step on either rank, counted
        assert r["none"]["metrics"]["actor/empty_updates"] == 1
        assert r["none"]["metrics"]["actor/optimizer_steps"] == 0
        assert all(torch.equal(t, r["none"]["weights"][n]) for n, t in _weights(initial).items())
