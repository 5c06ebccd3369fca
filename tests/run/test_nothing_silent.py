"""Nothing silent: a NaN metric is written, not dropped; a run that never updated fails."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from raygraph.cli import main
from raygraph.run.health import TrainingFailed, UpdateHealth
from raygraph.run.tracking import Tracker


def test_non_finite_metrics_are_written_counted_and_sent_to_mlflow(tmp_path, caplog):
    # before: reward/mean=NaN was left out of metrics.jsonl, the console and MLflow
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    (tmp_path / "config.yaml").write_text("a: 1\n")
    tracker = Tracker(tmp_path, total_steps=2, mlflow_uri=uri, experiment="e", run_name="r", params={"a": 1},
                      ray_metrics=False, console="lines")
    tracker.log(1, {"reward/mean": float("nan"), "val/accuracy": float("inf"), "actor/pg_loss": 0.5})
    tracker.close()
    row = json.loads((tmp_path / "metrics.jsonl").read_text())   # strict JSON: no bare NaN token
    assert row == {"step": 1, "reward/mean": "nan", "val/accuracy": "inf", "actor/pg_loss": 0.5,
                   "health/non_finite_metrics": 2.0}
    assert "step 1: non-finite metrics reward/mean=nan, val/accuracy=inf" in caplog.text

    import mlflow

    mlflow.set_tracking_uri(uri)
    history = mlflow.MlflowClient().get_metric_history(tracker.mlflow_run_id, "reward/mean")
    assert len(history) == 1 and math.isnan(history[0].value)


def test_a_run_whose_every_update_was_skipped_fails():
    health = UpdateHealth()
    health.observe(1, {"actor/skipped_steps": 2.0, "actor/optimizer_steps": 2.0})
    health.observe(2, {"actor/skipped_steps": 1.0, "actor/optimizer_steps": 1.0})
    health.observe(3, {"rollout/tokens": 10.0})            # a step without an update does not count
    with pytest.raises(TrainingFailed, match="all 2 training steps skipped every optimizer step"):
        health.check()


def test_raygraph_train_exits_1_for_a_run_that_never_updated(monkeypatch, capsys):
    """docs/guarantees.md, exit codes: 1 is "the run failed ... also a run that never updated"."""
    from raygraph.run import trainer

    def never_updated(cfg, address=None):
        health = UpdateHealth()
        health.observe(1, {"actor/skipped_steps": 1.0, "actor/optimizer_steps": 1.0})
        health.check()

    monkeypatch.setattr(trainer, "run", never_updated)
    monkeypatch.delenv("RAYGRAPH_DEBUG", raising=False)
    toy = Path(__file__).resolve().parents[2] / "configs" / "grpo_toy.yaml"
    assert main(["train", str(toy)]) == 1
    assert capsys.readouterr().err.splitlines()[-1] == (
        "raygraph train: TrainingFailed: all 1 training steps skipped every optimizer step (non-finite loss or "
        "gradient norm): the policy never changed. Look for NaN/Inf in reward/*, actor/* and "
        "health/non_finite_metrics in metrics.jsonl")


def test_some_skipped_updates_are_survivable_and_logged(caplog):
    health = UpdateHealth()
    health.observe(1, {"actor/skipped_steps": 1.0, "actor/optimizer_steps": 1.0})
    health.observe(2, {"actor/skipped_steps": 1.0, "actor/optimizer_steps": 2.0})   # one of two applied
    health.check()
    assert health.all_skipped_steps == 1
    assert "step 1: every optimizer step was skipped" in caplog.text
