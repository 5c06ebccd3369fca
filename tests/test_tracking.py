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


def _steps(path) -> list[int]:
    return [json.loads(line)["step"] for line in path.read_text().splitlines()]


def test_a_resumed_tracker_writes_each_step_once(tmp_path, caplog):
    """A run killed after step 5 and resumed from its step-3 checkpoint redoes steps 4-5: before,
    metrics.jsonl held 1..5 then 4, 5 again; now each once, the first attempt's kept aside."""
    first = Tracker(tmp_path, total_steps=6, mlflow_uri=None, experiment="e", run_name="r", params={},
                    ray_metrics=False, console="lines")
    for step in range(1, 6):
        first.log(step, {"reward/mean": step})
    first.jsonl.write('{"step": 6, "rew')  # killed while writing step 6
    first.jsonl.close()
    resumed = Tracker(tmp_path, total_steps=6, mlflow_uri=None, experiment="e", run_name="r", params={},
                      ray_metrics=False, console="lines", start_step=3)
    for step in range(4, 7):
        resumed.log(step, {"reward/mean": step * 10})
    resumed.close()
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5, 6]
    assert [r["reward/mean"] for r in rows] == [1, 2, 3, 40, 50, 60]
    redone = (tmp_path / "metrics_redone.jsonl").read_text().splitlines()
    assert [json.loads(line)["step"] for line in redone[:2]] == [4, 5] and redone[2] == '{"step": 6, "rew'
    assert "3 line(s) after step 3" in caplog.text


def test_a_resumed_run_continues_its_mlflow_run(tmp_path):
    import mlflow

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "config.yaml").write_text("trainer: {total_steps: 4}\n")
    ids = []
    for start, steps in ((0, (1, 2)), (1, (2, 3)), (3, (4,))):  # two resumes, the first redoes step 2
        tracker = Tracker(run_dir, total_steps=4, mlflow_uri=uri, experiment="e", run_name="r",
                          params={"trainer": {"total_steps": 3 + start}}, ray_metrics=False, start_step=start)
        for step in steps:
            tracker.log(step, {"reward/mean": float(step)})
        ids.append(tracker.mlflow_run_id)
        tracker.close("FAILED" if start < 3 else "FINISHED")
    assert ids[0] is not None and ids == [ids[0]] * 3
    runs = mlflow.MlflowClient(uri).search_runs([mlflow.get_experiment_by_name("e").experiment_id])
    assert len(runs) == 1 and runs[0].info.status == "FINISHED"
    assert runs[0].data.params["trainer.total_steps"] == "3"  # params of the first start: MLflow keeps them
    history = mlflow.MlflowClient(uri).get_metric_history(ids[0], "reward/mean")
    assert sorted(m.step for m in history) == [1, 2, 2, 3, 4]  # MLflow keeps the first attempt's step 2 too
    assert _steps(run_dir / "metrics.jsonl") == [1, 2, 3, 4]
