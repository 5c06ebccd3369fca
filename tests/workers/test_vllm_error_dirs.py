"""Each vLLM engine's first-error file lives in a directory named after its process; the
directories of processes that have ended are removed at the next engine start on the machine
(raygraph.workers.vllm_deaths.errors_dir). Before, every engine start left one in /tmp. And how a
dead engine process ended is learned even when another thread reaped it."""

from __future__ import annotations

import os
import subprocess
import sys
import time

from raygraph.workers import vllm_deaths
from raygraph.workers.vllm_deaths import errors_dir


def _ended_pid() -> int:
    done = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True,
                          check=True)
    return int(done.stdout)


def test_the_error_directories_of_ended_processes_are_removed_and_others_kept(tmp_path):
    ended = tmp_path / f"raygraph-vllm-{_ended_pid()}-abc123"
    ended.mkdir()
    (ended / "first_error.txt").write_text("EngineDeadError: gone")
    alive = tmp_path / f"raygraph-vllm-{os.getppid()}-def456"   # pytest's parent: alive
    older = tmp_path / "raygraph-vllm-k2j4x9q1"   # made before directories were named after their process
    other = tmp_path / "raygraph-vllm-notapid-x"
    for kept in (alive, older, other):
        kept.mkdir()

    made = errors_dir(tmp_path)

    assert not ended.exists()
    assert alive.is_dir() and older.is_dir() and other.is_dir()
    assert made.is_dir() and made.parent == tmp_path and made.name.startswith(f"raygraph-vllm-{os.getpid()}-")
    again = errors_dir(tmp_path)   # this process is alive: its own directory stays
    assert made.is_dir() and again != made


class _ReapedElsewhere:
    """A dead engine process that another thread (vLLM's own shutdown) reaps: this thread's join
    returns at once with no code, and the code appears once that thread has stored it."""

    def __init__(self, code: int, after_s: float):
        self._code, self._at = code, time.monotonic() + after_s

    def join(self, timeout=None) -> None:
        return None

    @property
    def exitcode(self):
        return self._code if time.monotonic() >= self._at else None


def test_the_death_watcher_reads_an_exit_code_stored_by_another_thread(monkeypatch):
    """How a killed engine ended ("killed by signal 9") is still learned when vLLM's shutdown reaps
    the process first (a full `make test` once said only "exited")."""
    monkeypatch.setattr(vllm_deaths, "JOIN_TIMEOUT_S", 1.0)   # the bound, shorter than the real 5 s
    assert vllm_deaths._exit_codes([_ReapedElsewhere(-9, after_s=0.2)]) == [-9]
    start = time.monotonic()
    assert vllm_deaths._exit_codes([_ReapedElsewhere(-9, after_s=60)]) == []   # bounded: gives up
    assert time.monotonic() - start < vllm_deaths.JOIN_TIMEOUT_S + 1
