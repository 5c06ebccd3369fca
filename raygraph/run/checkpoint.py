"""Atomic checkpoints: a checkpoint is complete, or it does not exist.

Layout of `<run_dir>/checkpoints/step_<N>/`::

    trainer_state.json    step, sampler position, KL controller, RNG seeds, weight version
    policy/               each role writes its own files (optimizer, scheduler, RNG, shards)
    critic/               (PPO)
    hf/                   the policy in Hugging Face format: `from_pretrained("…/hf")` works
    MANIFEST.json         sha256 and size of every file above, written after them
    COMPLETE              written last, after everything above is on disk

Everything is first written to `step_<N>.partial/` and renamed into place when complete, so a run
killed while saving never leaves a directory that `latest()` would take. `verify()` checks every
file against the manifest before a resume (a bit flip, a truncated or missing file); with
`trainer.resume=auto` a damaged newest checkpoint is renamed `step_<N>.damaged` and the previous
complete one is taken, with a warning naming the file (docs/guarantees.md).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import shutil
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from raygraph.errors import MissingInput
from raygraph.workers.safe_load import CheckpointError

__all__ = ["CheckpointError", "CheckpointWriter", "latest", "list_complete", "read_trainer_state",
           "resolve_resume", "verify"]

log = logging.getLogger("raygraph")

_COMPLETE = "COMPLETE"
MANIFEST = "MANIFEST.json"
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
    """`trainer_state.json` of a checkpoint. Raises CheckpointError if it is missing or not JSON."""
    path = Path(ckpt_dir) / "trainer_state.json"
    try:
        state = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CheckpointError(f"checkpoint {ckpt_dir}: cannot read trainer_state.json ({exc})") from exc
    if not isinstance(state, dict) or not isinstance(state.get("step"), int):
        raise CheckpointError(f"checkpoint {ckpt_dir}: trainer_state.json holds no step")
    return state


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _sha256_all(paths: list[Path]) -> list[str]:
    """sha256 of each file, several at once (hashlib releases the GIL: shards hash in parallel)."""
    with ThreadPoolExecutor(max_workers=min(8, os.cpu_count() or 1)) as pool:
        return list(pool.map(_sha256, paths))


def _files(ckpt_dir: Path) -> list[str]:
    return sorted(p.relative_to(ckpt_dir).as_posix() for p in ckpt_dir.rglob("*")
                  if p.is_file() and p.name not in (MANIFEST, _COMPLETE))


def write_manifest(ckpt_dir: Path) -> None:
    """`MANIFEST.json`: `{"files": {relative path: {"sha256", "bytes"}}}` of every file in `ckpt_dir`."""
    ckpt_dir = Path(ckpt_dir)
    rels = _files(ckpt_dir)
    digests = _sha256_all([ckpt_dir / rel for rel in rels])
    files = {rel: {"sha256": digest, "bytes": (ckpt_dir / rel).stat().st_size} for rel, digest in zip(rels, digests)}
    (ckpt_dir / MANIFEST).write_text(json.dumps({"files": files}, indent=1, sort_keys=True))


def verify(ckpt_dir: Path) -> None:
    """Check every file of a checkpoint against its manifest, and that its trainer state reads.

    Raises:
        CheckpointError: naming the first file that is missing, truncated, changed or unexpected.
    """
    ckpt_dir = Path(ckpt_dir)
    try:
        listed = json.loads((ckpt_dir / MANIFEST).read_text())["files"]
    except FileNotFoundError:
        raise CheckpointError(f"checkpoint {ckpt_dir} has no {MANIFEST} (written by raygraph before "
                              f"checksums); it cannot be verified") from None
    except (OSError, UnicodeDecodeError, ValueError, KeyError, TypeError) as exc:
        raise CheckpointError(f"checkpoint {ckpt_dir}: {MANIFEST} is damaged ({exc})") from exc
    listed = dict(sorted(listed.items()))
    for rel, expected in listed.items():  # sizes first: cheap, and they name a truncated file
        path = ckpt_dir / rel
        if not path.is_file():
            raise CheckpointError(f"checkpoint {ckpt_dir}: {rel} is missing")
        size = path.stat().st_size
        if size != expected["bytes"]:
            raise CheckpointError(f"checkpoint {ckpt_dir}: {rel} is {size} bytes, {expected['bytes']} when "
                                  f"written (truncated or overwritten)")
    for (rel, expected), digest in zip(listed.items(), _sha256_all([ckpt_dir / rel for rel in listed])):
        if digest != expected["sha256"]:
            raise CheckpointError(f"checkpoint {ckpt_dir}: {rel} does not match its checksum (changed on disk)")
    extra = sorted(set(_files(ckpt_dir)) - set(listed))
    if extra:
        raise CheckpointError(f"checkpoint {ckpt_dir}: {extra[0]} was not written with it")
    read_trainer_state(ckpt_dir)


def resolve_resume(resume: str, run_dir: Path) -> Path | None:
    """Turn `trainer.resume` (auto | never | a path) into a verified checkpoint directory or None.

    `auto`: the newest complete checkpoint of `run_dir` that passes `verify`; a damaged one is
    renamed `step_<N>.damaged` (kept for inspection, never taken again) with a warning naming the
    file, and the previous one is tried. A path: that checkpoint (or the newest of that run
    directory), which must pass `verify`.

    Raises:
        CheckpointError: the checkpoint named by a path is damaged, or every checkpoint of the run is.
        FileNotFoundError: a path that holds no complete checkpoint.
    """
    if resume == "never":
        return None
    if resume == "auto":
        return _newest_intact(run_dir)
    path = Path(resume)
    if not (path / _COMPLETE).is_file():
        path = latest(path)  # a run directory was given
        if path is None:
            raise MissingInput(f"trainer.resume={resume!r} is neither a complete checkpoint nor a run "
                                    f"directory with one (a complete checkpoint holds a {_COMPLETE} file)")
    verify(path)
    return path


def _newest_intact(run_dir: Path) -> Path | None:
    damaged: list[tuple[Path, CheckpointError]] = []
    for _, ckpt in reversed(list_complete(run_dir)):
        try:
            verify(ckpt)
        except CheckpointError as exc:
            damaged.append((ckpt, exc))
            continue
        for bad, exc in damaged:  # set aside only once there is one to fall back to
            aside = bad.with_name(bad.name + ".damaged")
            shutil.rmtree(aside, ignore_errors=True)
            os.replace(bad, aside)
            log.warning("%s; moved it to %s and resuming from %s instead", exc, aside.name, ckpt.name)
        return ckpt
    if damaged:
        raise CheckpointError(f"every checkpoint of {run_dir} is damaged: {'; '.join(str(e) for _, e in damaged)}. "
                              f"To start again: trainer.resume=never (with a new run_name to keep this one)")
    return None


class CheckpointWriter:
    """Write one checkpoint: `with CheckpointWriter(run_dir, step) as ckpt: ...`.

    Inside the block, roles write into `ckpt.path / <role>`; on a clean exit the trainer state,
    the manifest (checksums of every file) and the COMPLETE marker are written and the directory is renamed into place. On an exception
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
        write_manifest(self.path)
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
