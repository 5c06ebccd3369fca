"""A test environment (`rollout.agent.env: <this file>:SlowOnRankOne`): the demo's
retry_with_feedback, with every step on rollout rank 1 taking `delay_s` longer, so that
least-loaded dispatch has a slow rank to relieve.

With `ledger` and `marker` set, rank 0 kills its own process (SIGKILL) once step 1 is in the
ledger, at the first step of its episode number `kill_after + 1` (counted from then on, in this
process): with least-loaded dispatch, an episode of a group it took from rank 1 when
`kill_after` is its own share's episode count (it claims its own groups first)."""

from __future__ import annotations

import itertools
import os
import signal
import time
from pathlib import Path

import ray

from raygraph.agents.builtin_envs import RetryWithFeedbackEnv

_after_step1 = itertools.count(1)


class SlowOnRankOne:
    def __init__(self, row: dict, delay_s: float = 0.1, kill_after: int = 0, ledger: str = "",
                 marker: str = "") -> None:
        self.env = RetryWithFeedbackEnv(row)
        name = ray.get_runtime_context().get_actor_name() or ""
        self.delay_s = delay_s if name.endswith("/1") else 0.0
        self.kill, self.marker_path = False, marker
        if ledger and name.endswith("/0") and not Path(marker).exists() and Path(ledger).is_file() \
                and '"step": 1' in Path(ledger).read_text():
            self.kill = next(_after_step1) > kill_after

    def step(self, response: str):
        if self.kill and not Path(self.marker_path).exists():
            Path(self.marker_path).write_text("killed")
            os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(self.delay_s)
        return self.env.step(response)
