"""Reward functions from a user file, in a pool of processes with a per-call timeout, a policy for
failing calls (reward.on_error) and several weighted functions (raygraph.rewards.pool, .terms)."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import yaml
from doc_blocks import doc_blocks
from transformers import AutoTokenizer

from raygraph.algos.user_code import UserCodeError
from raygraph.batch import TOKEN_LEVEL_SCORES, UID
from raygraph.rewards.pool import RewardPool
from raygraph.rewards.terms import Call, RewardFunctionError
from raygraph.workers.reward_rule import RuleRewardWorker

USER_REWARDS = '''
import re
import time
from pathlib import Path


def hang_on_8(response_text, ground_truth, extra_info):
    if response_text == "8":
        time.sleep(3600)                       # a hung scorer: only killing its process ends it
    return float(response_text == ground_truth)


def raise_on_8(response_text, ground_truth, extra_info):
    if response_text == "8":
        raise ValueError("cannot parse 8")
    return float(response_text == ground_truth)
'''

USER_PLUGIN = '''
import raygraph


@raygraph.register_reward("length_tenths")     # a registered name: the pool's processes must see it
def length_tenths(response_text, ground_truth, extra_info):
    return len(response_text) / 10
'''

TEXTS = ["7", "8", "17", "7", "x", "77"]          # truth "7" for every row; row 1 is the bad one
UIDS = [f"u{i}" for i in range(len(TEXTS))]


@pytest.fixture
def user_file(tmp_path):
    path = tmp_path / "my_rewards.py"   # outside the repository
    path.write_text(USER_REWARDS)
    return str(path)


@pytest.fixture
def batch(tokenizer_path, make_response_batch):
    tok = AutoTokenizer.from_pretrained(tokenizer_path)
    rows = make_response_batch(tok, TEXTS, ["7"] * len(TEXTS), ["toy_arith"] * len(TEXTS))
    return rows.with_columns(**{UID: UIDS})


def scores_of(out) -> list[float]:
    return [round(v, 6) for v in out[TOKEN_LEVEL_SCORES].sum(dim=1).tolist()]


def test_a_hung_call_times_out_scores_zero_and_is_counted(tokenizer_path, user_file, batch, caplog):
    worker = RuleRewardWorker(tokenizer_path, function=f"{user_file}:hang_on_8", workers=2, timeout_s=1.0,
                              on_error="zero")
    try:
        start = time.monotonic()
        out = worker.score(batch)
        elapsed = time.monotonic() - start
        restarts = worker._pool.restarts
    finally:
        worker.close()
    assert scores_of(out) == [1.0, 0.0, 0.0, 1.0, 0.0, 0.0]     # exact match with "7"; row 1 timed out
    assert out["reward_extra.timeouts"].tolist() == [0.0, 1.0, 0, 0, 0, 0]   # reward/timeouts = 1/6
    assert out["reward_extra.errors"].tolist() == [0.0] * 6
    assert 1.0 <= elapsed < 5.0 and restarts == 1   # killed after ~timeout_s (1.0-1.1 s idle machine), replaced
    warnings = [r.getMessage() for r in caplog.records if "reward call" in r.getMessage()]
    assert len(warnings) == 1 and "hang_on_8" in warnings[0] and "(uid 'u1')" in warnings[0]
    assert "TimeoutError: still running after reward.timeout_s=1 s" in warnings[0]


def test_a_hung_call_under_fail_names_the_function_and_uid(tokenizer_path, user_file, batch):
    worker = RuleRewardWorker(tokenizer_path, function=f"{user_file}:hang_on_8", workers=1, timeout_s=0.5)
    try:
        with pytest.raises(RewardFunctionError, match=r"reward function '.*my_rewards.py:hang_on_8' on row 1 "
                                                      r"\(uid 'u1'\): TimeoutError: still running after"):
            worker.score(batch)
        out = worker.score(batch.select([0, 2]))   # the replacement process serves the next step
    finally:
        worker.close()
    assert scores_of(out) == [1.0, 0.0]


@pytest.mark.parametrize("workers", [0, 1])
def test_an_exception_follows_on_error_inline_and_in_the_pool(tokenizer_path, user_file, batch, workers):
    ref = f"{user_file}:raise_on_8"
    strict = RuleRewardWorker(tokenizer_path, function=ref, workers=workers)
    lenient = RuleRewardWorker(tokenizer_path, function=ref, workers=workers, on_error="zero")
    try:
        with pytest.raises(RewardFunctionError, match=r"1 reward call\(s\) failed on 6 samples: reward function "
                                                      r"'.*:raise_on_8' on row 1 \(uid 'u1'\): ValueError: "
                                                      r"cannot parse 8; fix the function, or set reward.on_error"):
            strict.score(batch)
        out = lenient.score(batch)
    finally:
        strict.close()
        lenient.close()
    assert scores_of(out) == [1.0, 0.0, 0.0, 1.0, 0.0, 0.0]
    assert out["reward_extra.errors"].tolist() == [0.0, 1.0, 0, 0, 0, 0]
    assert out["reward_extra.timeouts"].tolist() == [0.0] * 6


@pytest.mark.parametrize("workers", [0, 2])
def test_weighted_functions_sum_and_each_has_its_column(tokenizer_path, user_file, batch, workers):
    functions = [{"function": "toy_arith", "weight": 1.0},
                 {"function": f"{user_file}:raise_on_8", "weight": -0.5, "name": "strict"},
                 {"function": f"{user_file}:hang_on_8", "weight": 0.2}]
    worker = RuleRewardWorker(tokenizer_path, functions=functions, workers=workers, on_error="zero")
    try:
        out = worker.score(batch.select([0, 2, 3, 4, 5]))   # without the row that breaks two of them
    finally:
        worker.close()
    # texts 7, 17, 7, x, 77 against "7": each function is 1 exactly on rows 0 and 2, so the score
    # there is 1.0 - 0.5 + 0.2 = 0.7 and 0 elsewhere; each function's mean is 2/5.
    assert scores_of(out) == [0.7, 0.0, 0.7, 0.0, 0.0]
    for name in ("toy_arith", "strict", "hang_on_8"):
        assert out[f"reward_extra.{name}/mean"].tolist() == [1.0, 0.0, 1.0, 0.0, 0.0]
    assert out["reward_extra.acc"].tolist() == [1.0, 0.0, 1.0, 0.0, 0.0]     # the first function's extras
    assert out["reward_extra.format_ok"].tolist() == [1.0, 1.0, 1.0, 0.0, 1.0]   # keep their names


SHAPE = '''
from raygraph.rewards.registry import RewardResult


def shape(response_text, ground_truth, extra_info):
    return RewardResult(len(response_text) / 10, {"acc": float(response_text.startswith("7")),
                                                  "long": float(len(response_text) > 1)})
'''


def test_a_later_functions_extras_are_logged_under_its_name(tokenizer_path, tmp_path, batch):
    from raygraph.graph.step_metrics import rollout_metrics

    (tmp_path / "shape.py").write_text(SHAPE)
    functions = [{"function": "toy_arith", "weight": 1.0},
                 {"function": f"{tmp_path / 'shape.py'}:shape", "weight": 0.5, "name": "shape"}]
    rows = batch.select([0, 2, 3, 4, 5])   # texts 7, 17, 7, x, 77 against "7"
    out = RuleRewardWorker(tokenizer_path, functions=functions).score(rows)
    # toy_arith: 1 on rows 0 and 2; shape: len / 10 = 0.1, 0.2, 0.1, 0.1, 0.2, times 0.5
    assert scores_of(out) == [1.05, 0.1, 1.05, 0.05, 0.1]
    assert out["reward_extra.acc"].tolist() == [1.0, 0.0, 1.0, 0.0, 0.0]         # toy_arith's: validation reads it
    assert out["reward_extra.shape/acc"].tolist() == [1.0, 0.0, 1.0, 0.0, 1.0]   # starts with 7
    assert out["reward_extra.shape/long"].tolist() == [0.0, 1.0, 0.0, 0.0, 1.0]
    metrics = rollout_metrics(rows.union(out))
    assert metrics["reward/acc"] == pytest.approx(2 / 5) and metrics["reward/format_ok"] == pytest.approx(4 / 5)
    assert metrics["reward/shape/acc"] == pytest.approx(3 / 5) and metrics["reward/shape/long"] == pytest.approx(2 / 5)
    assert metrics["reward/shape/mean"] == pytest.approx(0.14) and metrics["reward/toy_arith/mean"] == pytest.approx(0.4)
    assert "reward/long" not in metrics


def test_the_pool_sees_the_plugins_registered_names(tmp_path):
    (tmp_path / "my_plugin.py").write_text(USER_PLUGIN)
    # this process never imports the file: only the pool's processes register "length_tenths"
    with RewardPool(["length_tenths"], workers=1, plugins=[str(tmp_path / "my_plugin.py")]) as pool:
        outcomes = pool.run([Call(0, i, text, "7", None, "toy_arith") for i, text in enumerate(["ab", "abcd"])])
    assert [o.score for o in outcomes] == [0.2, 0.4] and all(o.failure is None for o in outcomes)


def test_a_worker_that_died_between_steps_is_replaced_without_losing_a_call():
    calls = [Call(0, i, text, "7", None, "toy_arith") for i, text in enumerate(["7", "8", "7"])]
    with RewardPool(["toy_arith"], workers=1) as pool:
        assert [o.score for o in pool.run(calls)] == [1.0, 0.0, 1.0]
        pool._workers[0].proc.kill()     # e.g. the OOM killer, while the pool is idle
        pool._workers[0].proc.join()
        assert [o.score for o in pool.run(calls)] == [1.0, 0.0, 1.0] and pool.restarts == 1


def test_a_plugin_that_fails_in_the_pool_fails_its_start(tmp_path, user_file):
    (tmp_path / "broken.py").write_text("1 / 0\n")
    with pytest.raises(UserCodeError, match="ZeroDivisionError"):
        RewardPool(["toy_arith"], workers=1, plugins=[str(tmp_path / "broken.py")])
    with pytest.raises(UserCodeError, match="unknown reward function 'no_such'"):
        RewardPool(["no_such"], workers=1, plugins=[user_file])


REPO = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("world", [1, 2])
def test_a_run_logs_each_weighted_function(world, tmp_path, monkeypatch, tiny_model_path, ray_local):
    """`raygraph train` on the toy config with the doc's two weighted functions, scored in a pool
    (on 1 rank, and with 2 training and 2 rollout ranks): metrics.jsonl has each function's mean,
    and the total is their weighted sum."""
    import json

    from raygraph.config import build_config
    from raygraph.run.trainer import run

    (tmp_path / "my_rewards.py").write_text(doc_blocks()["my_rewards.py"])
    monkeypatch.chdir(tmp_path)
    data = yaml.safe_load((REPO / "configs" / "grpo_toy.yaml").read_text())
    data.update(yaml.safe_load(doc_blocks()["rewards.yaml"]))
    overrides = {
        "model.path": tiny_model_path, "model.tiny": "null", "data.train_files": "[data/train.parquet]",
        "data.val_files": "[data/val.parquet]", "data.prompts_per_step": 2, "data.val_prompts": 2,
        "trainer.output_dir": "runs", "trainer.total_steps": 2, "logging.mlflow": "false",
        "checkpoint.save_hf": "false", "placement.train_workers": world, "placement.rollout_workers": world,
    }
    cfg = build_config(data, [f"{k}={v}" for k, v in overrides.items()])
    assert cfg.reward.workers == 2 and cfg.reward.functions[1].weight == 0.2
    rows = [json.loads(line) for line in (run(cfg).run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2]
    for row in rows:   # brevity is in (0, 1] for responses of at most 8 tokens
        assert row["reward/mean"] == pytest.approx(row["reward/toy_arith/mean"] + 0.2 * row["reward/brevity/mean"],
                                                   abs=1e-6)
        assert 0.5 < row["reward/brevity/mean"] <= 1.0
        assert row["reward/errors"] == 0 and row["reward/timeouts"] == 0


def test_a_failing_reward_function_ends_the_run_instead_of_restarting():
    from raygraph.cluster.errors import CallSite, RemoteFailure, RoleError
    from raygraph.run.recovery import failure_is_recoverable

    wrapped = RemoteFailure.wrap(CallSite("reward", 0), "score", RewardFunctionError("reward function 'x' ..."))
    error = RoleError(wrapped.site, wrapped.method, wrapped.tb, wrapped.cause_type)
    assert error.cause == "RewardFunctionError" and not failure_is_recoverable(error, dead_actors=[])
