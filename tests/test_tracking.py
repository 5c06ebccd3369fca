"""Tracking: metrics.jsonl gets every step, the console and MLflow every `log_every`-th; names MLflow
accepts; sample files."""

from __future__ import annotations

import json

from raygraph.run.samples import SampleDumps, console_lines
from raygraph.run.tracking import Tracker, mlflow_name


def test_log_every_thins_the_console_but_never_the_jsonl(tmp_path, capsys):
    tracker = Tracker(tmp_path, total_steps=7, mlflow_uri=None, experiment="e", run_name="r", params={},
                      ray_metrics=False, console="lines", log_every=3)
    for step in range(1, 8):
        tracker.log(step, {"reward/mean": step / 10, "not/a/number": "x", "inf": float("inf")},
                    force=step == 7)
    tracker.close()
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5, 6, 7]
    printed = [line for line in capsys.readouterr().out.splitlines() if line.startswith("[raygraph] step")]
    assert [line.split()[2] for line in printed] == ["3/7", "6/7", "7/7"]   # every 3rd, and the forced last


def test_metric_names_are_made_acceptable_to_mlflow():
    assert mlflow_name("val/accuracy@gsm8k") == "val/accuracy_at_gsm8k"
    assert mlflow_name("perf/peak_rss_gb/policy+rollout+reward") == "perf/peak_rss_gb/policy_rollout_reward"
    assert mlflow_name("timing/rollout.generate_s") == "timing/rollout.generate_s"


def test_sample_dumps_every_n_steps_and_console_lines(tmp_path):
    dumps = SampleDumps(tmp_path, every=5, rows=None)
    assert [dumps.rows_for(s) for s in (1, 5, 10, 11)] == [0, -1, -1, 0]
    assert SampleDumps(tmp_path, every=0, rows=3).rows_for(10) == 0 and SampleDumps(tmp_path, 2, 3).rows_for(2) == 3
    path = dumps.write(5, [{"uid": "a", "score": 1.0, "prompt": "1+1=", "response": "2"}], "train")
    assert path.name == "train_step_000005.jsonl"
    assert json.loads(path.read_text()) == {"step": 5, "uid": "a", "score": 1.0, "prompt": "1+1=", "response": "2"}
    [line] = console_lines([{"score": 0.5, "prompt": "x" * 300, "response": "y\nz"}], width=20)
    assert "score=0.5" in line and "'...xxxxxxxxxxxxxxxxx'" in line and "'y z'" in line
