"""Environments in processes of their own: `rollout.agent.env_hosts` Ray actors per rollout rank.

    rollout rank r ──open/step/close──► env host 0 ┐  Ray actors of `env_host_cpus` CPUs each,
                   ──open/step/close──► env host 1 ┘  owned by the rollout rank's actor

Each host (`EnvHost`, a threaded Ray actor) holds the environments of many episodes, by key, and
runs up to `env_workers` steps at once. A new episode goes to the host with the fewest open
environments (`EnvHosts.open`); all its steps go to that host. What this buys over the default
(environments in the rollout rank's threads, `raygraph.agents.reactions.LocalEnvs`):

* CPU-heavy environments run beside the engine on CPUs of their own, not under the rollout
  process's GIL, and on other nodes of a cluster where Ray schedules them there.
* A step past `env_timeout_s` ends its episode and frees the rollout's thread at once (a Python
  thread cannot be stopped, a process can): its host is restarted when the rollout call ends, so a
  hung step never outlives it, and no number of hung steps can stall the rollout.
* A crashing environment (a segfault in native code, `os._exit`) takes its host down, not the
  rollout: the call fails with `EnvHostDied`, which the run recovers at stage level like a dead
  rollout engine (the rollout actor is started again with fresh hosts and the step rerun; its
  samples are the same).

The hosts are owned by the rollout actor that starts them, so they go with it: Ray ends an
actor's children when it dies, and their CPUs are free again. (A placement group would not go with
it: Ray keeps a group an actor made until the job ends, so each restarted rollout rank would leak
its hosts' CPUs. Hence plain actors, each asking for `env_host_cpus`.) Steps are never retried by
Ray (`max_task_retries=0`): a step changes its environment's state.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import ray
from ray.exceptions import ActorUnavailableError, GetTimeoutError, RayActorError, RayTaskError

from raygraph.agents.env import EnvStep, as_env_step, load_env
from raygraph.agents.reactions import EnvHostDied, EnvStepTimeout, EventLoop, call_step, close_env
from raygraph.agents.tools import ToolCall
from raygraph.algos.user_code import import_plugins
from raygraph.errors import RaygraphError

__all__ = ["EnvHost", "EnvHosts", "HostedEnv"]

log = logging.getLogger("raygraph")

CLOSE_TIMEOUT_S = 30.0     # closing a run's environments; a host that takes longer is said in the log
RESTART_TIMEOUT_S = 60.0   # a restarted host's start
SPARE_THREADS = 16         # host threads beyond the rollout's reaction threads, for steps past their time


class EnvHost:
    """The body of one environment host actor: environments by key, stepped on Ray's threads.

    Args:
        env_ref: the environment (`raygraph.agents.env.load_env`).
        env_args: keyword arguments of its constructor.
        plugins: the run's plugins (a registered environment may come from one).
    """

    def __init__(self, env_ref: str, env_args: Mapping[str, Any], plugins: tuple[str, ...] = ()) -> None:
        import_plugins(plugins)
        self.env_cls, self.env_args = load_env(env_ref), dict(env_args)
        self.envs: dict[int, Any] = {}
        self.events = EventLoop()

    def pid(self) -> int:
        return os.getpid()

    def step(self, key: int, text: str, calls: list[ToolCall], row: dict | None = None) -> EnvStep:
        """Step the environment `key`, first creating it from `row` (its episode's first step:
        one call instead of two)."""
        if row is not None:
            self.envs[key] = self.env_cls(dict(row), **self.env_args)
        env = self.envs[key]
        return as_env_step(call_step(env, text, calls, self.events), env)

    def close(self, keys: list[int]) -> None:
        for key in keys:
            env = self.envs.pop(key, None)
            if env is not None:
                close_env(env, self.events, f"env host {os.getpid()}")


@dataclass
class HostedEnv:
    """An episode's environment, as the rollout rank holds it: which host, which key there, and
    its row until the first step creates it there."""
    slot: int
    key: int
    row: dict | None


class EnvHosts:
    """The environment hosts of one rollout rank (a runner of `raygraph.agents.reactions.EpisodeEnvs`).

    Args:
        env_ref, env_args: the environment and its constructor's keyword arguments.
        count: hosts to start; cpus: CPUs of each.
        concurrency: calls one host runs at once: the rollout rank's reaction threads, plus
            `SPARE_THREADS` that steps past their time may hold until the host restarts.
        plugins: imported in each host first.
        placement_timeout_s: how long to wait for the hosts to be placed and started.

    Raises:
        RaygraphError: the hosts could not be placed in time (the message says what was asked).
    """
    hosted = True

    def __init__(self, env_ref: str, env_args: Mapping[str, Any], *, count: int, cpus: float, concurrency: int,
                 plugins: tuple[str, ...] = (), placement_timeout_s: float = 60.0) -> None:
        remote = ray.remote(EnvHost)
        self.actors = [remote.options(
            num_cpus=cpus, max_concurrency=concurrency + SPARE_THREADS, max_restarts=-1, max_task_retries=0,
        ).remote(env_ref, dict(env_args), tuple(plugins)) for _ in range(count)]
        try:   # a host that cannot start fails here
            self.pids = ray.get([a.pid.remote() for a in self.actors], timeout=placement_timeout_s)
        except GetTimeoutError:
            self.shutdown()
            raise RaygraphError(f"rollout.agent.env_hosts={count} hosts of env_host_cpus={cpus:g} CPUs could not be "
                                f"placed within {placement_timeout_s:g}s: the cluster has no room for them; "
                                "lower env_hosts or env_host_cpus, or add nodes") from None
        self.load = [0] * count
        self._lock, self._next_key, self._hung = threading.Lock(), 0, set()

    def open(self, row: dict) -> HostedEnv:
        """An episode's environment on the host with the fewest open ones (created there by its
        first step)."""
        with self._lock:
            slot = min(range(len(self.load)), key=lambda i: (self.load[i], i))
            self.load[slot] += 1
            key, self._next_key = self._next_key, self._next_key + 1
        return HostedEnv(slot, key, dict(row))

    def step(self, env: HostedEnv, text: str, calls: list[ToolCall], timeout_s: float | None) -> EnvStep:
        """The environment's step; `EnvStepTimeout` past `timeout_s` (its host restarts after the run)."""
        row, env.row = env.row, None
        return self._get(self.actors[env.slot].step.remote(env.key, text, calls, row), env, timeout_s)

    def _get(self, ref, env: HostedEnv, timeout_s: float | None) -> Any:
        try:
            return ray.get(ref, timeout=timeout_s)
        except GetTimeoutError:
            with self._lock:
                self._hung.add(env.slot)
            raise EnvStepTimeout(f"env host {env.slot}: no answer within {timeout_s:.1f}s") from None
        except RayTaskError as exc:   # the environment raised: its own exception, as in process
            raise exc.as_instanceof_cause() from None
        except RayActorError as exc:
            raise EnvHostDied(f"the env host {env.slot} (pid {self.pids[env.slot]}) died during a step of "
                              f"episode key {env.key}: {type(exc).__name__}: {exc}") from exc

    def close_all(self, envs: list[tuple[int, HostedEnv]]) -> None:
        """Close the environments (one call per host, waited for together)."""
        by_slot: dict[int, list[int]] = {}
        for _, env in envs:
            by_slot.setdefault(env.slot, []).append(env.key)
        with self._lock:
            for slot, keys in by_slot.items():
                self.load[slot] -= len(keys)
        # a host with a hung step restarts after the run (`after_run`): its closes are sent, not awaited
        refs = [self.actors[slot].close.remote(keys) for slot, keys in by_slot.items()]
        refs = [ref for ref, slot in zip(refs, by_slot) if slot not in self._hung]
        ready, pending = ray.wait(refs, num_returns=len(refs), timeout=CLOSE_TIMEOUT_S)
        for ref in ready:
            try:
                ray.get(ref)
            except Exception as exc:  # noqa: BLE001 - a lost host: its environments went with it
                log.warning("closing environments on an env host failed: %s: %s", type(exc).__name__, exc)
        if pending:
            log.warning("%d env hosts did not close their environments within %.0fs", len(pending), CLOSE_TIMEOUT_S)

    def after_run(self) -> None:
        """Restart every host still running a step that timed out (its environments are all closed
        or abandoned by now), so that no hung step outlives the rollout call."""
        with self._lock:   # `close_all` has run: no environment is open on any host
            hung, self._hung = sorted(self._hung), set()
        for slot in hung:
            log.warning("restarting env host %d (pid %d): a step ran past rollout.agent.env_timeout_s",
                        slot, self.pids[slot])
            ray.kill(self.actors[slot], no_restart=False)
        for slot in hung:
            self.pids[slot] = self._restarted_pid(slot)

    def _restarted_pid(self, slot: int) -> int:
        """The pid of host `slot` once Ray has started it again: calls fail, or reach the old
        process (the kill is asynchronous), until then."""
        deadline, old = time.monotonic() + RESTART_TIMEOUT_S, self.pids[slot]
        while time.monotonic() < deadline:
            try:
                pid = ray.get(self.actors[slot].pid.remote(), timeout=RESTART_TIMEOUT_S)
                if pid != old:
                    return pid
            except (ActorUnavailableError, RayActorError, GetTimeoutError):
                pass
            time.sleep(0.1)
        raise EnvHostDied(f"env host {slot} did not come back within {RESTART_TIMEOUT_S:g}s of its restart")

    def shutdown(self) -> None:
        for actor in self.actors:
            ray.kill(actor, no_restart=True)
