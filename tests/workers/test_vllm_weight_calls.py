"""What `VLLMRolloutWorker.load_weights` asks of its engine, against a recording stand-in for
`vllm.LLM` (no engine process, no GPU; docs/vllm.md and docs/lora.md): a sleeping engine is woken
before the update, and an adapter sync loads the new adapter, then removes the previous one from
the engine and deletes its directory."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest

pytest.importorskip("vllm")

from raygraph.models.loading import load_causal_lm  # noqa: E402
from raygraph.models.lora import LoraSpec  # noqa: E402
from raygraph.workers import vllm_compat  # noqa: E402
from raygraph.workers.policy import PolicyWorker  # noqa: E402
from raygraph.workers.rollout_vllm import VLLMRolloutWorker  # noqa: E402

SPEC = LoraSpec(rank=4, alpha=8.0)


class _RecordingEngine:
    """The part of `vllm.LLM` (and its `llm_engine`) the worker uses for weights, recorded."""

    def __init__(self):
        self.calls: list[str] = []
        self.model_config = SimpleNamespace(max_model_len=64)
        self.llm_engine = self
        self.engine_core = SimpleNamespace(shutdown=lambda: self.calls.append("shutdown"))
        self.adapters: dict[int, Path] = {}

    def sleep(self, level):
        self.calls.append(f"sleep({level})")

    def wake_up(self):
        self.calls.append("wake_up")

    def collective_rpc(self, method, args=()):
        self.calls.append(method)

    def reset_prefix_cache(self):
        self.calls.append("reset_prefix_cache")

    def add_lora(self, request):
        self.calls.append(f"add_lora({request.lora_int_id})")
        self.adapters[request.lora_int_id] = Path(request.lora_path)
        return (Path(request.lora_path) / "adapter_model.safetensors").is_file()   # vLLM reads it now

    def remove_lora(self, lora_id):
        self.calls.append(f"remove_lora({lora_id})")


@pytest.fixture
def engine(monkeypatch):
    engine = _RecordingEngine()
    monkeypatch.setattr(vllm_compat, "build_engine", lambda **kw: engine)
    monkeypatch.setattr(vllm_compat, "watch_engine", lambda engine: None)
    monkeypatch.setattr(vllm_compat, "load_bucket", lambda engine, bucket: engine.calls.append("load_bucket"))
    return engine


def test_a_sleeping_engine_is_woken_before_a_weight_update(tiny_model_path, engine):
    worker = VLLMRolloutWorker(model_path=tiny_model_path, max_new_tokens=4, enable_sleep_mode=True)
    worker.sleep()
    worker.load_weights([list(load_causal_lm(tiny_model_path).named_parameters())], version=1)
    assert engine.calls == ["sleep(1)", "wake_up", "raygraph_begin_weight_update", "load_bucket",
                            "raygraph_finish_weight_update", "reset_prefix_cache"]
    engine.calls.clear()
    worker.load_weights([list(load_causal_lm(tiny_model_path).named_parameters())], version=2)
    assert "wake_up" not in engine.calls   # awake already: nothing to wake


def test_an_adapter_sync_replaces_the_previous_adapter_in_the_engine_and_on_disk(tiny_model_path, engine):
    worker = VLLMRolloutWorker(model_path=tiny_model_path, max_new_tokens=4, enable_sleep_mode=True, lora=SPEC,
                               lora_sync="adapter")
    policy = PolicyWorker(model_path=tiny_model_path, lr=1e-3, lora=SPEC, lora_sync="adapter")
    try:
        worker.sleep()
        worker.load_weights(policy.weight_buckets(bucket_bytes=1 << 16), version=1)
        worker.load_weights(policy.weight_buckets(bucket_bytes=1 << 16), version=2)
        assert engine.calls == ["sleep(1)", "wake_up", "add_lora(1)", "add_lora(2)", "remove_lora(1)"]
        assert (engine.adapters[1].exists(), engine.adapters[2].is_dir()) == (False, True)
    finally:
        worker.close()
    assert not engine.adapters[2].exists()   # the worker's adapter directory goes with it
