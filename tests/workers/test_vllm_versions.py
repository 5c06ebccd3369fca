"""The vLLM versions raygraph accepts (docs/vllm.md, "Supported versions"): 0.32.x is used as it is,
an older release is refused before any engine starts, a newer one is used with a warning."""

from __future__ import annotations

import logging

import pytest

vllm = pytest.importorskip("vllm")

from raygraph.workers import vllm_compat  # noqa: E402


@pytest.mark.parametrize("version, outcome", [("0.32.0", "ok"), ("0.32.7", "ok"), ("0.31.2", "refused"),
                                              ("0.33.0", "warned"), ("1.0.0", "warned")])
def test_older_vllm_is_refused_and_newer_is_warned_about(monkeypatch, caplog, version, outcome):
    monkeypatch.setattr(vllm, "__version__", version)
    with caplog.at_level(logging.WARNING, logger=vllm_compat.__name__):
        if outcome == "refused":
            with pytest.raises(RuntimeError, match=rf"vLLM {version} is too old .*supported: >=0.32,<0.33"):
                vllm_compat.vllm_version()
            return
        assert vllm_compat.vllm_version() == version
    warned = [r.getMessage() for r in caplog.records if "newer than the tested range" in r.getMessage()]
    assert warned == ([f"vLLM {version} is newer than the tested range >=0.32,<0.33"] if outcome == "warned" else [])


def test_an_older_vllm_is_refused_before_an_engine_starts(monkeypatch):
    monkeypatch.setattr(vllm, "__version__", "0.30.0")
    with pytest.raises(RuntimeError, match="too old"):
        vllm_compat.build_engine(model_path="/nonexistent", dtype="float32", seed=0, max_model_len=None,
                                 tensor_parallel_size=1, gpu_memory_utilization=None, enable_sleep_mode=False,
                                 enable_prefix_caching=None, enforce_eager=True, max_num_seqs=None)
