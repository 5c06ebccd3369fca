"""Every shipped workflow runs 2 steps under Ray on CPU through `raygraph.trainer.run`."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from raygraph.config import load_config

REPO = Path(__file__).resolve().parents[1]
TOY_CONFIGS = sorted([REPO / "configs" / "grpo_toy.yaml", *(REPO / "configs" / "toy").glob("*.yaml")])


@pytest.fixture(scope="module")
def shared_assets(tmp_path_factory):
    """One tiny model and one toy dataset for every run of this module."""
    from raygraph.models.tiny import build_tiny_lm

    root = tmp_path_factory.mktemp("assets")   # the model is built here: build_tiny builds only under output_dir
    return {"model": build_tiny_lm(root / "tiny-lm"), "data": root / "toy"}


def toy_overrides(assets, out_dir: Path, train_file: str = "train.parquet", **extra) -> list[str]:
    data = assets["data"]
    overrides = {
        "model.path": assets["model"], "model.tiny": "null", "data.train_files": f"[{data / train_file}]",
        "data.val_files": f"[{data / 'val.parquet'}]", "trainer.output_dir": out_dir,
        "logging.mlflow": "false", "data.val_prompts": 8, "trainer.total_steps": 2, **extra,
    }
    return [f"{k}={v}" for k, v in overrides.items()]


def read_metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.parametrize("config", TOY_CONFIGS, ids=lambda p: p.stem)
def test_workflow_runs_two_steps(config, shared_assets, tmp_path, ray_local):
    from raygraph.run.trainer import run

    train_file = Path(load_config(config).data.train_files[0]).name
    cfg = load_config(config, toy_overrides(shared_assets, tmp_path, train_file,
                                                **{"trainer.dump_rollouts": 2, "rollout.val_n": 2}))
    summary = run(cfg)
    rows = read_metrics(summary.run_dir)
    assert [r["step"] for r in rows] == [1, 2]
    for row in rows:
        assert all(math.isfinite(v) for v in row.values())
        assert row["weights/verified"] == 1.0
        assert row["timing/step_s"] > 0
        assert any(k.startswith("perf/peak_rss_gb/policy") and 0.05 < v < 24 for k, v in row.items())
    assert rows[-1]["weights/version"] == 2.0
    assert "val/accuracy" in rows[-1] and 0.0 <= rows[-1]["val/accuracy"] <= 1.0
    if cfg.data.format == "rl":
        assert {"reward/mean", "actor/pg_loss", "actor/grad_norm", "rollout/logprob_diff_max"} <= rows[0].keys()
        # the rollout's own log-probs and the policy's recomputation agree (same weights, fp32)
        assert rows[0]["rollout/logprob_diff_max"] < 1e-4
        # a separate old-log-prob pass runs only where the config needs one
        assert ("timing/policy.logprobs_s" in rows[0]) == (cfg.old_logprobs_source == "recompute")
        # sampled validation (2 samples per prompt): pass@1 <= pass@2, both rates
        assert 0.0 <= rows[-1]["val/pass@1"] <= rows[-1]["val/pass@2"] <= 1.0 and "val/maj@2" in rows[-1]
        # every 2nd step's rollouts are kept as text: all prompts_per_step x n rows, scored
        dumped = [json.loads(line) for line in (summary.run_dir / "samples" / "train_step_000002.jsonl").open()]
        assert len(dumped) == cfg.samples_per_step and {r["step"] for r in dumped} == {2}
        assert all(r["response"] and r["uid"] and r["weight_version"] == 1 for r in dumped)
        assert sum(r["score"] for r in dumped) == pytest.approx(rows[1]["reward/mean"] * len(dumped), abs=1e-4)
    else:
        assert rows[0][f"actor/{cfg.data.format}_loss"] > 0
    for at in (0, 2):   # validation generations before training and after the last step
        val = (summary.run_dir / "samples" / f"val_step_{at:06d}.jsonl").read_text().splitlines()
        assert len(val) == 8
    ckpt = summary.run_dir / "checkpoints" / "step_2"
    assert (ckpt / "COMPLETE").is_file() and (ckpt / "hf" / "config.json").is_file()
    assert (summary.run_dir / "config.yaml").is_file()


def test_resume_continues_exactly(shared_assets, tmp_path, ray_local):
    """Stopped after step 2's checkpoint, resumed: steps 3-4 equal those of the uninterrupted
    4-step run. The stopped run is a copy of that run without step 4's checkpoint (one run fewer
    than stopping one; a finished run extended by total_steps: tests/test_resume_runs.py)."""
    import shutil

    from raygraph.run.trainer import run

    config = REPO / "configs" / "grpo_toy.yaml"
    common = {"run_name": "same", "trainer.val_every": 2, "trainer.save_every": 2, "checkpoint.keep_last": 0}
    whole = run(load_config(config, toy_overrides(shared_assets, tmp_path / "whole", **common,
                                                  **{"trainer.total_steps": 4})))
    split = tmp_path / "split" / whole.run_dir.relative_to(tmp_path / "whole")
    shutil.copytree(whole.run_dir, split)
    shutil.rmtree(split / "checkpoints" / "step_4")
    resumed = run(load_config(config, toy_overrides(shared_assets, tmp_path / "split", **common,
                                                    **{"trainer.total_steps": 4, "trainer.resume": "auto"})))
    assert resumed.run_dir == split and resumed.steps_done == 4
    # steps 3-4 were trained again, not read from the copy: their first lines moved aside
    assert [json.loads(x)["step"] for x in (split / "metrics_redone.jsonl").read_text().splitlines()] == [3, 4]
    expected, got = read_metrics(whole.run_dir), read_metrics(resumed.run_dir)
    assert [r["step"] for r in got] == [1, 2, 3, 4]
    for a, b in zip(expected[2:], got[2:]):
        for key in ("reward/mean", "actor/pg_loss", "actor/grad_norm", "rollout/response_length_mean",
                    "weights/version", "val/accuracy"):
            if key in a:
                assert b[key] == pytest.approx(a[key], rel=1e-5, abs=1e-6), key


def test_old_logprobs_sources_agree_over_several_optimizer_steps(shared_assets, tmp_path, ray_local):
    """Two mini-batches per step: old log-probs recomputed by policy.logprobs or taken from the
    rollout give the same training (synchronous, fp32: they differ by float rounding only)."""
    from raygraph.run.trainer import run

    rows = {}
    for source in ("recompute", "rollout"):
        cfg = load_config(REPO / "configs" / "grpo_toy.yaml", toy_overrides(
            shared_assets, tmp_path / source, **{"actor.mini_batch_size": 8, "actor.old_logprobs": source}))
        rows[source] = read_metrics(run(cfg).run_dir)
        assert ("timing/policy.logprobs_s" in rows[source][0]) == (source == "recompute")
        assert rows[source][0]["rollout/logprob_diff_max"] < 1e-4
    for a, b in zip(rows["recompute"], rows["rollout"]):
        for key in ("reward/mean", "actor/pg_loss", "actor/clipfrac", "actor/grad_norm"):
            assert b[key] == pytest.approx(a[key], rel=1e-3, abs=1e-5), key


CUSTOM_WORKFLOW = '''
"""A user's workflow: GRPO without the old-logprob pass (on-policy, ratio 1)."""
from raygraph.graph import InputNode, MultiOutputNode, step_metrics, whole_batch

ROLES = ("policy", "rollout", "reward")


def my_build(roles, cfg):
    with InputNode() as prompts:
        rollouts = roles.rollout.bind("generate", prompts)
        scored = roles.gather(rollouts, roles.reward.bind("score", rollouts))
        batch = roles.apply(whole_batch.use_rollout_logprobs, scored)
        batch = roles.apply(whole_batch.compute_advantages, batch, prompts, estimator="dr_grpo",
                            gamma=1.0, lam=1.0, eps=1e-6, kl_kind="k1", old_from_rollout=False)
        update = roles.policy.bind("update", batch)
        return MultiOutputNode([roles.gather(update), roles.sync_weights(after=update),
                                roles.apply(step_metrics.rollout_metrics, batch)])
'''


def test_custom_workflow_by_path(shared_assets, tmp_path, ray_local):
    from raygraph.run.trainer import run

    path = tmp_path / "my_algo.py"
    path.write_text(CUSTOM_WORKFLOW)
    cfg = load_config(REPO / "configs" / "grpo_toy.yaml",
                      toy_overrides(shared_assets, tmp_path, workflow=f"{path}:my_build"))
    rows = read_metrics(run(cfg).run_dir)
    assert len(rows) == 2 and rows[-1]["weights/version"] == 2.0 and "actor/pg_loss" in rows[0]


def test_tutorial_workflow_file_runs_and_matches_the_doc(shared_assets, tmp_path, ray_local):
    """docs/custom-algorithm.md shows examples/rejection_sampling.py verbatim; that file trains."""
    from raygraph.run.trainer import run

    example = REPO / "examples" / "rejection_sampling.py"
    doc = (REPO / "docs" / "custom-algorithm.md").read_text()
    assert example.read_text().strip() in doc
    cfg = load_config(REPO / "configs" / "grpo_toy.yaml",
                      toy_overrides(shared_assets, tmp_path, workflow=f"{example}:build"))
    rows = read_metrics(run(cfg).run_dir)
    assert [r["step"] for r in rows] == [1, 2] and "actor/sft_loss" in rows[0]
    assert rows[-1]["weights/version"] == 2.0


def test_impossible_placement_is_a_clear_error_not_a_hang(shared_assets, tmp_path, ray_local, capsys):
    from raygraph.cli import main

    code = main(["train", str(REPO / "configs" / "grpo_toy.yaml"),
                 *toy_overrides(shared_assets, tmp_path, **{"placement.cpus_per_worker": 64,
                                                            "placement.placement_timeout_s": 2})])
    err = capsys.readouterr().err
    assert code == 1
    assert "PlacementError" in err and "64" in err and "Traceback" not in err
