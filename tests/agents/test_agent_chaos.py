"""Chaos with episodes: the rollout+reward process dies in the middle of an episode of step 2
(its environment kills it with SIGKILL); stage-level recovery starts that process alone, step 2's
episodes run again from their start, every prompt is trained once (the ledger), and the final
weights equal those of the same run never interrupted, bit for bit.

The HF engine samples, set explicitly (vLLM's three engine starts took ~70 of this test's 137 s
in `make test` when `rollout.engine=auto` picked vLLM for any model path); a dead vLLM engine rebuilt and resampled
exactly is tests/run/test_chaos_vllm.py, episodes on vLLM tests/agents/test_agent_rollout.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from raygraph.config import load_config
from raygraph.run.ledger import check_ledger

ROOT = Path(__file__).resolve().parents[2]
STEPS = 3

DYING_ENV = '''
import os
import signal
from pathlib import Path

from raygraph.agents.builtin_envs import RetryWithFeedbackEnv

LEDGER, MARKER = Path({ledger!r}), Path({marker!r})


class DieInStep2(RetryWithFeedbackEnv):
    """retry_with_feedback; with kill=True the first second turn after step 1 is in the ledger
    kills its own process (the rollout+reward actor), mid-episode."""

    def __init__(self, row, kill: bool = False):
        super().__init__(row)
        self.kill = kill

    def step(self, response):
        if self.kill and self.turn == 1 and not MARKER.exists() and LEDGER.is_file() \\
                and '"step": 1' in LEDGER.read_text():
            MARKER.write_text("killed")
            os.kill(os.getpid(), signal.SIGKILL)
        return super().step(response)
'''


def _cfg(tmp_path: Path, model: str, env: Path, kill: bool, run_name: str):
    data = tmp_path / "data"
    return load_config(str(ROOT / "configs" / "demo_multiturn.yaml"), [
        f"model.path={model}", "model.tiny=null", f"run_name={run_name}", f"trainer.output_dir={tmp_path}",
        f"data.train_files=[{data / 'train.parquet'}]", f"data.val_files=[{data / 'val.parquet'}]",
        "data.toy.n_train=64", "data.toy.n_val=8", "data.prompts_per_step=8", "rollout.n=4", "actor.mini_batch_size=16", "actor.micro_batch_size=16",
        f"trainer.total_steps={STEPS}", "trainer.save_every=1", "trainer.val_every=0", "trainer.warm_start=null",
        "checkpoint.keep_last=0", "checkpoint.save_hf=true", "logging.mlflow=false", "data.val_prompts=4",
        "trainer.resume=auto", "trainer.max_restarts=2", "placement.mode=disaggregated", "rollout.engine=hf",
        f"rollout.agent.env={env}:DieInStep2", f"rollout.agent.env_args={{kill: {str(kill).lower()}}}"])


def _final_weights(run_dir: Path) -> dict[str, torch.Tensor]:
    return load_file(str(run_dir / "checkpoints" / f"step_{STEPS}" / "hf" / "model.safetensors"))


@pytest.mark.slow
def test_a_rollout_rank_killed_mid_episode_reruns_its_step_and_changes_nothing(tmp_path, tiny_model_path, ray_local):
    from raygraph.run.trainer import run

    run_dir = tmp_path / "demo_multiturn" / "chaos"
    env, marker = tmp_path / "dying_env.py", tmp_path / "killed"
    env.write_text(DYING_ENV.format(ledger=str(run_dir / "ledger.jsonl"), marker=str(marker)))
    reference = run(_cfg(tmp_path, tiny_model_path, env, False, "reference"))
    summary = run(_cfg(tmp_path, tiny_model_path, env, True, "chaos"))
    assert marker.is_file() and summary.steps_done == STEPS
    records = [json.loads(line) for line in (run_dir / "recoveries.jsonl").read_text().splitlines()]
    assert [r["kind"] for r in records] == ["stage", "stage"] and records[0]["failed_step"] == 2
    cfg = _cfg(tmp_path, tiny_model_path, env, True, "chaos")
    from raygraph.batch import UID
    from raygraph.run.feed import StepData

    data = StepData.load(cfg)
    order = {s: list(data.next_prompts(step=s, kl_coef=0.0)[UID]) for s in range(1, STEPS + 1)}
    assert check_ledger(run_dir, order) == []
    final, ref = _final_weights(run_dir), _final_weights(reference.run_dir)
    assert all(torch.equal(final[k], ref[k]) for k in ref), "weights differ from the uninterrupted run"
