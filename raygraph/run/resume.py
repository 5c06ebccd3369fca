"""Saving and resuming a run: which checkpoint, which settings may change, what is recorded.

    plan(cfg, run_dir)     before Ray starts: the checkpoint to resume (verified, see checkpoint.py),
                           and the settings that differ from the ones it was written with; a change
                           a resumed run would not honour is refused here (`ResumeError`)
    record(...)            `<run>/resumes.jsonl`: one line per resume, with its overrides
    restore(...)           after the roles exist: load every role, the sampler, the KL controller
    save(...)              one checkpoint (periodic, last step, stop)
    save_after_failure(...) on an exception, a checkpoint of the last step whose update finished

A resumed run keeps the model weights, optimizer state, lr schedule position, data order and
sampling RNG of its checkpoint, so only settings in `RESUMABLE` (cadence, length, logging,
checkpointing, timeouts) may change; the policy is stated in docs/guarantees.md.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from raygraph.config.role_kinds import kind_of
from raygraph.errors import BadConfig, CheckpointInvalid
from raygraph.run import checkpoint

__all__ = ["RESUMABLE", "ResumeError", "ResumePlan", "config_changes", "default_run_name", "plan", "record",
           "restore", "save", "save_after_failure"]

log = logging.getLogger("raygraph")

# Settings (a key, or a whole section) whose new value a resumed run honours. Anything else that
# differs from the checkpoint's config is refused: the checkpoint would silently win.
RESUMABLE = (
    "run_name", "experiment",            # a checkpoint given by path, resumed into a new run directory
    "trainer.total_steps",               # a decaying lr schedule stretches to the new length from here on
    "trainer.resume", "trainer.output_dir", "trainer.val_every", "trainer.val_before_train", "trainer.save_every",
    "trainer.dump_rollouts", "trainer.dump_rows", "trainer.executor", "trainer.profile",
    "trainer.ray_address", "trainer.stop_timeout_s", "trainer.max_restarts", "trainer.step_timeout_s",
    "trainer.warm_start",                # runs only before step 1: ignored by a resumed run
    "logging", "checkpoint",
    "placement.placement_timeout_s", "placement.weight_sync_timeout_s", "placement.weight_sync_verify",
    "placement.weight_sync_shared_memory",
)

RESUMES = "resumes.jsonl"


class ResumeError(CheckpointInvalid, ValueError):
    """A resume with settings the checkpoint would override."""


@dataclass
class ResumePlan:
    ckpt_dir: Path
    state: dict                            # trainer_state.json
    overrides: dict[str, tuple[Any, Any]]  # resumable settings changed: key -> (checkpoint's, now)

    @property
    def step(self) -> int:
        return int(self.state["step"])


def default_run_name(environ=os.environ) -> tuple[str, str]:
    """`run_name: null`: a name a scheduler's rerun of the same job gets again, so that
    `trainer.resume=auto` finds the checkpoints; a timestamp only outside a scheduler.

    Returns:
        (name, where it came from): `RAYGRAPH_RUN_NAME`; `slurm-<job id>` (a requeued Slurm job
        keeps its id; an array task: `slurm-<array job id>_<task id>`); else `run-<timestamp>`.
    """
    if environ.get("RAYGRAPH_RUN_NAME"):
        name = environ["RAYGRAPH_RUN_NAME"]
        if name in (".", "..") or "/" in name or "\\" in name:
            raise BadConfig(f"RAYGRAPH_RUN_NAME={name!r} must be a plain name (no '/', '\\', '.' or '..')")
        return name, "RAYGRAPH_RUN_NAME"
    if environ.get("SLURM_ARRAY_JOB_ID") and environ.get("SLURM_ARRAY_TASK_ID"):
        return f"slurm-{environ['SLURM_ARRAY_JOB_ID']}_{environ['SLURM_ARRAY_TASK_ID']}", "SLURM_ARRAY_JOB_ID"
    if environ.get("SLURM_JOB_ID"):
        return f"slurm-{environ['SLURM_JOB_ID']}", "SLURM_JOB_ID"
    return time.strftime("run-%Y%m%d-%H%M%S"), "the time (a rerun will not resume it: set run_name)"


def _flatten(tree: dict, prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in tree.items():
        if isinstance(value, dict) and value:
            out.update(_flatten(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def _resumable(key: str) -> bool:
    return any(key == r or key.startswith(r + ".") for r in RESUMABLE)


def config_changes(old: dict, new: dict) -> dict[str, tuple[Any, Any]]:
    """Settings that differ between two resolved configs (`model_dump(mode="json")`), by dotted key.
    Keys only one side has (a newer or older raygraph) are not compared; a section null on one side
    and set on the other (`model.lora: null` -> `{rank: 4, ...}`) is a change of that section."""
    old, new = _flatten(old), _flatten(new)
    changes = {k: (old[k], new[k]) for k in old.keys() & new.keys() if old[k] != new[k]}
    for section, values in _sections_set_on_one_side(new, old).items():
        changes[section] = (old[section], values)
    for section, values in _sections_set_on_one_side(old, new).items():
        changes[section] = (values, new[section])
    return dict(sorted(changes.items()))


def _sections_set_on_one_side(a: dict[str, Any], b: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """{section: its settings in `a`} for each section that `b` holds as one null (or empty) value."""
    found: dict[str, dict[str, Any]] = {}
    for key in a.keys() - b.keys():
        parts = key.split(".")
        prefixes = (".".join(parts[:i]) for i in range(1, len(parts)))
        section = next((p for p in prefixes if p in b), None)
        if section is not None and b[section] in (None, {}):
            found.setdefault(section, {})[key[len(section) + 1:]] = a[key]
    return found


def plan(cfg, run_dir: Path) -> ResumePlan | None:
    """The checkpoint `trainer.resume` names, checked against `cfg`; None to start from step 0.

    Raises:
        CheckpointError: the checkpoint is damaged (an explicit one, or every one of the run).
        ResumeError: a setting outside `RESUMABLE` differs from the checkpoint's; the message
            names each key with both values and says how to start a new run instead.
    """
    ckpt_dir = checkpoint.resolve_resume(cfg.trainer.resume, run_dir)
    if ckpt_dir is None:
        return None
    state = checkpoint.read_trainer_state(ckpt_dir)
    saved = state.get("config")
    if saved is None:
        log.warning("%s holds no config (an older raygraph): settings are not compared", ckpt_dir)
        return ResumePlan(ckpt_dir, state, {})
    changes = config_changes(saved, cfg.model_dump(mode="json"))
    refused = {k: v for k, v in changes.items() if not _resumable(k)}
    if refused:
        listed = "; ".join(f"{k}: {old!r} in the checkpoint, {new!r} now" for k, (old, new) in refused.items())
        tiny = "model.tiny=null " if cfg.model.tiny is not None else ""   # a tiny model's path is derived
        weights = (f"{tiny}model.path={ckpt_dir / 'hf'} (its weights, fresh optimizer state)" if (ckpt_dir / "hf").is_dir()
                   else "(this checkpoint has no hf/ weights: checkpoint.save_hf was false)")
        raise ResumeError(
            f"cannot resume {ckpt_dir} with changed settings ({listed}). A resumed run keeps the model, "
            f"optimizer, schedule, data order and sampling of its checkpoint, so these would not take "
            f"effect. Put the old values back to resume, or start a new run: run_name=<new name> "
            f"trainer.resume=never {weights}. Only cadence, length, logging, checkpointing and timeout "
            f"settings may change on resume (docs/guarantees.md, raygraph.run.resume.RESUMABLE)")
    return ResumePlan(ckpt_dir, state, changes)


def record(run_dir: Path, resumed: ResumePlan) -> None:
    """Append this resume to `<run_dir>/resumes.jsonl` (and say it in the log): the checkpoint, its
    step, the overrides, the damaged checkpoints set aside in this run so far, the command line."""
    set_aside = sorted(p.name for p in (Path(run_dir) / "checkpoints").glob("step_*.damaged"))
    entry = {"time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "checkpoint": str(resumed.ckpt_dir),
             "step": resumed.step, "overrides": {k: {"checkpoint": a, "now": b} for k, (a, b) in resumed.overrides.items()},
             "damaged_set_aside": set_aside, "command": sys.argv}
    with (Path(run_dir) / RESUMES).open("a") as f:
        f.write(json.dumps(entry, default=str) + "\n")
    if resumed.overrides:
        print("[raygraph] resume overrides: " + ", ".join(f"{k}={b!r} (was {a!r})"
                                                          for k, (a, b) in resumed.overrides.items()), flush=True)


def _role_state(roles, method: str, ckpt_dir: Path) -> None:
    """save_checkpoint / load_checkpoint on every stateful role, as its kind says
    (`raygraph.config.role_kinds`): a trained role's shards into `<ckpt>/<role>/` (every rank
    writes its own), a per-rank state (the rollout's sampling RNG) into `<ckpt>/<role>/rank<r>`."""
    for name in roles.names():
        if kind_of(name).checkpoint == "shards":
            roles[name].call(method, str(ckpt_dir / name))
    for name in roles.names():
        if kind_of(name).checkpoint == "ranks":
            group = roles[name]
            group.call_each(method, [(str(ckpt_dir / name / f"rank{r}"),) for r in range(group.world_size)])


def save(ctx, roles, step: int, data, kl_ctl, weight_version: int) -> None:
    """Write `<run>/checkpoints/step_<step>/` (atomic, checksummed; checkpoint.py)."""
    state = {"sampler": data.sampler.state_dict(), "kl_controller": kl_ctl.state_dict(),
             "weight_version": weight_version, "run_name": ctx.run_name, "config": ctx.resolved}
    with checkpoint.CheckpointWriter(ctx.run_dir, step, state, ctx.cfg.checkpoint.keep_last) as ckpt:
        _role_state(roles, "save_checkpoint", ckpt.path)
        if ctx.cfg.checkpoint.save_hf:
            roles.policy.call("save_pretrained", str(ckpt.path / "hf"))  # every FSDP rank gathers
    print(f"[raygraph] checkpoint written: {ckpt.final}", flush=True)


def restore(resumed: ResumePlan | None, roles, data, kl_ctl, seed: int) -> tuple[int, int]:
    """Load `resumed` into the roles, sampler and KL controller; returns (step, weight version).
    Without a checkpoint, seeds each rollout rank (`seed + rank`) and returns (0, 0).

    Raises:
        CheckpointError: a role could not load its part (named, with the cause).
    """
    if resumed is None:
        rollout = roles.rollout
        rollout.call_each("reseed", [(seed + r,) for r in range(rollout.world_size)])
        return 0, 0
    try:
        _role_state(roles, "load_checkpoint", resumed.ckpt_dir)
    except Exception as exc:  # a worker's CheckpointError arrives wrapped in a RayTaskError
        cause = getattr(exc, "cause", None) or exc
        raise checkpoint.CheckpointError(f"cannot load {resumed.ckpt_dir}: {cause}") from exc
    data.sampler.load_state_dict(resumed.state["sampler"])
    kl_ctl.load_state_dict(resumed.state["kl_controller"])
    version = int(resumed.state.get("weight_version", 0))
    roles.weights.sync_now(version=version)
    print(f"[raygraph] resumed from {resumed.ckpt_dir} (step {resumed.step})", flush=True)
    return resumed.step, version


def save_after_failure(ctx, roles, data, kl_ctl, weight_version: int, *, step: int | None, tracker,
                       metrics: dict | None) -> None:
    """On an exception: checkpoint `step`, the last step whose update, weight sync and KL update
    all finished with nothing of the next step started, unless a checkpoint of it exists; its
    training `metrics`, if the failure came before they were logged, go to metrics.jsonl first.
    Skipped, with the reason in the log, when no step is consistent (the failure came inside a
    step: a role may be half-updated). A failing save is logged, never raised over the original error.
    """
    newest = checkpoint.latest(ctx.run_dir)
    newest_name = newest.name if newest is not None else "none"
    if step is None or (newest is not None and checkpoint.read_trainer_state(newest)["step"] >= step):
        why = "it failed inside a step (a role may be half-updated)" if step is None else f"step {step} is saved"
        log.warning("run failed: no checkpoint written on the way out (%s); the newest is %s", why, newest_name)
        return
    log.warning("run failed after step %d finished: checkpointing it before exiting", step)
    try:
        if metrics is not None and tracker is not None:
            tracker.log(step, metrics, force=True)
        save(ctx, roles, step, data, kl_ctl, weight_version)
    except Exception as exc:
        log.warning("the checkpoint after the failure failed too (%s); the newest is %s", exc, newest_name)
