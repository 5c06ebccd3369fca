"""Streaming multi-turn episodes (issue 26), engine level and without Ray: episodes whose turns
outlive weight updates keep each token's version and log-prob, groups of episodes are handed out
whole, and without partial rollouts no episode mixes versions."""

from __future__ import annotations

import itertools
import threading
import time

import pytest
import torch
from new_weights import perturbed

from raygraph.agents.episode import Episode
from raygraph.batch import (
    AGENT_TURNS,
    PROMPT_IDS,
    PROMPT_MASK,
    RESPONSE_ATTENTION,
    RESPONSE_MASK,
    ROLLOUT_LOGPROBS,
    STALENESS,
    STREAM_TAKE,
    TOKEN_WEIGHT_VERSION,
    UID,
    WEIGHT_VERSION,
    Batch,
)
from raygraph.data.prompts import PromptDataset
from raygraph.data.toy import write_toy_dataset
from raygraph.models.loading import load_causal_lm, load_tokenizer
from raygraph.models.logprobs import response_logprobs
from raygraph.workers.rollout_hf import HFRolloutWorker
from raygraph.workers.streaming_episodes import StreamedEpisodes

# two turns of up to 24 tokens (a random model is wrong at turn 1, so retry_with_feedback asks
# again): each turn takes two waves of at most 16 tokens, so updates land inside turns
AGENT = {"budgets": {"max_turns": 2, "max_new_tokens": 24, "max_total_tokens": 128, "max_message_tokens": 8},
         "env": "retry_with_feedback"}


@pytest.fixture(scope="module")
def prompts(tiny_model_path, tmp_path_factory):
    train, _ = write_toy_dataset(tmp_path_factory.mktemp("toy"), n_train=16, n_val=4)
    return PromptDataset(train, load_tokenizer(tiny_model_path), max_prompt_length=32).to_batch(range(6))


def _worker(path: str, partial: bool = True) -> HFRolloutWorker:
    return HFRolloutWorker(model_path=path, seed=0, n=2, max_new_tokens=24, temperature=1.0, micro_batch_size=8,
                           agent=AGENT, partial_rollouts=partial)



def _model(path: str, weights: list[tuple[str, torch.Tensor]] | None = None) -> torch.nn.Module:
    model = load_causal_lm(path).eval()
    if weights is not None:
        model.load_state_dict(dict(weights))
    return model


def test_episodes_streamed_across_weight_updates_keep_each_tokens_version_and_logprob(tiny_model_path, prompts):
    """The rank's background agent loop runs 12 two-turn episodes while the main thread loads two
    new weight versions, each once the loop has made 5 model calls with the previous one, and
    runs a greedy validation between the two (its log-probs are version 1's). Every
    model token's log-prob is its own version's (recomputed with the observations attended),
    versions never go down along an episode, an update landed inside a turn, the tool/observation
    tokens carry the version before them, and the per-version token counts add up."""
    worker = _worker(tiny_model_path)
    calls, reached = itertools.count(1), threading.Event()
    worker.model.register_forward_pre_hook(lambda *_: reached.set() if next(calls) % 5 == 0 else None)
    models = {0: _model(tiny_model_path)}
    uids = list(prompts[UID])
    worker.stream_submit(prompts)
    try:
        for version in (1, 2):
            assert reached.wait(60), "the loop made no model calls"
            new = perturbed(worker.model, seed=version)
            worker.load_weights([new], version=version)
            reached.clear()
            models[version] = _model(tiny_model_path, new)
            if version == 1:   # a validation's episodes on the same engine, while the stream runs
                validation = worker.generate(prompts.select([0, 1]), greedy=True)
        figures = worker.stream_wait(uids, timeout_s=120)
        assert figures["ready"] == 1.0 and figures["in_flight"] == 0.0
        rows = worker.stream_take(Batch(meta={STREAM_TAKE: {0: uids}}))
    finally:
        worker.stream_stop()
    assert list(rows[UID]) == [u for u in uids for _ in range(2)]   # whole groups, in order
    seen = validation[RESPONSE_MASK].bool()
    assert len(validation) == 2 and (validation[AGENT_TURNS] >= 1).all()
    assert torch.allclose(validation[ROLLOUT_LOGPROBS][seen], response_logprobs(models[1], validation)[0][seen],
                          atol=1e-5)   # sampled with version 1 throughout
    assert (rows[AGENT_TURNS] == 2).any()
    mask, versions = rows[RESPONSE_MASK].bool(), rows[TOKEN_WEIGHT_VERSION]
    observed = rows[RESPONSE_ATTENTION].bool() & ~mask
    assert observed.any() and set(versions[mask].tolist()) == {0, 1, 2}
    straddled = 0
    for i in range(len(rows)):
        length = int(rows[RESPONSE_ATTENTION][i].sum())
        v = versions[i, :length]
        assert bool((v[1:] >= v[:-1]).all())   # an observation token has the version before it
        turns = torch.cumsum(torch.cat([torch.tensor([1]), (mask[i, 1:length] & ~mask[i, :length - 1]).long()]), 0)
        straddled += any(len(set(v[(turns == t) & mask[i, :length]].tolist())) > 1 for t in turns.unique())
    assert straddled, "no update landed inside a model turn"
    expected = torch.zeros_like(rows[ROLLOUT_LOGPROBS])
    for version, model in models.items():
        expected = torch.where(versions == version, response_logprobs(model, rows)[0], expected)
    assert torch.allclose(rows[ROLLOUT_LOGPROBS][mask], expected[mask], atol=1e-5)
    late = mask & (versions == 2)
    assert (response_logprobs(models[0], rows)[0] - expected)[late].abs().max() > 1e-2   # versions differ
    assert rows[WEIGHT_VERSION].tolist() == [int(versions[i][mask[i]].min()) for i in range(len(rows))]
    assert rows[STALENESS].tolist() == (2 - rows[WEIGHT_VERSION]).tolist()
    generated = {int(k[len("tokens_v"):]): v for k, v in figures.items() if k.startswith("tokens_v")}
    assert generated == {v: float(((versions == v) & mask).sum()) for v in (0, 1, 2)}


def test_without_partial_rollouts_an_update_waits_for_the_started_episodes(tiny_model_path, prompts):
    """partial_rollouts=false: an update that comes while the first groups' episodes run lands
    once they have ended; groups submitted while it waits start after it. No episode mixes
    versions, and each has the version it ran with."""
    worker = _worker(tiny_model_path, partial=False)
    calls, reached = itertools.count(1), threading.Event()
    worker.model.register_forward_pre_hook(lambda *_: reached.set() if next(calls) == 3 else None)
    first, later = prompts.select([0, 1, 2]), prompts.select([3, 4, 5])
    worker.stream_submit(first)
    try:
        assert reached.wait(60)
        update = threading.Thread(target=worker.load_weights, args=([perturbed(worker.model, seed=1)], 1))
        update.start()
        while worker._no_update.is_set():   # until the update is waiting (for the started episodes)
            time.sleep(0.001)
        worker.stream_submit(later)
        update.join(120)
        assert not update.is_alive()
        everything = list(first[UID]) + list(later[UID])
        assert worker.stream_wait(everything, timeout_s=120)["ready"] == 1.0
        rows = worker.stream_take(Batch(meta={STREAM_TAKE: {0: everything}}))
    finally:
        worker.stream_stop()
    mask, versions = rows[RESPONSE_MASK].bool(), rows[TOKEN_WEIGHT_VERSION]
    per_row = [set(versions[i][mask[i]].tolist()) for i in range(len(rows))]
    assert per_row == [{0}] * 6 + [{1}] * 6


def _batch(uids: list[str]) -> Batch:
    ids = torch.tensor([[0, 5, 6]] * len(uids))
    return Batch({PROMPT_IDS: ids, PROMPT_MASK: (ids > 0).long()}, {UID: uids})


def test_groups_of_episodes_are_handed_out_only_whole_and_once(tiny_model_path):
    no_update = threading.Event()
    no_update.set()
    streamed = StreamedEpisodes(2, load_tokenizer(tiny_model_path), partial=True, no_update=no_update)
    streamed.submit(_batch(["a", "b"]))
    assert streamed.in_flight() == 4
    prompts, rows, _ = streamed.more([])   # the loop takes the four episodes
    assert prompts == [[5, 6]] * 4 and [r["uid"] for r in rows] == ["a", "a", "b", "b"]
    episodes = [Episode(i, [5, 6], None) for i in range(4)]
    for ep in episodes[:3]:   # both of "a", one of "b"
        ep.add_model_turn([7, 8], [-1.0, -2.0], "", versions=[3, 4])
        ep.finish("none")
    assert streamed.more(episodes) is None and streamed.in_flight() == 1
    assert not streamed.wait_for(["b"], timeout_s=0.01) and streamed.wait_for(["a"], timeout_s=0.01)
    with pytest.raises(ValueError, match="taken only whole"):
        streamed.take(["b"], version=5)
    taken = streamed.take(["a"], version=5)
    assert taken[TOKEN_WEIGHT_VERSION].tolist() == [[3, 4]] * 2 and taken[STALENESS].tolist() == [2, 2]
    with pytest.raises(KeyError, match="no streamed group"):
        streamed.take(["a"], version=5)
    with pytest.raises(ValueError, match="submitted twice"):
        streamed.submit(_batch(["b"]))


class _Breaks:
    """A user environment with a bug."""

    def __init__(self, row):
        pass

    def step(self, response):
        raise ValueError("the environment broke")


def test_an_environment_that_raises_in_a_streamed_episode_fails_the_ranks_next_call_with_its_message(
        tiny_model_path, prompts):
    """The background loop dies with the environment's error; the rank's next streaming call (the
    driver's wait, in slices of 2 s) raises it, naming the environment and the episode, instead of
    waiting for a group that will never finish."""
    from raygraph.agents.env import register_env

    register_env("test_agent_streaming.breaks", _Breaks)
    worker = HFRolloutWorker(model_path=tiny_model_path, seed=0, n=2, max_new_tokens=4, temperature=1.0,
                             agent={**AGENT, "env": "test_agent_streaming.breaks"})
    uids = list(prompts.select([0])[UID])
    worker.stream_submit(prompts.select([0]))
    try:
        with pytest.raises(RuntimeError, match=r"streaming episode loop failed: .*_Breaks raised in episode \d+ "
                                               r"\(uid .*\) after turn 1: ValueError: the environment broke"):
            for _ in range(10):
                worker.stream_wait(uids, timeout_s=2.0)
    finally:
        worker.stream_stop()
