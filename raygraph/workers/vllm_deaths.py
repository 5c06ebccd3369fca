"""A dead vLLM engine, said once and clearly: `RolloutEngineDied` naming the engine's own root cause.

    errors = watch_engine(llm)          # after `vllm_compat.build_engine`
    with engine_guard(errors):          # around every engine call
        llm.generate(...)               # EngineDeadError -> RolloutEngineDied("...: <root cause>")

vLLM logs the cause of a death in the engine's worker processes and raises only `EngineDeadError`
in this one; `watch_engine` has the workers write their first logged error to a file (`FirstError`,
installed by `vllm_compat`'s worker extension) and watches the engine's processes, so a process
killed outright is named with its signal and a reader waiting for outputs is woken.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import signal
import tempfile
import threading
import time
import weakref
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from raygraph.errors import RoleFailed

__all__ = ["FirstError", "RolloutEngineDied", "engine_guard", "errors_dir", "exit_when_orphaned", "watch_engine"]


class RolloutEngineDied(RoleFailed, RuntimeError):
    """The vLLM engine's processes died; the message is the engine's own root-cause line. The
    engine cannot serve again: the worker that holds it must be rebuilt (the recovery of a dead
    actor does that; `RolloutEngineDied` counts as an infrastructure failure there)."""


def watch_engine(engine: Any) -> Path:
    """Record the first error the engine's worker processes log, in a file this process reads
    when the engine dies (vLLM logs the cause there and raises only `EngineDeadError` here)."""
    path = errors_dir() / "first_error.txt"   # written by the first error
    engine.collective_rpc("raygraph_record_errors", args=(str(path),))
    from raygraph.workers.vllm_in_process import runs_here

    client = engine.llm_engine.engine_core
    if runs_here(engine):
        _dead_after_a_failed_step(client, path)
    else:   # an engine process of its own
        engine.collective_rpc("raygraph_exit_when_orphaned")
        _wake_waiters_when_the_engine_dies(client, path)
    return path


_ERRORS_DIR_PREFIX = "raygraph-vllm-"


def errors_dir(root: Path | None = None) -> Path:
    """A new directory in `root` (the temporary directory) for an engine's first-error file, named
    `raygraph-vllm-<pid>-<random>` after this process. Those of processes that have ended are
    removed first: an actor is killed at the end of a run, never asked to clean up, and each
    engine start left one behind."""
    import psutil

    root = Path(tempfile.gettempdir()) if root is None else root
    for old in root.glob(f"{_ERRORS_DIR_PREFIX}*-*"):
        pid = old.name[len(_ERRORS_DIR_PREFIX):].split("-", 1)[0]
        if pid.isdigit() and not psutil.pid_exists(int(pid)):
            shutil.rmtree(old, ignore_errors=True)
    return Path(tempfile.mkdtemp(prefix=f"{_ERRORS_DIR_PREFIX}{os.getpid()}-", dir=root))


def _dead_after_a_failed_step(client: Any, errors: Path) -> None:
    """An engine core in this process (`raygraph.workers.vllm_in_process`) raises out of a failed
    step instead of dying: made to behave as a dead engine process does. The failure is written
    into `errors` and raised as `EngineDeadError`; from then on every step, request and RPC raises
    it too and an abort does nothing (a half-run step leaves the scheduler in no state to go on).
    Steps run under `torch.random.fork_rng`: the CPU sampler draws from the global torch RNG,
    which here is the actor's (a colocated policy's)."""
    import torch
    from vllm.v1.engine.exceptions import EngineDeadError

    step, dead = client.get_output, []

    def get_output(*args: Any, **kwargs: Any) -> Any:
        if dead:
            raise EngineDeadError()
        try:
            with torch.random.fork_rng(devices=[]):
                return step(*args, **kwargs)
        except Exception as exc:  # noqa: BLE001 - any failure inside the engine's step kills it
            dead.append(exc)
            errors.write_text(f"{type(exc).__name__}: {exc}")   # the cause, whatever was logged before
            raise EngineDeadError() from exc

    def refused_when_dead(method: Callable) -> Callable:
        def call(*args: Any, **kwargs: Any) -> Any:
            if dead:
                raise EngineDeadError()
            return method(*args, **kwargs)
        return call

    abort = client.abort_requests
    client.get_output = get_output
    client.add_request = refused_when_dead(client.add_request)
    client.collective_rpc = refused_when_dead(client.collective_rpc)
    client.abort_requests = lambda request_ids: None if dead else abort(request_ids)


def exit_when_orphaned(poll_s: float = 1.0) -> None:
    """End this process (SIGKILL) once its parent is gone, checked every `poll_s` seconds.

    Runs in the engine's processes: when the rollout actor's process dies and Ray's raylet is
    not there to reap its children (the whole local Ray went down with the driver), the engine
    would otherwise live on with its weights and KV cache (seen: 5.8 GB, idle, under init)."""
    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(poll_s)
        os.kill(os.getpid(), signal.SIGKILL)

    threading.Thread(target=watch, name="raygraph-exit-when-orphaned", daemon=True).start()


@contextlib.contextmanager
def engine_guard(errors: Path | None) -> Iterator[None]:
    """Turn vLLM's `EngineDeadError` into `RolloutEngineDied` naming the root cause (read from
    `errors`, the file of `watch_engine`); vLLM's chain of worker tracebacks is dropped."""
    from vllm.v1.engine.exceptions import EngineDeadError

    try:
        yield
    except EngineDeadError:
        cause = errors.read_text().strip() if errors is not None and errors.is_file() else ""
        raise RolloutEngineDied("the vLLM engine died: " + (cause or "its worker processes logged no error "
                                                                      "(see the engine core's log above)")) from None


def _wake_waiters_when_the_engine_dies(client: Any, errors: Path) -> None:
    """vLLM 0.32's offline client (`SyncMPClient`) learns of a dead engine core process from a
    monitor thread, which marks it dead and stops the output thread without a word: a `generate`
    already waiting for outputs then waits for ever (a killed engine hung the rollout). Watch the
    processes too, write which one died into `errors` unless an error is there already, and hand a
    waiting reader `EngineDeadError` (raised as `RolloutEngineDied`). Needed while vLLM's sync
    client does not do it itself (0.32.x)."""
    from vllm.v1.engine.exceptions import EngineDeadError

    manager = getattr(getattr(client, "resources", None), "engine_manager", None)
    if manager is None or not hasattr(client, "outputs_queue"):
        return   # in-process engine, or a client that forwards deaths itself
    ref = weakref.ref(client)

    def watch() -> None:
        manager.monitor_engine_liveness()   # returns when an engine core process exits
        alive, failed = ref(), getattr(manager, "failed_proc_name", None)
        if alive is None or not failed:   # shut down by us, not dead
            return
        procs = [p for p in manager.processes if p.name == failed]
        codes = _exit_codes(procs)
        how = (f"was killed by signal {-codes[0]}" if codes and codes[0] < 0
               else f"exited with code {codes[0]}" if codes else "exited")
        if not (errors.is_file() and errors.read_text().strip()):
            errors.write_text(f"its process {failed} {how}")
        alive.outputs_queue.put_nowait(EngineDeadError())

    threading.Thread(target=watch, daemon=True, name="raygraph-engine-death").start()


JOIN_TIMEOUT_S = 5.0   # how long the watcher waits to learn how a dead engine process ended


def _exit_codes(procs: list) -> list[int]:
    """The exit codes of ended `multiprocessing` processes, waited for up to `JOIN_TIMEOUT_S`.

    Its pipe closes before the kernel can report how a process ended (on a loaded machine 1 s was
    not always enough). vLLM's own shutdown polls the same processes from another thread: when it
    reaps one first, this thread's wait finds no child and returns before that thread has stored
    the code, so the code is read again until it is there."""
    deadline = time.monotonic() + JOIN_TIMEOUT_S
    for proc in procs:
        proc.join(timeout=max(0.0, deadline - time.monotonic()))
    while any(p.exitcode is None for p in procs) and time.monotonic() < deadline:
        time.sleep(0.02)
    return [p.exitcode for p in procs if p.exitcode is not None]


class FirstError(logging.Handler):
    """Writes `<type>: <message>` of the first logged exception to a file; later ones are effects."""

    def __init__(self, path: str):
        super().__init__(logging.ERROR)
        self.path, self.done = Path(path), False

    def emit(self, record: logging.LogRecord) -> None:
        if self.done or not record.exc_info or record.exc_info[1] is None:
            return
        exc = record.exc_info[1]
        self.done = True
        self.path.write_text(f"{type(exc).__name__}: {exc}")
