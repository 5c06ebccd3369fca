"""The vLLM rollout engine against the HF one's contract, with the real engine (the CPU build of
vLLM in CI): batch layout and stop handling, log-probs equal to the policy's recomputation,
weight updates into the running engine, prefetch and checkpoint round trip.

One engine serves the whole module (starting one costs ~15-30 s on 2 cores). The model is the
tiny Qwen2 at size "small" (head_dim 32, as every preset: vLLM's CPU attention needs >= 32).
"""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

pytest.importorskip("vllm")
pytestmark = pytest.mark.slow   # one engine start (~15-30 s on 2 cores): not in `make test-fast`

from raygraph.batch import (  # noqa: E402
    PROMPT_IDS,
    PROMPT_MASK,
    RESPONSE_ATTENTION,
    RESPONSE_LENGTH,
    RESPONSE_MASK,
    RESPONSE_TEXT,
    RESPONSES,
    ROLLOUT_LOGPROBS,
    STALENESS,
    TOKEN_WEIGHT_VERSION,
    UID,
    WEIGHT_VERSION,
    Batch,
)
from raygraph.models.loading import load_causal_lm, load_tokenizer  # noqa: E402
from raygraph.models.logprobs import response_logprobs  # noqa: E402
from raygraph.models.tiny import build_tiny_lm  # noqa: E402
from raygraph.workers.rollout_hf import HFRolloutWorker  # noqa: E402
from raygraph.workers.rollout_vllm import VLLMRolloutWorker  # noqa: E402

PROMPTS = ["<|user|>1+1=?<|end|><|assistant|>", "<|user|>a much longer question?<|end|><|assistant|>",
           "<|user|>x<|end|><|assistant|>"]
SAMPLING = {"temperature": 0.7, "top_p": 0.9, "top_k": 20, "max_new_tokens": 12}
TOLERANCE = 1e-4  # fp32 on both sides; measured ~5e-7


@pytest.fixture(scope="module")
def model_paths(tmp_path_factory) -> tuple[str, str]:
    """Two differently seeded tiny models with head_dim 32 (hidden 128, 4 heads)."""
    root = tmp_path_factory.mktemp("vllm_models")
    return str(build_tiny_lm(root / "a", size="small", seed=0)), str(build_tiny_lm(root / "b", size="small", seed=1))


@pytest.fixture(scope="module")
def stop_ids(model_paths) -> list[int]:
    """Digits end a response too: ~1 token in 10, so most rows stop before the length cap."""
    return load_tokenizer(model_paths[0]).convert_tokens_to_ids(list("0123456789"))


@pytest.fixture(scope="module")
def worker(model_paths, stop_ids):
    w = VLLMRolloutWorker(model_path=model_paths[0], seed=3, n=2, stop_token_ids=stop_ids,
                          enforce_eager=True, **SAMPLING)
    yield w
    w.close()


@pytest.fixture(scope="module")
def prompts(model_paths) -> Batch:
    tok = load_tokenizer(model_paths[0])
    enc = tok(PROMPTS, padding=True, return_tensors="pt", add_special_tokens=False)
    return Batch({PROMPT_IDS: enc.input_ids, PROMPT_MASK: enc.attention_mask},
                 {UID: ["p0", "p1", "p2"], "extra_info": [{"i": 0}, {"i": 1, "tags": ["x"]}, {"i": np.int64(2)}]})


def _buckets(path: str, per_bucket: int = 7) -> list[list[tuple[str, torch.Tensor]]]:
    """A policy-style weight stream: parameters in HF names, tied ones once, a few per bucket."""
    named = [(n, p.detach().clone()) for n, p in load_causal_lm(path, dtype="float32").named_parameters()]
    return [named[i:i + per_bucket] for i in range(0, len(named), per_bucket)]


def _recomputed(path: str, rollouts: Batch) -> torch.Tensor:
    return response_logprobs(load_causal_lm(path, dtype="float32"), rollouts, temperature=SAMPLING["temperature"])[0]


def test_generate_has_the_hf_workers_columns_layout_and_stop_handling(worker, model_paths, stop_ids, prompts):
    out = worker.generate(prompts)
    hf = HFRolloutWorker(model_path=model_paths[0], n=2, stop_token_ids=stop_ids, **SAMPLING).generate(prompts)
    assert set(out.columns()) == set(hf.columns())
    assert {k: v.dtype for k, v in out.tensors.items()} == {k: v.dtype for k, v in hf.tensors.items()}
    assert list(out[UID]) == ["p0", "p0", "p1", "p1", "p2", "p2"]
    assert torch.equal(out[PROMPT_IDS], prompts[PROMPT_IDS].repeat_interleave(2, 0))
    none = worker.generate(prompts.select(slice(0, 0)))   # an unneeded DAPO refill round
    assert len(none) == 0 and set(none.columns()) == set(hf.columns())

    mask, lengths, responses = out[RESPONSE_MASK], out[RESPONSE_LENGTH], out[RESPONSES]
    width = responses.shape[1]
    assert width == int(lengths.max()) and torch.equal(lengths, mask.sum(-1))
    assert torch.equal(mask, (torch.arange(width) < lengths[:, None]).long())  # ones, then padding
    stops = torch.tensor(worker.stop_token_ids)
    assert 1 in worker.stop_token_ids  # the tokenizer's eos is always a stop token
    stopped = 0
    for row, n_tokens in zip(responses, lengths.tolist()):
        tokens = row[:n_tokens]
        assert not torch.isin(tokens[:-1], stops).any()   # nothing generated after a stop token
        if torch.isin(tokens[-1], stops):                 # the stop token is part of the response
            stopped += 1
        else:
            assert n_tokens == SAMPLING["max_new_tokens"]
        assert (row[n_tokens:] == worker.tokenizer.pad_token_id).all()
    assert stopped > 0, "no row hit a stop token: the stop handling went untested"
    assert (out[ROLLOUT_LOGPROBS][mask == 0] == 0).all() and (out[ROLLOUT_LOGPROBS][mask == 1] < 0).all()
    assert list(out[RESPONSE_TEXT]) == worker.tokenizer.batch_decode(
        [r[:k].tolist() for r, k in zip(responses, lengths.tolist())], skip_special_tokens=True)
    assert out[WEIGHT_VERSION].tolist() == [0] * 6

    greedy = worker.generate(prompts, greedy=True)
    assert len(greedy) == 3 and list(greedy[UID]) == ["p0", "p1", "p2"]


def test_the_engines_first_error_file_is_in_a_directory_named_after_its_process(worker):
    """So that the next engine start on the machine removes it once this process has ended
    (vllm_deaths.errors_dir; tests/workers/test_vllm_error_dirs.py)."""
    assert worker._errors.name == "first_error.txt"
    assert worker._errors.parent.name.startswith(f"raygraph-vllm-{os.getpid()}-")


def test_rollout_logprobs_equal_the_policys_recomputation(worker, model_paths, prompts):
    """log softmax(logits / T) of the sampled tokens, before top-k/top-p, sampled and greedy."""
    for greedy in (False, True):
        out = worker.generate(prompts, greedy=greedy, n=4 if not greedy else None)
        diff = (out[ROLLOUT_LOGPROBS] - _recomputed(model_paths[0], out)).abs()[out[RESPONSE_MASK] == 1]
        print(f"\nlog-prob agreement (greedy={greedy}, {diff.numel()} tokens): "
              f"max {diff.max().item():.3g}, mean {diff.mean().item():.3g}")
        assert diff.max() < TOLERANCE


def test_greedy_decoding_matches_the_hf_worker_token_for_token(worker, model_paths, stop_ids, prompts):
    hf = HFRolloutWorker(model_path=model_paths[0], stop_token_ids=stop_ids, **SAMPLING)
    ours, theirs = worker.generate(prompts, greedy=True), hf.generate(prompts, greedy=True)
    assert torch.equal(ours[RESPONSES], theirs[RESPONSES])
    assert torch.allclose(ours[ROLLOUT_LOGPROBS], theirs[ROLLOUT_LOGPROBS], atol=TOLERANCE)


def test_seeded_sampling_is_reproducible(worker, prompts):
    worker.reseed(11)
    a = worker.generate(prompts)
    worker.reseed(11)
    b = worker.generate(prompts)
    worker.reseed(12)
    c = worker.generate(prompts)
    assert torch.equal(a[RESPONSES], b[RESPONSES]) and not torch.equal(a[RESPONSES], c[RESPONSES])


def test_load_weights_switches_the_running_engine_to_the_new_weights(worker, model_paths, prompts):
    new, old = model_paths[1], model_paths[0]
    bad_name = [[("model.layers.0.nope.weight", torch.zeros(1))]]
    with pytest.raises(KeyError, match="nope"):
        worker.load_weights(bad_name, version=7)
    bad_shape = [[("model.norm.weight", torch.zeros(3))]]
    with pytest.raises(ValueError, match="model.norm.weight"):
        worker.load_weights(bad_shape, version=7)
    assert worker.weight_version == 0
    before = worker.generate(prompts, greedy=True)
    try:
        stats = worker.load_weights(_buckets(new), version=1)
        expected = sum(t.numel() * t.element_size() for b in _buckets(new) for _, t in b)
        assert stats == {"loaded": sum(len(b) for b in _buckets(new)), "bytes": expected, "version": 1}
        assert worker.weight_version == 1
        after = worker.generate(prompts, greedy=True)
        assert after[WEIGHT_VERSION].tolist() == [1] * 3
        assert not torch.equal(after[RESPONSES], before[RESPONSES])
        diff = (after[ROLLOUT_LOGPROBS] - _recomputed(new, after)).abs()[after[RESPONSE_MASK] == 1]
        print(f"\nlog-prob agreement after load_weights: max {diff.max().item():.3g}, mean {diff.mean().item():.3g}")
        assert diff.max() < TOLERANCE
        # argmax under the new weights, token for token
        hf_new = HFRolloutWorker(model_path=new, stop_token_ids=worker.stop_token_ids, **SAMPLING)
        assert torch.equal(after[RESPONSES], hf_new.generate(prompts, greedy=True)[RESPONSES])
    finally:  # the engine is shared by the module: put the first model back (lm_head alias for the tie)
        buckets = [[("lm_head.weight" if n == "model.embed_tokens.weight" else n, t) for n, t in b]
                   for b in _buckets(old)]
        worker.load_weights(buckets, version=2)
    restored = worker.generate(prompts, greedy=True)
    assert torch.equal(restored[RESPONSES], before[RESPONSES])
    worker.load_weights(_buckets(old, per_bucket=100), version=0)


def test_a_streamed_sample_continues_across_a_weight_update_with_each_tokens_version(worker, model_paths, prompts):
    """Streaming (issue 26) on the vLLM CPU engine: a wave of at most 16 tokens with model a
    (version 0), the update to model b mid-request, the rest with b from the same token ids. Each
    token's log-prob is its own version's, recomputed by the policy's code at the sampling
    temperature."""
    from raygraph.workers.streaming import WAVE_TOKENS, StreamedSamples

    streamed = StreamedSamples(n=8, pad_id=worker.tokenizer.pad_token_id)   # 24 samples: some outlive a wave
    streamed.submit(prompts)
    worker.max_new_tokens = 40
    try:
        wave = streamed.unfinished(100)
        streamed.extend(wave, worker.continue_samples(wave, 0, lambda: True), version=0)
        assert max(len(s.tokens) for s in wave) == WAVE_TOKENS
        worker.load_weights(_buckets(model_paths[1]), version=1)
        while streamed.in_flight():
            wave = streamed.unfinished(100)
            streamed.extend(wave, worker.continue_samples(wave, 1, lambda: True), version=1)
        rows = streamed.take(list(prompts[UID]), version=1)
    finally:
        worker.max_new_tokens = SAMPLING["max_new_tokens"]
        worker.load_weights(_buckets(model_paths[0], per_bucket=100), version=0)
    mask, versions = rows[RESPONSE_MASK].bool(), rows[TOKEN_WEIGHT_VERSION]
    mixed = [i for i in range(len(rows)) if {0, 1} <= set(versions[i][mask[i]].tolist())]
    assert mixed, "no sample straddled the update"
    for i in mixed:
        length = int(mask[i].sum())
        assert versions[i][:length].tolist() == [0] * WAVE_TOKENS + [1] * (length - WAVE_TOKENS)
    expected = torch.where(versions == 0, _recomputed(model_paths[0], rows), _recomputed(model_paths[1], rows))
    diff = (rows[ROLLOUT_LOGPROBS] - expected).abs()[mask]
    assert diff.max() < TOLERANCE
    late = mask & (versions == 1)
    assert (_recomputed(model_paths[0], rows) - expected).abs()[late].max() > 1e-2   # the versions differ


class _TwoTurns:
    """An environment that asks once more after the first turn."""

    def __init__(self, row):
        self.turn = 0

    def step(self, response):
        self.turn += 1
        return "again", 0.0, self.turn >= 2


def test_streamed_episodes_continue_their_turns_across_a_weight_update(worker, model_paths, prompts):
    """Streaming multi-turn episodes on the vLLM CPU engine: 24 two-turn episodes whose turns are
    generated in waves of at most 16 tokens (`StreamTurns`), with the update to model b right after
    the first wave. Turns longer than a wave continue with b from their token ids; every model
    token's log-prob is its own version's, recomputed with the observations attended."""
    import threading

    from raygraph.agents.env import register_env
    from raygraph.agents.loop import AgentLoop
    from raygraph.workers.streaming import WAVE_TOKENS
    from raygraph.workers.streaming_episodes import StreamedEpisodes, StreamTurns

    register_env("test_rollout_vllm.two_turns", _TwoTurns)
    loop = AgentLoop(tokenizer=worker.tokenizer, stop_token_ids=worker.stop_token_ids, env="test_rollout_vllm.two_turns",
                     budgets={"max_turns": 2, "max_new_tokens": 24, "max_total_tokens": 128, "max_message_tokens": 8})
    ready = threading.Event()
    ready.set()
    streamed = StreamedEpisodes(8, worker.tokenizer, partial=True, no_update=ready)
    waves = []

    def after_wave(version: int, tokens: int) -> None:
        waves.append(version)
        if len(waves) == 1:
            worker.load_weights(_buckets(model_paths[1]), version=1)

    turns = StreamTurns(worker.continue_samples, lambda: worker._weight_version, 256, ready, partial=True,
                        stopped=lambda: False, count_tokens=after_wave)
    streamed.submit(prompts)
    try:
        loop.run(turns, [], [], [], more=streamed.more, streaming=True)
        rows = streamed.take(list(prompts[UID]), version=1)
    finally:
        loop.shutdown()
        worker.load_weights(_buckets(model_paths[0], per_bucket=100), version=0)
    assert waves[:2] == [0, 1] and set(waves) == {0, 1}
    mask, versions = rows[RESPONSE_MASK].bool(), rows[TOKEN_WEIGHT_VERSION]
    assert (rows[RESPONSE_ATTENTION].bool() & ~mask).any()   # observations between the turns
    straddled = [i for i in range(len(rows)) if versions[i][mask[i]][:WAVE_TOKENS + 1].tolist()
                 == [0] * WAVE_TOKENS + [1]]
    assert straddled, "no first turn outlived the first wave"
    expected = torch.where(versions == 0, _recomputed(model_paths[0], rows), _recomputed(model_paths[1], rows))
    assert (rows[ROLLOUT_LOGPROBS] - expected).abs()[mask].max() < TOLERANCE
    late = mask & (versions == 1)
    assert (_recomputed(model_paths[0], rows) - expected).abs()[late].max() > 1e-2   # the versions differ


def test_a_wave_checks_each_streamed_samples_own_length_against_max_model_len(worker):
    """A sample near its end (long prompt + tokens, few left) beside a fresh one (short prompt, all
    max_new_tokens left) fits, though the longest ids plus the largest budget would not (a check
    that mixed the two stopped a benchmark run); a sample that itself exceeds is refused."""
    from raygraph.workers.streaming import Sample

    room, budget = worker.max_model_len, 40
    worker.max_new_tokens = budget
    try:
        near_end = Sample(prompt_ids=[10] * (room - budget), tokens=[11] * (budget - 4))
        fresh = Sample(prompt_ids=[10] * 5)
        late, new = worker.continue_samples([near_end, fresh], 0, lambda: True)
        assert 1 <= len(late.tokens) <= 4 and 1 <= len(new.tokens) <= 16
        too_long = Sample(prompt_ids=[10] * (room - budget + 1), tokens=[11] * (budget - 4))
        with pytest.raises(ValueError, match="max_model_len"):
            worker.continue_samples([too_long, fresh], 0, lambda: True)
    finally:
        worker.max_new_tokens = SAMPLING["max_new_tokens"]


def test_a_corrupted_bucket_is_refused_by_the_transport_and_never_loaded(worker, model_paths, prompts, stop_ids):
    from raygraph.cluster.errors import WeightSyncError
    from raygraph.cluster.weights import InProcessTransport

    transport = InProcessTransport()   # what a colocated sync uses; the collective one checks the same digests
    transport.send(iter(_buckets(model_paths[1])), 9, corrupt_bucket=1)
    with pytest.raises(WeightSyncError, match="bucket 1.*NOT loaded"):
        transport.receive(worker.load_weights)
    assert worker.weight_version == 0   # the update did not complete
    # a whole verified update afterwards puts the engine back on the first model, token for token
    transport.send(iter(_buckets(model_paths[0], per_bucket=100)), 0)
    assert transport.receive(worker.load_weights)["weights/verified"] == 1.0
    hf = HFRolloutWorker(model_path=model_paths[0], stop_token_ids=stop_ids, **SAMPLING)
    assert torch.equal(worker.generate(prompts, greedy=True)[RESPONSES], hf.generate(prompts, greedy=True)[RESPONSES])


def test_an_incomplete_update_is_refused(worker, model_paths):
    partial = [b for b in _buckets(model_paths[0])][:1]
    with pytest.raises(ValueError, match="lacks"):
        worker.load_weights(partial, version=5)
    assert worker.weight_version == 0
    worker.load_weights(_buckets(model_paths[0], per_bucket=100), version=0)  # whole again


def test_prefetched_rollouts_are_taken_later_and_survive_a_checkpoint(worker, model_paths, prompts, tmp_path):
    worker.reseed(5)
    assert worker.prefetch(prompts) == 6
    kept = worker.prefetched.kept[("p0", "p1", "p2")]
    worker.save_checkpoint(tmp_path)
    after_save = worker.generate(prompts)

    worker.load_weights(_buckets(model_paths[0], per_bucket=100), version=1)  # a sync happens
    taken = worker.take_or_generate(prompts.with_columns())
    assert torch.equal(taken[RESPONSES], kept[RESPONSES]) and taken[STALENESS].tolist() == [1] * 6
    assert worker.prefetched.kept == {}

    worker.reseed(99)
    worker.load_checkpoint(tmp_path)
    assert worker.weight_version == 0
    restored = worker.prefetched.kept[("p0", "p1", "p2")]
    assert set(restored.columns()) == set(kept.columns())
    assert all(torch.equal(restored[k], kept[k]) for k in kept.tensors)
    assert list(restored["extra_info"]) == [{"i": 0}] * 2 + [{"i": 1, "tags": ["x"]}] * 2 + [{"i": 2}] * 2
    assert list(restored[RESPONSE_TEXT]) == list(kept[RESPONSE_TEXT])
    assert torch.equal(worker.generate(prompts)[RESPONSES], after_save[RESPONSES])  # generator state too


def test_a_checkpoint_refuses_columns_json_cannot_hold(worker, prompts, tmp_path):
    worker.prefetch(prompts.with_columns(extra_info=[object()] * 3))
    with pytest.raises(TypeError, match="extra_info"):
        worker.save_checkpoint(tmp_path)
    worker.prefetched.kept.clear()


def test_a_prompt_that_leaves_no_room_for_max_new_tokens_is_refused(worker):
    room = worker.max_model_len - SAMPLING["max_new_tokens"]
    long = Batch({PROMPT_IDS: torch.full((1, room + 1), 10), PROMPT_MASK: torch.ones(1, room + 1, dtype=torch.long)},
                 {UID: ["long"]})
    with pytest.raises(ValueError, match="max_model_len"):
        worker.generate(long)


def test_sleep_mode_is_refused_on_the_cpu_backend(model_paths):
    from raygraph.workers import vllm_compat

    if not vllm_compat.on_cpu():
        pytest.skip("the CPU backend's refusal")
    with pytest.raises(ValueError, match="enable_sleep_mode"):
        VLLMRolloutWorker(model_path=model_paths[0], max_new_tokens=4, enable_sleep_mode=True)


def test_the_cpu_engine_core_runs_in_the_workers_process_and_leaves_its_threads_and_rngs_alone(
        worker, model_paths, stop_ids):
    """On the CPU build with one rank the engine core runs in the worker's process
    (`vllm_engine_core=auto`, raygraph.workers.vllm_in_process): no vLLM process is started, and
    what vLLM does to a process it runs in is undone: the global RNGs are neither reseeded by the
    build nor moved by generating, `torch.set_num_threads` still works, the thread count is the
    caller's, and closing one engine leaves the process's distributed state to the other (the
    module's)."""
    import random

    import psutil

    from raygraph.workers import vllm_compat

    if not vllm_compat.on_cpu():
        pytest.skip("the CPU build's engine")

    def seed_and_draw(build=None):
        torch.manual_seed(1234)
        random.seed(1234)
        np.random.seed(1234)
        built = build() if build else None
        return built, (torch.rand(3).tolist(), random.random(), float(np.random.rand()))

    torch.set_num_threads(2)
    _, expected = seed_and_draw()
    w, drawn = seed_and_draw(lambda: VLLMRolloutWorker(model_path=model_paths[0], seed=3, n=2,
                                                       stop_token_ids=stop_ids, **SAMPLING))
    try:
        assert drawn == expected   # vLLM seeds the process's RNGs with 3 (and draws) when it runs here
        # Only vLLM's processes: a Ray cluster another test of this pytest worker started is a child too.
        assert [k.name() for k in psutil.Process().children(recursive=True) if k.name().startswith("VLLM")] == []
        # vLLM asks for 1 thread "for serving" during its start-up and leaves set_num_threads a no-op
        assert torch.get_num_threads() == 2
        torch.set_num_threads(1)
        assert torch.get_num_threads() == 1
        ids = torch.full((2, 3), 10)
        batch = Batch({PROMPT_IDS: ids, PROMPT_MASK: torch.ones_like(ids)}, {UID: ["a", "b"]})
        torch.manual_seed(99)
        want = torch.rand(3)
        torch.manual_seed(99)
        assert len(w.generate(batch)) == 4
        assert torch.equal(torch.rand(3), want)   # the CPU sampler's per-step draws stay in the engine
    finally:
        torch.set_num_threads(1)
        w.close()
    assert len(worker.generate(batch)) == 4   # vLLM's shutdown would have destroyed its process groups


def test_in_process_is_refused_where_vllm_would_take_a_trained_roles_group(monkeypatch):
    """A colocated process in a torch.distributed group of several ranks keeps the engine in a
    process of its own (auto); asking for in_process there is a clear error."""
    import torch.distributed as dist

    from raygraph.workers import vllm_compat, vllm_in_process

    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_world_size", lambda: 2)
    monkeypatch.setattr(dist, "get_rank", lambda: 1)
    assert vllm_in_process.resolve("auto", 1) is False
    with pytest.raises(ValueError, match="rank 1 of a torch.distributed group of 2"):
        vllm_in_process.resolve("in_process", 1)
    assert vllm_in_process.resolve("own_process", 1) is False
    monkeypatch.setattr(dist, "get_world_size", lambda: 1)
    assert vllm_in_process.resolve("auto", 1) is vllm_compat.on_cpu()
    assert vllm_in_process.resolve("auto", 2) is False
    with pytest.raises(ValueError, match="valid: auto, in_process, own_process"):
        vllm_in_process.resolve("inline", 1)
    if vllm_compat.on_cpu():   # several NUMA nodes: vLLM would bind the whole process's memory to one
        from vllm.utils import cpu_resource_utils

        monkeypatch.setattr(cpu_resource_utils, "get_visible_memory_node", lambda: [0, 1])
        assert vllm_in_process.resolve("auto", 1) is False
        with pytest.raises(ValueError, match="2 NUMA memory nodes"):
            vllm_in_process.resolve("in_process", 1)


def test_killing_the_engine_process_mid_generate_raises_instead_of_hanging(model_paths, stop_ids):
    """An engine core in a process of its own (`own_process`; on GPUs always). vLLM 0.32's
    offline client stops reading outputs when its engine core process dies, so a `generate` in
    flight waited for ever; raygraph's watcher (vllm_compat) hands it `RolloutEngineDied`, naming
    the process and the signal."""
    import os
    import signal
    import threading
    import time

    import psutil

    from raygraph.workers import vllm_compat

    worker = VLLMRolloutWorker(model_path=model_paths[0], seed=3, n=2, stop_token_ids=stop_ids,
                               engine_core="own_process", **SAMPLING)
    ids = torch.full((64, 4), 10)
    batch = Batch({PROMPT_IDS: ids, PROMPT_MASK: torch.ones_like(ids)}, {UID: [f"p{i}" for i in range(64)]})
    worker.max_new_tokens, worker.stop_token_ids = 256, [worker.tokenizer.eos_token_id]   # long: killed in flight
    outcome: dict = {}

    def generate():
        try:
            worker.generate(batch)
            outcome["returned"] = True
        except Exception as exc:  # noqa: BLE001 - the test reads it
            outcome["error"] = exc

    thread = threading.Thread(target=generate, daemon=True)
    thread.start()
    time.sleep(1.0)
    (engine,) = [p for p in psutil.Process().children(recursive=True) if "EngineCore" in p.name()]
    os.kill(engine.pid, signal.SIGKILL)
    killed = time.monotonic()
    thread.join(timeout=30)
    assert not thread.is_alive(), "generate still waits 30 s after its engine was killed"
    assert time.monotonic() - killed < 10
    assert isinstance(outcome.get("error"), vllm_compat.RolloutEngineDied), outcome
    assert "EngineCore was killed by signal 9" in str(outcome["error"])
