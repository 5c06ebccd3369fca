"""Environments in Ray actors of their own (`rollout.agent.env_hosts`): the same episodes as in
process, each episode on the least-loaded host, every environment closed; a hung step ends its
episode without holding a thread and its host restarts after the run; a crashed host is an
`EnvHostDied` (which the run recovers at stage level: tests/agents/test_agent_chaos.py)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from raygraph.agents.episode import AgentBudgets
from raygraph.agents.loop import AgentLoop, EnvFailed
from raygraph.agents.reactions import EnvHostDied
from raygraph.models.tiny import build_tiny_tokenizer

TOK = build_tiny_tokenizer()
EOS = TOK.eos_token_id
PROMPT = TOK("1+", add_special_tokens=False)["input_ids"]
BUDGETS = AgentBudgets(max_turns=4, max_new_tokens=8, max_total_tokens=64, max_message_tokens=8)

ENVS = '''
import os
import time
from pathlib import Path


class Noted:
    """Rewards 0.5 per turn, done at turn `turns`; writes its pid when opened and a mark when
    closed; a row with `hang` sleeps 60 s in its step, one with `crash` ends its process."""

    def __init__(self, row, out: str, turns: int = 2):
        self.row, self.out, self.turns, self.k = row, Path(out), turns, 0
        (self.out / f"{row['uid']}.pid").write_text(str(os.getpid()))

    def step(self, response):
        self.k += 1
        if self.row.get("hang"):
            time.sleep(60)
        if self.row.get("crash"):
            os._exit(3)
        return f"o{self.k}", 0.5 * self.k, self.k >= self.turns

    def close(self):
        (self.out / f"{self.row['uid']}.closed").write_text("")
'''


class Engine:
    """Every submitted turn answers "a" + eos on the next poll."""
    lock_step = False

    def __init__(self):
        self.queue, self.aborted = [], []

    def submit(self, key, prompt, max_tokens, seed):
        self.queue.append(key)

    def pending(self):
        return len(self.queue)

    def poll(self):
        out = [(key, [5, EOS], [-0.25, -0.5]) for key in self.queue]
        self.queue = []
        return out

    def abort(self):
        self.aborted, self.queue = list(self.queue), []


@pytest.fixture
def env_ref(tmp_path) -> str:
    path = tmp_path / "noted_env.py"
    path.write_text(ENVS)
    return f"{path}:Noted"


def _loop(env_ref: str, out: Path, **kwargs) -> AgentLoop:
    return AgentLoop(tokenizer=TOK, stop_token_ids=[EOS], budgets=BUDGETS, env=env_ref,
                     env_args={"out": str(out)}, **kwargs)


def _rows(n: int, **flags) -> list[dict]:
    return [{"uid": f"u{i}", **{k: True for k, ids in flags.items() if i in ids}} for i in range(n)]


def _pids(out: Path, n: int) -> list[int]:
    return [int((out / f"u{i}.pid").read_text()) for i in range(n)]


def test_hosted_environments_give_the_in_process_episodes_in_processes_of_their_own(env_ref, tmp_path, ray_local):
    local_out, hosted_out = tmp_path / "local", tmp_path / "hosted"
    local_out.mkdir(), hosted_out.mkdir()
    local = _loop(env_ref, local_out).run(Engine(), [PROMPT] * 4, _rows(4), [1, 2, 3, 4])
    agent = _loop(env_ref, hosted_out, env_hosts=2, env_host_cpus=0.5)
    try:
        hosted = agent.run(Engine(), [PROMPT] * 4, _rows(4), [1, 2, 3, 4])
    finally:
        agent.shutdown()
    for a, b in zip(local, hosted):
        assert (a.tokens, a.mask, a.logprobs, a.rewards, a.truncation, a.turns) == \
               (b.tokens, b.mask, b.logprobs, b.rewards, b.truncation, b.turns)
    assert hosted[0].total_reward == 1.5 and hosted[0].truncation == "none"   # 0.5 + 1.0, done at turn 2
    assert set(_pids(local_out, 4)) == {os.getpid()}
    pids = _pids(hosted_out, 4)
    assert os.getpid() not in pids and len(set(pids)) == 2
    assert sorted(pids.count(p) for p in set(pids)) == [2, 2]   # each host took the least-loaded share
    assert all((hosted_out / f"u{i}.closed").is_file() for i in range(4))


def test_a_hung_hosted_step_ends_its_episode_frees_its_thread_and_its_host_restarts(env_ref, tmp_path, ray_local):
    # in process, one thread and a hung step stop the run (a thread cannot be killed): tests/agents/test_loop_failures.py
    agent = _loop(env_ref, tmp_path, env_hosts=2, env_host_cpus=0.5, env_workers=1, env_timeout_s=1.0)
    try:
        hosts = agent.reactor.envs
        before = list(hosts.pids)
        episodes = agent.run(Engine(), [PROMPT] * 4, _rows(4, hang={0, 1}), [1, 2, 3, 4])
        assert [ep.truncation for ep in episodes] == ["env_timeout", "env_timeout", "none", "none"]
        assert agent.hung == 0
        assert all(p != q for p, q in zip(before, hosts.pids)), "the hosts with a hung step were not restarted"
        again = agent.run(Engine(), [PROMPT] * 2, _rows(2), [1, 2])   # the restarted hosts serve the next run
        assert [ep.truncation for ep in again] == ["none", "none"]
        assert set(_pids(tmp_path, 2)) <= set(hosts.pids)
    finally:
        agent.shutdown()


def test_a_crashed_host_is_an_env_host_died_error_and_the_engine_is_left_clean(env_ref, tmp_path, ray_local):
    agent, engine = _loop(env_ref, tmp_path, env_hosts=1, env_host_cpus=0.5), Engine()
    try:
        with pytest.raises(EnvHostDied, match="env host 0 .* died during a step"):
            agent.run(engine, [PROMPT] * 2, _rows(2, crash={1}), [1, 2])
        assert not isinstance(EnvHostDied("x"), EnvFailed)   # recovered by restarting, not a user error
        assert engine.pending() == 0
    finally:
        agent.shutdown()


def test_env_hosts_without_an_environment_is_a_config_error():
    from raygraph.config import load_config
    from raygraph.config.loading import ConfigError

    demo = str(Path(__file__).resolve().parents[2] / "configs" / "demo_multiturn.yaml")
    tools_only = ["rollout.agent.env=null", "rollout.agent.tools=[calculator]", "reward.kind=rule"]
    load_config(demo, tools_only)
    with pytest.raises(ConfigError, match="rollout.agent.env_hosts hosts environments: set rollout.agent.env"):
        load_config(demo, [*tools_only, "rollout.agent.env_hosts=2"])


def _free_cpus(ray, expected: float, timeout_s: float = 20.0) -> float:
    """The cluster's available CPUs once they equal `expected` (or at `timeout_s`)."""
    import time

    deadline = time.monotonic() + timeout_s
    while (free := ray.available_resources().get("CPU", 0.0)) != expected and time.monotonic() < deadline:
        time.sleep(0.2)
    return free


def _settled_free_cpus(ray, quiet_s: float = 2.0, timeout_s: float = 30.0) -> float:
    """The cluster's available CPUs once unchanged for `quiet_s` (earlier tests' kills are asynchronous)."""
    import time

    deadline, last, since = time.monotonic() + timeout_s, None, time.monotonic()
    while time.monotonic() < deadline:
        free = ray.available_resources().get("CPU", 0.0)
        if free != last:
            last, since = free, time.monotonic()
        elif time.monotonic() - since >= quiet_s:
            break
        time.sleep(0.2)
    return last


def test_a_killed_rollout_rank_frees_its_env_hosts_cpus(env_ref, tmp_path, ray_local):
    """A rollout rank killed or restarted (stage recovery) takes its hosts and their CPUs with it:
    the hosts were once in a placement group, which Ray keeps until the job ends, so each restart
    leaked its hosts' CPUs until the cluster was full."""
    class Owner:   # a stand-in rollout rank: it starts env hosts, as a rollout actor does (defined here: pickled by value)
        def __init__(self, env_ref: str, out: str) -> None:
            from raygraph.agents.env_hosts import EnvHosts

            self.hosts = EnvHosts(env_ref, {"out": out}, count=2, cpus=0.5, concurrency=1)

        def host_pids(self) -> list[int]:
            return list(self.hosts.pids)

    ray = ray_local
    before = _settled_free_cpus(ray)
    owner = ray.remote(num_cpus=0)(Owner).remote(env_ref, str(tmp_path))
    assert len(set(ray.get(owner.host_pids.remote()))) == 2
    assert _free_cpus(ray, before - 1.0) == before - 1.0   # 2 hosts x 0.5 CPU
    ray.kill(owner, no_restart=True)
    assert _free_cpus(ray, before) == before, "the killed rank's env hosts still hold their CPUs"


def test_env_hosts_the_cluster_cannot_place_fail_in_time_and_hold_nothing(env_ref, tmp_path, ray_local):
    from raygraph.agents.env_hosts import EnvHosts
    from raygraph.errors import RaygraphError

    ray = ray_local
    before = _settled_free_cpus(ray)
    with pytest.raises(RaygraphError, match=r"env_hosts=2 hosts of env_host_cpus=64 CPUs could not be placed "
                                            r"within 2s: .*lower env_hosts or env_host_cpus, or add nodes"):
        EnvHosts(env_ref, {"out": str(tmp_path)}, count=2, cpus=64, concurrency=1, placement_timeout_s=2)
    assert _free_cpus(ray, before) == before
