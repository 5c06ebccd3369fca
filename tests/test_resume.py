"""Resume policy: what may change on resume, what is refused (before anything is written), what is
recorded; run names a scheduler's rerun finds again; a checkpoint on the way out of a failure."""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path
from types import SimpleNamespace

import pytest
import yaml

from raygraph.config import load_config
from raygraph.run import checkpoint, resume
from raygraph.run.setup import prepare_run

TOY = Path(__file__).resolve().parents[1] / "configs" / "grpo_toy.yaml"


@pytest.fixture(scope="module")
def out(tmp_path_factory) -> Path:
    """The output directory of every run here (tiny model and toy data built once, inside it)."""
    return tmp_path_factory.mktemp("runs")


def _cfg(out: Path, *overrides: str, run_name: str = "r"):
    return load_config(TOY, [f"trainer.output_dir={out}", f"data.train_files=[{out / 'data' / 'train.parquet'}]",
                             f"data.val_files=[{out / 'data' / 'val.parquet'}]",
                             f"run_name={run_name}", "trainer.resume=auto", *overrides])


def _checkpoint(cfg, step: int) -> Path:
    run_dir = Path(cfg.trainer.output_dir) / cfg.experiment / cfg.run_name
    state = {"sampler": {}, "kl_controller": {}, "weight_version": step, "config": cfg.model_dump(mode="json")}
    with checkpoint.CheckpointWriter(run_dir, step, state) as ckpt:
        (ckpt.path / "policy").mkdir()
        (ckpt.path / "policy" / "shard").write_bytes(b"x" * 64)
    return ckpt.final


def test_a_changed_learning_rate_is_refused_naming_key_values_and_the_way_out(out):
    """Before: the run resumed with the checkpoint's lr while config.yaml claimed the new one."""
    ckpt = _checkpoint(_cfg(out, run_name="lr"), 4)
    run_dir = ckpt.parents[1]
    (run_dir / "config.yaml").write_text("the config the run was started with\n")
    with pytest.raises(resume.ResumeError) as info:
        prepare_run(_cfg(out, "actor.optim.lr=0.01", "rollout.n=8", "trainer.total_steps=9", run_name="lr"))
    message = str(info.value)
    assert "actor.optim.lr: 0.0001 in the checkpoint, 0.01 now" in message
    assert "rollout.n: 4 in the checkpoint, 8 now" in message
    assert "trainer.total_steps" not in message  # allowed
    assert "run_name=<new name> trainer.resume=never (this checkpoint has no hf/ weights" in message
    (ckpt / "hf").mkdir()
    with pytest.raises(resume.ResumeError, match=re.escape(f"trainer.resume=never model.tiny=null model.path={ckpt / 'hf'} (its")):
        prepare_run(_cfg(out, "actor.optim.lr=0.01", run_name="lr"))
    assert (run_dir / "config.yaml").read_text() == "the config the run was started with\n"  # untouched
    assert not (run_dir / resume.RESUMES).exists()


def test_allowed_changes_are_applied_and_every_resume_is_recorded(out):
    _checkpoint(_cfg(out, run_name="ok"), 4)
    ctx = prepare_run(_cfg(out, "trainer.total_steps=9", "trainer.val_every=3", "logging.mlflow=false", run_name="ok"))
    assert ctx.resume.step == 4 and ctx.resume.ckpt_dir.name == "step_4"
    assert load_config(ctx.run_dir / "config.yaml").trainer.total_steps == 9  # config.yaml says what runs
    prepare_run(_cfg(out, "trainer.total_steps=12", run_name="ok"))
    entries = [json.loads(line) for line in (ctx.run_dir / resume.RESUMES).read_text().splitlines()]
    assert [e["step"] for e in entries] == [4, 4]
    assert entries[0]["overrides"] == {"logging.mlflow": {"checkpoint": True, "now": False},
                                       "trainer.total_steps": {"checkpoint": 2, "now": 9},
                                       "trainer.val_every": {"checkpoint": 0, "now": 3}}
    assert entries[1]["overrides"] == {"trainer.total_steps": {"checkpoint": 2, "now": 12}}


def test_a_tiny_model_run_resumes_into_another_output_dir(out, tmp_path):
    """model.tiny's path is derived from trainer.output_dir (resumable), so it is not a changed setting:
    config.yaml and the checkpoint's config leave it out and it is derived again where the run goes."""
    first = prepare_run(_cfg(out, "logging.mlflow=false", run_name="moved"))
    assert "path" not in yaml.safe_load((first.run_dir / "config.yaml").read_text())["model"]
    ckpt = _checkpoint(first.cfg, 3)
    elsewhere = tmp_path / "elsewhere"
    ctx = prepare_run(_cfg(out, f"trainer.output_dir={elsewhere}", f"trainer.resume={ckpt}", "logging.mlflow=false",
                           run_name="moved"))
    assert ctx.resume.step == 3 and "model.path" not in ctx.resume.overrides
    assert ctx.cfg.model.path == str(elsewhere / "models" / "tiny-tiny")
    assert (elsewhere / "models" / "tiny-tiny" / "config.json").is_file()
    assert load_config(ctx.run_dir / "config.yaml") == ctx.cfg     # the resolved config loads back as it was


def test_keys_only_one_side_has_are_not_compared(out):
    """A checkpoint written by another raygraph version: a key it has that this one lacks, and one this
    one has that it lacks, are no change; a key both have is still compared."""
    assert resume.config_changes({"actor": {"lr": 1, "old_knob": 2}, "gone": {"x": 3}},
                                 {"actor": {"lr": 5, "new_knob": 4}, "added": 6}) == {"actor.lr": (1, 5)}
    cfg = _cfg(out, run_name="versions")
    saved = cfg.model_dump(mode="json")
    saved["actor"]["optim"]["retired_knob"] = 0.5   # only in the checkpoint's config
    del saved["rollout"]["top_k"]                   # only in the new one
    run_dir = Path(cfg.trainer.output_dir) / cfg.experiment / cfg.run_name
    with checkpoint.CheckpointWriter(run_dir, 2, {"sampler": {}, "kl_controller": {}, "config": saved}):
        pass
    plan = resume.plan(cfg, run_dir)
    assert plan.step == 2 and plan.overrides == {}


def test_every_resumable_key_names_a_setting():
    cfg = load_config(TOY).model_dump(mode="json")
    for key in resume.RESUMABLE:
        node = cfg
        for part in key.split("."):
            assert part in node, key
            node = node[part]


@pytest.mark.parametrize("environ, expected", [
    ({"RAYGRAPH_RUN_NAME": "nightly", "SLURM_JOB_ID": "7"}, ("nightly", "RAYGRAPH_RUN_NAME")),
    ({"SLURM_JOB_ID": "4242"}, ("slurm-4242", "SLURM_JOB_ID")),
    ({"SLURM_JOB_ID": "4243", "SLURM_ARRAY_JOB_ID": "4242", "SLURM_ARRAY_TASK_ID": "1"},
     ("slurm-4242_1", "SLURM_ARRAY_JOB_ID")),
])
def test_a_rerun_of_the_same_job_gets_the_same_run_name(environ, expected):
    assert resume.default_run_name(environ) == expected == resume.default_run_name(dict(environ))


def test_outside_a_scheduler_the_run_name_is_a_timestamp_and_a_bad_env_name_is_refused():
    name, source = resume.default_run_name({})
    assert re.fullmatch(r"run-\d{8}-\d{6}", name) and "set run_name" in source
    with pytest.raises(ValueError, match="plain name"):
        resume.default_run_name({"RAYGRAPH_RUN_NAME": "../elsewhere"})


def test_a_restarted_slurm_job_resumes_its_run(out, monkeypatch):
    monkeypatch.setenv("SLURM_JOB_ID", "99")
    monkeypatch.delenv("RAYGRAPH_RUN_NAME", raising=False)
    cfg = _cfg(out, run_name="null")
    first = prepare_run(cfg)
    assert first.run_name == "slurm-99" and first.resume is None
    state = {"sampler": {}, "kl_controller": {}, "config": cfg.model_dump(mode="json")}
    with checkpoint.CheckpointWriter(first.run_dir, 2, state):
        pass
    assert prepare_run(cfg).resume.step == 2  # the requeued job finds its checkpoint


class _Roles:
    def names(self):
        return []


def _failure_ctx(tmp_path):
    cfg = _cfg(tmp_path, "checkpoint.save_hf=false")  # prepare_run is not called: nothing is built
    return SimpleNamespace(cfg=cfg, run_dir=tmp_path / "run", run_name="r", resolved=cfg.model_dump(mode="json"))


def test_a_failure_after_a_finished_step_checkpoints_it_and_logs_its_metrics(tmp_path):
    ctx, logged = _failure_ctx(tmp_path), []
    data = SimpleNamespace(sampler=SimpleNamespace(state_dict=lambda: {"pos": 12}))
    kl_ctl = SimpleNamespace(state_dict=lambda: {"value": 0.1})
    tracker = SimpleNamespace(log=lambda step, metrics, force: logged.append((step, metrics)))
    resume.save_after_failure(ctx, _Roles(), data, kl_ctl, 3, step=3, tracker=tracker, metrics={"reward/mean": 1.0})
    state = checkpoint.read_trainer_state(checkpoint.latest(ctx.run_dir))
    assert state["step"] == 3 and state["sampler"] == {"pos": 12} and state["weight_version"] == 3
    assert logged == [(3, {"reward/mean": 1.0})]


def test_a_failure_inside_a_step_writes_no_checkpoint_and_says_why(tmp_path, caplog):
    ctx = _failure_ctx(tmp_path)
    with caplog.at_level(logging.WARNING, logger="raygraph"):
        resume.save_after_failure(ctx, _Roles(), None, None, 0, step=None, tracker=None, metrics=None)
    assert checkpoint.latest(ctx.run_dir) is None
    assert "failed inside a step (a role may be half-updated)" in caplog.text


def test_a_role_that_cannot_load_its_part_is_one_checkpoint_error(tmp_path):
    """A worker's error reaches the driver wrapped by Ray (a traceback text, the error as `cause`);
    the run stops with one CheckpointError naming the checkpoint and the worker's own cause."""
    class _RayTaskError(RuntimeError):   # what ray.get raises: its text is the remote traceback
        def __init__(self, cause):
            super().__init__("ray::PolicyWorker.load_checkpoint() (pid=7)\nTraceback (most recent call last): ...")
            self.cause = cause

    class _Group:
        def call(self, method, path):
            raise _RayTaskError(FileNotFoundError(f"{path}/extra_rank0.safetensors"))

    class _PolicyOnly:
        def names(self):
            return ["policy"]

        def __getitem__(self, name):
            return _Group()

    plan = resume.ResumePlan(tmp_path / "step_4", {"step": 4}, {})
    with pytest.raises(checkpoint.CheckpointError) as err:
        resume.restore(plan, _PolicyOnly(), None, None, seed=0)
    ckpt = tmp_path / "step_4"   # each role loads its own folder of the checkpoint
    assert str(err.value) == f"cannot load {ckpt}: {ckpt / 'policy' / 'extra_rank0.safetensors'}"


def test_toy_data_written_with_other_settings_is_refused_not_used(tmp_path, tiny_model_path):
    """Before: `make demo` after a grpo_toy run trained on grpo_toy's 60 problems (same folder)."""
    from raygraph.run.setup import ensure_assets

    data = tmp_path / "data"
    files = [f"data.train_files=[{data / 'train.parquet'}]", f"data.val_files=[{data / 'val.parquet'}]"]
    model = [f"model.path={tiny_model_path}", "model.tiny=null"]
    small = load_config(TOY, [f"trainer.output_dir={tmp_path}", *model, *files])
    ensure_assets(small)
    assert json.loads((data / "toy.json").read_text())["n_train"] == 60
    ensure_assets(small)   # the same settings: the files are used as they are
    larger = load_config(TOY, [f"trainer.output_dir={tmp_path}", *model, "data.toy.n_train=80", *files])
    with pytest.raises(ValueError, match=r"holds toy data written with data.toy=.*'n_train': 60.*delete"):
        ensure_assets(larger)


def test_a_section_turned_on_or_off_is_a_change_and_lora_on_a_full_model_checkpoint_is_refused(out):
    """`model.lora` null in the checkpoint and set now (or the reverse) is not a key one side lacks
    (a version difference) but a change of the section: LoRA on a full-model checkpoint is refused."""
    old = load_config(TOY, [f"trainer.output_dir={out}"]).model_dump(mode="json")
    lora = load_config(TOY, [f"trainer.output_dir={out}", "model.lora.rank=4"]).model_dump(mode="json")
    changes = resume.config_changes(old, lora)
    assert list(changes) == ["model.lora"] and changes["model.lora"][0] is None
    assert changes["model.lora"][1] == {"rank": 4, "alpha": 16.0, "dropout": 0.0, "target_modules": "all-linear"}
    assert resume.config_changes(lora, old) == {"model.lora": (changes["model.lora"][1], None)}
    cfg = _cfg(out, "model.lora.rank=4", run_name="lora_on")
    run_dir = Path(cfg.trainer.output_dir) / cfg.experiment / cfg.run_name
    saved = _cfg(out, run_name="lora_on").model_dump(mode="json")
    with checkpoint.CheckpointWriter(run_dir, 2, {"sampler": {}, "kl_controller": {}, "config": saved}):
        pass
    with pytest.raises(resume.ResumeError, match="model.lora"):
        resume.plan(cfg, run_dir)
