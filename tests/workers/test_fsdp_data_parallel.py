"""Data parallelism: 2 FSDP2 ranks (gloo, spawned processes), each with part of the batch, end
with the same weights as 1 rank with the whole batch, to fp32 tolerance. The split is uneven
(5 + 3 rows), so rank 1 runs a zero-weight dummy micro-batch in lockstep."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from raygraph.batch import (
    ADVANTAGES,
    OLD_LOGPROBS,
    PROMPT_IDS,
    PROMPT_MASK,
    RESPONSE_MASK,
    RETURNS,
    VALUES,
    Batch,
)
from raygraph.workers.critic import CriticWorker
from raygraph.workers.distributed import find_free_port, init_process_group_from_env
from raygraph.workers.policy import PolicyWorker

WORLD = 2
# Small lr: Adam's 1/sqrt(v) turns fp32 rounding of near-zero gradient entries into weight
# differences of up to ~lr * 1e-3; two micro-batches per rank and two epochs exercise the
# token-count scaling across micro-batches AND ranks.
POLICY_KW = {"lr": 1e-4, "micro_batch_size": 2, "ppo_epochs": 2, "kl_loss_coef": 0.0, "entropy_coef": 0.01,
             "temperature": 0.9}
CRITIC_KW = {"lr": 1e-4, "micro_batch_size": 2}


def _training_batch(rollout_batch) -> Batch:
    # two samples per prompt, as GRPO lays them out: the passes share each prompt's KV cache
    prompts = rollout_batch(4, seed=12)
    batch = rollout_batch(8, seed=11).with_columns(**{
        name: prompts[name].repeat_interleave(2, 0) for name in (PROMPT_IDS, PROMPT_MASK)})
    gen = torch.Generator().manual_seed(1)
    shape = batch[RESPONSE_MASK].shape
    return batch.with_columns(**{ADVANTAGES: torch.randn(shape, generator=gen),
                                 OLD_LOGPROBS: -3.0 - torch.rand(shape, generator=gen),
                                 VALUES: torch.randn(shape, generator=gen), RETURNS: torch.randn(shape, generator=gen)})


def _run(model_path: str, batch: Batch, critic_batch: Batch, out: Path | None) -> dict:
    policy = PolicyWorker(model_path=model_path, **POLICY_KW)
    logprobs = policy.logprobs(batch)[OLD_LOGPROBS]
    metrics = policy.update(batch)
    weights = {n: t for bucket in policy.weight_buckets(bucket_bytes=100_000) for n, t in bucket}
    critic = CriticWorker(model_path=model_path, **CRITIC_KW)
    critic_metrics = critic.update(critic_batch)
    critic_weights = {n: t for bucket in _critic_buckets(critic) for n, t in bucket}
    if out is not None:
        policy.save_pretrained(out)
    return {"logprobs": logprobs, "metrics": metrics, "weights": weights, "critic_metrics": critic_metrics,
            "critic_weights": critic_weights}


def _critic_buckets(critic: CriticWorker):
    from raygraph.workers.weight_buckets import iter_weight_buckets

    return iter_weight_buckets(critic.model, 1 << 20)


def _sharded_checkpoint_round_trip(model_path: str, shard: Batch, path: Path) -> bool:
    """Save a sharded checkpoint after one update; a fresh worker that loads it continues
    bit-identically (model, optimizer moments, schedule)."""
    kw = POLICY_KW | {"lr_schedule": "cosine", "total_steps": 3}
    policy = PolicyWorker(model_path=model_path, **kw)
    policy.update(shard)
    policy.save_checkpoint(path)
    policy.update(shard)
    resumed = PolicyWorker(model_path=model_path, **kw)
    resumed.load_checkpoint(path)
    resumed.update(shard)
    a = [t for bucket in policy.weight_buckets() for _, t in bucket]
    b = [t for bucket in resumed.weight_buckets() for _, t in bucket]
    return all(torch.equal(x, y) for x, y in zip(a, b))


def _rank_main(rank: int, port: int, model_path: str, batch: Batch, out_dir: str) -> None:
    torch.set_num_threads(1)
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(WORLD), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    init_process_group_from_env("gloo")
    try:
        # uneven (5 + 3 rows): rank 1 runs a dummy micro-batch, and its micro-batches cut prompt
        # groups differently from rank 0's; both must still make the same model calls
        shard = batch.select(slice(0, 5) if rank == 0 else slice(5, 8))
        result = _run(model_path, shard, shard, Path(out_dir) / "hf")
        result["checkpoint_exact"] = _sharded_checkpoint_round_trip(model_path, shard, Path(out_dir) / "ckpt")
        torch.save(result, Path(out_dir) / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()


@pytest.mark.slow   # a subprocess (or two torch ranks): not in `make test-fast`
def test_two_fsdp_ranks_with_uneven_shards_equal_one_rank(tiny_model_path, rollout_batch, tmp_path):
    batch = _training_batch(rollout_batch)
    mp.start_processes(_rank_main, args=(find_free_port(), tiny_model_path, batch, str(tmp_path)), nprocs=WORLD,
                       start_method="spawn")
    single = _run(tiny_model_path, batch, batch, None)
    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(WORLD)]

    torch.testing.assert_close(torch.cat([r["logprobs"] for r in ranks]), single["logprobs"], atol=1e-5, rtol=0)
    assert all(r["checkpoint_exact"] for r in ranks)
    for r in ranks:  # metrics are reduced over ranks: every rank reports the global values
        for name, value in single["metrics"].items():
            assert abs(r["metrics"][name] - value) <= 1e-4 * max(1.0, abs(value)), name
        for name, value in single["critic_metrics"].items():
            assert abs(r["critic_metrics"][name] - value) <= 1e-4 * max(1.0, abs(value)), name
        assert set(r["weights"]) == set(single["weights"])
        for name, tensor in single["weights"].items():
            torch.testing.assert_close(r["weights"][name], tensor, atol=1e-6, rtol=0)
        for name, tensor in single["critic_weights"].items():
            torch.testing.assert_close(r["critic_weights"][name], tensor, atol=1e-6, rtol=0)

    from transformers import AutoModelForCausalLM

    initial = AutoModelForCausalLM.from_pretrained(tiny_model_path).state_dict()
    assert max((single["weights"][k] - initial[k]).abs().max() for k in single["weights"]) > 1e-4
    exported_model = AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    assert exported_model.config.architectures == ["Qwen2ForCausalLM"]
    exported = exported_model.state_dict()
    for name, tensor in single["weights"].items():
        torch.testing.assert_close(exported[name], tensor, atol=1e-6, rtol=0)
