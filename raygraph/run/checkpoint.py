"""Atomic checkpoints: a checkpoint is complete, or it does not exist.

Layout of `<run_dir>/checkpoints/step_<N>/`::

    trainer_state.json    step, sampler position, KL controller, RNG seeds, weight version
    policy/               each role writes its own files (optimizer, scheduler, RNG, shards)
    critic/               (PPO)
    hf/                   the policy in Hugging Face format: `from_pretrained("…/hf")` works
    COMPLETE              written last, after everything above is on disk

Everything is first written to `step_<N>.partial/` and renamed into place when complete, so a run
killed while saving never leaves a directory that `latest()` would take.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path
from typing import Any

__all__ = ["CheckpointWriter", "latest", "list_complete", "read_trainer_state", "resolve_resume"]

_COMPLETE = "COMPLETE"
_STEP_DIR = re.compile(r"^step_(\d+)$")


def _root(run_dir: Path) -> Path:
    return Path(run_dir) / "checkpoints"


def list_complete(run_dir: Path) -> list[tuple[int, Path]]:
    """Complete checkpoints of a run as (step, path), oldest first."""
    root = _root(run_dir)
    if not root.is_dir():
        return []
    found = []
    for child in root.iterdir():
        match = _STEP_DIR.match(child.name)
        if match and (child / _COMPLETE).is_file():
            found.append((int(match.group(1)), child))
    return sorted(found)


def latest(run_dir: Path) -> Path | None:
    """The newest complete checkpoint, or None."""
    complete = list_complete(run_dir)
    return complete[-1][1] if complete else None


def read_trainer_state(ckpt_dir: Path) -> dict[str, Any]:
    return json.loads((Path(ckpt_dir) / "trainer_state.json").read_text())


def resolve_resume(resume: str, run_dir: Path) -> Path | None:
    """Turn `trainer.resume` (auto | never | a path) into a checkpoint directory or None."""
    if resume == "never":
        return None
    if resume == "auto":
        return latest(run_dir)
    path = Path(resume)
    if (path / _COMPLETE).is_file():
        return path
    nested = latest(path)  # a run directory was given
    if nested is not None:
        return nested
    raise FileNotFoundError(f"trainer.resume={resume!r} is neither a complete checkpoint nor a run "
                            f"directory with one (a complete checkpoint holds a {_COMPLETE} file)")


class CheckpointWriter:
    """Write one checkpoint: `with CheckpointWriter(run_dir, step) as ckpt: ...`.

    Inside the block, roles write into `ckpt.path / <role>`; on a clean exit the trainer state
    and the COMPLETE marker are written and the directory is renamed into place. On an exception
    the partial directory is removed.
    """

    def __init__(self, run_dir: Path, step: int, trainer_state: dict[str, Any], keep_last: int = 0):
        self.final = _root(run_dir) / f"step_{step}"
        self.path = self.final.with_name(f"step_{step}.partial")
        self.run_dir = Path(run_dir)
        self.state = {"step": step, **trainer_state}
        self.keep_last = keep_last

    def __enter__(self) -> CheckpointWriter:
        shutil.rmtree(self.path, ignore_errors=True)
        self.path.mkdir(parents=True)
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is not None:
            shutil.rmtree(self.path, ignore_errors=True)
            return
        (self.path / "trainer_state.json").write_text(json.dumps(self.state, indent=1, sort_keys=True))
        marker = self.path / _COMPLETE
        marker.write_text("ok\n")
        _fsync_dir(self.path)
        if self.final.exists():
            shutil.rmtree(self.final)
        os.replace(self.path, self.final)
        _fsync_dir(self.final.parent)
        self._prune()

    def _prune(self) -> None:
        if self.keep_last <= 0:
            return
        for _, old in list_complete(self.run_dir)[:-self.keep_last]:
            shutil.rmtree(old, ignore_errors=True)


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
