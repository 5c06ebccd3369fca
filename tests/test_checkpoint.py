"""Atomic checkpoints: a partial directory is never taken as the latest."""

import pytest

from raygraph.run import checkpoint


def test_complete_checkpoint_is_found_and_partial_is_not(tmp_path):
    with checkpoint.CheckpointWriter(tmp_path, 2, {"sampler": {"pos": 3}}) as ckpt:
        (ckpt.path / "policy").mkdir()
    assert checkpoint.latest(tmp_path).name == "step_2"
    assert checkpoint.read_trainer_state(checkpoint.latest(tmp_path)) == {"step": 2, "sampler": {"pos": 3}}
    # A crash while writing step 4 leaves step_4.partial without COMPLETE: still step 2.
    with pytest.raises(RuntimeError):
        with checkpoint.CheckpointWriter(tmp_path, 4, {}):
            raise RuntimeError("killed mid-save")
    (tmp_path / "checkpoints" / "step_5").mkdir()  # no COMPLETE marker
    assert checkpoint.latest(tmp_path).name == "step_2"
    assert not (tmp_path / "checkpoints" / "step_4.partial").exists()


def test_keep_last_prunes_old_checkpoints(tmp_path):
    for step in (1, 2, 3):
        with checkpoint.CheckpointWriter(tmp_path, step, {}, keep_last=2):
            pass
    assert [s for s, _ in checkpoint.list_complete(tmp_path)] == [2, 3]


def test_resolve_resume(tmp_path):
    assert checkpoint.resolve_resume("auto", tmp_path) is None
    assert checkpoint.resolve_resume("never", tmp_path) is None
    with checkpoint.CheckpointWriter(tmp_path, 7, {}):
        pass
    assert checkpoint.resolve_resume("auto", tmp_path).name == "step_7"
    assert checkpoint.resolve_resume(str(tmp_path), tmp_path / "other").name == "step_7"
    with pytest.raises(FileNotFoundError, match="COMPLETE"):
        checkpoint.resolve_resume(str(tmp_path / "nope"), tmp_path)
