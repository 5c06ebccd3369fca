"""Each vLLM engine's first-error file lives in a directory named after its process; the
directories of processes that have ended are removed at the next engine start on the machine
(raygraph.workers.vllm_deaths.errors_dir). Before, every engine start left one in /tmp."""

from __future__ import annotations

import os
import subprocess
import sys

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
