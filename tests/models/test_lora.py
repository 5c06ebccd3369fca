"""LoRA on the tiny model: what is trained, the three views of the weights, and bad settings."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from raygraph.models.loading import load_causal_lm
from raygraph.models.lora import (
    LoraError,
    LoraSpec,
    adapter_tensors,
    apply_lora,
    check_lora_on_config,
    hf_name,
    merged_tensors,
    save_adapter,
)

# tiny preset: hidden 64, 2 layers, 2 heads of 32, 1 kv head (k/v_proj: 64 -> 32), MLP 128
SPEC = LoraSpec(rank=4, alpha=8.0)


def _perturbed(model):
    """Non-zero B (a fresh adapter has B = 0 and changes nothing), deterministically."""
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".lora_B." in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.05)
    return model


def _ids():
    return torch.randint(6, 93, (3, 9), generator=torch.Generator().manual_seed(1))


def test_only_adapters_train_and_all_linear_skips_the_tied_head(tiny_model_path):
    model = apply_lora(load_causal_lm(tiny_model_path), SPEC)
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    # 2 layers x 7 linear layers (q, k, v, o, gate, up, down) x (A, B); no lm_head (tied to embeddings)
    assert len(trainable) == 2 * 7 * 2
    assert all(".lora_A." in n or ".lora_B." in n for n in trainable)
    assert all(p.dtype == torch.float32 for n, p in model.named_parameters() if n in trainable)
    # adapter parameters: per layer q(64x4+4x64) k(64x4+4x32) v(same) o(64x4+4x64) gate/up(64x4+4x128) down(128x4+4x64)
    per_layer = 512 + 384 + 384 + 512 + 768 + 768 + 768
    assert sum(p.numel() for n, p in model.named_parameters() if n in trainable) == 2 * per_layer


def test_fresh_adapter_and_disabled_adapter_equal_the_base_model_exactly(tiny_model_path):
    base = load_causal_lm(tiny_model_path)
    expected = base(_ids()).logits
    model = apply_lora(load_causal_lm(tiny_model_path), SPEC)
    assert torch.equal(model(_ids()).logits, expected)            # B = 0
    _perturbed(model)
    changed = model(_ids()).logits
    assert (changed - expected).abs().max() > 1e-3
    with model.disable_adapter():
        assert torch.equal(model(_ids()).logits, expected)


def test_merged_weights_load_in_a_plain_model_and_give_the_adapted_logits(tiny_model_path, tmp_path):
    model = _perturbed(apply_lora(load_causal_lm(tiny_model_path), SPEC)).eval()
    expected = model(_ids()).logits
    merged = dict(merged_tensors(model))
    plain = load_causal_lm(tiny_model_path)
    assert set(merged) == {n for n, _ in plain.named_parameters()}   # HF names, tied weight once
    plain.load_state_dict(merged, strict=False)
    torch.testing.assert_close(plain(_ids()).logits, expected, atol=1e-5, rtol=1e-5)
    # the merge is W + (alpha / rank) B A on exactly the targeted layers
    name = "model.layers.0.self_attn.q_proj.weight"
    a = model.base_model.model.model.layers[0].self_attn.q_proj.lora_A["default"].weight
    b = model.base_model.model.model.layers[0].self_attn.q_proj.lora_B["default"].weight
    base_w = dict(load_causal_lm(tiny_model_path).named_parameters())[name]
    torch.testing.assert_close(merged[name], base_w + (8.0 / 4) * b @ a)
    # the PEFT-format adapter round-trips through peft's own loader
    from peft import PeftModel

    save_adapter(model, tmp_path / "adapter", dict(adapter_tensors(model)))
    reloaded = PeftModel.from_pretrained(load_causal_lm(tiny_model_path), str(tmp_path / "adapter")).eval()
    assert torch.equal(reloaded(_ids()).logits, expected)


def test_hf_names_drop_the_peft_prefix_and_base_layer():
    assert hf_name("base_model.model.model.layers.0.mlp.up_proj.base_layer.weight") == \
        "model.layers.0.mlp.up_proj.weight"
    assert hf_name("base_model.model.lm_head.weight") == "lm_head.weight"


@pytest.mark.parametrize(("spec", "message"), [
    (LoraSpec(rank=4, target_modules=("qproj",)), "'qproj' matches no module of the model; its linear layers "
                                                  "are named down_proj, gate_proj, k_proj, lm_head, o_proj"),
    (LoraSpec(rank=4, target_modules=("embed_tokens",)), "'embed_tokens' matches Embedding modules, not linear"),
    (LoraSpec(rank=4, target_modules=("lm_head",)), "'lm_head' is tied to the input embeddings"),
    # k_proj maps 64 -> 32 (one kv head of 32): rank 33 cannot exist there, rank 32 can
    (LoraSpec(rank=33, target_modules=("k_proj",)), "model.lora.rank=33 is larger than the smaller dimension "
                                                    "(32) of model.layers.0.self_attn.k_proj (2 targeted"),
])
def test_bad_settings_are_refused_on_a_weightless_model(tiny_model_path, spec, message):
    config = AutoConfig.from_pretrained(tiny_model_path)
    with pytest.raises(LoraError) as err:
        check_lora_on_config(config, spec)
    assert message in str(err.value)
    check_lora_on_config(config, LoraSpec(rank=32, target_modules=("k_proj",)))   # the largest that fits


def test_meta_check_matches_the_real_model(tiny_model_path):
    """The check `raygraph validate` runs (meta device) applies the same code as the worker."""
    with torch.device("meta"):
        meta = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(tiny_model_path))
    real = load_causal_lm(tiny_model_path)
    names = lambda m: [n for n, _ in apply_lora(m, SPEC).named_parameters()]  # noqa: E731
    assert names(meta) == names(real)
