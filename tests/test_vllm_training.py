"""Training with `rollout.engine=vllm` (the real vLLM CPU build) through `raygraph.run.trainer.run`:
colocated with the rollout correction, disaggregated and asynchronous, and an exact resume."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest

pytest.importorskip("vllm")

from raygraph.config import load_config  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
TOY = REPO / "configs" / "grpo_toy.yaml"
VLLM = {"rollout.engine": "vllm", "logging.mlflow": "false", "checkpoint.save_hf": "false",
        "data.val_prompts": 8, "trainer.dump_rollouts": 0}


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    from raygraph.models.tiny import build_tiny_lm

    root = tmp_path_factory.mktemp("vllm-assets")   # a model of its own: the runs here give model.path (model.tiny=null)
    return {"model": build_tiny_lm(root / "tiny-lm"), "data": root / "toy"}


def _cfg(assets, out: Path, **extra):
    from test_workflows import toy_overrides

    return load_config(TOY, toy_overrides(assets, out, **{**VLLM, **extra}))


def _rows(summary) -> list[dict]:
    from test_workflows import read_metrics

    return read_metrics(summary.run_dir)


ASYNC = {"placement.mode": "disaggregated", "placement.max_staleness": 1, "placement.rollout_workers": 2,
         "data.prompts_per_step": 4, "actor.entropy_coef": 0.5, "actor.optim.lr": 0.01, "run_name": "async",
         "trainer.save_every": 2}


@pytest.mark.timeout(900)   # three runs with vLLM engines: 212 s on a loaded 2-core machine (2026-12-03)
def test_disaggregated_async_vllm_trains_and_resumes_exactly(assets, tmp_path, ray_local):
    """Two vLLM rollout ranks sampling one step ahead, weights over the collective group; stop after
    step 2 and resume: step 3 equals that of an uninterrupted 3-step run (vLLM's per-row seeds come
    from each rank's checkpointed generator, prefetched rollouts from the checkpoint)."""
    from raygraph.run.trainer import run

    summary = run(_cfg(assets, tmp_path / "whole", **ASYNC, **{"trainer.total_steps": 3}))
    whole = _rows(summary)
    assert [r["step"] for r in whole] == [1, 2, 3]
    assert all(r["weights/verified"] == 1.0 for r in whole)
    assert whole[0]["rollout/staleness"] == 0.0 and whole[2]["rollout/staleness"] == 1.0
    # the same run stopped after its step-2 checkpoint (save_every=2): a copy without step 3's
    # checkpoint resumes there (one 2-step run fewer, four vLLM engine starts fewer)
    split = tmp_path / "split" / summary.run_dir.relative_to(tmp_path / "whole")
    shutil.copytree(summary.run_dir, split)
    last = sorted((split / "checkpoints").glob("step_*"))[-1]
    assert last.name.endswith("3")
    shutil.rmtree(last)
    resumed = _rows(run(_cfg(assets, tmp_path / "split", **ASYNC,
                             **{"trainer.total_steps": 3, "trainer.resume": "auto"})))
    assert [r["step"] for r in resumed] == [1, 2, 3]
    # step 3 was trained again, not read from the copy: its first line moved aside
    assert [json.loads(x)["step"] for x in (split / "metrics_redone.jsonl").read_text().splitlines()] == [3]
    for key in ("reward/mean", "actor/pg_loss", "actor/grad_norm", "rollout/response_length_mean",
                "rollout/is_weight_mean", "weights/version"):
        assert resumed[2][key] == pytest.approx(whole[2][key], rel=1e-5, abs=1e-6), key


# More prompt tokens than one vLLM scheduler step holds (4096 on the CPU build; toy prompts are 7
# tokens): training 32 prompts x 20 samples = 4480, sampled validation 64 x 16 = 7168. Every row is
# seeded; before issue 29 the CPU engine died at the first chunked prefill.
BEYOND_ONE_BATCH = {"data.toy.n_train": 36, "data.toy.n_val": 64, "data.val_prompts": 64,
                    "data.prompts_per_step": 32, "rollout.n": 20, "rollout.val_greedy": "false",
                    "rollout.val_n": 16, "trainer.total_steps": 2, "actor.micro_batch_size": 64,
                    "trainer.val_every": 0}


def test_colocated_vllm_steps_beyond_one_scheduler_batch_agree_with_the_trainer_and_are_corrected(
        assets, tmp_path, ray_local):
    """Colocated vLLM rollouts with the rollout correction: step 2 samples with the weights synced
    after step 1, and its log-probs are still the policy's; both steps and the sampled validation
    send more prompt tokens than one scheduler step of the CPU engine holds."""
    from raygraph.run.trainer import run

    own = {"model": assets["model"], "data": tmp_path / "toy"}   # a larger toy split than the module's
    rows = _rows(run(_cfg(own, tmp_path / "out", **BEYOND_ONE_BATCH,
                          **{"algorithm.rollout_correction.mode": "truncated_is"})))
    assert [r["step"] for r in rows] == [1, 2]
    for row in rows:
        assert row["rollout/samples"] == 640.0 and all(math.isfinite(v) for v in row.values())
        assert row["weights/verified"] == 1.0 and row["weights/version"] == row["step"]
        # fp32 vLLM vs the policy's recomputation at the same weights: numerics only
        assert row["rollout/logprob_diff_max"] < 1e-4 and 0 <= row["rollout/mismatch_kl"] < 1e-8
        assert row["rollout/correction_weight_mean"] == pytest.approx(1.0, abs=1e-4)
        assert row["rollout/correction_capped_frac"] == 0.0
        assert "timing/policy.logprobs_s" in row   # the correction needs the trainer's old log-probs
    assert 0.0 <= rows[-1]["val/pass@16"] <= 1.0
