"""An engine process does not outlive the process that started it (`vllm_deaths.exit_when_orphaned`,
installed in every vLLM engine process): shown on a plain child process, without vLLM."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import psutil
import pytest

# the parent starts a child that installs the guard and would sleep a minute, prints its pid, exits
PARENT = """
import subprocess, sys
child = subprocess.Popen([sys.executable, "-c", "from raygraph.workers.vllm_deaths import exit_when_orphaned; "
                          "exit_when_orphaned(poll_s=0.1); print('ready', flush=True); import time; time.sleep(60)"],
                         stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
assert child.stdout.readline().strip() == "ready"
print(child.pid, flush=True)
"""


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def test_a_process_with_the_guard_dies_soon_after_its_parent():
    out = subprocess.run([sys.executable, "-c", PARENT], capture_output=True, text=True, timeout=60, check=True)
    child = int(out.stdout.split()[-1])
    deadline = time.monotonic() + 10
    while _alive(child) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _alive(child), "the child outlived its parent by 10 s"


# a process that builds a vLLM rollout worker with its engine core in a child process (on GPUs always;
# on the CPU build by default the engine core runs in the worker's process and cannot outlive it)
HOLD_AN_ENGINE = """
import os, sys, time


def main():
    from raygraph.workers.rollout_vllm import VLLMRolloutWorker

    VLLMRolloutWorker(model_path=sys.argv[1], max_new_tokens=4, max_model_len=64, gpu_memory_utilization=0.05,
                      engine_core="own_process")
    print("READY", os.getpid(), flush=True)
    time.sleep(600)


if __name__ == "__main__":
    main()
"""


@pytest.mark.slow   # starts a vLLM engine in a subprocess (~17 s)
def test_a_vllm_engine_dies_with_the_process_that_built_it(tiny_model_path, tmp_path):
    """Outside Ray (no raylet to reap it), the engine core of a kill -9'd rollout process went on
    holding its weights and KV cache; now it ends within seconds (checked: without the guard it
    was still there, reparented to init)."""
    pytest.importorskip("vllm")
    script = tmp_path / "hold_an_engine.py"
    script.write_text(HOLD_AN_ENGINE)
    holder = subprocess.Popen([sys.executable, str(script), tiny_model_path], stdout=subprocess.PIPE,
                              stderr=subprocess.DEVNULL, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    try:
        ready = any(line.startswith("READY") for line in holder.stdout)   # vLLM logs on stdout too
        assert ready, "the engine did not start"
        engines = [p.pid for p in psutil.Process(holder.pid).children(recursive=True)
                   if "EngineCore" in p.name() + " ".join(p.cmdline())]
        assert engines, "no engine core process under the holder"
    finally:
        holder.kill()
        holder.wait()
    deadline = time.monotonic() + 15
    while any(map(_alive, engines)) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not [pid for pid in engines if _alive(pid)], "the engine core outlived its process by 15 s"
