"""A pool of worker processes that run reward calls, each bounded by a timeout.

    pool = RewardPool(["toy_arith", "/abs/my.py:format_bonus"], workers=2, plugins=[...], timeout_s=5.0)
    outcomes = pool.run(calls)      # one `Outcome` per `Call`, in order
    pool.close()

Why not `concurrent.futures.ProcessPoolExecutor`: it cannot stop a running task, so one hung
call would hold a worker for ever. Here a call past `timeout_s` has its worker process killed
(SIGKILL: a call stuck in C code may ignore SIGTERM) and replaced; the call's outcome is a
timeout, and the rest of its chunk goes back to the queue. A worker that dies (a crash, an
`os._exit` in user code) is replaced the same way, its call failing with the exit code.

Batched: the calls are cut into chunks (about four per worker) so that one message carries many
samples; a worker sends each result as soon as it has it, and the parent's clock for a worker
restarts at every result, so `timeout_s` bounds each call, not the chunk.

Workers are forked from multiprocessing's forkserver, which imports `raygraph.rewards` once, so a
replacement starts in milliseconds; never forked from the reward actor itself (a Ray worker
runs threads whose locks a fork would copy). Each worker imports the run's plugins, resolves
every function once (registered names and `file.py:fn` alike), and says it is ready; a plugin
that fails to import there fails the pool's start with its error.
"""

from __future__ import annotations

import math
import multiprocessing as mp
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from multiprocessing.connection import Connection, wait

from raygraph.algos.user_code import UserCodeError
from raygraph.rewards.terms import Call, Outcome

__all__ = ["RewardPool"]

_CHUNKS_PER_WORKER = 4


@dataclass
class _Worker:
    proc: mp.process.BaseProcess
    conn: Connection
    ready: bool = False
    calls: deque = field(default_factory=deque)   # indices of the chunk's calls not answered yet
    since: float = 0.0                            # when the current call started (last result or dispatch)


class RewardPool:
    """`workers` processes scoring calls of the functions `refs` (None = by data_source).

    Args:
        refs: one registry name or `file.py:fn` per term (a `Call.term` indexes it).
        workers: number of processes (>= 1).
        plugins: user modules or `.py` files each worker imports first.
        timeout_s: seconds one call may run; None = no limit.
        start_timeout_s: seconds the workers may take to import and resolve everything.
    """

    def __init__(self, refs: Sequence[str | None], workers: int, plugins: Sequence[str] = (),
                 timeout_s: float | None = None, start_timeout_s: float = 300.0) -> None:
        if workers < 1:
            raise ValueError(f"a reward pool needs workers >= 1, got {workers}")
        self._ctx = mp.get_context("forkserver")
        self._ctx.set_forkserver_preload(["raygraph.rewards"])
        self._args = (tuple(refs), tuple(plugins))
        self.timeout_s = timeout_s
        self.restarts = 0
        self._workers = [self._start() for _ in range(workers)]
        deadline = time.monotonic() + start_timeout_s
        for w in self._workers:
            self._await_ready(w, deadline)

    def _start(self) -> _Worker:
        parent, child = self._ctx.Pipe()
        proc = self._ctx.Process(target=_serve, args=(child, *self._args), daemon=True, name="raygraph-reward")
        proc.start()
        child.close()
        return _Worker(proc, parent)

    def _await_ready(self, w: _Worker, deadline: float) -> None:
        if not w.conn.poll(max(0.0, deadline - time.monotonic())):
            raise RuntimeError("a reward worker process did not start in time (importing the plugins?)")
        self._handle(w, w.conn.recv(), [])

    def run(self, calls: Sequence[Call]) -> list[Outcome]:
        """Score every call; one outcome each, in order (failures are outcomes, not exceptions)."""
        outcomes: list[Outcome | None] = [None] * len(calls)
        size = max(1, math.ceil(len(calls) / (_CHUNKS_PER_WORKER * len(self._workers))))
        queue = deque(list(range(i, min(i + size, len(calls)))) for i in range(0, len(calls), size))
        while any(o is None for o in outcomes):
            for w in list(self._workers):
                if w.ready and not w.calls and queue:
                    self._dispatch(w, queue, calls)
            wait([x for w in self._workers for x in (w.conn, w.proc.sentinel)], self._wait_s())
            for w in list(self._workers):
                self._poll(w, outcomes, queue)
        return outcomes

    def _dispatch(self, w: _Worker, queue: deque, calls: Sequence[Call]) -> None:
        """Send `w` the next chunk; a worker that died while idle is replaced, its chunk kept queued."""
        chunk = queue.popleft()
        try:
            w.conn.send([(i, calls[i]) for i in chunk])
        except OSError:   # BrokenPipeError: it died between two batches
            queue.appendleft(chunk)
            w.proc.kill()
            w.proc.join()
            w.conn.close()
            self._workers[self._workers.index(w)] = self._start()
            self.restarts += 1
            return
        w.calls, w.since = deque(chunk), time.monotonic()

    def _wait_s(self) -> float | None:
        busy = [w.since for w in self._workers if w.ready and w.calls]
        if self.timeout_s is None or not busy:
            return None if self.timeout_s is None else 1.0
        return max(0.0, min(busy) + self.timeout_s - time.monotonic())

    def _poll(self, w: _Worker, outcomes: list, queue: deque) -> None:
        """Read `w`'s results; replace it when it died or its current call ran out of time."""
        try:
            while w.conn.poll():
                self._handle(w, w.conn.recv(), outcomes)
        except (EOFError, OSError):
            pass
        if not w.proc.is_alive():
            w.proc.join()
            self._replace(w, outcomes, queue, Outcome(
                failure=f"WorkerDied: the reward worker process exited with code {w.proc.exitcode}"))
        elif (self.timeout_s is not None and w.ready and w.calls
              and time.monotonic() - w.since > self.timeout_s):
            self._replace(w, outcomes, queue, Outcome(
                failure=f"TimeoutError: still running after reward.timeout_s={self.timeout_s:g} s "
                        "(its worker process was killed)", timed_out=True))

    def _handle(self, w: _Worker, message: tuple, outcomes: list) -> None:
        if message[0] == "init_error":
            self.close()
            raise UserCodeError(f"a reward worker process cannot load the reward functions: {message[1]}")
        if message[0] == "ready":
            w.ready, w.since = True, time.monotonic()
            return
        index, outcome = message
        outcomes[index] = outcome
        w.calls.remove(index)
        w.since = time.monotonic()

    def _replace(self, w: _Worker, outcomes: list, queue: deque, outcome: Outcome) -> None:
        if not w.ready:
            self.close()
            raise RuntimeError(f"a reward worker process died while starting (exit code {w.proc.exitcode})")
        w.proc.kill()
        w.proc.join()
        w.conn.close()
        if w.calls:
            outcomes[w.calls.popleft()] = outcome
            if w.calls:
                queue.appendleft(list(w.calls))
        self._workers[self._workers.index(w)] = self._start()
        self.restarts += 1

    def close(self) -> None:
        """Stop every worker (idempotent)."""
        for w in self._workers:
            try:
                w.conn.send(None)
            except (OSError, ValueError):
                pass
        for w in self._workers:
            w.proc.join(timeout=2.0)
            if w.proc.is_alive():
                w.proc.kill()
                w.proc.join()
            w.conn.close()
        self._workers = []

    def __enter__(self) -> RewardPool:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _serve(conn: Connection, refs: tuple[str | None, ...], plugins: tuple[str, ...]) -> None:
    """A worker process: import the plugins, resolve the functions, then score chunks until None."""
    _die_with_parent()
    from raygraph.algos.user_code import import_plugins
    from raygraph.rewards import get, score_for_source
    from raygraph.rewards.terms import call_one

    try:
        import_plugins(plugins)
        fns = [None if ref is None else get(ref) for ref in refs]
    except Exception as exc:  # noqa: BLE001 - user code: reported to the parent
        conn.send(("init_error", f"{type(exc).__name__}: {exc}"))
        return
    conn.send(("ready",))

    def fn_for(call: Call):
        return fns[call.term] or score_for_source(call.source)

    while True:
        try:
            chunk = conn.recv()
        except EOFError:    # the parent is gone
            return
        if chunk is None:
            return
        for index, call in chunk:
            conn.send((index, call_one(fn_for, call)))


def _die_with_parent() -> None:
    """Linux: SIGKILL this process when its parent (the forkserver, which exits with the reward
    actor) dies, so a call hung in user code does not outlive the run."""
    try:
        import ctypes
        import signal

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)   # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass
