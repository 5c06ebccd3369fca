"""Run model-written Python in a throwaway, resource-limited process: the `python_exec` tool.

    result = run_python("print(6 * 7)", SandboxLimits(timeout_s=2))
    result.stdout, result.exit_code, result.timed_out     # "42\\n", 0, False
    python_exec("print(6 * 7)")                           # "42": what the model reads

Each call runs `python -I program.py` in its own session (process group) and its own fresh
temporary directory (also its HOME and TMPDIR), with a minimal environment (no variable of the
parent, so no secret, reaches it), rlimits on CPU seconds, address space and file size, and, by
default, no network: `network_isolation()` prefixes the command with `unshare -n` (root) or
`unshare -rn` (an unprivileged user namespace), so the program runs in an empty network namespace
where even loopback is down. At the wall-clock deadline, or as soon as the program has exited,
the whole process group is killed with SIGKILL, so processes it started die too; then the
directory is deleted. Output beyond `max_output_bytes` is cut, with a line saying how much.

Not a security boundary against hostile code: the program sees the same filesystem (with the
parent's user rights) and a process that calls `setsid()` escapes the group kill.
"""

from __future__ import annotations

import functools
import os
import resource
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass

from raygraph.errors import RaygraphError

__all__ = ["SandboxLimits", "SandboxResult", "SandboxUnavailable", "run_python", "python_exec",
           "network_isolation"]

_PROGRAM_FILE = "program.py"
_FILE_SIZE_LIMIT_BYTES = 16 * 2**20   # per file the program writes
_EXIT_POLL_S = 0.05                   # once the program exited, pipes idle this long mean "done"


class SandboxUnavailable(RaygraphError, RuntimeError):
    """The sandbox cannot provide what was asked on this machine (e.g. network isolation)."""


@dataclass(frozen=True)
class SandboxLimits:
    """Limits of one sandboxed run; `network=False` needs `network_isolation()` to work."""

    timeout_s: float = 5.0          # wall clock; the whole process group is SIGKILLed after it
    cpu_s: int = 5                  # RLIMIT_CPU: SIGXCPU after this many CPU seconds
    memory_mb: int = 512            # RLIMIT_AS: allocations beyond it fail (MemoryError)
    max_output_bytes: int = 4096    # stdout + stderr kept; the rest is cut with a marker line
    network: bool = False           # False: run in an empty network namespace

    def __post_init__(self):
        for name in ("timeout_s", "cpu_s", "memory_mb", "max_output_bytes"):
            if not getattr(self, name) > 0:
                raise ValueError(f"SandboxLimits.{name} must be > 0, got {getattr(self, name)!r}")


@dataclass(frozen=True)
class SandboxResult:
    """What one run printed and how it ended; `exit_code` is None when it timed out and negative
    (-signal) when a signal killed it (e.g. -24, SIGXCPU, at the CPU limit)."""

    stdout: str
    stderr: str
    exit_code: int | None
    timed_out: bool
    truncated: bool
    timeout_s: float                # the limit it ran under, for the "[timed out after ...]" line

    def as_text(self) -> str:
        """What the model reads: stdout, then stderr if any, then how the run ended if not cleanly."""
        parts = [text.rstrip("\n") for text in (self.stdout, self.stderr) if text]
        if self.timed_out:
            parts.append(f"[timed out after {self.timeout_s:g}s]")
        elif self.exit_code and self.exit_code < 0:
            parts.append(f"[exit code {self.exit_code} ({signal.strsignal(-self.exit_code)})]")
        elif self.exit_code:
            parts.append(f"[exit code {self.exit_code}]")
        return "\n".join(parts)


def network_isolation() -> list[str]:
    """The command prefix that runs a program without network access on this machine.

    Probed once by running `unshare -n true` (needs root or CAP_SYS_ADMIN), then `unshare -rn true`
    (an unprivileged user namespace).

    Raises:
        SandboxUnavailable: `unshare` is missing or neither form works here.
    """
    return list(_cached_network_isolation())


@functools.cache
def _cached_network_isolation() -> tuple[str, ...]:
    return tuple(_probe_network_isolation(shutil.which("unshare")))


def _probe_network_isolation(unshare: str | None) -> list[str]:
    if unshare is None:
        raise SandboxUnavailable("the sandbox needs `unshare` to cut network access and it is not on PATH: "
                                 "install util-linux (apt-get install util-linux), or run with "
                                 "SandboxLimits(network=True) to allow network access")
    failures = []
    for prefix in ([unshare, "-n"], [unshare, "-rn"]):
        probe = subprocess.run([*prefix, "true"], capture_output=True, text=True, timeout=30)
        if probe.returncode == 0:
            return prefix
        failures.append(f"`{' '.join(prefix)} true`: exit {probe.returncode}, {probe.stderr.strip()!r}")
    raise SandboxUnavailable("the sandbox cannot cut network access on this machine (" + "; ".join(failures)
                             + "): run as root or with CAP_SYS_ADMIN (docker: --cap-add SYS_ADMIN), or enable "
                             "unprivileged user namespaces (sysctl kernel.unprivileged_userns_clone=1 and "
                             "user.max_user_namespaces > 0), or run with SandboxLimits(network=True)")


def run_python(code: str, limits: SandboxLimits = SandboxLimits()) -> SandboxResult:
    """Run `code` as a Python program in a fresh sandboxed process (see the module docstring).

    Args:
        code: the program's source.
        limits: time, CPU, memory, output and network limits.

    Returns:
        The run's (possibly truncated) stdout and stderr, exit code and whether it timed out.

    Raises:
        SandboxUnavailable: `limits.network` is False and this machine cannot cut network access.
    """
    prefix = [] if limits.network else network_isolation()
    workdir = tempfile.mkdtemp(prefix="raygraph-sandbox-")
    try:
        with open(os.path.join(workdir, _PROGRAM_FILE), "w", encoding="utf-8") as program:
            program.write(code)
        env = {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": workdir, "TMPDIR": workdir, "LANG": "C.UTF-8"}
        proc = subprocess.Popen([*prefix, sys.executable, "-I", _PROGRAM_FILE], cwd=workdir, env=env,
                                stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                start_new_session=True, preexec_fn=functools.partial(_apply_rlimits, limits))
        try:
            (stdout, stdout_len), (stderr, stderr_len), timed_out = _collect_output(proc, limits)
        finally:
            _kill_group(proc)       # stragglers after a normal exit, everything after a timeout
            proc.stdout.close()
            proc.stderr.close()
    finally:
        _remove_tree(workdir)
    stdout, stderr, truncated = _cap_output(stdout, stdout_len, stderr, stderr_len, limits.max_output_bytes)
    return SandboxResult(stdout=stdout, stderr=stderr, exit_code=None if timed_out else proc.returncode,
                         timed_out=timed_out, truncated=truncated, timeout_s=limits.timeout_s)


def python_exec(code: str) -> str:
    """Run a Python program and return what it printed.

    Each call is a fresh process with no network access, a 5 second time limit and 512 MB of
    memory; nothing is kept between calls. Use print() to see values.

    Args:
        code: The complete Python program to run, e.g. "print(sum(range(10)))".

    Returns:
        The program's output (stdout, then stderr), followed by its exit code if it failed or a
        note if it timed out.
    """
    return run_python(code).as_text()


def _apply_rlimits(limits: SandboxLimits) -> None:
    """Runs in the child between fork and exec; the limits carry over to python through `unshare`."""
    memory_bytes = limits.memory_mb * 2**20
    resource.setrlimit(resource.RLIMIT_CPU, (limits.cpu_s, limits.cpu_s + 1))   # SIGXCPU, then SIGKILL
    resource.setrlimit(resource.RLIMIT_AS, (memory_bytes, memory_bytes))
    resource.setrlimit(resource.RLIMIT_FSIZE, (_FILE_SIZE_LIMIT_BYTES, _FILE_SIZE_LIMIT_BYTES))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))   # no core files from SIGXCPU
    # No RLIMIT_NPROC: it counts every process of the user (the trainer's too), not the sandbox's.


def _collect_output(proc: subprocess.Popen, limits: SandboxLimits):
    """Read both pipes until they close or the program has exited and gone quiet, then wait for it
    until the deadline (it may have closed its pipes and go on running).

    Keeps at most `max_output_bytes` of each stream but counts all of it; returns
    ((stdout, stdout_len), (stderr, stderr_len), timed_out).
    """
    deadline = time.monotonic() + limits.timeout_s
    kept = {proc.stdout: bytearray(), proc.stderr: bytearray()}
    seen = dict.fromkeys(kept, 0)
    with selectors.DefaultSelector() as selector:
        for pipe in kept:
            selector.register(pipe, selectors.EVENT_READ)
        while selector.get_map() and time.monotonic() < deadline:
            events = selector.select(timeout=min(deadline - time.monotonic(), _EXIT_POLL_S))
            if not events and proc.poll() is not None:
                break       # exited; whatever still holds the pipes is a straggler
            for key, _ in events:
                chunk = os.read(key.fd, 65536)
                if not chunk:
                    selector.unregister(key.fileobj)
                seen[key.fileobj] += len(chunk)
                kept[key.fileobj] += chunk[:max(0, limits.max_output_bytes - len(kept[key.fileobj]))]
    try:
        proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        timed_out = False
    except subprocess.TimeoutExpired:
        timed_out = True
    return (bytes(kept[proc.stdout]), seen[proc.stdout]), (bytes(kept[proc.stderr]), seen[proc.stderr]), timed_out


def _kill_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)   # pgid == pid: start_new_session, and unshare execs python
    except ProcessLookupError:
        pass                                  # the group is already gone
    proc.wait()


def _cap_output(stdout: bytes, stdout_len: int, stderr: bytes, stderr_len: int, cap: int):
    """Share `cap` bytes between the streams (each gets at least half if it needs it, so a flood on
    stdout cannot hide the traceback) and mark each cut; returns (stdout, stderr, truncated)."""
    stdout_keep = min(stdout_len, max(cap // 2, cap - stderr_len))
    stderr_keep = min(stderr_len, cap - stdout_keep)
    texts = []
    for data, length, keep in ((stdout, stdout_len, stdout_keep), (stderr, stderr_len, stderr_keep)):
        text = data[:keep].decode("utf-8", errors="replace")
        if length > keep:
            separator = "\n" if text and not text.endswith("\n") else ""
            text += f"{separator}[... {length - keep} bytes cut]\n"
        texts.append(text)
    return texts[0], texts[1], stdout_len > stdout_keep or stderr_len > stderr_keep


def _remove_tree(workdir: str) -> None:
    """Delete the run's directory even if the program made parts of it unreadable (a non-root user
    cannot list a mode-000 directory); symlinks are never followed."""
    os.chmod(workdir, 0o700)
    for root, dirs, _ in os.walk(workdir):
        for name in dirs:
            path = os.path.join(root, name)
            if not os.path.islink(path):
                os.chmod(path, 0o700)
    shutil.rmtree(workdir)
