"""Streaming rollouts (issue 26), engine level and without Ray: samples continued across a weight
update keep each token's version and log-prob, groups are handed out whole, stale groups are
regenerated, and the background loop takes weights that land mid-request."""

from __future__ import annotations

import itertools

import pytest
import torch
from new_weights import perturbed

from raygraph.batch import (
    ADVANTAGES,
    OLD_LOGPROBS,
    PROMPT_IDS,
    PROMPT_MASK,
    RESPONSE_MASK,
    RESPONSE_TEXT,
    RESPONSES,
    ROLLOUT_LOGPROBS,
    STALENESS,
    STREAM_TAKE,
    TOKEN_WEIGHT_VERSION,
    UID,
    WEIGHT_VERSION,
    Batch,
)
from raygraph.graph.corrections import truncated_importance_weights
from raygraph.models.loading import load_causal_lm
from raygraph.models.logprobs import response_logprobs
from raygraph.workers.rollout_hf import HFRolloutWorker
from raygraph.workers.streaming import Continuation, StreamedSamples

MAX_NEW = 12


def _prompts(uids: list[str], width: int = 5) -> Batch:
    """Left-padded prompts of different lengths (ids well inside the tiny vocab)."""
    ids = torch.zeros(len(uids), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i in range(len(uids)):
        length = 3 + i % 3
        ids[i, width - length:] = torch.arange(10 + i, 10 + i + length)
        mask[i, width - length:] = 1
    return Batch({PROMPT_IDS: ids, PROMPT_MASK: mask}, {UID: list(uids)})


def _worker(path: str, n: int = 2) -> HFRolloutWorker:
    return HFRolloutWorker(model_path=path, seed=0, n=n, max_new_tokens=MAX_NEW, temperature=1.0,
                           micro_batch_size=8)



def _stop_after(calls: int):
    """A `keep_going` that allows `calls` model calls (the prefill and calls - 1 decode steps)."""
    counter = itertools.count()
    return lambda: next(counter) < calls


def test_a_sample_continued_across_a_weight_update_keeps_each_tokens_version_and_logprob(tiny_model_path):
    """4 tokens with v0, a weight update mid-request, the rest with v1 from the same token ids:
    each token's log-prob is the one its version's model gives (recomputed without streaming),
    and the two versions' log-probs really differ (else the check could not fail)."""
    worker = _worker(tiny_model_path)
    v0 = load_causal_lm(tiny_model_path).eval()
    streamed = StreamedSamples(n=2, pad_id=worker.tokenizer.pad_token_id)
    uids = ["a", "b", "c"]
    streamed.submit(_prompts(uids))
    wave = streamed.unfinished(8)
    assert len(wave) == 6
    streamed.extend(wave, worker.continue_samples(wave, 0, _stop_after(4)), version=0)
    assert all(len(s.tokens) == 4 or s.done for s in wave) and streamed.ready() == {}

    worker.load_weights([perturbed(worker.model, seed=1)], version=1)
    while streamed.in_flight():
        wave = streamed.unfinished(8)
        streamed.extend(wave, worker.continue_samples(wave, 1, lambda: True), version=1)
    assert set(streamed.ready()) == set(uids)
    rows = streamed.take(uids, version=1)

    mask, versions = rows[RESPONSE_MASK].bool(), rows[TOKEN_WEIGHT_VERSION]
    mixed = [i for i in range(len(rows)) if {0, 1} <= set(versions[i][mask[i]].tolist())]
    assert mixed, "no sample straddled the update"
    for i in mixed:   # four tokens of v0, then v1 to the end
        length = int(mask[i].sum())
        assert versions[i][:length].tolist() == [0] * 4 + [1] * (length - 4)
    assert rows[WEIGHT_VERSION].tolist() == [0] * len(rows) and rows[STALENESS].tolist() == [1] * len(rows)
    lp0, _ = response_logprobs(v0, rows)
    lp1, _ = response_logprobs(worker.model, rows)
    expected = torch.where(versions == 0, lp0, lp1)
    assert torch.allclose(rows[ROLLOUT_LOGPROBS][mask], expected[mask], atol=1e-5)
    late = mask & (versions == 1)
    assert (lp0[late] - lp1[late]).abs().max() > 1e-2, "the update did not change the log-probs"


def test_importance_weights_of_a_mixed_version_sample_are_exact_token_by_token():
    """Taken at v2: a row whose tokens came from v0, v1, v2. Tokens of v2 get weight exactly 1,
    the others min(exp(old - behaviour), cap), by hand."""
    behaviour = torch.tensor([[-1.0, -2.0, -0.5, -3.0, 0.0]])
    old = torch.tensor([[-0.5, -2.5, -0.4, -3.2, 0.0]])
    batch = Batch({RESPONSE_MASK: torch.tensor([[1, 1, 1, 1, 0]]), ROLLOUT_LOGPROBS: behaviour, OLD_LOGPROBS: old,
                   ADVANTAGES: torch.full((1, 5), 2.0), TOKEN_WEIGHT_VERSION: torch.tensor([[0, 1, 2, 2, 0]]),
                   WEIGHT_VERSION: torch.tensor([0]), STALENESS: torch.tensor([2])})
    out = truncated_importance_weights(batch, cap=1.5)[ADVANTAGES][0]
    # token 0 (v0): exp(0.5) = 1.6487 -> capped at 1.5; token 1 (v1): exp(-0.5) = 0.6065;
    # tokens 2, 3 (v2, the current weights): 1 (their ratio 1.105 and 0.819 is not applied); padding: 1
    assert out.tolist() == pytest.approx([2 * 1.5, 2 * 0.60653066, 2.0, 2.0, 2.0], abs=1e-6)


def test_groups_are_taken_only_whole_and_once(tiny_model_path):
    streamed = StreamedSamples(n=3, pad_id=0)
    streamed.submit(_prompts(["a", "b"]))
    wave = streamed.unfinished(10)
    assert [s.prompt_ids for s in wave[:3]] == [wave[0].prompt_ids] * 3 and len(wave) == 6
    # finish all of "a" and two of the three samples of "b"
    streamed.extend(wave[:5], [Continuation([7, 8], [-1.0, -2.0], True)] * 5, version=0)
    assert streamed.ready() == {"a": 0} and streamed.in_flight() == 1
    with pytest.raises(ValueError, match="taken only whole"):
        streamed.take(["b"], version=0)
    rows = streamed.take(["a"], version=0)
    assert rows[UID].tolist() == ["a"] * 3 and rows[RESPONSES].tolist() == [[7, 8]] * 3
    with pytest.raises(KeyError, match="no streamed group"):
        streamed.take(["a"], version=0)
    with pytest.raises(ValueError, match="submitted twice"):
        streamed.submit(_prompts(["b"]))


def test_ready_groups_carry_the_version_of_their_oldest_token():
    streamed = StreamedSamples(n=2, pad_id=0)
    streamed.submit(_prompts(["a", "b", "c"]))
    wave = streamed.unfinished(6)
    streamed.extend(wave[:2], [Continuation([5], [-0.3], True)] * 2, version=0)              # "a" at v0
    streamed.extend(wave[2:4], [Continuation([6, 7], [-0.1, -0.2], False)] * 2, version=1)  # "b" starts at v1
    streamed.extend(wave[2:4], [Continuation([8], [-0.4], True)] * 2, version=3)            # ... ends at v3
    assert streamed.ready() == {"a": 0, "b": 1} and streamed.in_flight() == 2
    assert streamed.unfinished(6, started=True) == [] and len(streamed.unfinished(6)) == 2   # "c" not started
    assert streamed.tokens_per_version == {0: 2, 1: 4, 3: 2}
    rows = streamed.take(["b"], version=3)
    assert rows[TOKEN_WEIGHT_VERSION].tolist() == [[1, 1, 3]] * 2 and rows[STALENESS].tolist() == [2, 2]


def test_the_background_loop_takes_weights_that_land_mid_request(tiny_model_path):
    """The loop generates while the main thread loads two new weight versions, each once the loop
    has made 6 model calls with the previous one (a forward hook tells when): every token's
    log-prob is its version's (the weights of each version kept aside), versions never go down
    along a sample, and both new versions really sampled tokens."""
    import threading

    worker = _worker(tiny_model_path, n=2)
    worker.max_new_tokens = 48   # long samples, so that updates land inside them
    calls, reached = itertools.count(1), threading.Event()
    worker.model.register_forward_pre_hook(lambda *_: reached.set() if next(calls) % 6 == 0 else None)
    weights = {0: load_causal_lm(tiny_model_path).eval()}
    uids = [f"p{i}" for i in range(6)]
    worker.stream_submit(_prompts(uids))
    try:
        for version in (1, 2):
            assert reached.wait(30), "the loop made no model calls"
            new = perturbed(worker.model, seed=version)
            worker.load_weights([new], version=version)
            reached.clear()
            weights[version] = load_causal_lm(tiny_model_path).eval()
            weights[version].load_state_dict(dict(new))
        figures = worker.stream_wait(uids, timeout_s=60)
        assert figures["ready"] == 1.0 and figures["in_flight"] == 0.0 and figures["queued"] == len(uids)
        assert 0 < figures["busy_s"] <= figures["wall_s"]
        rows = worker.stream_take(Batch(meta={STREAM_TAKE: {0: uids}}))
    finally:
        worker.stream_stop()
    mask, versions = rows[RESPONSE_MASK].bool(), rows[TOKEN_WEIGHT_VERSION]
    assert set(versions[mask].tolist()) == {0, 1, 2}
    for i in range(len(rows)):
        v = versions[i][mask[i]]
        assert bool((v[1:] >= v[:-1]).all())
    expected = torch.zeros_like(rows[ROLLOUT_LOGPROBS])
    for version, model in weights.items():
        lp, _ = response_logprobs(model, rows)
        expected = torch.where(versions == version, lp, expected)
    assert torch.allclose(rows[ROLLOUT_LOGPROBS][mask], expected[mask], atol=1e-5)
    assert rows[STALENESS].tolist() == (2 - rows[WEIGHT_VERSION]).tolist()
    generated = {int(k[len("tokens_v"):]): v for k, v in figures.items() if k.startswith("tokens_v")}
    assert generated == {v: float(((versions == v) & mask).sum()) for v in (0, 1, 2)}
    assert list(rows[RESPONSE_TEXT]) == worker.tokenizer.batch_decode(
        [r[m].tolist() for r, m in zip(rows[RESPONSES], mask)], skip_special_tokens=True)


def test_without_partial_rollouts_an_update_waits_for_the_started_samples(tiny_model_path):
    """partial_rollouts=false: the update lands once the samples started before it have finished
    (waves of 16 tokens go on with them, and start no other), so no sample mixes versions and
    each sample's log-probs are those of its one version."""
    import threading

    worker = _worker(tiny_model_path, n=2)
    worker.partial_rollouts, worker.stream_wave_rows, worker.max_new_tokens = False, 4, 48
    calls, reached = itertools.count(1), threading.Event()
    worker.model.register_forward_pre_hook(lambda *_: reached.set() if next(calls) == 3 else None)
    uids = [f"p{i}" for i in range(6)]
    worker.stream_submit(_prompts(uids))
    try:
        assert reached.wait(30)
        new = perturbed(worker.model, seed=1)
        worker.load_weights([new], version=1)   # waits for the 4 samples of the first wave to finish
        assert worker.stream_wait(uids, timeout_s=60)["ready"] == 1.0
        rows = worker.stream_take(Batch(meta={STREAM_TAKE: {0: uids}}))
    finally:
        worker.stream_stop()
    mask, versions = rows[RESPONSE_MASK].bool(), rows[TOKEN_WEIGHT_VERSION]
    per_row = [set(versions[i][mask[i]].tolist()) for i in range(len(rows))]
    assert per_row == [{0}] * 4 + [{1}] * 8, per_row
    v1 = load_causal_lm(tiny_model_path).eval()
    v1.load_state_dict(dict(new))
    expected = torch.where(versions == 0, response_logprobs(load_causal_lm(tiny_model_path).eval(), rows)[0],
                           response_logprobs(v1, rows)[0])
    assert torch.allclose(rows[ROLLOUT_LOGPROBS][mask], expected[mask], atol=1e-5)
