"""The trainer's stop flag without Ray: what `ray job stop`'s SIGTERM does to the loop."""

from __future__ import annotations

import os
import signal
import time

import pytest

from raygraph.run.stopping import StopFlag


def _busy(seconds: float) -> None:
    """A step that runs Python code (a pending interrupt is raised between bytecodes)."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        time.sleep(0.01)


def test_sigterm_is_noted_and_the_step_may_finish():
    before = signal.getsignal(signal.SIGTERM)
    with StopFlag(timeout_s=30) as stop:
        assert not stop.requested
        os.kill(os.getpid(), signal.SIGTERM)
        _busy(0.2)  # the rest of the step: not interrupted
        assert stop.requested
    _busy(0.2)  # the watchdog was cancelled on exit: nothing is raised later
    assert signal.getsignal(signal.SIGTERM) is before


def test_a_step_that_does_not_end_is_interrupted_after_the_timeout():
    t0 = time.monotonic()
    with pytest.raises(KeyboardInterrupt):
        with StopFlag(timeout_s=0.3):
            os.kill(os.getpid(), signal.SIGTERM)
            _busy(30)
    assert 0.3 <= time.monotonic() - t0 < 10


def test_once_the_stop_checkpoint_is_written_a_slow_shutdown_is_not_interrupted():
    with StopFlag(timeout_s=0.3) as stop:
        os.kill(os.getpid(), signal.SIGTERM)
        _busy(0.1)   # the step ends and its checkpoint is written
        stop.checkpointed()
        _busy(0.6)   # the shutdown outlasts the timeout: no KeyboardInterrupt
        assert stop.requested


def test_a_second_signal_stops_at_once():
    with pytest.raises(KeyboardInterrupt):
        with StopFlag(timeout_s=30):
            os.kill(os.getpid(), signal.SIGTERM)
            _busy(0.1)
            os.kill(os.getpid(), signal.SIGINT)
            _busy(30)
