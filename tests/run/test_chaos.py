"""Chaos: kill -9 an actor of a short GRPO run at a step; the run recovers and finishes, the sample
ledger shows every prompt trained exactly once, and the final weights equal those of a run that
was never interrupted (checkpoints every step, sampling RNG checkpointed, CPU kernels
deterministic: the redone step is the same computation).

One uninterrupted reference run per layout (module fixture); each chaos run kills one actor."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from killer import Killer
from safetensors.torch import load_file

from raygraph.config import load_config
from raygraph.run.ledger import check_ledger

ROOT = Path(__file__).resolve().parents[2]
TOY = str(ROOT / "configs" / "grpo_toy.yaml")
STEPS = 4   # the faults come in steps 1-3; one step after the last shows the run goes on


@pytest.fixture(scope="module")
def toy_data(tmp_path_factory):
    from raygraph.data.toy import write_toy_dataset

    out = tmp_path_factory.mktemp("chaos_data")
    write_toy_dataset(out, n_train=40, n_val=8, seed=0)
    return out


def _cfg(tmp_path: Path, model: str, data: Path, run_name: str, *extra: str):
    return load_config(TOY, [f"model.path={model}", "model.tiny=null", f"run_name={run_name}",
                             f"data.train_files=[{data / 'train.parquet'}]", f"data.val_files=[{data / 'val.parquet'}]",
                             f"trainer.output_dir={tmp_path}", f"trainer.total_steps={STEPS}",
                             "trainer.save_every=1", "checkpoint.keep_last=0", "checkpoint.save_hf=true",
                             "logging.mlflow=false", "data.val_prompts=4", "trainer.resume=auto",
                             "trainer.max_restarts=2", *TRAINS, *extra])


# The tiny random model never answers a toy problem: every reward is 0, so GRPO alone leaves the
# weights as they were and "equal to the uninterrupted run" would hold for any samples. An
# entropy bonus gives every step a gradient that depends on the step's samples.
TRAINS = ("actor.entropy_coef=0.5", "actor.optim.lr=0.01")


def _trained(final: dict[str, torch.Tensor], model: str) -> bool:
    initial = load_file(str(Path(model) / "model.safetensors"))
    return any(not torch.equal(final[k], initial[k]) for k in initial if k in final)


def _final_weights(run_dir: Path) -> dict[str, torch.Tensor]:
    return load_file(str(run_dir / "checkpoints" / f"step_{STEPS}" / "hf" / "model.safetensors"))


def _expected_order(cfg) -> dict[int, list[str]]:
    """The data order the sampler gives this config, computed without Ray."""
    from raygraph.batch import UID
    from raygraph.run.feed import StepData

    data = StepData.load(cfg)
    return {s: list(data.next_prompts(step=s, kl_coef=0.0)[UID]) for s in range(1, STEPS + 1)}


def _recoveries(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "recoveries.jsonl").read_text().splitlines()]


LAYOUTS = {
    "colocated": [],
    "disaggregated_2_ranks": ["placement.mode=disaggregated", "placement.train_workers=2",
                              "placement.rollout_workers=1"],
    # two rollout+reward ranks: when one dies, the survivor sampled in the failed step too and
    # must be rewound to the step's sampling RNG for the rerun to equal the uninterrupted run
    "two_rollout_ranks": ["placement.mode=disaggregated", "placement.train_workers=1",
                          "placement.rollout_workers=2"],
    # a KL term, and the reference (unsharded) on a pool of its own: an actor of its own
    "own_reference": ["placement.mode=disaggregated", "actor.kl_loss_coef=0.1",
                      'placement.pools={"train": {"bundles": 1}, "rollout": {"bundles": 1}, "ref": {"bundles": 1}}',
                      'placement.roles={"policy": "train", "rollout": "rollout", "reward": "rollout", '
                      '"reference": "ref"}'],
}


@pytest.fixture(scope="module")
def reference(tmp_path_factory, tiny_model_path, toy_data, ray_local):
    """Final weights of uninterrupted runs, per layout."""
    from raygraph.run.trainer import run

    out = {}
    for layout, extra in LAYOUTS.items():
        tmp = tmp_path_factory.mktemp(f"ref_{layout}")
        # the last step is always checkpointed: no other checkpoint is needed here
        out[layout] = _final_weights(run(_cfg(tmp, tiny_model_path, toy_data, "ref", *extra,
                                              "trainer.save_every=0")).run_dir)
    return out


@pytest.mark.parametrize("layout, victim", [
    ("colocated", "policy+rollout"),        # the policy, rollout and reward process of rank 0
    ("disaggregated_2_ranks", "policy"),    # a policy rank of the 2-rank FSDP group (rank 0 by name order)
    ("colocated", "coordinator"),           # the actor that runs whole-batch steps
])
def test_a_killed_actor_is_recovered_and_nothing_is_lost(tmp_path, tiny_model_path, toy_data, ray_local,
                                                          reference, layout, victim, capsys, caplog):
    from raygraph.run.trainer import run

    cfg = _cfg(tmp_path, tiny_model_path, toy_data, "chaos", *LAYOUTS[layout])
    run_dir = tmp_path / cfg.experiment / "chaos"
    killer = Killer(run_dir, f"{cfg.experiment}/chaos/", victim, after_step=2)
    summary = run(cfg)
    assert killer.killed_at is not None, "the killer never fired"
    assert summary.steps_done == STEPS

    recoveries = _recoveries(run_dir)
    failure, resumed = recoveries[0], recoveries[1]
    assert failure["recovery"] == 1 and resumed["resumed_from"] in (1, 2)   # killed after step 2 trained
    detected_s = failure["time"] - killer.killed_at
    print(f"\n[chaos] {layout}/{killer.victim}: failure detected {detected_s:.2f}s after kill -9, "
          f"training again {resumed['restart_s']:.1f}s after detection")
    assert detected_s < 10
    # a dead rank's state is gone: no checkpoint is attempted on the way out, and the log says why
    assert "checkpointing it before exiting" not in caplog.text
    assert f"no checkpoint written on the way out ({killer.victim} died, and its state with it)" in caplog.text

    assert check_ledger(run_dir, _expected_order(cfg)) == []          # none lost, none repeated
    final = _final_weights(run_dir)
    ref = reference[layout]
    assert final.keys() == ref.keys()
    assert all(torch.equal(final[k], ref[k]) for k in ref), "weights differ from the uninterrupted run"
    assert _trained(final, tiny_model_path), "the run trained nothing: equal weights would prove nothing"
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == list(range(1, STEPS + 1))   # each step once
    assert any(m.get("recovery/count") == 1.0 for m in metrics) and all(m["actor/grad_norm"] > 0 for m in metrics)


SELF_KILLING_REWARD = '''
import json
import os
import signal
import time
from pathlib import Path

LEDGER, MARKER = Path({ledger!r}), Path({marker!r})


def die_in_step_3(response_text, ground_truth, extra_info):
    """Scores like toy_arith; the first call after step 2 is in the ledger kills its own process
    (the rollout+reward actor) with SIGKILL, in the middle of step 3's reward stage. One process
    only, also with several ranks (the marker is created exclusively)."""
    if not MARKER.exists() and LEDGER.is_file() and '"step": 2' in LEDGER.read_text():
        try:
            fd = os.open(MARKER, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
        except FileExistsError:   # another rank won
            return float(response_text.strip() == str(ground_truth))
        os.write(fd, json.dumps({{"killed_at": time.time(), "pid": os.getpid()}}).encode())
        os.close(fd)
        os.kill(os.getpid(), signal.SIGKILL)
    return float(response_text.strip() == str(ground_truth))
'''


@pytest.mark.parametrize("layout", ["disaggregated_2_ranks", "two_rollout_ranks"])
def test_a_killed_rollout_actor_is_restarted_alone_and_its_step_rerun(tmp_path, tiny_model_path, toy_data,
                                                                      ray_local, reference, layout):
    """Stage-level recovery: the rollout+reward process (stateless) dies inside step 3; only it is
    started again, gets the policy's weights and the step's sampling RNG, and step 3 runs again
    with no checkpoint loaded; the result equals the uninterrupted run bit for bit. With two
    rollout ranks, the surviving rank is rewound to the step's RNG too."""
    from raygraph.run.trainer import run

    run_dir = tmp_path / "grpo_toy" / "stage"
    plugin, marker = tmp_path / "self_killing_reward.py", tmp_path / "killed.json"
    plugin.write_text(SELF_KILLING_REWARD.format(ledger=str(run_dir / "ledger.jsonl"), marker=str(marker)))
    cfg = _cfg(tmp_path, tiny_model_path, toy_data, "stage", *LAYOUTS[layout],
               f"reward.function={plugin}:die_in_step_3")
    assert run_dir == tmp_path / cfg.experiment / "stage"
    summary = run(cfg)
    assert marker.is_file() and summary.steps_done == STEPS

    failure, done = _recoveries(run_dir)
    assert failure["kind"] == done["kind"] == "stage" and failure["failed_step"] == done["rerun_step"] == 3
    ranks = [f"{cfg.experiment}/stage/rollout+reward/{r}" for r in range(cfg.placement.rollout_workers)]
    assert len(failure["dead_actors"]) == 1 and failure["dead_actors"][0] in ranks and done["weights_verified"] == 1.0
    killed_at = json.loads(marker.read_text())["killed_at"]
    print(f"\n[chaos] stage-level: failure detected {failure['time'] - killed_at:.2f}s after kill -9, "
          f"step 3 running again {done['restart_s']:.1f}s after detection")
    assert failure["time"] - killed_at < 10
    ledger = [json.loads(line) for line in (run_dir / "ledger.jsonl").read_text().splitlines()]
    assert [r for r in ledger if "resume_from" in r] == [{"resume_from": 0, "reason": "start"}]  # no reload
    assert check_ledger(run_dir, _expected_order(cfg)) == []
    final, ref = _final_weights(run_dir), reference[layout]
    assert final.keys() == ref.keys()
    assert all(torch.equal(final[k], ref[k]) for k in ref), "weights differ from the uninterrupted run"
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == list(range(1, STEPS + 1))
    assert metrics[2].get("recovery/stage_count") == 1.0


def test_a_killed_reference_actor_is_restarted_alone(tmp_path, tiny_model_path, toy_data, ray_local, reference):
    """Stage-level recovery of a frozen model: the reference, on a pool of its own, is killed once
    step 2 is trained; the step that needs it next fails, only the reference is started again
    (same model, nothing to restore), the step runs again, and nothing is reloaded."""
    from raygraph.run.trainer import run

    cfg = _cfg(tmp_path, tiny_model_path, toy_data, "refkill", *LAYOUTS["own_reference"])
    run_dir = tmp_path / cfg.experiment / "refkill"
    killer = Killer(run_dir, f"{cfg.experiment}/refkill/", "reference", after_step=2)
    summary = run(cfg)
    assert killer.killed_at is not None and killer.victim == f"{cfg.experiment}/refkill/reference/0"
    assert summary.steps_done == STEPS
    failure, done = _recoveries(run_dir)
    assert failure["kind"] == done["kind"] == "stage" and failure["dead_actors"] == [killer.victim]
    print(f"\n[chaos] stage-level reference: failure detected {failure['time'] - killer.killed_at:.2f}s after "
          f"kill -9, step {done['rerun_step']} running again {done['restart_s']:.1f}s after detection")
    ledger = [json.loads(line) for line in (run_dir / "ledger.jsonl").read_text().splitlines()]
    assert [r for r in ledger if "resume_from" in r] == [{"resume_from": 0, "reason": "start"}]  # no reload
    assert check_ledger(run_dir, _expected_order(cfg)) == []
    final, ref = _final_weights(run_dir), reference["own_reference"]
    assert all(torch.equal(final[k], ref[k]) for k in ref), "weights differ from the uninterrupted run"
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == list(range(1, STEPS + 1)) and all(m["actor/kl_loss"] > 0 for m in metrics[1:])


HANGING_REWARD = '''
import time
from pathlib import Path

MARKER = Path({marker!r})


def hang_once(response_text, ground_truth, extra_info):
    """Scores like toy_arith, but the first call of the run never returns."""
    if not MARKER.exists():
        MARKER.write_text("hung")
        time.sleep(10_000)
    return float(response_text.strip() == str(ground_truth))
'''


def test_a_hanging_stage_is_named_by_the_watchdog_and_recovered(tmp_path, tiny_model_path, toy_data, ray_local,
                                                                reference, capsys):
    from raygraph.run.trainer import run

    plugin = tmp_path / "hanging_reward.py"
    plugin.write_text(HANGING_REWARD.format(marker=str(tmp_path / "hung.marker")))
    cfg = _cfg(tmp_path, tiny_model_path, toy_data, "hang", f"reward.function={plugin}:hang_once",
               "trainer.step_timeout_s=12")
    summary = run(cfg)
    assert summary.steps_done == STEPS
    run_dir = summary.run_dir
    failure = _recoveries(run_dir)[0]
    assert failure["failed_step"] in (0, 1) and failure["cause"] == "no result within 12.0s"
    assert "rank 0" in failure["where"] and failure["dead_actors"] == []   # hung, not dead
    assert check_ledger(run_dir, _expected_order(cfg)) == []
    final, ref = _final_weights(run_dir), reference["colocated"]   # hang_once scores as toy_arith does
    assert all(torch.equal(final[k], ref[k]) for k in ref), "weights differ from the uninterrupted run"
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == list(range(1, STEPS + 1))   # each step once
    print(f"\n[chaos] hang: {failure['where']}: {failure['cause']}")


# GRPO as the shipped workflow computes it (the same weights), with two faults a test can ask for:
# the first attempt's weight sync flips a byte after its checksum; a reward call after the policy
# update of the same step (its scores unused: the weights do not change).
FAULTY_WORKFLOW = '''
from pathlib import Path

from raygraph.batch import EXTRA_INFO
from raygraph.graph import InputNode, MultiOutputNode
from raygraph.graph.fragments import advantages, rollout_columns

ROLES = ("policy", "rollout", "reward")
ESTIMATORS = ("grpo",)
BUILT = Path({built!r})


def once_updated(update, rollouts):
    """The rollouts, each row's extra_info marked, once the update is done."""
    infos = rollouts[EXTRA_INFO] if EXTRA_INFO in rollouts else [None] * len(rollouts)
    return rollouts.with_columns(**{{EXTRA_INFO: [{{**(i or {{}}), "after_update": True}} for i in infos]}})


def nothing(scores):
    return {{}}


def build(roles, cfg, *, corrupt_first_sync: bool = False, score_after_update: bool = False):
    corrupt = corrupt_first_sync and not BUILT.exists()   # the first attempt's graph only
    BUILT.touch()
    with InputNode() as prompts:
        rollouts = roles.rollout.bind("generate", prompts)
        batch = advantages(roles, cfg, roles.gather(rollouts, *rollout_columns(roles, cfg, rollouts)), prompts)
        update = roles.policy.bind("update", batch)
        outputs = [roles.gather(update), roles.sync_weights(after=update, corrupt_bucket=0 if corrupt else None)]
        if score_after_update:
            late = roles.reward.bind("score", roles.apply(once_updated, roles.gather(update), rollouts))
            outputs.append(roles.apply(nothing, late))
        return MultiOutputNode(outputs)
'''

KILLED_AFTER_THE_UPDATE = '''
import os
import signal
from pathlib import Path

LEDGER, MARKER = Path({ledger!r}), Path({marker!r})


def die_after_the_update_of_step_3(response_text, ground_truth, extra_info):
    """Scores like toy_arith; in step 3, the first call of the reward stage that runs after the
    policy's update (its rows are marked) kills its own process, once."""
    late = bool(extra_info and extra_info.get("after_update"))
    if late and not MARKER.exists() and LEDGER.is_file() and '"step": 2' in LEDGER.read_text():
        MARKER.write_text("killed")
        os.kill(os.getpid(), signal.SIGKILL)
    return float(response_text.strip() == str(ground_truth))
'''


def _faulty_workflow(tmp_path: Path) -> str:
    path = tmp_path / "faulty_grpo.py"
    path.write_text(FAULTY_WORKFLOW.format(built=str(tmp_path / "built.marker")))
    return f"workflow={path}:build"


def test_a_failed_weight_sync_is_recovered_at_run_level(tmp_path, tiny_model_path, toy_data, ray_local, reference):
    """A bucket that fails verification in step 1's weight sync (a byte flipped in transit) is
    recoverable: the run is started again (no checkpoint yet), its syncs verify, and it ends
    equal to the uninterrupted run."""
    from raygraph.run.trainer import run

    cfg = _cfg(tmp_path, tiny_model_path, toy_data, "badsync", *LAYOUTS["disaggregated_2_ranks"],
               _faulty_workflow(tmp_path), "workflow_args.corrupt_first_sync=true")
    summary = run(cfg)
    assert summary.steps_done == STEPS
    failure, resumed = _recoveries(summary.run_dir)
    assert failure["kind"] == "run" and failure["failed_step"] == 1 and failure["cause"] == "WeightSyncError"
    assert "'weight_recv'" in failure["where"] and failure["dead_actors"] == []
    assert resumed["resumed_from"] == 0
    assert check_ledger(summary.run_dir, _expected_order(cfg)) == []
    final, ref = _final_weights(summary.run_dir), reference["disaggregated_2_ranks"]
    assert all(torch.equal(final[k], ref[k]) for k in ref), "weights differ from the uninterrupted run"
    metrics = [json.loads(line) for line in (summary.run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == list(range(1, STEPS + 1))
    assert all(m["weights/verified"] == 1.0 for m in metrics)


def test_a_stateless_actor_killed_after_the_update_goes_to_run_level(tmp_path, tiny_model_path, toy_data,
                                                                     ray_local, reference, capsys):
    """Never trained twice: the rollout+reward process (stateless) dies in step 3 after the policy
    updated; rerunning the step would update again, so the run resumes from step 2's checkpoint
    instead, and ends equal to the uninterrupted run (a stage-level rerun would not)."""
    from raygraph.run.trainer import run

    run_dir, marker = tmp_path / "grpo_toy" / "late", tmp_path / "killed.marker"
    plugin = tmp_path / "late_reward.py"
    plugin.write_text(KILLED_AFTER_THE_UPDATE.format(ledger=str(run_dir / "ledger.jsonl"), marker=str(marker)))
    cfg = _cfg(tmp_path, tiny_model_path, toy_data, "late", *LAYOUTS["disaggregated_2_ranks"],
               _faulty_workflow(tmp_path), "workflow_args.score_after_update=true",
               f"reward.function={plugin}:die_after_the_update_of_step_3")
    summary = run(cfg)
    assert marker.is_file() and summary.steps_done == STEPS
    assert "not recovering at stage level (a trained role already updated)" in capsys.readouterr().out
    failure, resumed = _recoveries(run_dir)
    assert failure["kind"] == "run" and failure["failed_step"] == 3 and resumed["resumed_from"] == 2
    assert check_ledger(run_dir, _expected_order(cfg)) == []
    final, ref = _final_weights(run_dir), reference["disaggregated_2_ranks"]
    assert all(torch.equal(final[k], ref[k]) for k in ref), "weights differ from the uninterrupted run"


def test_the_compiled_executor_recovers_a_killed_rollout_actor_at_run_level(tmp_path, tiny_model_path, toy_data,
                                                                            ray_local, reference):
    """A compiled graph is torn down with its actors, so stage-level recovery does not apply: the
    rollout+reward process killed inside step 3 is recovered at run level from step 2's checkpoint,
    and the run ends equal to the uninterrupted (interpreted) run."""
    from raygraph.run.trainer import run

    run_dir = tmp_path / "grpo_toy" / "compiled"
    plugin, marker = tmp_path / "self_killing_reward.py", tmp_path / "killed.json"
    plugin.write_text(SELF_KILLING_REWARD.format(ledger=str(run_dir / "ledger.jsonl"), marker=str(marker)))
    cfg = _cfg(tmp_path, tiny_model_path, toy_data, "compiled", *LAYOUTS["disaggregated_2_ranks"],
               "trainer.executor=compiled", f"reward.function={plugin}:die_in_step_3")
    summary = run(cfg)
    assert marker.is_file() and summary.steps_done == STEPS
    failure, resumed = _recoveries(run_dir)
    assert failure["kind"] == "run" and failure["failed_step"] == 3 and resumed["resumed_from"] == 2
    assert failure["dead_actors"] == [f"{cfg.experiment}/compiled/rollout+reward/0"]
    assert check_ledger(run_dir, _expected_order(cfg)) == []
    final, ref = _final_weights(run_dir), reference["disaggregated_2_ranks"]
    assert all(torch.equal(final[k], ref[k]) for k in ref), "weights differ from the uninterrupted run"


# Imported by every actor (trainer.plugins): the rollout's checkpoint save of step 2 kills its own
# process once, outside the step graph (after step 2's update and weight sync, during the save).
DIE_DURING_THE_SAVE = '''
import os
import signal
from pathlib import Path

from raygraph.workers.rollout_hf import HFRolloutWorker

MARKER = Path({marker!r})
_save = HFRolloutWorker.save_checkpoint


def _dying_save(self, path):
    if "step_2" in str(path) and not MARKER.exists():
        MARKER.write_text(str(path))
        os.kill(os.getpid(), signal.SIGKILL)
    return _save(self, path)


HFRolloutWorker.save_checkpoint = _dying_save
'''


def test_a_stateless_actor_killed_during_the_checkpoint_save_goes_to_run_level(tmp_path, tiny_model_path,
                                                                                toy_data, ray_local, reference,
                                                                                monkeypatch):
    """Outside the step graph there is no stage to rerun: the rollout+reward process (stateless)
    killed while step 2's checkpoint is written sends the run back to step 1's checkpoint (the
    half-written step 2 is never loaded), and it ends equal to the uninterrupted run."""
    from raygraph.run.trainer import run
    from raygraph.workers.rollout_hf import HFRolloutWorker

    # the driver imports the plugin too: the class gets its own method back after the test
    monkeypatch.setattr(HFRolloutWorker, "save_checkpoint", HFRolloutWorker.save_checkpoint)
    run_dir, marker = tmp_path / "grpo_toy" / "save", tmp_path / "killed.marker"
    plugin = tmp_path / "dying_save.py"
    plugin.write_text(DIE_DURING_THE_SAVE.format(marker=str(marker)))
    cfg = _cfg(tmp_path, tiny_model_path, toy_data, "save", *LAYOUTS["disaggregated_2_ranks"],
               f"plugins=[{plugin}]")
    summary = run(cfg)
    assert "step_2" in marker.read_text() and summary.steps_done == STEPS
    failure, resumed = _recoveries(run_dir)
    assert failure["kind"] == "run" and failure["failed_step"] == 2 and resumed["resumed_from"] == 1
    assert failure["dead_actors"] == [f"{cfg.experiment}/save/rollout+reward/0"]
    assert check_ledger(run_dir, _expected_order(cfg)) == []
    final, ref = _final_weights(run_dir), reference["disaggregated_2_ranks"]
    assert all(torch.equal(final[k], ref[k]) for k in ref), "weights differ from the uninterrupted run"
