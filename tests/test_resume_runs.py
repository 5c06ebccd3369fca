"""Whole runs, resumed: a bit flip in the newest checkpoint falls back to the one before; a failure
after a finished step checkpoints it; metrics.jsonl holds each step once and MLflow one run; the
warm start runs before step 1 only; a changed learning rate is refused before anything starts.

Before these fixes: the flipped checkpoint loaded "successfully", the failure lost its step, the
redone steps appeared twice in metrics.jsonl, every resume opened a new MLflow run, and the new lr
was silently ignored while config.yaml claimed it.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest

from raygraph.config import load_config
from raygraph.run import checkpoint, resume

TOY = Path(__file__).resolve().parents[1] / "configs" / "grpo_toy.yaml"


def _cfg(out: Path, total_steps: int, *extra: str):
    return load_config(TOY, [
        f"trainer.output_dir={out}",
        f"data.train_files=[{out / 'data' / 'train.parquet'}]", f"data.val_files=[{out / 'data' / 'val.parquet'}]",
        "data.val_prompts=8", "run_name=e2e", "trainer.resume=auto", f"trainer.total_steps={total_steps}",
        "trainer.save_every=2", "checkpoint.keep_last=0", "checkpoint.save_hf=false",
        f"logging.mlflow_tracking_uri=sqlite:///{out / 'mlflow.db'}", *extra])


def _rows(run_dir: Path, name: str = "metrics.jsonl") -> list[dict]:
    return [json.loads(line) for line in (run_dir / name).read_text().splitlines()]


def _flip_a_bit(path: Path) -> None:
    raw = bytearray(path.read_bytes())
    raw[len(raw) // 2] ^= 0x10
    path.write_bytes(bytes(raw))


def test_damage_failure_and_resumes_keep_one_history(tmp_path, ray_local, monkeypatch, caplog):
    import mlflow

    from raygraph.run import trainer

    real_warm_start, warm_starts = trainer.run_warm_start, []

    def counted_warm_start(cfg, roles, **kwargs):
        warm_starts.append(cfg.trainer.total_steps)
        return real_warm_start(cfg, roles, **kwargs)

    monkeypatch.setattr(trainer, "run_warm_start", counted_warm_start)
    warm_start = "trainer.warm_start.steps=1"
    first = trainer.run(_cfg(tmp_path, 3, warm_start))
    run_dir = first.run_dir
    assert [s for s, _ in checkpoint.list_complete(run_dir)] == [2, 3]
    original = _rows(run_dir)
    shard = max((run_dir / "checkpoints" / "step_3" / "policy").rglob("*.distcp"), key=lambda p: p.stat().st_size)
    _flip_a_bit(shard)

    # Resume to 4 steps; validation at step 4 fails after step 4's update finished.
    real_validation = trainer.run_validation

    def failing_validation(graph, roles, prompts, *, step, **kw):
        if step == 4:
            raise RuntimeError("validation crashed")
        return real_validation(graph, roles, prompts, step=step, **kw)

    monkeypatch.setattr(trainer, "run_validation", failing_validation)
    with caplog.at_level(logging.WARNING, logger="raygraph"), pytest.raises(RuntimeError, match="validation crashed"):
        trainer.run(_cfg(tmp_path, 4, warm_start))
    monkeypatch.setattr(trainer, "run_validation", real_validation)
    fell_back = [r.getMessage() for r in caplog.records if "step_3.damaged" in r.getMessage()]
    assert fell_back and shard.relative_to(run_dir / "checkpoints" / "step_3").as_posix() in fell_back[0]
    assert "resuming from step_2" in fell_back[0]
    assert [s for s, _ in checkpoint.list_complete(run_dir)] == [2, 4]  # step 4 saved on the way out
    redone = _rows(run_dir)[2]
    assert redone["step"] == 3  # redone from step 2: the same numbers as the first attempt
    for key in ("reward/mean", "actor/pg_loss", "actor/grad_norm", "weights/version"):
        assert redone[key] == pytest.approx(original[2][key], rel=1e-5, abs=1e-6), key

    final = trainer.run(_cfg(tmp_path, 5, "trainer.warm_start.steps=2"))   # may change: a resume ignores it
    assert final.steps_done == 5 and final.run_dir == run_dir
    assert [r["step"] for r in _rows(run_dir)] == [1, 2, 3, 4, 5]  # each step once
    assert [r["step"] for r in _rows(run_dir, "metrics_redone.jsonl")] == [3]  # the damaged attempt's
    resumes = _rows(run_dir, resume.RESUMES)
    assert [(r["step"], r["overrides"], r["damaged_set_aside"]) for r in resumes] == [
        (2, {"trainer.total_steps": {"checkpoint": 3, "now": 4}}, ["step_3.damaged"]),
        (4, {"trainer.total_steps": {"checkpoint": 4, "now": 5},
             "trainer.warm_start.steps": {"checkpoint": 1, "now": 2}}, ["step_3.damaged"])]
    assert warm_starts == [3]   # the first run's, before its step 1; neither resume ran one
    client = mlflow.MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    runs = client.search_runs([client.get_experiment_by_name("grpo_toy").experiment_id])
    assert len(runs) == 1 and runs[0].info.status == "FINISHED"
    assert max(m.step for m in client.get_metric_history(runs[0].info.run_id, "reward/mean")) == 5

    config_before = (run_dir / "config.yaml").read_text()
    with pytest.raises(resume.ResumeError, match=r"actor.optim.lr: 0.0001 in the checkpoint, 0.02 now"):
        trainer.run(_cfg(tmp_path, 6, "trainer.warm_start.steps=2", "actor.optim.lr=0.02"))
    assert (run_dir / "config.yaml").read_text() == config_before
