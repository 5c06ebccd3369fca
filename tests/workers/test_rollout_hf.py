"""The HF rollout engine: reproducible sampling, greedy == argmax by hand, exact log-probs,
stop handling, and in-place weight loading."""

from __future__ import annotations

import pytest
import torch

from raygraph.batch import (
    PROMPT_IDS,
    PROMPT_MASK,
    RESPONSE_LENGTH,
    RESPONSE_MASK,
    RESPONSE_TEXT,
    RESPONSES,
    ROLLOUT_LOGPROBS,
    UID,
    WEIGHT_VERSION,
    Batch,
)
from raygraph.models.loading import load_causal_lm, load_tokenizer
from raygraph.models.logprobs import response_logprobs
from raygraph.workers.rollout_hf import HFRolloutWorker, filter_top_k_top_p

PROMPTS = ["<|user|>1+1=?<|end|><|assistant|>", "<|user|>a much longer question?<|end|><|assistant|>",
           "<|user|>x<|end|><|assistant|>"]


@pytest.fixture(scope="module")
def prompts(tiny_model_path) -> Batch:
    tok = load_tokenizer(tiny_model_path)
    enc = tok(PROMPTS, padding=True, return_tensors="pt", add_special_tokens=False)
    return Batch({PROMPT_IDS: enc.input_ids, PROMPT_MASK: enc.attention_mask},
                 {UID: ["p0", "p1", "p2"], "data_source": ["toy"] * 3})


def _worker(path, **kw):
    kw = {"max_new_tokens": 6, "micro_batch_size": 4} | kw
    return HFRolloutWorker(model_path=path, **kw)


def test_seeded_sampling_is_reproducible_and_groups_are_contiguous(tiny_model_path, prompts):
    a = _worker(tiny_model_path, seed=7, n=2).generate(prompts)
    b = _worker(tiny_model_path, seed=7, n=2).generate(prompts)
    c = _worker(tiny_model_path, seed=8, n=2).generate(prompts)
    assert torch.equal(a[RESPONSES], b[RESPONSES]) and torch.equal(a[ROLLOUT_LOGPROBS], b[ROLLOUT_LOGPROBS])
    assert not torch.equal(a[RESPONSES], c[RESPONSES])
    assert list(a[UID]) == ["p0"] * 2 + ["p1"] * 2 + ["p2"] * 2 and list(a["data_source"]) == ["toy"] * 6
    assert torch.equal(a[PROMPT_IDS], prompts[PROMPT_IDS].repeat_interleave(2, 0))
    assert a[WEIGHT_VERSION].tolist() == [0] * 6 and a[WEIGHT_VERSION].dtype == torch.int64


def test_shared_prefill_samples_what_per_row_prefill_samples(tiny_model_path, prompts, monkeypatch):
    """Each distinct prompt is prefilled once for its n samples; the draws are unchanged."""
    import raygraph.workers.rollout_hf as rollout_module

    shared = _worker(tiny_model_path, seed=5, n=4, micro_batch_size=12).generate(prompts)
    monkeypatch.setattr(rollout_module, "prompt_runs", lambda ids, mask: None)
    per_row = _worker(tiny_model_path, seed=5, n=4, micro_batch_size=12).generate(prompts)
    assert torch.equal(shared[RESPONSES], per_row[RESPONSES])
    torch.testing.assert_close(shared[ROLLOUT_LOGPROBS], per_row[ROLLOUT_LOGPROBS], atol=1e-5, rtol=0)


def test_greedy_equals_argmax_decoding_by_hand(tiny_model_path, prompts):
    steps = 4
    out = _worker(tiny_model_path, max_new_tokens=steps).generate(prompts, greedy=True)
    model = load_causal_lm(tiny_model_path)
    for i in range(len(prompts)):
        ids = prompts[PROMPT_IDS][i][prompts[PROMPT_MASK][i].bool()][None]
        for _ in range(int(out[RESPONSE_LENGTH][i])):  # full forward each step, no cache, no padding
            with torch.no_grad():
                ids = torch.cat([ids, model(input_ids=ids).logits[:, -1].argmax(-1, keepdim=True)], 1)
        n = int(out[RESPONSE_LENGTH][i])
        assert out[RESPONSES][i, :n].tolist() == ids[0, -n:].tolist()


@pytest.mark.parametrize("temperature, top_k, top_p", [(1.0, 0, 1.0), (0.7, 20, 0.9)])
def test_rollout_logprobs_match_policy_recomputation(tiny_model_path, prompts, temperature, top_k, top_p):
    worker = _worker(tiny_model_path, seed=1, n=2, temperature=temperature, top_k=top_k, top_p=top_p)
    out = worker.generate(prompts)
    logprobs, _ = response_logprobs(worker.model, out, temperature=temperature, micro_batch_size=3)
    assert (logprobs - out[ROLLOUT_LOGPROBS]).abs().max() < 1e-4
    assert (out[ROLLOUT_LOGPROBS][out[RESPONSE_MASK] == 0] == 0).all()


def test_stop_tokens_end_responses_and_padding_follows(tiny_model_path, prompts):
    tok = load_tokenizer(tiny_model_path)
    stop_ids = tok.convert_tokens_to_ids(list("aeiou0123456789 "))
    out = _worker(tiny_model_path, seed=3, n=3, max_new_tokens=12, stop_token_ids=stop_ids).generate(prompts)
    stops = set(stop_ids) | {tok.eos_token_id}
    for row, mask, length, text in zip(out[RESPONSES], out[RESPONSE_MASK], out[RESPONSE_LENGTH], out[RESPONSE_TEXT]):
        n = int(length)
        assert mask[:n].all() and not mask[n:].any()
        assert all(t == tok.pad_token_id for t in row[n:].tolist())
        assert not stops & set(row[:n - 1].tolist())  # no stop before the last token
        assert n == 12 or row[n - 1].item() in stops
        assert text == tok.decode(row[:n], skip_special_tokens=True)
    assert (out[RESPONSE_LENGTH] < 12).any()


def test_top_k_top_p_filter():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    assert torch.isinf(filter_top_k_top_p(logits, top_k=2)).tolist() == [[False, False, True, True]]
    assert torch.isinf(filter_top_k_top_p(logits, top_p=0.8)).tolist() == [[False, False, True, True]]
    assert torch.isinf(filter_top_k_top_p(logits, top_p=0.81)).tolist() == [[False, False, False, True]]
    assert torch.isinf(filter_top_k_top_p(logits, top_p=0.1)).tolist() == [[False, True, True, True]]


def test_load_weights_is_bit_exact_and_names_bad_tensors(tiny_model_path):
    worker = _worker(tiny_model_path)
    gen = torch.Generator().manual_seed(0)
    new = {k: torch.randn(v.shape, generator=gen) for k, v in worker.model.state_dict().items()
           if k != "lm_head.weight"}  # tied to embed_tokens: sent once
    names = list(new)
    buckets = [[(n, new[n]) for n in names[i:i + 5]] for i in range(0, len(names), 5)]
    info = worker.load_weights(iter(buckets), version=4)
    assert info == {"loaded": len(new), "bytes": sum(t.numel() * 4 for t in new.values()), "version": 4}
    assert worker.weight_version == 4
    state = worker.model.state_dict()
    assert all(torch.equal(state[k], v) for k, v in new.items())
    assert torch.equal(state["lm_head.weight"], new["model.embed_tokens.weight"])
    with pytest.raises(KeyError, match="model.nope"):
        worker.load_weights([[("model.nope", torch.zeros(1))]], version=5)
    with pytest.raises(ValueError, match="model.norm.weight"):
        worker.load_weights([[("model.norm.weight", torch.zeros(3))]], version=5)
    assert worker.weight_version == 4
