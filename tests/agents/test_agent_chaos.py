"""Chaos with episodes: the rollout+reward process dies in the middle of an episode of step 2
(its environment kills it with SIGKILL); stage-level recovery starts that process alone, step 2's
episodes run again from their start, every prompt is trained once (the ledger), and the final
weights equal those of the same run never interrupted, bit for bit. With the environments in hosts
of their own (`rollout.agent.env_hosts`), the environment kills its host instead: the rollout
actor is started again with new hosts, and the final weights equal the same uninterrupted run
with in-process environments (so hosting changes no sample either).

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


DYING_PROGRAM = '''
import os
import signal
from pathlib import Path

from raygraph.agents.demo_program import run as demo_run

LEDGER, MARKER = Path({ledger!r}), Path({marker!r})


class _Dying:
    """The client, except that the first second call after step 1 is in the ledger kills the
    program's process (the rollout+reward actor), mid-episode."""

    def __init__(self, client):
        self.client, self.calls = client, 0
        self.chat = self
        self.completions = self

    async def create(self, **request):
        self.calls += 1
        if self.calls == 2 and not MARKER.exists() and LEDGER.is_file() and '"step": 1' in LEDGER.read_text():
            MARKER.write_text("killed")
            os.kill(os.getpid(), signal.SIGKILL)
        return await self.client.chat.completions.create(**request)


async def run(row, client, kill: bool = False):
    return await demo_run(row, _Dying(client) if kill else client)
'''


def _cfg(tmp_path: Path, model: str, env: Path, kill: bool, run_name: str, *extra: str):
    data = tmp_path / "data"
    return load_config(str(ROOT / "configs" / "demo_multiturn.yaml"), [
        f"model.path={model}", "model.tiny=null", f"run_name={run_name}", f"trainer.output_dir={tmp_path}",
        f"data.train_files=[{data / 'train.parquet'}]", f"data.val_files=[{data / 'val.parquet'}]",
        "data.toy.n_train=64", "data.toy.n_val=8", "data.prompts_per_step=8", "rollout.n=4", "actor.mini_batch_size=16", "actor.micro_batch_size=16",
        f"trainer.total_steps={STEPS}", "trainer.save_every=1", "trainer.val_every=0", "trainer.warm_start=null",
        "checkpoint.keep_last=0", "checkpoint.save_hf=true", "logging.mlflow=false", "data.val_prompts=4",
        "trainer.resume=auto", "trainer.max_restarts=2", "placement.mode=disaggregated", "rollout.engine=hf",
        f"rollout.agent.env={env}:DieInStep2", f"rollout.agent.env_args={{kill: {str(kill).lower()}}}", *extra])


def _final_weights(run_dir: Path) -> dict[str, torch.Tensor]:
    return load_file(str(run_dir / "checkpoints" / f"step_{STEPS}" / "hf" / "model.safetensors"))


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory, tiny_model_path, ray_local):
    """(the dying environment's file and folder, the final weights of the run never interrupted)."""
    from raygraph.run.trainer import run

    tmp_path = tmp_path_factory.mktemp("agent_chaos")
    env = tmp_path / "dying_env.py"
    env.write_text(DYING_ENV.format(ledger=str(tmp_path / "unused"), marker=str(tmp_path / "unused")))
    return tmp_path, _final_weights(run(_cfg(tmp_path, tiny_model_path, env, False, "reference")).run_dir)


def _chaos_run(tmp_path: Path, model: str, run_name: str, *extra: str, code: str = DYING_ENV) -> Path:
    """A run whose environment (or agent program) kills its own process in the second turn of an
    episode of step 2; checks the recovery records and the ledger, and returns the run's folder."""
    from raygraph.batch import UID
    from raygraph.run.feed import StepData
    from raygraph.run.trainer import run

    run_dir = tmp_path / "demo_multiturn" / run_name
    env, marker = tmp_path / f"{run_name}_env.py", tmp_path / f"{run_name}_killed"
    env.write_text(code.format(ledger=str(run_dir / "ledger.jsonl"), marker=str(marker)))
    if code is DYING_PROGRAM:
        extra = ("rollout.agent.env=null", "rollout.agent.env_args={}", f"rollout.agent.program={env}:run",
                 "rollout.agent.program_args={kill: true}", *extra)
    cfg = _cfg(tmp_path, model, env, True, run_name, *extra)
    summary = run(cfg)
    assert marker.is_file() and summary.steps_done == STEPS
    records = [json.loads(line) for line in (run_dir / "recoveries.jsonl").read_text().splitlines()]
    assert [r["kind"] for r in records] == ["stage", "stage"] and records[0]["failed_step"] == 2
    data = StepData.load(cfg)
    order = {s: list(data.next_prompts(step=s, kl_coef=0.0)[UID]) for s in range(1, STEPS + 1)}
    assert check_ledger(run_dir, order) == []
    return run_dir


def _same_weights(run_dir: Path, reference: dict[str, torch.Tensor]) -> bool:
    final = _final_weights(run_dir)
    return final.keys() == reference.keys() and all(torch.equal(final[k], reference[k]) for k in reference)


@pytest.mark.slow
def test_a_rollout_rank_killed_mid_episode_reruns_its_step_and_changes_nothing(uninterrupted, tiny_model_path):
    tmp_path, reference = uninterrupted
    assert _same_weights(_chaos_run(tmp_path, tiny_model_path, "chaos"), reference), \
        "weights differ from the uninterrupted run"


@pytest.mark.slow
def test_an_env_host_killed_mid_episode_restarts_its_rollout_rank_and_changes_nothing(uninterrupted, tiny_model_path):
    tmp_path, reference = uninterrupted
    run_dir = _chaos_run(tmp_path, tiny_model_path, "hosted", "rollout.agent.env_hosts=2",
                         "rollout.agent.env_host_cpus=0.5")
    record = json.loads((run_dir / "recoveries.jsonl").read_text().splitlines()[0])
    assert "EnvHostDied" in json.dumps(record)
    assert _same_weights(run_dir, reference), "weights differ from the uninterrupted in-process run"


@pytest.mark.slow
def test_an_agent_program_killed_mid_episode_reruns_its_step_and_trains_as_the_environment(uninterrupted,
                                                                                           tiny_model_path):
    """The demo's task as an agent program whose second call in step 2 kills its rollout process:
    the step is rerun from the same samples, and the final weights equal those of the environment
    version never interrupted (same seeds per turn, same waves, same rows on the tiny template)."""
    tmp_path, reference = uninterrupted
    run_dir = _chaos_run(tmp_path, tiny_model_path, "program", code=DYING_PROGRAM)
    assert _same_weights(run_dir, reference), "weights differ from the uninterrupted environment run"
