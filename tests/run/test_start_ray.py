"""Which Ray `raygraph train` joins or starts (docs/cluster.md): `--address`, then `trainer.ray_address`,
then `RAY_ADDRESS`; without any, a local Ray whose workers run at niceness 0 and with no idle workers
prestarted. `ray.init` is replaced by a recorder: no Ray starts here."""

from __future__ import annotations

import os
from pathlib import Path
from types import SimpleNamespace

import pytest
import ray

from raygraph.cli import main
from raygraph.config import load_config
from raygraph.run import setup, trainer

TOY = str(Path(__file__).resolve().parents[2] / "configs" / "grpo_toy.yaml")


@pytest.fixture
def inits(monkeypatch) -> list[dict]:
    """Every `ray.init` call: its keyword arguments and the Ray settings of the environment it saw."""
    calls: list[dict] = []

    def init(**kwargs):
        calls.append({**kwargs, "niceness": os.environ.get("RAY_worker_niceness"),
                      "prestart": os.environ.get("RAY_prestart_worker_first_driver"),
                      "env": {key: os.environ.get(key) for key in setup.ACTOR_ENV}})
        return SimpleNamespace(dashboard_url=None)

    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(ray, "init", init)
    for name in ("RAY_worker_niceness", "RAY_prestart_worker_first_driver"):
        monkeypatch.setenv(name, "unset by the test")   # restored afterwards, then removed
        monkeypatch.delenv(name)
    for name in ("RAY_ADDRESS", "RAY_JOB_CONFIG_JSON_ENV_VAR"):
        monkeypatch.delenv(name, raising=False)
    return calls


def test_the_local_ray_starts_its_workers_at_niceness_0_and_prestarts_none(inits):
    setup.start_ray(load_config(TOY), None)
    [call] = inits
    assert call["address"] == "local" and call["niceness"] == "0" and call["prestart"] == "0"


def test_the_local_ray_inherits_the_actor_environment_and_the_driver_keeps_its_own(inits, monkeypatch):
    """No job runtime env (it would start every actor through Ray's setup_worker process,
    docs/runtime.md): the local Ray's processes see ACTOR_ENV in the environment they inherit while
    `ray.init` starts them; the driver's own values are back afterwards, unset ones unset."""
    monkeypatch.setenv("TRANSFORMERS_VERBOSITY", "info")
    monkeypatch.delenv("VLLM_LOGGING_LEVEL", raising=False)
    setup.start_ray(load_config(TOY), None)
    [call] = inits
    assert "runtime_env" not in call and call["env"] == setup.ACTOR_ENV
    assert os.environ["TRANSFORMERS_VERBOSITY"] == "info" and "VLLM_LOGGING_LEVEL" not in os.environ


def test_a_cluster_run_gives_its_job_the_actor_environment(inits):
    setup.start_ray(load_config(TOY), "head:6379")
    [call] = inits
    assert call["runtime_env"] == {"env_vars": setup.ACTOR_ENV}


def test_address_flag_then_config_then_ray_address_env(inits, monkeypatch):
    def run(cfg, address=None):   # the trainer up to the point where it joins Ray
        setup.start_ray(cfg, address)
        return SimpleNamespace(stop_signal=0)

    monkeypatch.setattr(trainer, "run", run)
    monkeypatch.setenv("RAY_ADDRESS", "env-head:6379")
    assert main(["train", "--address", "flag-head:6379", TOY, "trainer.ray_address=config-head:6379"]) == 0
    assert main(["train", TOY, "trainer.ray_address=config-head:6379"]) == 0
    assert main(["train", TOY]) == 0
    monkeypatch.delenv("RAY_ADDRESS")
    assert main(["train", TOY]) == 0
    assert [call["address"] for call in inits] == ["flag-head:6379", "config-head:6379", "env-head:6379", "local"]
