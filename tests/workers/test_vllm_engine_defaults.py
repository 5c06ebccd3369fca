"""What the vLLM engine is given for `rollout.*` defaults (docs/vllm.md, Configuration):
`gpu_memory_utilization: null` is 0.9 on GPU and 0.15 on CPU, where the share of host RAM goes to
the engine as bytes; `enforce_eager` is true. `vllm.LLM` is replaced by a recorder and the platform
is told to be a GPU one for the GPU half: no engine starts."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import psutil
import pytest

vllm = pytest.importorskip("vllm")

from vllm.platforms import current_platform  # noqa: E402

from raygraph.config import load_config  # noqa: E402
from raygraph.run.role_specs import role_specs  # noqa: E402
from raygraph.workers import vllm_compat  # noqa: E402

TOY = str(Path(__file__).resolve().parents[2] / "configs" / "grpo_toy.yaml")
GIB = 2**30


@pytest.fixture
def engine_args(monkeypatch) -> list[dict]:
    """The keyword arguments of every `vllm.LLM` built, on a host with 16 GiB of RAM."""
    built: list[dict] = []

    class RecordingLLM:
        def __init__(self, **kwargs):
            built.append(kwargs)

    monkeypatch.setattr(vllm, "LLM", RecordingLLM)
    monkeypatch.setattr(psutil, "virtual_memory", lambda: SimpleNamespace(total=16 * GIB))
    return built


def _build(gpu_memory_utilization: float | None, enforce_eager: bool = True) -> None:
    vllm_compat.build_engine(model_path="/nonexistent/tiny", dtype="float32", seed=0, max_model_len=64,
                             tensor_parallel_size=1, gpu_memory_utilization=gpu_memory_utilization,
                             enable_sleep_mode=False, enable_prefix_caching=None, enforce_eager=enforce_eager,
                             max_num_seqs=None)


def test_the_config_defaults_are_a_null_memory_share_and_eager_mode():
    cfg = load_config(TOY, ["rollout.engine=vllm"])
    assert cfg.rollout.gpu_memory_utilization is None and cfg.rollout.enforce_eager is True
    rollout = role_specs(cfg, ("policy", "rollout", "reward"))["rollout"].kwargs
    assert rollout["gpu_memory_utilization"] is None and rollout["enforce_eager"] is True


def test_a_null_memory_share_is_0_15_of_host_ram_on_cpu_given_as_bytes(engine_args, monkeypatch):
    monkeypatch.setattr(current_platform, "is_cpu", lambda: True)
    _build(None)
    _build(0.25)
    null, set_ = engine_args
    assert null["gpu_memory_utilization"] == 0.15
    assert null["kv_cache_memory_bytes"] == 2_576_980_377   # int(0.15 x 16 GiB = 2576980377.6)
    assert set_["gpu_memory_utilization"] == 0.25 and set_["kv_cache_memory_bytes"] == 4 * GIB
    assert null["enforce_eager"] is True


def test_a_null_memory_share_is_0_9_on_gpu(engine_args, monkeypatch):
    monkeypatch.setattr(current_platform, "is_cpu", lambda: False)   # a CUDA platform
    _build(None, enforce_eager=False)
    _build(0.5)
    null, set_ = engine_args
    assert null["gpu_memory_utilization"] == 0.9 and "kv_cache_memory_bytes" not in null
    assert set_["gpu_memory_utilization"] == 0.5
    assert null["enforce_eager"] is False and set_["enforce_eager"] is True   # passed on as given


def test_a_cpu_engine_counts_token_ranks_eagerly_with_the_same_numbers(engine_args, monkeypatch):
    """vLLM compiles its token-rank count with Inductor on an engine's first call (3.15 s of a
    0.05 s first call on the CPU build, vllm_compat's docstring); a CPU engine counts eagerly."""
    import torch
    from vllm.v1.sample import sampler
    from vllm.v1.sample.ops.logprobs import batched_count_greater_than as compiled

    monkeypatch.setattr(sampler, "batched_count_greater_than", compiled)   # restored after the test
    monkeypatch.setattr(current_platform, "is_cpu", lambda: True)
    _build(None)
    assert sampler.batched_count_greater_than is not compiled
    logprobs = torch.randn(5, 50).log_softmax(-1)
    chosen = logprobs.gather(-1, torch.tensor([[0], [7], [49], [3], [3]]))
    eager = sampler.batched_count_greater_than(logprobs, chosen)
    assert torch.equal(eager, compiled._torchdynamo_orig_callable(logprobs, chosen))   # vLLM's own expression
    assert eager.tolist() == [int((logprobs[i] >= chosen[i]).sum()) for i in range(5)]
