"""Chaos: kill -9 actors of short GRPO runs, hang a stage, corrupt a weight sync; each run recovers
and finishes, its sample ledger shows every prompt trained exactly once, and its final weights
equal those of a run that was never interrupted (checkpoints every step, sampling RNG
checkpointed, CPU kernels deterministic: a redone step is the same computation).

A run start costs seconds of actor start-up while a toy step costs milliseconds, so the faults
share runs: one uninterrupted reference run per layout, and one run per layout that meets each of
its faults in turn, at steps of its own (module fixtures; each test checks one fault's records).
The colocated and the small disaggregated layout share their uninterrupted run (the same steps,
bit-equal wherever one policy and one rollout rank live):

- colocated (one process: its steps are fused into it and it starts no coordinator): a stage hangs
  in the first call (watchdog), the policy+rollout+reward process is killed once step 2 is trained;
- disaggregated, one policy and one rollout+reward process: step 1's weight sync fails its
  checksum, the rollout rank dies in step 2's checkpoint save, the coordinator is killed once
  step 3 is trained, and the rollout rank dies in step 5 after the policy updated (each a
  run-level recovery: the small layout restarts fastest);
- disaggregated, two policy ranks, two rollout+reward ranks and the reference on a pool of its
  own with a KL loss: a rollout rank kills itself in step 3's reward stage, reference rank 0 kills
  itself in its first call of step 4 (both stage level), policy rank 0 is killed once step 5 is
  trained;
- the compiled executor on the small disaggregated layout: the rollout rank kills itself in step 3."""

from __future__ import annotations

import contextlib
import io
import json
import logging
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from killer import Killer
from safetensors.torch import load_file

from raygraph.config import load_config
from raygraph.run.ledger import check_ledger

ROOT = Path(__file__).resolve().parents[2]
TOY = str(ROOT / "configs" / "grpo_toy.yaml")
STEPS = 6   # the last faults come in step 5; one step after them shows the run goes on


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
                             "trainer.max_restarts=6", *TRAINS, *extra])


# The tiny random model never answers a toy problem: every reward is 0, so GRPO alone leaves the
# weights as they were and "equal to the uninterrupted run" would hold for any samples. An
# entropy bonus gives every step a gradient that depends on the step's samples.
TRAINS = ("actor.entropy_coef=0.5", "actor.optim.lr=0.01")

LAYOUTS = {
    "colocated": [],
    "disaggregated": ["placement.mode=disaggregated"],
    # two FSDP policy ranks; two rollout+reward ranks (when one dies, the survivor sampled in the
    # failed step too and must be rewound to the step's sampling RNG for the rerun to equal the
    # uninterrupted run); a KL loss, and the reference on a pool of its own: actors of its own
    "disaggregated_2x2": ["placement.mode=disaggregated", "placement.train_workers=2", "placement.rollout_workers=2",
                      "actor.kl_loss_coef=0.1",
                      'placement.pools={"train": {"bundles": 2}, "rollout": {"bundles": 2}, "ref": {"bundles": 2}}',
                      'placement.roles={"policy": "train", "rollout": "rollout", "reward": "rollout", '
                      '"reference": "ref"}'],
}


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


def _recoveries(run_dir: Path) -> list[tuple[dict, dict]]:
    """(failure, outcome) records of each recovery, in order."""
    records = [json.loads(line) for line in (run_dir / "recoveries.jsonl").read_text().splitlines()]
    failures = [r for r in records if "failed_step" in r]
    outcomes = [r for r in records if "failed_step" not in r]
    assert [f["recovery"] for f in failures] == [o["recovery"] for o in outcomes], records
    return list(zip(failures, outcomes))


def _metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _resumes(run_dir: Path) -> list[int]:
    """The checkpoint step of each `resume_from` line of the ledger (0 for the start)."""
    ledger = [json.loads(line) for line in (run_dir / "ledger.jsonl").read_text().splitlines()]
    return [r["resume_from"] for r in ledger if "resume_from" in r]


@dataclass
class ChaosRun:
    """A finished chaos run and what the test's faults left behind."""

    cfg: object
    run_dir: Path
    steps_done: int
    recoveries: list[tuple[dict, dict]]
    killers: dict[str, Killer]
    markers: Path
    console: str
    log: str


def _run_capturing(cfg, run_dir: Path, markers: Path, killers: dict[str, Killer]) -> ChaosRun:
    """Run `cfg`, keeping its console output and log records (module fixtures have no capsys or
    caplog) and echoing them for `pytest -s`."""
    from raygraph.run.trainer import run

    log, out = io.StringIO(), io.StringIO()
    handler = logging.StreamHandler(log)
    handler.setLevel(logging.WARNING)
    logging.getLogger().addHandler(handler)
    try:
        with contextlib.redirect_stdout(out):
            summary = run(cfg)
    finally:
        logging.getLogger().removeHandler(handler)
        print(out.getvalue())
    return ChaosRun(cfg, run_dir, summary.steps_done, _recoveries(run_dir), killers, markers, out.getvalue(),
                    log.getvalue())


@pytest.fixture(scope="module")
def reference(tmp_path_factory, tiny_model_path, toy_data, ray_local):
    """Final weights of uninterrupted runs, per layout. One run serves the colocated and the small
    disaggregated layout: one policy rank and one rollout rank compute the same steps wherever they
    live (measured bit-equal; each chaos run of either layout is compared with it)."""
    from raygraph.run.trainer import run

    out = {}
    for layout in ("colocated", "disaggregated_2x2"):
        tmp = tmp_path_factory.mktemp(f"ref_{layout}")
        # the last step is always checkpointed: no other checkpoint is needed here
        out[layout] = _final_weights(run(_cfg(tmp, tiny_model_path, toy_data, "ref", *LAYOUTS[layout],
                                              "trainer.save_every=0")).run_dir)
    out["disaggregated"] = out["colocated"]
    return out


# Scores like toy_arith. Kills its own process (a rollout+reward rank) with SIGKILL, once each,
# in the first call of step `in_step` (the reward stage before the update) and, in step
# `after_update_in_step`, in the first call that scores rows marked as scored after the policy's
# update (FAULTY_WORKFLOW); 0: never. One rank only, also with several (each marker is created
# exclusively). The step in progress is the one after the newest step the ledger keeps.
DYING_REWARD = '''
import json
import os
import signal
import time
from pathlib import Path

from raygraph.run.ledger import effective_steps

RUN_DIR, MARKERS = Path({run_dir!r}), Path({markers!r})


def _die_once(name):
    try:
        fd = os.open(MARKERS / name, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
    except FileExistsError:   # done before, or another rank won
        return
    os.write(fd, json.dumps({{"killed_at": time.time(), "pid": os.getpid()}}).encode())
    os.close(fd)
    os.kill(os.getpid(), signal.SIGKILL)


def dying_reward(response_text, ground_truth, extra_info):
    step = max(effective_steps(RUN_DIR), default=0) + 1
    late = bool(extra_info and extra_info.get("after_update"))
    if step == {in_step} and not late:
        _die_once("in_step_{in_step}.json")
    if step == {after_update_in_step} and late:
        _die_once("after_the_update_of_step_{after_update_in_step}.json")
    return float(response_text.strip() == str(ground_truth))
'''

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

# GRPO as the shipped workflow computes it (the same weights), with two faults a test can ask for:
# the first attempt's weight sync flips a byte after its checksum; a reward call after the policy
# update of each step (its scores unused: the weights do not change).
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

# Imported by every actor (trainer.plugins): a rollout rank's checkpoint save of step 2 kills its
# own process once, outside the step graph (after step 2's update and weight sync, during the save).
DIE_DURING_THE_SAVE = '''
import os
import signal
from pathlib import Path

import ray

from raygraph.workers.rollout_hf import HFRolloutWorker

MARKER = Path({marker!r})
_save = HFRolloutWorker.save_checkpoint


def _dying_save(self, path):
    if "step_2" in str(path):
        try:
            os.close(os.open(MARKER, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
        except FileExistsError:   # done before, or another rank won
            return _save(self, path)
        MARKER.write_text(str(path))
        os.kill(os.getpid(), signal.SIGKILL)
    return _save(self, path)


if ray.is_initialized() and ray.get_runtime_context().get_actor_id():   # in the actors, not in the driver
    HFRolloutWorker.save_checkpoint = _dying_save   # (which imports plugins too, and runs later tests)
'''


# Imported by every actor (trainer.plugins): reference rank 0 kills its own process (kill -9) in
# its first call once step 3 is in the ledger, i.e. in step 4 before the policy's update, so the
# step can run again at stage level. A kill from the test's process raced the step: it waited for
# the actor's pid behind that very call and landed after the update (then at run level).
REFERENCE_DIES_IN_STEP_4 = '''
import json
import os
import signal
import time
from pathlib import Path

import ray

from raygraph.run.ledger import effective_steps
from raygraph.workers.reference import ReferenceWorker

RUN_DIR, MARKER = Path({run_dir!r}), Path({marker!r})
_logprobs = ReferenceWorker.logprobs


def _dying_logprobs(self, batch):
    name = ray.get_runtime_context().get_actor_name() or ""
    if name.endswith("/reference/0") and 3 in effective_steps(RUN_DIR) and not MARKER.exists():
        MARKER.write_text(json.dumps({{"killed_at": time.time(), "actor": name}}))
        os.kill(os.getpid(), signal.SIGKILL)
    return _logprobs(self, batch)


if ray.is_initialized() and ray.get_runtime_context().get_actor_id():   # in the actors, not in the driver
    ReferenceWorker.logprobs = _dying_logprobs
'''


def _dying_reward(tmp: Path, run_dir: Path, *, in_step: int, after_update_in_step: int) -> str:
    """The `reward.function` override of a DYING_REWARD written for `run_dir` (markers in `tmp`)."""
    reward = tmp / "dying_reward.py"
    reward.write_text(DYING_REWARD.format(run_dir=str(run_dir), markers=str(tmp), in_step=in_step,
                                          after_update_in_step=after_update_in_step))
    return f"reward.function={reward}:dying_reward"


@pytest.fixture(scope="module")
def colocated_chaos(tmp_path_factory, tiny_model_path, toy_data, ray_local) -> ChaosRun:
    tmp = tmp_path_factory.mktemp("chaos_colocated")
    plugin = tmp / "hanging_reward.py"
    plugin.write_text(HANGING_REWARD.format(marker=str(tmp / "hung.marker")))
    cfg = _cfg(tmp, tiny_model_path, toy_data, "chaos", f"reward.function={plugin}:hang_once",
               "trainer.step_timeout_s=12")
    run_dir = tmp / cfg.experiment / "chaos"
    prefix = f"{cfg.experiment}/chaos/"
    killers = {"policy+rollout": Killer(run_dir, prefix, "policy+rollout", after_step=2)}
    return _run_capturing(cfg, run_dir, tmp, killers)


@pytest.fixture(scope="module")
def disaggregated_chaos(tmp_path_factory, tiny_model_path, toy_data, ray_local) -> ChaosRun:

    tmp = tmp_path_factory.mktemp("chaos_disaggregated")
    run_dir = tmp / "grpo_toy" / "chaos"
    workflow, save = tmp / "faulty_grpo.py", tmp / "dying_save.py"
    workflow.write_text(FAULTY_WORKFLOW.format(built=str(tmp / "built.marker")))
    save.write_text(DIE_DURING_THE_SAVE.format(marker=str(tmp / "in_the_save_of_step_2")))
    cfg = _cfg(tmp, tiny_model_path, toy_data, "chaos", *LAYOUTS["disaggregated"],
               f"workflow={workflow}:build", "workflow_args.corrupt_first_sync=true",
               "workflow_args.score_after_update=true",
               _dying_reward(tmp, run_dir, in_step=0, after_update_in_step=5), f"plugins=[{save}]")
    assert run_dir == tmp / cfg.experiment / "chaos"
    killers = {"coordinator": Killer(run_dir, f"{cfg.experiment}/chaos/", "coordinator", after_step=3)}
    return _run_capturing(cfg, run_dir, tmp, killers)


@pytest.fixture(scope="module", autouse=True)
def _drivers_rollout_class_left_alone():
    """The save- and reference-killing plugins patch their classes in the actors only: the driver (this pytest
    worker, which imports a run's plugins too) runs later modules, whose tests must see the real one."""
    from raygraph.workers.reference import ReferenceWorker
    from raygraph.workers.rollout_hf import HFRolloutWorker

    real, real_reference = HFRolloutWorker.save_checkpoint, ReferenceWorker.logprobs
    yield
    assert HFRolloutWorker.save_checkpoint is real, "a chaos plugin patched the driver's HFRolloutWorker"
    assert ReferenceWorker.logprobs is real_reference, "a chaos plugin patched the driver's ReferenceWorker"


@pytest.fixture(scope="module")
def disaggregated_2x2_chaos(tmp_path_factory, tiny_model_path, toy_data, ray_local) -> ChaosRun:
    tmp = tmp_path_factory.mktemp("chaos_disaggregated_2x2")
    run_dir = tmp / "grpo_toy" / "chaos"
    dying_reference = tmp / "dying_reference.py"
    dying_reference.write_text(REFERENCE_DIES_IN_STEP_4.format(run_dir=str(run_dir),
                                                               marker=str(tmp / "reference_killed.json")))
    cfg = _cfg(tmp, tiny_model_path, toy_data, "chaos", *LAYOUTS["disaggregated_2x2"],
               _dying_reward(tmp, run_dir, in_step=3, after_update_in_step=0), f"plugins=[{dying_reference}]")
    killers = {"policy": Killer(run_dir, f"{cfg.experiment}/chaos/", "policy", after_step=5)}
    return _run_capturing(cfg, run_dir, tmp, killers)


@pytest.fixture(scope="module")
def compiled_chaos(tmp_path_factory, tiny_model_path, toy_data, ray_local) -> ChaosRun:
    tmp = tmp_path_factory.mktemp("chaos_compiled")
    run_dir = tmp / "grpo_toy" / "compiled"
    cfg = _cfg(tmp, tiny_model_path, toy_data, "compiled", *LAYOUTS["disaggregated"],
               "trainer.executor=compiled", _dying_reward(tmp, run_dir, in_step=3, after_update_in_step=0))
    return _run_capturing(cfg, run_dir, tmp, {})


CHAOS_RUNS = {"colocated": "colocated_chaos", "disaggregated": "disaggregated_chaos",
              "disaggregated_2x2": "disaggregated_2x2_chaos", "compiled": "compiled_chaos"}
# the kind of each recovery, in order (the faults of each run are listed in the module docstring)
KINDS = {"colocated": ["run", "run"], "disaggregated": ["run", "run", "run", "run"],
         "disaggregated_2x2": ["stage", "stage", "run"], "compiled": ["run"]}


@pytest.mark.parametrize("layout", CHAOS_RUNS)
def test_each_chaos_run_trains_each_prompt_once_and_ends_equal_to_the_uninterrupted_run(request, reference,
                                                                                          tiny_model_path, layout):
    chaos: ChaosRun = request.getfixturevalue(CHAOS_RUNS[layout])
    assert chaos.steps_done == STEPS
    assert [done["kind"] for _, done in chaos.recoveries] == KINDS[layout]
    assert check_ledger(chaos.run_dir, _expected_order(chaos.cfg)) == []          # none lost, none repeated
    final = _final_weights(chaos.run_dir)
    ref = reference["disaggregated" if layout == "compiled" else layout]
    assert final.keys() == ref.keys()
    assert all(torch.equal(final[k], ref[k]) for k in ref), "weights differ from the uninterrupted run"
    assert _trained(final, tiny_model_path), "the run trained nothing: equal weights would prove nothing"
    metrics = _metrics(chaos.run_dir)
    assert [m["step"] for m in metrics] == list(range(1, STEPS + 1))   # each step once
    assert all(m["actor/grad_norm"] > 0 for m in metrics)
    # a stage-level recovery loads no checkpoint: the ledger's resumes are the run-level ones
    run_level = [done["resumed_from"] for _, done in chaos.recoveries if done["kind"] == "run"]
    assert _resumes(chaos.run_dir) == [0, *run_level]
    counts = [m["recovery/count"] for m in metrics if "recovery/count" in m]
    assert counts == sorted(counts) and counts[-1] == len(chaos.recoveries)


@pytest.mark.ray   # its runs come from `request.getfixturevalue`, which the automatic `ray` mark cannot see
@pytest.mark.parametrize("layout, victim, n", [
    ("colocated", "policy+rollout", 2),    # the policy, rollout and reward process of rank 0
    ("disaggregated_2x2", "policy", 3),    # a policy rank of the 2-rank FSDP group (rank 0 by name order)
    ("disaggregated", "coordinator", 3),   # the actor that runs whole-batch steps
])
def test_a_killed_actor_is_recovered_and_nothing_is_lost(request, layout, victim, n):
    chaos: ChaosRun = request.getfixturevalue(CHAOS_RUNS[layout])
    killer = chaos.killers[victim]
    assert killer.killed_at is not None, "the killer never fired"
    failure, resumed = chaos.recoveries[n - 1]
    after = killer.after
    assert failure["kind"] == resumed["kind"] == "run" and resumed["resumed_from"] in (after - 1, after)
    assert failure["dead_actors"] == [killer.victim]
    detected_s = failure["time"] - killer.killed_at
    print(f"\n[chaos] {layout}/{killer.victim}: failure detected {detected_s:.2f}s after kill -9, "
          f"training again {resumed['restart_s']:.1f}s after detection")
    assert detected_s < 10
    # a dead rank's state is gone: no checkpoint is attempted on the way out, and the log says why
    assert "checkpointing it before exiting" not in chaos.log
    assert f"no checkpoint written on the way out ({killer.victim} died, and its state with it)" in chaos.log
    metrics = _metrics(chaos.run_dir)
    assert any(m.get("recovery/count") == n for m in metrics)


def test_a_killed_rollout_actor_is_restarted_alone_and_its_step_rerun(disaggregated_2x2_chaos):
    """Stage-level recovery: a rollout+reward rank (stateless) dies inside step 3; only it is
    started again, gets the policy's weights and the step's sampling RNG, and step 3 runs again
    with no checkpoint loaded (the whole-run test: the result equals the uninterrupted run bit
    for bit). The surviving rollout rank, which sampled in step 3 too, is rewound to the step's
    RNG."""
    chaos = disaggregated_2x2_chaos
    failure, done = chaos.recoveries[0]
    assert failure["kind"] == done["kind"] == "stage" and failure["failed_step"] == done["rerun_step"] == 3
    ranks = [f"{chaos.cfg.experiment}/chaos/rollout+reward/{r}" for r in range(chaos.cfg.placement.rollout_workers)]
    assert len(ranks) == 2 and len(failure["dead_actors"]) == 1 and failure["dead_actors"][0] in ranks
    assert done["weights_verified"] == 1.0 and done["redone_steps"] == 0
    killed_at = json.loads((chaos.markers / "in_step_3.json").read_text())["killed_at"]
    print(f"\n[chaos] stage-level: failure detected {failure['time'] - killed_at:.2f}s after kill -9, "
          f"step 3 running again {done['restart_s']:.1f}s after detection")
    assert failure["time"] - killed_at < 10
    assert _metrics(chaos.run_dir)[2].get("recovery/stage_count") == 1.0


def test_a_killed_reference_actor_is_restarted_alone(disaggregated_2x2_chaos):
    """Stage-level recovery of a frozen model: reference rank 0, on a pool of its own, is killed
    (kill -9) in its first call of step 4; the step fails, only the reference is started again
    (same model, nothing to restore), the step runs again, and nothing is reloaded."""
    chaos = disaggregated_2x2_chaos
    killed = json.loads((chaos.markers / "reference_killed.json").read_text())
    assert killed["actor"] == f"{chaos.cfg.experiment}/chaos/reference/0"
    failure, done = chaos.recoveries[1]
    assert failure["kind"] == done["kind"] == "stage" and failure["dead_actors"] == [killed["actor"]]
    assert failure["failed_step"] == done["rerun_step"] == 4
    print(f"\n[chaos] stage-level reference: failure detected {failure['time'] - killed['killed_at']:.2f}s after "
          f"kill -9, step {done['rerun_step']} running again {done['restart_s']:.1f}s after detection")
    metrics = _metrics(chaos.run_dir)
    assert all(m["actor/kl_loss"] > 0 for m in metrics[1:])
    assert metrics[3].get("recovery/stage_count") == 2.0


def test_a_hanging_stage_is_named_by_the_watchdog_and_recovered(colocated_chaos):
    failure, resumed = colocated_chaos.recoveries[0]
    assert failure["failed_step"] in (0, 1) and failure["cause"] == "no result within 12.0s"
    assert "rank 0" in failure["where"] and failure["dead_actors"] == []   # hung, not dead
    assert resumed["kind"] == "run" and resumed["resumed_from"] == 0
    print(f"\n[chaos] hang: {failure['where']}: {failure['cause']}")


def test_a_failed_weight_sync_is_recovered_at_run_level(disaggregated_chaos):
    """A bucket that fails verification in step 1's weight sync (a byte flipped in transit) is
    recoverable: the run is started again (no checkpoint yet), and its syncs verify."""
    failure, resumed = disaggregated_chaos.recoveries[0]
    assert failure["kind"] == "run" and failure["failed_step"] == 1 and failure["cause"] == "WeightSyncError"
    assert "'weight_recv'" in failure["where"] and failure["dead_actors"] == []
    assert resumed["resumed_from"] == 0
    assert all(m["weights/verified"] == 1.0 for m in _metrics(disaggregated_chaos.run_dir))


def test_a_stateless_actor_killed_during_the_checkpoint_save_goes_to_run_level(disaggregated_chaos):
    """Outside the step graph there is no stage to rerun: the rollout+reward process (stateless)
    killed while step 2's checkpoint is written sends the run back to step 1's checkpoint (the
    half-written step 2 is never loaded)."""
    chaos = disaggregated_chaos
    assert "step_2" in (chaos.markers / "in_the_save_of_step_2").read_text()
    failure, resumed = chaos.recoveries[1]
    assert failure["kind"] == "run" and failure["failed_step"] == 2 and resumed["resumed_from"] == 1
    assert failure["dead_actors"] == [f"{chaos.cfg.experiment}/chaos/rollout+reward/0"]


def test_a_stateless_actor_killed_after_the_update_goes_to_run_level(disaggregated_chaos):
    """Never trained twice: the rollout+reward process (stateless) dies in step 5 after the policy
    updated; rerunning the step would update again, so the run resumes from step 4's checkpoint
    instead (a stage-level rerun would not end equal to the uninterrupted run)."""
    chaos = disaggregated_chaos
    assert (chaos.markers / "after_the_update_of_step_5.json").is_file()
    assert "step 5: not recovering at stage level (a trained role already updated)" in chaos.console
    failure, resumed = chaos.recoveries[3]
    assert failure["kind"] == "run" and failure["failed_step"] == 5 and resumed["resumed_from"] == 4


def test_the_compiled_executor_recovers_a_killed_rollout_actor_at_run_level(compiled_chaos):
    """A compiled graph is torn down with its actors, so stage-level recovery does not apply: the
    rollout+reward process killed inside step 3 is recovered at run level from step 2's checkpoint
    (the whole-run test: it ends equal to the uninterrupted, interpreted run)."""
    (failure, resumed), = compiled_chaos.recoveries
    assert failure["kind"] == "run" and failure["failed_step"] == 3 and resumed["resumed_from"] == 2
    assert failure["dead_actors"] == [f"{compiled_chaos.cfg.experiment}/compiled/rollout+reward/0"]
