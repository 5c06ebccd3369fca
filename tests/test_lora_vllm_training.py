"""GRPO with `model.lora` and `rollout.engine=vllm` through `raygraph.run.trainer.run`: the CPU build
of vLLM serves the adapter itself, so each sync moves the adapter only (verified), and the engine's
log-probs stay those of the trained policy step after step (a stale adapter would show here)."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

pytest.importorskip("vllm")

from raygraph.config import load_config  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
ADAPTER_BYTES = 4 * 2 * (512 + 384 + 384 + 512 + 768 + 768 + 768)   # rank 4 on all-linear, tiny preset


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    from raygraph.models.tiny import build_tiny_lm

    root = tmp_path_factory.mktemp("lora-vllm-assets")
    return {"model": build_tiny_lm(root / "tiny-lm"), "data": root / "toy"}


def test_grpo_with_lora_syncs_the_adapter_to_vllm(assets, tmp_path, ray_local, capsys):
    from test_workflows import read_metrics, toy_overrides

    from raygraph.run.trainer import run

    overrides = {"rollout.engine": "vllm", "checkpoint.save_hf": "false", "trainer.dump_rollouts": 0,
                 "model.lora.rank": 4, "model.lora.alpha": 8, "actor.optim.lr": 1e-2, "actor.entropy_coef": 0.5,
                 "algorithm.rollout_correction.mode": "truncated_is", "trainer.total_steps": 3}
    summary = run(load_config(REPO / "configs" / "grpo_toy.yaml", toy_overrides(assets, tmp_path, **overrides)))
    assert f"[raygraph] vLLM LoRA: adapter sync ({ADAPTER_BYTES} bytes per sync)\n" in capsys.readouterr().out
    rows = read_metrics(summary.run_dir)
    assert [r["step"] for r in rows] == [1, 2, 3]
    for row in rows:
        assert all(math.isfinite(v) for v in row.values())
        assert row["weights/verified"] == 1.0 and row["weights/version"] == row["step"]
        assert row["weights/bytes"] == row["weights/lora_sync_bytes"] == ADAPTER_BYTES
        assert row["weights/full_bytes"] > 4 * ADAPTER_BYTES
        # steps 2 and 3 sample with a synced (non-zero) adapter: the engine's log-probs are the policy's
        assert row["rollout/logprob_diff_max"] < 1e-4
    assert rows[-1]["actor/entropy"] != rows[0]["actor/entropy"]   # the adapter moved the policy
