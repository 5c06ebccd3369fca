"""Loading conventions: attention backend choice, pad fallback, reward-model pad alignment."""

from __future__ import annotations

import logging

import pytest
import torch
from transformers import AutoModelForSequenceClassification, AutoTokenizer

from raygraph.models import loading
from raygraph.models.loading import (
    ATTN_IMPL_ENV,
    load_causal_lm,
    load_reward_model,
    load_tokenizer,
    resolve_attn_impl,
    resolve_dtype,
)


def test_attn_impl_auto_is_sdpa_on_cpu_and_env_overrides(monkeypatch, caplog):
    monkeypatch.delenv(ATTN_IMPL_ENV, raising=False)
    monkeypatch.setattr(loading, "_logged_attn_choices", set())
    with caplog.at_level(logging.INFO, logger="raygraph.models.loading"):
        assert resolve_attn_impl("auto") == "sdpa"
        assert resolve_attn_impl("auto") == "sdpa"
        monkeypatch.setenv(ATTN_IMPL_ENV, "eager")
        assert resolve_attn_impl("sdpa") == "eager"
    choices = [r.getMessage() for r in caplog.records]
    assert choices == ["attention implementation: sdpa (auto-detected)",
                       f"attention implementation: eager (${ATTN_IMPL_ENV})"]  # each logged once
    monkeypatch.setenv(ATTN_IMPL_ENV, "flash")
    with pytest.raises(ValueError, match="flash.*RAYGRAPH_ATTN_IMPL"):
        resolve_attn_impl("auto")


def test_dtype_names():
    assert resolve_dtype("bf16") is torch.bfloat16 and resolve_dtype("float32") is torch.float32
    with pytest.raises(ValueError, match="valid"):
        resolve_dtype("float8")


def test_causal_lm_dtype_and_gradient_checkpointing(tiny_model_path):
    model = load_causal_lm(tiny_model_path, dtype="bfloat16", attn_impl="eager", gradient_checkpointing=True)
    assert next(model.parameters()).dtype == torch.bfloat16
    assert getattr(model, "is_activation_checkpointing", None) or model.is_gradient_checkpointing
    assert model.config._attn_implementation == "eager"
    assert not model.training


def test_tokenizer_without_pad_pads_with_eos(tiny_model_path, tmp_path, caplog):
    tok = AutoTokenizer.from_pretrained(tiny_model_path)
    tok.pad_token = None
    tok.padding_side = "right"
    tok.save_pretrained(tmp_path)
    with caplog.at_level(logging.WARNING):
        loaded = load_tokenizer(tmp_path)
    assert loaded.pad_token_id == loaded.eos_token_id
    assert loaded.padding_side == "left"
    assert "no pad token" in caplog.text


def test_reward_model_pad_id_is_aligned_with_its_tokenizer(tiny_rm_path, tmp_path):
    model = AutoModelForSequenceClassification.from_pretrained(tiny_rm_path)
    model.config.pad_token_id = 5  # a wrong id: HF would pool at the wrong token
    model.save_pretrained(tmp_path)
    AutoTokenizer.from_pretrained(tiny_rm_path).save_pretrained(tmp_path)
    rm = load_reward_model(tmp_path)
    assert rm.config.pad_token_id == load_tokenizer(tmp_path).pad_token_id != 5
    assert not any(p.requires_grad for p in rm.parameters())


def test_no_model_is_kernelized_with_hub_kernels(tiny_model_path, tiny_rm_path):
    """transformers kernelizes a loaded model with kernels from the Hub by default (on CUDA, when
    the model switches to train mode; offline that raised in `PolicyWorker.update` on an H200):
    every model raygraph loads opts out, and a switch to train mode keeps it out."""
    from raygraph.models.value_head import ValueModel

    policy, reward = load_causal_lm(tiny_model_path), load_reward_model(tiny_rm_path)
    critic_body = ValueModel.from_pretrained(tiny_model_path).body
    for model in (policy, reward, critic_body):
        model.train()
        assert model.use_kernels is False and model.kernels_mode is None
