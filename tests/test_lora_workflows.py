"""LoRA runs under Ray: no reference role is started (the policy without its adapter scores the
reference log-probs), each sync moves the adapter only and is verified (in process and over the
collective group), checkpoints hold the merged export and the PEFT adapter, resume is exact."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from raygraph.config import load_config

REPO = Path(__file__).resolve().parents[1]
LORA = {"model.lora.rank": 4, "model.lora.alpha": 8, "actor.optim.lr": 1e-3}
ADAPTER_BYTES = 4 * 2 * (512 + 384 + 384 + 512 + 768 + 768 + 768)   # rank 4, tiny preset (tests/models)


@pytest.fixture(scope="module")
def assets(tmp_path_factory, tiny_model_path):
    return {"model": tiny_model_path, "data": tmp_path_factory.mktemp("lora_assets") / "toy"}


def _run(config: str, assets, out: Path, train_file: str = "train.parquet", **extra):
    from raygraph.run.trainer import run

    data = assets["data"]
    overrides = {"model.path": assets["model"], "model.tiny": "null", "data.train_files": f"[{data / train_file}]",
                 "data.val_files": f"[{data / 'val.parquet'}]", "trainer.output_dir": out, "logging.mlflow": "false",
                 "data.val_prompts": 8, "trainer.total_steps": 2, **LORA, **extra}
    summary = run(load_config(REPO / "configs" / config, [f"{k}={v}" for k, v in overrides.items()]))
    return summary, [json.loads(line) for line in (summary.run_dir / "metrics.jsonl").read_text().splitlines()]


def _check_lora_step(row: dict) -> None:
    assert row["weights/verified"] == 1.0
    assert row["weights/bytes"] == row["weights/lora_sync_bytes"] == ADAPTER_BYTES
    assert row["weights/full_bytes"] > 4 * row["weights/bytes"]
    assert "timing/policy.ref_logprobs_s" in row and not any("reference" in k for k in row)


def test_grpo_with_kl_colocated_resumes_exactly(assets, tmp_path, ray_local):
    # the random tiny model earns no reward: an entropy bonus makes the adapters move
    common = {"run_name": "same", "trainer.save_every": 2, "placement.mode": "colocated",
              "trainer.executor": "interpreted", "actor.entropy_coef": 0.01}
    first, whole = _run("toy/grpo_kl_loss.yaml", assets, tmp_path / "whole", **common, **{"trainer.total_steps": 4})
    # the same run as if stopped after its step-2 checkpoint: a copy without step 4's checkpoint
    # resumes there (one run fewer than stopping a run of its own after step 2)
    split = tmp_path / "split" / first.run_dir.relative_to(tmp_path / "whole")
    shutil.copytree(first.run_dir, split)
    shutil.rmtree(split / "checkpoints" / "step_4")
    resumed, got = _run("toy/grpo_kl_loss.yaml", assets, tmp_path / "split", **common,
                        **{"trainer.total_steps": 4, "trainer.resume": "auto"})
    assert resumed.run_dir == split and [r["step"] for r in got] == [1, 2, 3, 4]
    # steps 3-4 were trained again, not read from the copy: their first lines moved aside
    assert [json.loads(x)["step"] for x in (split / "metrics_redone.jsonl").read_text().splitlines()] == [3, 4]
    for row in got:
        _check_lora_step(row)
    assert any(k.startswith("perf/peak_rss_gb/policy+rollout+reward") for k in got[0])   # no reference
    assert got[0]["actor/kl_loss"] == 0.0 < got[1]["actor/kl_loss"]   # B = 0 at step 1: policy = reference
    for a, b in zip(whole[2:], got[2:]):
        for key in ("reward/mean", "actor/kl_loss", "actor/entropy", "actor/grad_norm", "weights/version"):
            assert b[key] == pytest.approx(a[key], rel=1e-5, abs=1e-7), key
    ckpt = first.run_dir / "checkpoints" / "step_2"
    assert (ckpt / "hf" / "config.json").is_file() and not (ckpt / "hf" / "adapter_config.json").exists()
    assert (ckpt / "hf_adapter" / "adapter_config.json").is_file()


def test_grpo_disaggregated_sends_the_adapter_over_the_collective(assets, tmp_path, ray_local):
    _, rows = _run("toy/grpo_kl_loss.yaml", assets, tmp_path)   # disaggregated, compiled executor
    for row in rows:
        _check_lora_step(row)


def test_dpo_with_lora_needs_no_reference_model(assets, tmp_path, ray_local):
    _, rows = _run("toy/dpo.yaml", assets, tmp_path, train_file="train_dpo.parquet")
    assert rows[0]["actor/dpo_loss"] == pytest.approx(0.6931, abs=1e-3)   # policy = reference at step 1
    for row in rows:
        _check_lora_step(row)


@pytest.mark.parametrize("config", ["ppo", "rloo", "reinforce_pp", "remax", "sft"])
def test_every_other_workflow_trains_the_adapter_only(config, assets, tmp_path, ray_local):
    """docs/lora.md: LoRA in every workflow. One step each: the policy's syncs carry the adapter
    only, and the checkpoint's PEFT adapter moved away from its zero-initialised B (the tiny model
    earns no reward: an entropy bonus gives the RL workflows a gradient)."""
    from safetensors.torch import load_file

    summary, (row,) = _run(f"toy/{config}.yaml", assets, tmp_path, **{
        "trainer.total_steps": 1, "trainer.val_before_train": "false", "actor.entropy_coef": 0.01})
    assert row["weights/verified"] == 1.0 and row["weights/bytes"] == ADAPTER_BYTES
    adapter = load_file(str(summary.run_dir / "checkpoints" / "step_1" / "hf_adapter" / "adapter_model.safetensors"))
    lora_b = [t for name, t in adapter.items() if "lora_B" in name]
    assert len(lora_b) == 7 * 2 and all(t.abs().sum() > 0 for t in lora_b)   # 7 linear layers a block, 2 blocks
