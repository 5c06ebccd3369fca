"""Atomic checkpoints: a partial directory is never taken as the latest."""

import json
import logging
import re

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


def _write(run_dir, step: int, shard: bytes = b"\x00" * 4096, keep_last: int = 0):
    """A checkpoint shaped like a real one: a policy shard and a rollout state."""
    with checkpoint.CheckpointWriter(run_dir, step, {"sampler": {"pos": step}}, keep_last) as ckpt:
        (ckpt.path / "policy" / "dcp").mkdir(parents=True)
        (ckpt.path / "policy" / "dcp" / "__0_0.distcp").write_bytes(shard)
        (ckpt.path / "rollout" / "rank0").mkdir(parents=True)
        (ckpt.path / "rollout" / "rank0" / "rollout_state.safetensors").write_bytes(b"state" * 10)
    return ckpt.final


def _flip_a_bit(path, offset: int = 1000):
    raw = bytearray(path.read_bytes())
    raw[offset] ^= 0x01
    path.write_bytes(bytes(raw))


def test_every_file_is_checksummed_and_a_bit_flip_is_named(tmp_path):
    ckpt = _write(tmp_path, 3)
    manifest = json.loads((ckpt / checkpoint.MANIFEST).read_text())["files"]
    assert sorted(manifest) == ["policy/dcp/__0_0.distcp", "rollout/rank0/rollout_state.safetensors",
                                "trainer_state.json"]
    checkpoint.verify(ckpt)
    _flip_a_bit(ckpt / "policy" / "dcp" / "__0_0.distcp")
    with pytest.raises(checkpoint.CheckpointError, match=r"policy/dcp/__0_0.distcp does not match its checksum"):
        checkpoint.verify(ckpt)


def test_auto_resume_falls_back_past_a_damaged_newest_checkpoint_with_a_warning(tmp_path, caplog):
    _write(tmp_path, 2)
    newest = _write(tmp_path, 4)
    _flip_a_bit(newest / "policy" / "dcp" / "__0_0.distcp")
    with caplog.at_level(logging.WARNING, logger="raygraph"):
        chosen = checkpoint.resolve_resume("auto", tmp_path)
    assert chosen.name == "step_2" and checkpoint.read_trainer_state(chosen)["step"] == 2
    warning, = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert "step_4" in warning and "policy/dcp/__0_0.distcp" in warning and "resuming from step_2" in warning
    assert (tmp_path / "checkpoints" / "step_4.damaged").is_dir()  # kept for inspection, never taken again
    assert [s for s, _ in checkpoint.list_complete(tmp_path)] == [2]


def test_a_damaged_checkpoint_named_explicitly_is_an_error(tmp_path):
    _write(tmp_path, 2)
    newest = _write(tmp_path, 4)
    _flip_a_bit(newest / "policy" / "dcp" / "__0_0.distcp")
    with pytest.raises(checkpoint.CheckpointError, match="__0_0.distcp"):
        checkpoint.resolve_resume(str(newest), tmp_path / "other")
    assert newest.is_dir()  # an explicit choice is never moved aside


@pytest.mark.parametrize("damage, message", [
    (lambda c: (c / "policy/dcp/__0_0.distcp").write_bytes(b"\x00" * 100), "is 100 bytes, 4096 when written"),
    (lambda c: (c / "trainer_state.json").write_text('{"step": 4, "sam'), "trainer_state.json is"),
    (lambda c: (c / "rollout/rank0/rollout_state.safetensors").write_bytes(b""), "rollout_state.safetensors is 0"),
    (lambda c: (c / "policy/dcp/__0_0.distcp").unlink(), "__0_0.distcp is missing"),
    (lambda c: (c / checkpoint.MANIFEST).write_text("{"), "MANIFEST.json is damaged"),
])
def test_truncated_broken_or_empty_files_give_one_checkpoint_error(tmp_path, damage, message):
    ckpt = _write(tmp_path, 4)
    damage(ckpt)
    with pytest.raises(checkpoint.CheckpointError, match=re.escape(message)):
        checkpoint.resolve_resume(str(ckpt), tmp_path)
    with pytest.raises(checkpoint.CheckpointError, match="every checkpoint .* is damaged"):
        checkpoint.resolve_resume("auto", tmp_path)  # nothing to fall back to: an error, not a fresh start
    assert ckpt.is_dir()


def test_a_broken_trainer_state_is_a_checkpoint_error_not_a_json_error(tmp_path):
    (tmp_path / "trainer_state.json").write_text("")
    with pytest.raises(checkpoint.CheckpointError, match="cannot read trainer_state.json"):
        checkpoint.read_trainer_state(tmp_path)


def test_a_checkpoint_without_a_manifest_is_not_loaded_and_nothing_is_hashed(tmp_path, monkeypatch):
    """A checkpoint written before checksums (no MANIFEST.json, `extra_rank*.pt`) is refused before any
    file is read for a checksum; start a new run from its hf/ weights (docs/guarantees.md)."""
    def no_checksum(path):
        raise AssertionError(f"{path} was hashed")

    ckpt = _write(tmp_path, 3)
    (ckpt / "policy" / "extra_rank0.pt").write_bytes(b"\x80\x04 an old pickle")
    (ckpt / checkpoint.MANIFEST).unlink()
    monkeypatch.setattr(checkpoint, "_sha256", no_checksum)
    message = f"checkpoint {ckpt} has no MANIFEST.json (written by raygraph before checksums); it cannot be verified"
    with pytest.raises(checkpoint.CheckpointError) as info:
        checkpoint.resolve_resume(str(ckpt), tmp_path)
    assert str(info.value) == message
    with pytest.raises(checkpoint.CheckpointError) as info:
        checkpoint.resolve_resume("auto", tmp_path)   # the only checkpoint: an error, not a fresh start
    assert str(info.value).startswith(f"every checkpoint of {tmp_path} is damaged: {message}. To start again: ")
    assert ckpt.is_dir()
