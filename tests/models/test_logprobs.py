"""Response log-probs and entropy against direct computations on unpadded sequences."""

from __future__ import annotations

import pytest
import torch

from raygraph.batch import PROMPT_IDS, PROMPT_MASK, RESPONSE_MASK, RESPONSES, Batch
from raygraph.models.loading import load_causal_lm
from raygraph.models.logprobs import forward_response, position_ids_from_mask, prompt_runs, response_logprobs


@pytest.fixture(scope="module")
def model(tiny_model_path):
    return load_causal_lm(tiny_model_path)


def _direct(model, batch: Batch, temperature: float = 1.0):
    """Row by row on the UNPADDED sequence: log_softmax + gather, and -sum p log p."""
    logprobs = torch.zeros(batch[RESPONSES].shape)
    entropy = torch.zeros(batch[RESPONSES].shape)
    for i in range(len(batch)):
        prompt = batch[PROMPT_IDS][i][batch[PROMPT_MASK][i].bool()]
        response = batch[RESPONSES][i][batch[RESPONSE_MASK][i].bool()]
        ids = torch.cat([prompt, response])[None]
        with torch.no_grad():
            logits = model(input_ids=ids).logits[0, len(prompt) - 1:-1] / temperature  # (r, V)
        logp = torch.log_softmax(logits.double(), -1)
        logprobs[i, :len(response)] = logp.gather(-1, response[:, None]).squeeze(-1).float()
        entropy[i, :len(response)] = -(logp.exp() * logp).sum(-1).float()
    return logprobs, entropy


def test_logprobs_and_entropy_match_direct_computation(model, rollout_batch, temperature=0.7):
    batch = rollout_batch(4, seed=1)
    logprobs, entropy = response_logprobs(model, batch, temperature=temperature, micro_batch_size=2,
                                          with_entropy=True)
    want_lp, want_ent = _direct(model, batch, temperature)
    torch.testing.assert_close(logprobs, want_lp, atol=2e-5, rtol=0)
    torch.testing.assert_close(entropy, want_ent, atol=2e-5, rtol=0)
    assert (logprobs[batch[RESPONSE_MASK] == 0] == 0).all()


def test_padding_amount_does_not_change_results(model, rollout_batch):
    batch = rollout_batch(4, seed=2)
    extra_left, extra_right = 5, 3
    padded = Batch({
        PROMPT_IDS: torch.nn.functional.pad(batch[PROMPT_IDS], (extra_left, 0)),
        PROMPT_MASK: torch.nn.functional.pad(batch[PROMPT_MASK], (extra_left, 0)),
        RESPONSES: torch.nn.functional.pad(batch[RESPONSES], (0, extra_right)),
        RESPONSE_MASK: torch.nn.functional.pad(batch[RESPONSE_MASK], (0, extra_right)),
    })
    lp, ent = response_logprobs(model, batch, micro_batch_size=4, with_entropy=True)
    lp_pad, ent_pad = response_logprobs(model, padded, micro_batch_size=3, with_entropy=True)
    torch.testing.assert_close(lp_pad[:, :lp.shape[1]], lp, atol=1e-5, rtol=0)
    torch.testing.assert_close(ent_pad[:, :lp.shape[1]], ent, atol=1e-5, rtol=0)
    assert (lp_pad[:, lp.shape[1]:] == 0).all()


def test_packed_layout_equals_padded(model, rollout_batch):
    batch = rollout_batch(5, seed=3)
    lp, ent = response_logprobs(model, batch, micro_batch_size=5, with_entropy=True, packed=False)
    lp_packed, ent_packed = response_logprobs(model, batch, micro_batch_size=5, with_entropy=True, packed=True)
    torch.testing.assert_close(lp_packed, lp, atol=1e-5, rtol=0)
    torch.testing.assert_close(ent_packed, ent, atol=1e-5, rtol=0)


def _grouped(rollout_batch, groups: int, n: int, seed: int) -> Batch:
    """`groups` prompts, each repeated for `n` rows with different responses (the GRPO layout)."""
    prompts = rollout_batch(groups, seed=seed)
    rows = rollout_batch(groups * n, seed=seed + 1)
    return Batch({PROMPT_IDS: prompts[PROMPT_IDS].repeat_interleave(n, 0),
                  PROMPT_MASK: prompts[PROMPT_MASK].repeat_interleave(n, 0),
                  RESPONSES: rows[RESPONSES], RESPONSE_MASK: rows[RESPONSE_MASK]})


def test_shared_prompts_give_the_same_logprobs_and_gradients(model, rollout_batch):
    batch = _grouped(rollout_batch, groups=3, n=4, seed=7)
    starts, sizes = prompt_runs(batch[PROMPT_IDS], batch[PROMPT_MASK])
    assert starts.tolist() == [0, 4, 8] and sizes.tolist() == [4, 4, 4]
    assert prompt_runs(*rollout_batch(6, seed=9).select_columns([PROMPT_IDS, PROMPT_MASK]).tensors.values()) is None
    results = {}
    for shared in (False, True):
        model.zero_grad()
        lp, ent = forward_response(model, batch, temperature=0.7, with_entropy=True, shared_prompts=shared)
        (lp.sum() + 0.1 * ent.sum()).backward()
        results[shared] = (lp.detach(), ent.detach(), [p.grad.clone() for p in model.parameters()])
    model.zero_grad()
    torch.testing.assert_close(results[True][0], results[False][0], atol=1e-5, rtol=0)
    torch.testing.assert_close(results[True][1], results[False][1], atol=1e-5, rtol=0)
    torch.testing.assert_close(results[True][0], _direct(model, batch, 0.7)[0], atol=2e-5, rtol=0)
    for got, want in zip(results[True][2], results[False][2]):
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    assert max(float(g.abs().max()) for g in results[True][2]) > 1e-2   # the gradients are not trivially 0


def test_position_ids_count_real_tokens_only():
    mask = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 0]])
    assert position_ids_from_mask(mask).tolist() == [[0, 0, 0, 1, 2], [0, 1, 2, 3, 3]]
