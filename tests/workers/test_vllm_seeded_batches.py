"""Seeded requests whose prompts exceed one scheduler batch, on the real engine (issue 29).

vLLM 0.32 chunks a prefill that does not fit the step's token budget (`max_num_batched_tokens`,
4096 on the CPU build), discards the sample of the partly prefilled request and rewinds that
request's generator offset; a CPU generator has no offset, so the engine died
("CPU Generator does not use offset", then `EngineDeadError`). `vllm_compat.build_engine` turns
chunked prefill off on the CPU build; these tests send more prompt tokens than one batch holds.

One engine for the module (tiny Qwen2 at size "small": head_dim 32, the smallest vLLM's CPU
attention takes), held by a `VLLMRolloutWorker`; the last test kills it.
"""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.slow   # a vLLM engine start: not in `make test-fast`

pytest.importorskip("vllm")

from raygraph.batch import PROMPT_IDS, PROMPT_MASK, RESPONSES, UID, Batch  # noqa: E402
from raygraph.models.tiny import build_tiny_lm  # noqa: E402
from raygraph.workers import vllm_compat  # noqa: E402
from raygraph.workers.rollout_vllm import VLLMRolloutWorker  # noqa: E402

BUDGET = 4096           # vLLM 0.32's max_num_batched_tokens on the CPU build (LLM class)
ROWS, PROMPT_LEN = 48, 100   # 4800 prompt tokens > BUDGET; token ids 10..89 (the tiny vocabulary has 93)


@pytest.fixture(scope="module")
def worker(tmp_path_factory):
    path = build_tiny_lm(tmp_path_factory.mktemp("vllm_seeded") / "m", size="small", seed=0)
    with pytest.MonkeyPatch.context() as env:   # the last test sends the engine a function (pickled)
        env.setenv("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")
        w = VLLMRolloutWorker(model_path=str(path), seed=0, n=4, max_new_tokens=4, enforce_eager=True)
        yield w
    w.close()


def _prompts(rows: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(0)
    return torch.randint(10, 90, (rows, PROMPT_LEN), generator=g).tolist()


def _params(seeds: list[int]) -> list:
    return [vllm_compat.sampling_params(greedy=False, top_p=1.0, top_k=0, max_tokens=4, stop_token_ids=(),
                                        seed=s) for s in seeds]


def test_seeded_prompts_beyond_one_scheduler_batch_do_not_kill_the_cpu_engine(worker):
    """The bare reproduction: fails with EngineDeadError when chunked prefill is on."""
    prompts = _prompts(ROWS)
    assert ROWS * PROMPT_LEN > BUDGET   # with chunking, row 40's prefill is split here and the engine dies
    outputs = vllm_compat.generate_tokens(worker.engine, prompts, _params(list(range(ROWS))))
    assert len(outputs) == ROWS and all(1 <= len(tokens) <= 4 for tokens, _ in outputs)


def test_a_seeded_row_samples_the_same_alone_as_in_a_batch_larger_than_the_budget(worker):
    """Per-row reproducibility: a row's sample depends on its seed, the weights and its prompt,
    not on the other rows or on how the scheduler split the batch into steps."""
    prompts, seeds = _prompts(ROWS), [1000 + i for i in range(ROWS)]
    together = vllm_compat.generate_tokens(worker.engine, prompts, _params(seeds))
    for i in (0, BUDGET // PROMPT_LEN, ROWS - 1):   # in the first step, at the budget's edge, the last
        alone = vllm_compat.generate_tokens(worker.engine, [prompts[i]], _params([seeds[i]]))
        assert alone[0][0] == together[i][0]
        assert alone[0][1] == pytest.approx(together[i][1], abs=1e-5)


def test_the_worker_samples_n_rows_per_prompt_beyond_the_budget_reproducibly(worker):
    """16 prompts x n=4 x 80 tokens = 5120 prompt tokens in one `generate`; reseeding repeats it."""
    ids = torch.tensor(_prompts(16))[:, :80]
    batch = Batch({PROMPT_IDS: ids, PROMPT_MASK: torch.ones_like(ids)}, {UID: [f"p{i}" for i in range(16)]})
    worker.reseed(7)
    first = worker.generate(batch)
    worker.reseed(7)
    again = worker.generate(batch)
    assert len(first) == 64 and torch.equal(first[RESPONSES], again[RESPONSES])


def test_prefix_caching_on_a_hybrid_model_is_refused_on_the_cpu_build(tmp_path, worker):
    from transformers import JambaConfig

    JambaConfig(num_hidden_layers=2, hidden_size=64, architectures=["JambaForCausalLM"]).save_pretrained(tmp_path)
    reason = vllm_compat.seeded_sampling_problem(str(tmp_path), None)   # vLLM's default: on
    assert reason is not None and "chunked prefill" in reason
    assert vllm_compat.seeded_sampling_problem(str(tmp_path), False) is None
    assert vllm_compat.seeded_sampling_problem(worker.engine.model_config.model, None) is None  # plain Qwen2


def _fail_next_sample(worker_self) -> None:   # runs in the engine's worker process
    def fail(*args, **kwargs):
        raise RuntimeError("injected sampler failure")

    worker_self.model_runner.sample_tokens = fail


def test_a_dead_engine_is_one_error_with_its_root_cause_and_counts_as_recoverable(worker):
    """Runs last (it kills the module's engine). The engine's worker raises while sampling; the
    rollout worker raises RolloutEngineDied with that line, and the driver's RoleError names role,
    rank and cause and is recovered like a dead actor."""
    from raygraph.cluster.errors import CallSite, RemoteFailure, RoleError
    from raygraph.run.recovery import failure_is_recoverable

    worker.engine.collective_rpc(_fail_next_sample)
    ids = torch.tensor(_prompts(2))
    batch = Batch({PROMPT_IDS: ids, PROMPT_MASK: torch.ones_like(ids)}, {UID: ["a", "b"]})
    with pytest.raises(vllm_compat.RolloutEngineDied, match="RuntimeError: injected sampler failure") as died:
        worker.generate(batch)
    assert died.value.__cause__ is None and died.value.__suppress_context__   # no vLLM traceback chain
    with pytest.raises(vllm_compat.RolloutEngineDied, match="injected sampler failure"):   # and stays dead
        worker.generate(batch)
    failure = RemoteFailure.wrap(CallSite("rollout", 1, "run/rollout/1"), "generate", died.value)   # in the actor
    error = RoleError(failure.site, failure.method, failure.tb, failure.cause_type)   # as the driver builds it
    assert "role 'rollout' rank 1" in str(error) and "injected sampler failure" in str(error)
    assert len(error.remote_traceback.splitlines()) < 20
    assert failure_is_recoverable(error, dead_actors=[])
