"""Kill -9 a run's actor from the test's process once a step is in the run's ledger (chaos tests)."""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path

from raygraph.run.ledger import effective_steps


class Killer:
    """Kill -9 the process of the run's actor whose name contains `role` once `after_step` is in
    the ledger; remembers when (to time the detection)."""

    def __init__(self, run_dir: Path, run_prefix: str, role: str, after_step: int):
        self.run_dir, self.prefix, self.role, self.after = run_dir, run_prefix, role, after_step
        self.killed_at: float | None = None
        self.victim = ""
        self.thread = threading.Thread(target=self._watch, daemon=True)
        self.thread.start()

    def _watch(self):
        import ray

        deadline = time.monotonic() + 900
        while time.monotonic() < deadline and self.killed_at is None:
            if self.after in effective_steps(self.run_dir):
                names = [a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
                         if a["name"].startswith(self.prefix) and self.role in a["name"]]
                actor = ray.get_actor(sorted(names)[0])
                pid = ray.get(actor.__ray_call__.remote(lambda self: os.getpid()))
                os.kill(pid, signal.SIGKILL)
                self.killed_at, self.victim = time.time(), sorted(names)[0]
            time.sleep(0.05)
