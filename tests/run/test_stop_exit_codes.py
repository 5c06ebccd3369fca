"""`raygraph train` stopped by SIGTERM (what `ray job stop` and schedulers send) never exits with
the success code, and a signal during set-up ends in an orderly shutdown, not a crash dump.

Each test runs the real command in a subprocess with its own local Ray (about 20 s each)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow   # a `raygraph train` subprocess: not in `make test-fast`

ROOT = Path(__file__).resolve().parents[2]
TOY = str(ROOT / "configs" / "grpo_toy.yaml")


def _start(tmp_path: Path, *overrides: str, own_group: bool = False) -> subprocess.Popen:
    out = tmp_path / "runs"
    args = [sys.executable, "-m", "raygraph.cli", "train", TOY, "run_name=stopped",
            f"trainer.output_dir={out}",
            f"data.train_files=[{tmp_path / 'toy' / 'train.parquet'}]",
            f"data.val_files=[{tmp_path / 'toy' / 'val.parquet'}]", "logging.mlflow=false",
            "trainer.total_steps=1000", *overrides]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    return subprocess.Popen(args, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                            start_new_session=own_group)


def _signal_on(proc: subprocess.Popen, marker: str, timeout_s: float = 240,
               send=lambda proc: proc.send_signal(signal.SIGTERM)) -> tuple[int, str]:
    """`send` a signal (SIGTERM to the process) once `marker` is printed; return (exit code, whole output)."""
    lines: list[str] = []
    seen = threading.Event()

    def read():
        for line in proc.stdout:
            lines.append(line)
            if marker in line and not seen.is_set():
                seen.set()
                send(proc)

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    deadline = time.monotonic() + timeout_s
    while proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.2)
    if proc.poll() is None:
        proc.kill()
    reader.join(timeout=10)
    assert seen.is_set(), "".join(lines)[-3000:]
    return proc.wait(), "".join(lines)


def test_sigterm_between_steps_checkpoints_and_exits_143(tmp_path):
    code, out = _signal_on(_start(tmp_path), "[raygraph] step 2/1000")
    assert code == 128 + signal.SIGTERM, out[-3000:]      # before: 0, as if the run had finished
    assert "stop requested (signal 15)" in out and "[raygraph] checkpoint written:" in out
    assert "[raygraph] stopped after step" in out and "Traceback" not in out


def test_sigterm_during_set_up_exits_143_without_a_crash_dump(tmp_path):
    # "run directory" is printed right after Ray starts, before the actors are built: before, Ray's
    # own SIGTERM handler ran sys.exit(15) wherever the main thread was
    code, out = _signal_on(_start(tmp_path), "[raygraph] run directory:")
    assert code == 128 + signal.SIGTERM, out[-3000:]
    assert "stop requested (signal 15)" in out and "Traceback" not in out
    assert "[raygraph] step 1/" not in out                   # no step started after the stop
    assert not list((tmp_path / "runs").glob("grpo_toy/stopped/checkpoints/step_*"))


def test_ctrl_c_checkpoints_and_exits_130(tmp_path):
    # a terminal's Ctrl-C sends SIGINT to the whole foreground process group: the command and the
    # local Ray it started (raylet, GCS, workers) get it at once
    proc = _start(tmp_path, own_group=True)
    code, out = _signal_on(proc, "[raygraph] step 1/1000", send=lambda p: os.killpg(p.pid, signal.SIGINT))
    assert code == 128 + signal.SIGINT, out[-3000:]
    assert "stop requested (signal 2)" in out and "[raygraph] checkpoint written:" in out
    assert "[raygraph] stopped after step" in out and "Traceback" not in out


def test_sigterm_during_the_warm_start_ends_it_at_the_next_sft_step_and_exits_143(tmp_path):
    # 5000 SFT steps would take minutes; the stop must not wait for them (nor for stop_timeout_s)
    proc = _start(tmp_path, "trainer.warm_start.steps=5000", "trainer.warm_start.batch_size=4",
                  f"trainer.warm_start.files=[{tmp_path / 'toy' / 'warm_start.parquet'}]", "trainer.stop_timeout_s=600")
    started = time.monotonic()
    code, out = _signal_on(proc, "[raygraph] warm start 1/5000")
    assert code == 128 + signal.SIGTERM, out[-3000:]
    assert "stop requested (signal 15)" in out and "Traceback" not in out
    assert "warm start stopped before step" in out and "validation at step 0" not in out
    assert "[raygraph] step 1/" not in out and "[raygraph] warm start 25/5000" not in out
    assert time.monotonic() - started < 120
