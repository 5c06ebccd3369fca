"""Chaos with the vLLM engine. Disaggregated: kill -9 the engine process of a rollout rank (its
engine core in a process of its own, `rollout.vllm_engine_core=own_process`) in the middle of a
run. The rank's actor lives on with a dead engine (`RolloutEngineDied`); stage-level recovery starts that actor again (a new engine), pushes the policy's weights into it, rewinds the
sampling RNG and runs the step again, with no checkpoint loaded. Colocated: kill -9 the process
that holds the policy and the engine; run-level recovery rebuilds it and resumes from the newest
checkpoint. Either way the final weights equal those of an uninterrupted run: per-row seeds make
the new engine sample what the old one would have (one uninterrupted run serves both: colocated
and disaggregated layouts compute the same weights)."""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

pytest.importorskip("vllm")

from raygraph.config import load_config  # noqa: E402
from raygraph.run.ledger import check_ledger, effective_steps  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
TOY = str(ROOT / "configs" / "grpo_toy.yaml")
STEPS = 3


def _cfg(tmp_path: Path, model: str, data: Path, run_name: str, *extra: str):
    return load_config(TOY, [f"model.path={model}", "model.tiny=null", f"run_name={run_name}",
                             f"data.train_files=[{data / 'train.parquet'}]", f"data.val_files=[{data / 'val.parquet'}]",
                             f"trainer.output_dir={tmp_path}", f"trainer.total_steps={STEPS}",
                             "trainer.save_every=0", "checkpoint.save_hf=true", "trainer.val_every=0",
                             "logging.mlflow=false", "trainer.max_restarts=1", "rollout.engine=vllm",
                             "placement.mode=disaggregated", "placement.train_workers=1",
                             "placement.rollout_workers=1", "actor.entropy_coef=0.5", "actor.optim.lr=0.01",
                             "trainer.step_timeout_s=60", *extra])


def _final_weights(run_dir: Path) -> dict[str, torch.Tensor]:
    return load_file(str(run_dir / "checkpoints" / f"step_{STEPS}" / "hf" / "model.safetensors"))


def _expected_order(cfg) -> dict[int, list[str]]:
    """The data order the sampler gives this config, computed without Ray."""
    from raygraph.batch import UID
    from raygraph.run.feed import StepData

    data = StepData.load(cfg)
    return {s: list(data.next_prompts(step=s, kl_coef=0.0)[UID]) for s in range(1, STEPS + 1)}


# Imported by every actor (trainer.plugins): step 2's generate (the first once step 1 is in the
# ledger) kill -9s its own engine processes, notes when and which in the marker, and goes on into
# the dead engine. Killing from inside the call makes the failure land in step 2's generate every
# time; a kill from outside raced the 0.2 s step and could land after the update (run level).
KILL_THE_ENGINE_IN_STEP_2 = '''
import json
import os
import signal
import time
from pathlib import Path

import ray

from raygraph.workers.rollout_vllm import VLLMRolloutWorker

RUN, MARKER = Path({run!r}), Path({marker!r})
_generate = VLLMRolloutWorker.generate


def _generate_with_a_dead_engine(self, batch, **kwargs):
    ledger = RUN / "ledger.jsonl"
    if ledger.is_file() and '"step": 1' in ledger.read_text() and not MARKER.exists():
        import psutil

        children = [(c.pid, c.name(), " ".join(c.cmdline())[:120]) for c in psutil.Process().children(recursive=True)]
        # vLLM titles its engine core process "VLLM::EngineCore"; the kernel keeps 15 characters of a
        # process name ("VLLM::EngineCor"), and a title set late may not be in the command line yet
        victims = [pid for pid, name, cmdline in children if "EngineCor" in name + " " + cmdline]
        for pid in victims or [pid for pid, _, _ in children]:
            os.kill(pid, signal.SIGKILL)
        MARKER.write_text(json.dumps({{"at": time.time(), "victims": victims, "children": children}}))
    return _generate(self, batch, **kwargs)


if ray.is_initialized() and ray.get_runtime_context().get_actor_id():   # in the actors, not in the driver
    VLLMRolloutWorker.generate = _generate_with_a_dead_engine   # (which imports plugins too, and runs later tests)
'''


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    from raygraph.data.toy import write_toy_dataset

    out = tmp_path_factory.mktemp("chaos_vllm_data")
    write_toy_dataset(out, n_train=24, n_val=4, seed=0)
    return out


@pytest.fixture(scope="module")
def reference(tmp_path_factory, tiny_model_path, data, ray_local):
    """The final weights of an uninterrupted disaggregated run."""
    from raygraph.run.trainer import run

    return _final_weights(run(_cfg(tmp_path_factory.mktemp("ref"), tiny_model_path, data, "ref")).run_dir)


@pytest.mark.timeout(900)   # two runs and three engine starts: 300 s on a loaded 2-core machine (2026-12-03)
def test_a_dead_vllm_engine_is_rebuilt_at_stage_level_and_nothing_changes(tmp_path, tiny_model_path, ray_local,
                                                                         data, reference):
    from raygraph.run.trainer import run
    from raygraph.workers.rollout_vllm import VLLMRolloutWorker

    real_generate = VLLMRolloutWorker.generate   # the driver imports the plugin too, and must keep it
    run_dir, marker = tmp_path / "chaos" / "grpo_toy" / "chaos", tmp_path / "killed.json"
    plugin = tmp_path / "kill_the_engine.py"
    plugin.write_text(KILL_THE_ENGINE_IN_STEP_2.format(run=str(run_dir), marker=str(marker)))
    # an engine core in a process of its own (on GPUs always; the CPU build's default runs it in the
    # rollout actor's process, where a step that fails is the same RolloutEngineDied, tests/workers);
    # the reference ran with it in-process: both engines sample the same rows
    cfg = _cfg(tmp_path / "chaos", tiny_model_path, data, "chaos", f"plugins=[{plugin}]",
               "rollout.vllm_engine_core=own_process")
    assert run_dir == tmp_path / "chaos" / cfg.experiment / "chaos"
    summary = run(cfg)
    assert VLLMRolloutWorker.generate is real_generate, "the plugin patched the driver's VLLMRolloutWorker"
    killed = json.loads(marker.read_text())
    assert killed["victims"], f"no engine core among the rollout actor's processes: {killed['children']}"
    assert summary.steps_done == STEPS

    records = [json.loads(line) for line in (run_dir / "recoveries.jsonl").read_text().splitlines()]
    failure, done = records
    failed_step = failure["failed_step"]
    assert failure["kind"] == done["kind"] == "stage" and failed_step == done["rerun_step"] == 2
    assert failure["cause"].startswith("RolloutEngineDied")   # its message: "EngineCore was killed by signal 9"
    assert failure["dead_actors"] == [f"{cfg.experiment}/chaos/rollout+reward/0"]
    assert done["weights_verified"] == 1.0
    print(f"\n[chaos] vLLM engine: failure detected {failure['time'] - killed['at']:.2f}s after kill -9, "
          f"step {failed_step} running again {done['restart_s']:.1f}s after detection")
    ledger = [json.loads(line) for line in (run_dir / "ledger.jsonl").read_text().splitlines()]
    assert [r for r in ledger if "resume_from" in r] == [{"resume_from": 0, "reason": "start"}]  # no reload
    assert check_ledger(run_dir, _expected_order(cfg)) == []          # none lost, none repeated
    final = _final_weights(run_dir)
    assert final.keys() == reference.keys()
    assert all(torch.equal(final[k], reference[k]) for k in reference), "weights differ from the uninterrupted run"
    initial = load_file(str(Path(tiny_model_path) / "model.safetensors"))
    assert any(not torch.equal(final[k], initial[k]) for k in initial if k in final), "the run trained nothing"
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == list(range(1, STEPS + 1))
    assert metrics[failed_step - 1].get("recovery/stage_count") == 1.0


@pytest.mark.timeout(900)
def test_a_killed_colocated_policy_and_vllm_process_resumes_from_its_checkpoint(tmp_path, tiny_model_path,
                                                                                ray_local, data, reference):
    """The one process of a colocated rank (policy, vLLM engine, reward) is killed after step 1:
    the engine goes with it (its core runs in that process on the CPU build: no process of its own
    is left behind, none existed), the run resumes from the newest checkpoint with a new engine
    (weights loaded from the checkpoint, RNG restored) and ends with the uninterrupted run's weights."""
    import psutil
    import ray

    from raygraph.run.trainer import run

    cfg = _cfg(tmp_path, tiny_model_path, data, "colocated", "placement.mode=colocated", "trainer.save_every=1",
               "trainer.resume=auto")
    run_dir = tmp_path / cfg.experiment / "colocated"
    killed: dict = {}

    def kill_after_step_1():
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline and not killed:
            if 1 in effective_steps(run_dir):
                name = next(a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
                            if a["name"].startswith(f"{cfg.experiment}/colocated/") and "policy" in a["name"])
                pid = ray.get(ray.get_actor(name).__ray_call__.remote(lambda self: os.getpid()))
                killed.update(children=psutil.Process(pid).children(recursive=True), at=time.time())
                os.kill(pid, signal.SIGKILL)
            time.sleep(0.05)

    threading.Thread(target=kill_after_step_1, daemon=True).start()
    summary = run(cfg)
    assert killed and summary.steps_done == STEPS
    # the engine core ran in the killed process (rollout.vllm_engine_core=auto, CPU build, one rank)
    assert killed["children"] == []
    failure, resumed = [json.loads(line) for line in (run_dir / "recoveries.jsonl").read_text().splitlines()]
    assert failure["kind"] == "run" and failure["dead_actors"] == [f"{cfg.experiment}/colocated/policy+rollout+reward/0"]
    assert resumed["resumed_from"] == failure["failed_step"] - 1   # killed in a step or in its checkpoint save
    print(f"\n[chaos] colocated vLLM: failure detected {failure['time'] - killed['at']:.2f}s after kill -9, "
          f"training again {resumed['restart_s']:.1f}s after detection")
    assert check_ledger(run_dir, _expected_order(cfg)) == []
    final = _final_weights(run_dir)
    assert all(torch.equal(final[k], reference[k]) for k in reference), "weights differ from the uninterrupted run"
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == list(range(1, STEPS + 1))
