"""Stopping a run from outside: SIGTERM (`ray job stop`, a scheduler) or Ctrl-C.

The first signal asks the loop to finish the current step, checkpoint and exit; a second signal,
or no step boundary within `trainer.stop_timeout_s`, interrupts the main thread. Either way the
run ends as stopped, never as a success: `raygraph train` exits 128 + the signal number (143 for
SIGTERM, 130 for Ctrl-C), the convention schedulers read as "terminated".

The handler is installed when the run starts and again after `ray.init` (which installs its own
SIGTERM handler, `sys.exit(15)` from wherever the main thread is), so a signal during set-up or
warm start also ends in an orderly shutdown.
"""

from __future__ import annotations

import _thread
import logging
import signal
import threading

__all__ = ["RunStopped", "StopFlag"]

log = logging.getLogger("raygraph")


class RunStopped(Exception):
    """A stop signal could not be honoured at a step boundary in time (or came twice): the run
    was interrupted without a new checkpoint. `signum`: 15 SIGTERM, 2 SIGINT."""

    def __init__(self, signum: int):
        self.signum = signum
        super().__init__(f"stopped by signal {signum} without a new checkpoint (no step boundary within "
                         "trainer.stop_timeout_s, or a second signal); the newest complete checkpoint is kept")


class StopFlag:
    """`with StopFlag(timeout_s) as stop:` ... `if stop.requested: ...`; `stop.signum` says which."""

    def __init__(self, timeout_s: float):
        self.requested = False
        self.signum: int | None = None
        self.timeout_s = timeout_s
        self._previous: dict = {}
        self._watchdog: threading.Timer | None = None

    def __enter__(self) -> StopFlag:
        self.install()
        return self

    def install(self) -> None:
        """(Re)install the handlers; call again after anything that replaced them (`ray.init`)."""
        for sig in (signal.SIGTERM, signal.SIGINT):
            try:
                previous = signal.signal(sig, self._handle)
            except ValueError:  # not the main thread: leave signals alone
                continue
            self._previous.setdefault(sig, previous)

    def _handle(self, signum, frame):
        if self.requested:  # a second signal: stop now
            raise KeyboardInterrupt
        self.requested, self.signum = True, signum
        log.warning("stop requested (signal %d): finishing this step, then checkpointing (at most %.0fs)",
                    signum, self.timeout_s)
        self._watchdog = threading.Timer(self.timeout_s, self._give_up)
        self._watchdog.daemon = True
        self._watchdog.start()

    def checkpointed(self) -> None:
        """The stop was honoured (the step ended, its checkpoint is written): the watchdog goes, so
        a slow shutdown after it (engines, Ray) is not reported as a stop without a checkpoint."""
        if self._watchdog is not None:
            self._watchdog.cancel()

    def _give_up(self):
        log.warning("stop: no step boundary and checkpoint within %.0fs; exiting without a new checkpoint",
                    self.timeout_s)
        _thread.interrupt_main()

    def __exit__(self, *exc):
        if self._watchdog is not None:
            self._watchdog.cancel()
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
