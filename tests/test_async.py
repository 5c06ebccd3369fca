"""Asynchronous pipelining (one-step off-policy GRPO, `placement.max_staleness=1`).

Plain parts first (the rollout worker's prefetch buffer, the driver's lookahead, truncated IS
and the order the DAG puts calls on each actor), then real runs under Ray on CPU.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from raygraph.batch import (
    ADVANTAGES,
    NEXT_PROMPTS,
    OLD_LOGPROBS,
    PROMPT_IDS,
    PROMPT_MASK,
    RESPONSE_MASK,
    RESPONSES,
    ROLLOUT_LOGPROBS,
    STALENESS,
    UID,
    WEIGHT_VERSION,
    Batch,
)
from raygraph.config import ConfigError, load_config
from raygraph.graph import corrections
from raygraph.workers.prefetch import KEPT_COLUMNS, KEPT_TENSORS, STATE_FILE

REPO = Path(__file__).resolve().parents[1]
TOY = REPO / "configs" / "toy" / "grpo_kl_loss.yaml"   # disaggregated: policy+reference | rollout+reward


def _prompts(uids: list[str]) -> Batch:
    ids = torch.tensor([[5 + i, 6, 7] for i in range(len(uids))])
    return Batch({PROMPT_IDS: ids, PROMPT_MASK: torch.ones_like(ids)}, {UID: uids})


# --- rollout worker: prefetch buffer ---------------------------------------------------------------
@pytest.fixture(scope="module")
def rollout(tiny_model_path):
    from raygraph.workers.rollout_hf import HFRolloutWorker

    return HFRolloutWorker(model_path=tiny_model_path, n=2, max_new_tokens=4, seed=0)


def _bump_version(worker, version: int) -> None:
    """A weight sync that keeps the weights: only the version changes."""
    worker.load_weights([list(worker.model.state_dict().items())], version=version)


def test_take_returns_the_prefetched_rollouts_with_their_staleness(rollout):
    now, later = _prompts(["a", "b"]), _prompts(["c", "d"])
    _bump_version(rollout, 3)
    assert rollout.prefetch(later) == 4                       # 2 prompts x n=2, sampled with version 3
    kept = rollout.prefetched.kept[("c", "d")]
    fresh = rollout.take_or_generate(now)                     # nothing prefetched for a, b: sampled now
    assert fresh[STALENESS].tolist() == [0] * 4 and fresh[WEIGHT_VERSION].tolist() == [3] * 4
    _bump_version(rollout, 4)                                 # the step's weight sync
    taken = rollout.take_or_generate(later)
    assert torch.equal(taken[RESPONSES], kept[RESPONSES]) and list(taken[UID]) == ["c", "c", "d", "d"]
    assert taken[STALENESS].tolist() == [1] * 4 and taken[WEIGHT_VERSION].tolist() == [3] * 4
    assert rollout.prefetched.kept == {}                          # handed over once


def test_prefetch_next_samples_the_share_attached_for_this_rank(rollout):
    share = _prompts(["a", "b"])
    share.meta[NEXT_PROMPTS] = {("x",): _prompts(["y"]), ("a", "b"): _prompts(["c", "d"])}
    assert rollout.prefetch_next(share) == {"rollout/prefetched": 4.0}
    assert set(rollout.prefetched.kept) == {("c", "d")}
    assert rollout.prefetch_next(_prompts(["q"])) == {"rollout/prefetched": 0.0}   # no lookahead attached
    now = _prompts(["c", "d"])
    now.meta.update(step=7, **{NEXT_PROMPTS: {("c", "d"): _prompts(["e"])}})
    assert rollout.take_or_generate(now).meta == {"step": 7}   # the lookahead goes no further


def test_checkpoint_keeps_the_prefetched_rollouts(rollout, tiny_model_path, tmp_path):
    from raygraph.workers.rollout_hf import HFRolloutWorker

    rollout.prefetch(_prompts(["e"]))
    rollout.save_checkpoint(tmp_path)
    other = HFRolloutWorker(model_path=tiny_model_path, n=2, max_new_tokens=4, seed=1)
    other.load_checkpoint(tmp_path)
    assert torch.equal(other.take_or_generate(_prompts(["e"]))[RESPONSES],
                       rollout.take_or_generate(_prompts(["e"]))[RESPONSES])
    other.save_checkpoint(tmp_path / "empty")                  # nothing kept: no file, and loads empty
    rollout.load_checkpoint(tmp_path / "empty")
    assert rollout.prefetched.kept == {}   # as a synchronous run's checkpoint: the next step samples fresh
    assert (tmp_path / "empty" / STATE_FILE).is_file()
    assert not (tmp_path / "empty" / KEPT_COLUMNS).exists() and not (tmp_path / "empty" / KEPT_TENSORS).exists()
    assert (tmp_path / KEPT_COLUMNS).is_file() and (tmp_path / KEPT_TENSORS).is_file()


# --- driver: lookahead without moving the sampler --------------------------------------------------
class _Rows:
    """A dataset stand-in: row i has uid "i"."""

    def __len__(self) -> int:
        return 12

    def to_batch(self, indices):
        return _prompts([str(i) for i in indices])


def test_lookahead_attaches_next_shares_and_leaves_the_sampler_in_place():
    from raygraph.data import ResumableSampler
    from raygraph.run.feed import StepData

    data = StepData(_Rows(), ResumableSampler(12, 4, seed=0), None)
    reference = StepData(_Rows(), ResumableSampler(12, 4, seed=0), None)
    first = data.next_prompts(step=1, kl_coef=0.0, lookahead_shares=2)
    state = data.sampler.state_dict()
    assert state == {**reference.sampler.state_dict(), "position": 4}    # one batch drawn, not two
    second = data.next_prompts(step=2, kl_coef=0.0, lookahead_shares=2)
    assert list(first[UID]) == list(reference.next_prompts(step=1, kl_coef=0.0)[UID])
    shares = first.meta[NEXT_PROMPTS]
    now = [tuple(s[UID]) for s in first.chunk_by_group(2)]
    assert list(shares) == now                                            # keyed by this step's shares
    assert [tuple(v[UID]) for v in shares.values()] == [tuple(s[UID]) for s in second.chunk_by_group(2)]
    assert NEXT_PROMPTS not in reference.next_prompts(step=2, kl_coef=0.0).meta


# --- truncated importance sampling -----------------------------------------------------------------
def _scored(staleness: list[int], old: list[list[float]], rollout_lp: list[list[float]]) -> Batch:
    old_t, roll_t = torch.tensor(old), torch.tensor(rollout_lp)
    return Batch({OLD_LOGPROBS: old_t, ROLLOUT_LOGPROBS: roll_t, ADVANTAGES: torch.full_like(old_t, 2.0),
                  RESPONSE_MASK: torch.tensor([[1, 1, 0]] * len(staleness)),
                  STALENESS: torch.tensor(staleness)})


def test_is_weights_are_exactly_one_on_fresh_rows():
    # log-probs from two engines differ in the last digits even with the same weights
    batch = _scored([0, 0], [[-1.0, -2.0, 0.0], [-0.5, -0.25, 0.0]], [[-1.00001, -1.99999, 0.0], [-0.5, -0.3, 0.0]])
    out = corrections.truncated_importance_weights(batch, cap=2.0)
    assert torch.equal(out[ADVANTAGES], batch[ADVANTAGES])
    m = corrections.off_policy_metrics(out, cap=2.0)
    assert m == {"rollout/staleness": 0.0, "rollout/staleness_max": 0.0, "rollout/is_weight_mean": 1.0,
                 "rollout/is_weight_max": 1.0, "rollout/is_clipfrac": 0.0}


def test_is_weights_on_stale_rows_are_truncated_ratios():
    # row 0 is stale: ratios exp(-1 - -1.5) = e^0.5 = 1.6487 and exp(-1 - -3) = e^2 = 7.39 -> cap 2.0;
    # row 1 is fresh: weight 1 whatever its log-probs; position 2 is padding.
    batch = _scored([1, 0], [[-1.0, -1.0, 0.0], [-1.0, -1.0, 0.0]], [[-1.5, -3.0, 0.0], [-2.0, -2.0, 0.0]])
    out = corrections.truncated_importance_weights(batch, cap=2.0)
    expected = torch.tensor([[2.0 * math.exp(0.5), 4.0, 2.0], [2.0, 2.0, 2.0]])
    assert torch.allclose(out[ADVANTAGES], expected)
    m = corrections.off_policy_metrics(out, cap=2.0)
    assert m["rollout/staleness"] == 0.5 and m["rollout/staleness_max"] == 1.0
    assert m["rollout/is_weight_mean"] == pytest.approx((math.exp(0.5) + 2.0 + 1.0 + 1.0) / 4)
    assert m["rollout/is_weight_max"] == 2.0 and m["rollout/is_clipfrac"] == 0.25


class _Eager:
    """Roles that run each `apply` at once: the update batch a graph fragment builds, without Ray."""

    def apply(self, fn, *args, **kwargs):
        return fn(*args, **kwargs)


def test_rollout_correction_covers_every_row_and_replaces_the_async_weights():
    """docs/algorithms.md: with `max_staleness=1` and a rollout correction, the correction applies
    to every row (fresh ones too) and the stale rows' truncated IS (`is_cap`) is not applied on top."""
    from raygraph.graph import fragments

    cfg = load_config(TOY, ["placement.max_staleness=1", "algorithm.is_cap=1.5",
                            "algorithm.rollout_correction.mode=truncated_is", "algorithm.rollout_correction.cap=3.0"])
    # r = pi_old / pi_rollout: stale row 0 has r = 2.5, 4; fresh row 1 has r = 2, 1/2; position 2 is padding
    ln = math.log
    batch = _scored([1, 0], [[ln(2.5), ln(4.0), 0.0], [ln(2.0), ln(0.5), 0.0]], [[0.0, 0.0, 0.0]] * 2)
    out, metrics = fragments.update_batch(_Eager(), cfg, batch)
    # advantages 2 x min(r, 3): row 0 -> 5, 6 (async alone: 2 x min(r, 1.5) = 3, 3; both: 7.5, 9);
    # row 1 -> 4, 1 (async alone leaves a fresh row at 2, 2); padding untouched
    assert torch.allclose(out[ADVANTAGES], torch.tensor([[5.0, 6.0, 2.0], [4.0, 1.0, 2.0]]))
    # the metrics read the batch before the correction: staleness, and the weights applied, (2.5 + 3 + 2 + 0.5) / 4
    staleness, correction = metrics
    assert staleness["rollout/staleness"] == 0.5 and staleness["rollout/staleness_max"] == 1.0
    assert correction["rollout/correction_weight_mean"] == pytest.approx(2.0)
    assert correction["rollout/correction_capped_frac"] == 0.25


# --- the DAG: what each actor runs, in which order -------------------------------------------------
def _fake_disaggregated(fake_roles):
    """Roles as the trainer builds them disaggregated: policy+reference | rollout+reward."""
    from raygraph.run.graphs import worker_classes

    cfg = load_config(TOY, ["placement.max_staleness=1", "actor.kl_loss_coef=0.1"])
    classes = worker_classes(cfg, ("policy", "rollout", "reward"))
    train, gen = ["policy+reference/0"], ["rollout+reward/0"]
    return fake_roles({"policy": (classes["policy"], train), "reference": (classes["reference"], train),
                       "rollout": (classes["rollout"], gen), "reward": (classes["reward"], gen)},
                      collective=("policy", "rollout"))


def test_rollout_samples_ahead_after_scoring_and_before_receiving_weights(fake_roles):
    """Both executors submit a plan's calls in plan order and each actor runs its calls in that
    order, so this order is what runs: the rollout actor takes this step's rollouts, scores them,
    then samples the next step while the policy trains, and only then receives the new weights
    (the weight-sync steps wait for the update AND the prefetch: no collective waits on either)."""
    from raygraph.graph import GraphBuilder
    from raygraph.graph.lowering import lower
    from raygraph.workflows import grpo

    cfg = load_config(TOY, ["placement.max_staleness=1"])
    roles = _fake_disaggregated(fake_roles)
    plan = lower(grpo.build(GraphBuilder.of(roles), cfg), roles)
    on = {name: [op.task.label for op in plan.ops if op.actor.name == name]
          for name in ("rollout+reward/0", "policy+reference/0")}
    assert on["rollout+reward/0"] == ["rollout.take_or_generate", "reward.score", "rollout.prefetch_next",
                                      "rollout.load_weights"]
    assert on["policy+reference/0"] == ["policy.logprobs", "reference.logprobs", "policy.update",
                                        "policy.weight_buckets"]
    prefetch = next(op.id for op in plan.ops if op.task.label == "rollout.prefetch_next")
    update = next(op.id for op in plan.ops if op.task.label == "policy.update")
    barrier = next(op for op in plan.ops if op.task.op == "gather" and {i for i, _ in op.inputs} == {update, prefetch})
    for op in plan.ops:
        if op.task.op in ("weights_send", "weights_recv"):
            assert [i for i, _ in op.inputs] == [barrier.id]


def test_staleness_bound_is_checked():
    with pytest.raises(ConfigError, match="only 0 .synchronous. and 1"):
        load_config(TOY, ["placement.max_staleness=2"])


def test_workflow_without_an_async_dag_refuses_staleness(tmp_path):
    # a config error (raygraph validate reports it), before anything starts
    with pytest.raises(ConfigError, match="workflow 'ppo' implements at most 0"):
        load_config(REPO / "configs" / "toy" / "ppo.yaml",
                    [f"trainer.output_dir={tmp_path}", "placement.mode=disaggregated",
                     "placement.max_staleness=1", "logging.mlflow=false"])


# --- real runs under Ray ---------------------------------------------------------------------------
@pytest.fixture(scope="module")
def shared_assets(tmp_path_factory):
    from raygraph.models.tiny import build_tiny_lm

    root = tmp_path_factory.mktemp("assets")   # a model of its own: the runs here give model.path (model.tiny=null)
    return {"model": build_tiny_lm(root / "tiny-lm"), "data": root / "toy"}


def toy_overrides(assets, out_dir: Path, **extra) -> list[str]:
    data = assets["data"]
    overrides = {
        "model.path": assets["model"], "model.tiny": "null", "data.train_files": f"[{data / 'train.parquet'}]",
        "data.val_files": f"[{data / 'val.parquet'}]", "trainer.output_dir": out_dir,
        "logging.mlflow": "false", "data.val_prompts": 8, **extra,
    }
    return [f"{k}={v}" for k, v in overrides.items()]


def read_metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


# Two rollout ranks (each prefetches its own share of the next prompts). An entropy bonus moves the
# policy even when every reward is 0 (a random tiny model), so stale rollouts really were sampled by
# other weights; is_cap 1.2 makes some weights clip.
ASYNC = {"placement.max_staleness": 1, "placement.rollout_workers": 2, "actor.entropy_coef": 0.5,
         "actor.optim.lr": 0.01, "algorithm.is_cap": 1.2, "run_name": "async", "trainer.save_every": 2,
         "trainer.total_steps": 3, "checkpoint.save_hf": "false"}


@pytest.fixture(scope="module")
def async_run(shared_assets, tmp_path_factory, ray_local):
    from raygraph.run.trainer import run

    out = tmp_path_factory.mktemp("async")
    return run(load_config(TOY, toy_overrides(shared_assets, out, **ASYNC)))


def test_async_grpo_trains_one_step_off_policy(async_run):
    rows = read_metrics(async_run.run_dir)
    assert [r["step"] for r in rows] == [1, 2, 3]
    for row in rows:
        assert all(math.isfinite(v) for v in row.values())
        assert row["weights/verified"] == 1.0
    first, later = rows[0], rows[1:]
    # step 1 has nothing prefetched: sampled now, with the policy's weights, so weights are exactly 1
    assert first["rollout/staleness"] == 0.0 and first["rollout/is_weight_mean"] == 1.0
    assert first["rollout/is_weight_max"] == 1.0 and first["rollout/is_clipfrac"] == 0.0
    for row in later:   # sampled during the previous update, with the weights one version older
        assert row["rollout/staleness"] == 1.0 and row["rollout/staleness_max"] == 1.0
        assert row["weights/rollout_version_min"] == row["weights/version"] - 2
        assert row["rollout/is_weight_mean"] != 1.0 and row["rollout/is_weight_max"] <= 1.2 + 1e-6  # float32
    assert any(row["rollout/is_clipfrac"] > 0 for row in later)
    # the last step prefetched too (the next step's prompts), and the final checkpoint keeps it
    final = async_run.run_dir / "checkpoints" / "step_3" / "rollout"
    assert all(len(json.loads((final / f"rank{r}" / KEPT_COLUMNS).read_text())) == 1 for r in (0, 1))


def test_async_resume_continues_exactly(async_run, shared_assets, tmp_path):
    """Resuming from step 2 (with the interpreted executor; the first run was compiled) repeats
    step 3: the checkpoint holds the sampler position before the lookahead and the rollouts
    prefetched for step 3."""
    from raygraph.run.trainer import run

    ckpt = async_run.run_dir / "checkpoints" / "step_2"
    assert all((ckpt / "rollout" / f"rank{r}" / "prefetched.json").is_file() for r in (0, 1))
    resumed = run(load_config(TOY, toy_overrides(shared_assets, tmp_path, **ASYNC, **{
        "trainer.resume": ckpt, "trainer.executor": "interpreted"})))
    expected, got = read_metrics(async_run.run_dir)[2], read_metrics(resumed.run_dir)
    assert [r["step"] for r in got] == [3]
    for key in ("reward/mean", "actor/pg_loss", "actor/grad_norm", "actor/entropy", "rollout/response_length_mean",
                "rollout/staleness", "rollout/is_weight_mean", "rollout/is_clipfrac", "weights/version"):
        assert got[0][key] == pytest.approx(expected[key], rel=1e-5, abs=1e-6), key

