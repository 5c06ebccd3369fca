"""Training-state checkpoints load without unpickling: a planted payload is refused, never run."""

from __future__ import annotations

import io
import pickle
import random

import numpy as np
import pytest
import torch
from torch import nn

from raygraph.workers.optim import build_optimizer, build_scheduler
from raygraph.workers.safe_load import CheckpointError, _safe_planner
from raygraph.workers.train_state import load_train_state, save_train_state


class _Payload:
    """Unpickling this creates `marker` (stands in for arbitrary code)."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return open, (self.marker, "w")


def _trained(seed: int = 0):
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 2))
    optimizer = build_optimizer(model, lr=0.1, weight_decay=0.01, betas=(0.9, 0.99))
    scheduler = build_scheduler(optimizer, warmup_steps=2, total_steps=10, lr_schedule="cosine", min_lr_ratio=0.1)
    for _ in range(3):
        model(torch.randn(5, 4)).pow(2).mean().backward()
        optimizer.step()
        optimizer.zero_grad()
        scheduler.step()
    return model, optimizer, scheduler


def test_round_trip_restores_everything_without_unpickling(tmp_path, monkeypatch):
    model, optimizer, scheduler = _trained()
    random.seed(3), np.random.seed(4), torch.manual_seed(5)
    save_train_state(tmp_path, model, optimizer, scheduler)
    draws = (random.random(), float(np.random.rand()), float(torch.rand(1)))
    assert not list(tmp_path.rglob("*.pt"))  # scheduler + RNG: safetensors with JSON metadata

    def refuse(*args, **kwargs):
        raise AssertionError("a checkpoint was unpickled")

    real_torch_load = torch.load

    def weights_only_load(*args, **kwargs):
        assert kwargs.get("weights_only") is True, "torch.load without weights_only=True"
        return real_torch_load(*args, **kwargs)

    monkeypatch.setattr(pickle, "load", refuse)
    monkeypatch.setattr(pickle, "loads", refuse)
    monkeypatch.setattr(torch, "load", weights_only_load)
    fresh, fresh_opt, fresh_sched = _trained(seed=1)
    load_train_state(tmp_path, fresh, fresh_opt, fresh_sched)
    for a, b in zip(model.state_dict().values(), fresh.state_dict().values(), strict=True):
        assert torch.equal(a, b)
    assert fresh_sched.state_dict()["last_epoch"] == 3 and fresh_sched.get_last_lr() == scheduler.get_last_lr()
    assert fresh_opt.param_groups[0]["lr"] == optimizer.param_groups[0]["lr"]
    for p in model.parameters():
        assert torch.equal(optimizer.state[p]["exp_avg"], fresh_opt.state[dict(zip(model.parameters(),
                                                                               fresh.parameters()))[p]]["exp_avg"])
    assert (random.random(), float(np.random.rand()), float(torch.rand(1))) == draws  # RNG restored


_ENUM_PICKLES = {"by_name": lambda self, proto: (getattr, (type(self), self.name)),   # Python 3.11.2
                 "by_value": lambda self, proto: (type(self), (self.value,))}        # Python 3.11.7


@pytest.mark.parametrize("form", sorted(_ENUM_PICKLES))
def test_a_checkpoint_loads_whichever_way_its_python_pickled_enum_members(tmp_path, monkeypatch, form):
    """Python 3.11.2 (Debian 12's) pickles an enum member as `getattr(cls, name)`, 3.11.7 by value:
    torch's DCP metadata holds one. A checkpoint written either way loads under this interpreter."""
    from torch.distributed.checkpoint.metadata import _MEM_FORMAT_ENCODING

    model, optimizer, scheduler = _trained()
    monkeypatch.setattr(_MEM_FORMAT_ENCODING, "__reduce_ex__", _ENUM_PICKLES[form])
    save_train_state(tmp_path, model, optimizer, scheduler)
    monkeypatch.undo()
    assert (b"getattr" in (tmp_path / "dcp" / ".metadata").read_bytes()) == (form == "by_name")
    fresh, fresh_opt, fresh_sched = _trained(seed=1)
    load_train_state(tmp_path, fresh, fresh_opt, fresh_sched)
    for a, b in zip(model.state_dict().values(), fresh.state_dict().values(), strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("target", ["pathlib.PosixPath.write_text", "torch.distributed.checkpoint.metadata.Metadata.__init__",
                                    "torch.distributed.checkpoint.metadata._MEM_FORMAT_ENCODING.__class__"])
def test_getattr_in_dcp_metadata_loads_enum_members_only(tmp_path, target):
    from torch.distributed.checkpoint.metadata import _MEM_FORMAT_ENCODING

    from raygraph.workers.safe_load import _MetadataUnpickler

    module, cls, attr = target.rsplit(".", 2)

    class _ByName:
        def __init__(self, owner, name):
            self.owner, self.name = owner, name

        def __reduce__(self):
            return getattr, (self.owner, self.name)

    def load(obj):
        return _MetadataUnpickler(io.BytesIO(pickle.dumps(obj))).load()

    assert load(_ByName(_MEM_FORMAT_ENCODING, "TORCH_CONTIGUOUS_FORMAT")) is _MEM_FORMAT_ENCODING.TORCH_CONTIGUOUS_FORMAT
    owner = getattr(__import__(module, fromlist=[cls]), cls)
    with pytest.raises(pickle.UnpicklingError, match="only an enum member"):
        load(_ByName(owner, attr))


def test_a_planted_pickle_in_place_of_the_extra_file_is_refused_not_run(tmp_path):
    model, optimizer, scheduler = _trained()
    save_train_state(tmp_path, model, optimizer, scheduler)
    (tmp_path / "extra_rank0.safetensors").unlink()
    marker = tmp_path / "payload-ran"
    torch.save({"scheduler": _Payload(marker), "rng": {}}, tmp_path / "extra_rank0.pt")
    with pytest.raises(CheckpointError, match="extra_rank0.safetensors is missing"):
        load_train_state(tmp_path, *_trained(seed=1))
    assert not marker.exists()


def test_a_planted_pickle_as_dcp_metadata_is_refused_not_run(tmp_path):
    model, optimizer, scheduler = _trained()
    save_train_state(tmp_path, model, optimizer, scheduler)
    marker = tmp_path / "payload-ran"
    (tmp_path / "dcp" / ".metadata").write_bytes(pickle.dumps(_Payload(marker)))
    with pytest.raises(CheckpointError, match="refusing to load .*open"):
        load_train_state(tmp_path, *_trained(seed=1))
    assert not marker.exists()


def test_a_planted_pickle_as_a_non_tensor_entry_is_refused_not_run(tmp_path):
    marker = tmp_path / "payload-ran"
    raw = io.BytesIO()
    torch.save(_Payload(marker), raw)
    raw.seek(0)
    with pytest.raises(pickle.UnpicklingError):
        _safe_planner().load_bytes(None, raw)
    assert not marker.exists()


def test_a_truncated_shard_is_a_checkpoint_error(tmp_path):
    model, optimizer, scheduler = _trained()
    save_train_state(tmp_path, model, optimizer, scheduler)
    shard = next((tmp_path / "dcp").glob("*.distcp"))
    shard.write_bytes(shard.read_bytes()[:100])
    with pytest.raises(CheckpointError, match="cannot load the sharded state"):
        load_train_state(tmp_path, *_trained(seed=1))


def test_every_rng_state_round_trips_through_the_file_format(tmp_path):
    """CUDA RNG states (one per device) too, so a GPU checkpoint is covered without a GPU."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    from raygraph.workers.train_state import _extra_from_file, _extra_to_file

    random.seed(1), np.random.seed(2), np.random.randn()  # numpy now holds a cached gaussian
    rng = {"torch": torch.get_rng_state(), "python": random.getstate(), "numpy": np.random.get_state(),
           "cuda": [torch.randint(0, 255, (16,), dtype=torch.uint8) for _ in range(2)]}
    tensors, meta = _extra_to_file({"last_epoch": 3, "base_lrs": [0.1]}, rng)
    save_file(tensors, tmp_path / "extra.safetensors", metadata=meta)
    with safe_open(tmp_path / "extra.safetensors", framework="pt") as f:
        scheduler, back = _extra_from_file({k: f.get_tensor(k) for k in f.keys()}, f.metadata())
    assert scheduler == {"last_epoch": 3, "base_lrs": [0.1]}
    assert torch.equal(back["torch"], rng["torch"]) and back["python"] == rng["python"]
    assert back["numpy"][0] == rng["numpy"][0] and (back["numpy"][1] == rng["numpy"][1]).all()
    assert back["numpy"][2:] == rng["numpy"][2:]
    assert all(torch.equal(a, b) for a, b in zip(back["cuda"], rng["cuda"], strict=True))
