"""The recovery policy, shown by runs (docs/fault-tolerance.md): a plain exception ends the run at
once (no retry, nothing recorded as a recovery); a process that keeps dying is recovered
`trainer.max_restarts` times and then ends the run; a recovered run stays one MLflow run, whose
metrics have each step once and the recovery counted at the redone step; a stage-level restart
that fails falls back to run level, which redoes the steps since the newest checkpoint (one run
shows the last two).

The user's reward function is the fault: it raises, or kills its own process (the rollout+reward
actor of a disaggregated layout, a stateless one: stage-level recovery), once step 1 is in the
ledger. (What recovery changes in the weights, nothing, is tests/run/test_chaos.py.)"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from raygraph.config import load_config

ROOT = Path(__file__).resolve().parents[2]
STEPS = 3

FAULTY_REWARD = '''
import os
import signal
import time
from pathlib import Path

LEDGER, MARKER = Path({ledger!r}), Path({marker!r})
BREAK_IMPORT = MARKER.with_suffix(".break_import")
if BREAK_IMPORT.exists():   # the first process to import this after the kill fails to start
    BREAK_IMPORT.unlink()
    raise ImportError("this reward cannot be imported right now")


def _after_step_1():
    return LEDGER.is_file() and '"step": 1' in LEDGER.read_text()


def raise_in_step_2(response_text, ground_truth, extra_info):
    if _after_step_1():
        raise ValueError("the reward service said no")
    return 0.0


def hang_once_then_raise(response_text, ground_truth, extra_info):
    if not MARKER.exists():
        MARKER.write_text("hung")
        time.sleep(60)
    raise ValueError("the reward service said no")


def die_in_every_step_2(response_text, ground_truth, extra_info):
    if _after_step_1():
        os.kill(os.getpid(), signal.SIGKILL)
    return 0.0


def die_once_then_fail_the_restart(response_text, ground_truth, extra_info):
    if _after_step_1() and not MARKER.exists():
        MARKER.write_text("killed")
        BREAK_IMPORT.write_text("")
        os.kill(os.getpid(), signal.SIGKILL)
    return 0.0

'''


@pytest.fixture(scope="module")
def toy_data(tmp_path_factory):
    from raygraph.data.toy import write_toy_dataset

    out = tmp_path_factory.mktemp("policy_data")
    write_toy_dataset(out, n_train=24, n_val=4, seed=0)
    return out


def _run(tmp_path: Path, model: str, data: Path, name: str, fault: str, *extra: str):
    """(the run's folder, its summary or the exception it ended with) of a run whose reward is `fault`."""
    from raygraph.run.trainer import run

    run_dir = tmp_path / "grpo_toy" / name
    plugin = tmp_path / f"{name}_reward.py"
    plugin.write_text(FAULTY_REWARD.format(ledger=str(run_dir / "ledger.jsonl"), marker=str(tmp_path / f"{name}.killed")))
    cfg = load_config(str(ROOT / "configs" / "grpo_toy.yaml"), [
        f"model.path={model}", "model.tiny=null", f"run_name={name}", f"trainer.output_dir={tmp_path}",
        f"data.train_files=[{data / 'train.parquet'}]", f"data.val_files=[{data / 'val.parquet'}]",
        f"trainer.total_steps={STEPS}", "trainer.save_every=1", "trainer.val_every=0", "checkpoint.keep_last=0",
        "trainer.resume=auto", "placement.mode=disaggregated", "placement.train_workers=1",
        "placement.rollout_workers=1", f"reward.function={plugin}:{fault}", *extra])
    try:
        return run_dir, run(cfg)
    except Exception as exc:  # noqa: BLE001 - the test reads it
        return run_dir, exc


def _lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.is_file() else []


def test_a_plain_exception_ends_the_run_at_once_without_a_retry(tmp_path, tiny_model_path, toy_data, ray_local):
    run_dir, outcome = _run(tmp_path, tiny_model_path, toy_data, "plain", "raise_in_step_2",
                            "trainer.max_restarts=2", "logging.mlflow=false")
    assert isinstance(outcome, Exception) and "the reward service said no" in str(outcome)
    assert _lines(run_dir / "recoveries.jsonl") == []   # not retried: restarting cannot cure the code
    assert [m["step"] for m in _lines(run_dir / "metrics.jsonl")] == [1]


def test_the_reward_settings_of_the_config_reach_the_reward_worker_of_a_run(tmp_path, tiny_model_path, toy_data,
                                                                             ray_local):
    # on_error=zero, a pool of one process and a 2 s timeout: the first call hangs (1 timeout in 16
    # samples), the other 15 raise; the run goes on with those calls scored 0
    run_dir, summary = _run(tmp_path, tiny_model_path, toy_data, "zeroed", "hang_once_then_raise", "trainer.total_steps=1",
                            "trainer.val_before_train=false",
                            "reward.on_error=zero", "reward.workers=1", "reward.timeout_s=2", "logging.mlflow=false")
    assert not isinstance(summary, Exception), summary
    (metrics,) = _lines(run_dir / "metrics.jsonl")
    assert (metrics["reward/errors"], metrics["reward/timeouts"], metrics["reward/mean"]) == (15 / 16, 1 / 16, 0.0)


def test_recoveries_stop_at_trainer_max_restarts(tmp_path, tiny_model_path, toy_data, ray_local, capsys):
    run_dir, outcome = _run(tmp_path, tiny_model_path, toy_data, "bound", "die_in_every_step_2",
                            "trainer.max_restarts=1", "logging.mlflow=false")
    assert isinstance(outcome, Exception)
    records = _lines(run_dir / "recoveries.jsonl")
    assert [r["kind"] for r in records] == ["stage", "stage"] and records[0]["failed_step"] == 2   # one recovery
    assert "recovery 1/1" in capsys.readouterr().out
    assert [m["step"] for m in _lines(run_dir / "metrics.jsonl")] == [1]


@pytest.fixture(scope="module")
def fallback_run(tmp_path_factory, tiny_model_path, toy_data, ray_local):
    """A rollout+reward process killed in step 2 whose stage-level restart fails (its reward cannot
    be imported once): run level takes over. No checkpoint before the failure (save_every=0), so
    run level starts over and step 1 is redone. Tracked in MLflow."""
    import contextlib
    import io

    tmp = tmp_path_factory.mktemp("fallback")
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        run_dir, summary = _run(tmp, tiny_model_path, toy_data, "fallback", "die_once_then_fail_the_restart",
                                "trainer.max_restarts=2", "logging.mlflow=true", "trainer.save_every=0")
    print(out.getvalue())
    return tmp, run_dir, summary, out.getvalue()


def test_a_recovered_run_stays_one_mlflow_run_with_each_step_once(fallback_run):
    """A stage-level failure and a run-level recovery (every actor started again) later, the run is
    still one MLflow run, FINISHED, with the recovery figures at the redone step."""
    from mlflow.tracking import MlflowClient

    tmp, run_dir, summary, _ = fallback_run
    assert not isinstance(summary, Exception), summary
    assert summary.steps_done == STEPS and (tmp / "fallback.killed").is_file()
    client = MlflowClient(f"sqlite:///{tmp / 'mlflow.db'}")
    (experiment,) = [e for e in client.search_experiments() if e.name == "grpo_toy"]
    (tracked,) = client.search_runs([experiment.experiment_id])   # one run, not one per attempt
    assert tracked.info.status == "FINISHED"
    # MLflow keeps metric history: the redone step 1 is a second point (docs/guarantees.md);
    # metrics.jsonl holds each step once (the test below)
    assert sorted(m.step for m in client.get_metric_history(tracked.info.run_id, "actor/grad_norm")) == [1, 1, 2, 3]
    redone = client.get_metric_history(tracked.info.run_id, "recovery/redone_steps")
    assert [(m.step, m.value) for m in redone] == [(1, 1.0)]
    restart_s = client.get_metric_history(tracked.info.run_id, "recovery/restart_s")
    assert len(restart_s) == 1 and restart_s[0].value > 0


def test_a_failed_stage_restart_falls_back_to_run_level_and_redoes_the_lost_steps(fallback_run):
    tmp, run_dir, summary, console = fallback_run
    assert not isinstance(summary, Exception), summary
    assert summary.steps_done == STEPS and not (tmp / "fallback.break_import").exists()
    assert "stage-level recovery failed" in console
    records = _lines(run_dir / "recoveries.jsonl")
    assert [r["kind"] for r in records] == ["stage", "run", "run"] and records[0]["failed_step"] == 2
    metrics = _lines(run_dir / "metrics.jsonl")
    assert [m["step"] for m in metrics] == [1, 2, 3]   # each step once, step 1 from the run after recovery
    assert [m.get("recovery/redone_steps") for m in metrics if "recovery/redone_steps" in m] == [1.0]
