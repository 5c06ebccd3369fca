"""The python_exec tool's sandbox (raygraph.agents.sandbox): output, errors, limits, the group kill,
network isolation, a fresh directory and environment per run, and the tool schema."""

from __future__ import annotations

import json
import os
import socket
import time
from pathlib import Path

import pytest
from transformers.utils import get_json_schema

from raygraph.agents.sandbox import (
    SandboxLimits,
    SandboxResult,
    SandboxUnavailable,
    _probe_network_isolation,
    network_isolation,
    python_exec,
    run_python,
)

SPAWN_SLEEPER = """
import subprocess
sleeper = subprocess.Popen(["sleep", "60"])
print(sleeper.pid, flush=True)
"""


def process_is_alive(pid: int) -> bool:
    """True while `pid` runs; a zombie (killed, not yet reaped by its new parent) counts as dead."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return False
    return state != "Z"


def wait_until_dead(pid: int, within_s: float = 2.0) -> bool:
    """SIGKILL is delivered asynchronously: give the kernel a moment to finish the process."""
    deadline = time.monotonic() + within_s
    while process_is_alive(pid):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


def test_prints_are_returned():
    result = run_python("print(6 * 7)\nprint('done')")
    assert result == SandboxResult(stdout="42\ndone\n", stderr="", exit_code=0, timed_out=False,
                                   truncated=False, timeout_s=5.0)
    assert result.as_text() == "42\ndone"


def test_an_exception_gives_its_traceback_and_a_nonzero_exit_code():
    result = run_python("print('before')\n1 / 0")
    assert result.exit_code == 1 and not result.timed_out
    assert result.stdout == "before\n"
    assert "Traceback" in result.stderr and "ZeroDivisionError: division by zero" in result.stderr
    assert result.as_text().startswith("before\nTraceback")
    assert result.as_text().endswith("ZeroDivisionError: division by zero\n[exit code 1]")


def test_timeout_kills_the_program_and_every_process_it_started():
    start = time.monotonic()
    result = run_python(SPAWN_SLEEPER + "while True:\n    pass", SandboxLimits(timeout_s=1.0, cpu_s=10))
    elapsed = time.monotonic() - start
    assert result.timed_out and result.exit_code is None
    assert elapsed < 2.5                             # the 1 s deadline, not the 10 s CPU limit
    assert result.as_text().endswith("[timed out after 1s]")
    assert wait_until_dead(int(result.stdout)), "the sleep the program started outlived the sandbox"


def test_a_program_that_exits_leaving_a_child_returns_at_once_and_the_child_dies():
    start = time.monotonic()
    result = run_python(SPAWN_SLEEPER, SandboxLimits(timeout_s=5.0))
    assert time.monotonic() - start < 2.0            # not held until the deadline by the sleep's pipes
    assert result.exit_code == 0 and not result.timed_out
    assert wait_until_dead(int(result.stdout))


def test_a_program_that_closes_its_output_runs_to_its_end():
    code = "import os, time\nos.close(1)\nos.close(2)\ntime.sleep(0.3)\nos._exit(3)"
    result = run_python(code, SandboxLimits(timeout_s=5.0))
    assert result.exit_code == 3 and not result.timed_out


def test_cpu_limit_kills_a_busy_loop_with_sigxcpu():
    result = run_python("while True:\n    pass", SandboxLimits(timeout_s=10.0, cpu_s=1))
    assert not result.timed_out
    assert result.exit_code == -24                   # SIGXCPU at the soft limit
    assert result.as_text() == "[exit code -24 (CPU time limit exceeded)]"


def test_memory_cap_turns_a_2gb_allocation_into_memory_error():
    result = run_python("block = bytearray(2 * 1024**3)", SandboxLimits(memory_mb=256))
    assert result.exit_code == 1
    assert "MemoryError" in result.stderr


def test_output_beyond_the_cap_is_cut_with_a_marker():
    result = run_python("print('x' * 10_000)", SandboxLimits(max_output_bytes=100))
    assert result.truncated
    # 10_001 bytes printed (with the newline), 100 kept
    assert result.stdout == "x" * 100 + "\n[... 9901 bytes cut]\n"


def test_a_flood_on_stdout_does_not_hide_the_traceback():
    result = run_python("print('x' * 100_000)\n1 / 0", SandboxLimits(max_output_bytes=1000))
    assert result.truncated
    assert result.stdout.startswith("x" * 500) and "bytes cut" in result.stdout
    assert result.stderr.rstrip().endswith("ZeroDivisionError: division by zero")
    assert "bytes cut" not in result.stderr


def test_network_is_cut_unless_allowed():
    with socket.create_server(("127.0.0.1", 0)) as server:   # the kernel completes connects to it
        port = server.getsockname()[1]
        code = f"import socket\nsocket.create_connection(('127.0.0.1', {port}), timeout=2)\nprint('connected')"
        isolated = run_python(code, SandboxLimits(network=False))
        allowed = run_python(code, SandboxLimits(network=True))
    assert isolated.exit_code == 1 and "connected" not in isolated.stdout
    # a new network namespace has only a loopback device, and it is down
    assert isolated.stderr.splitlines()[-1] == "OSError: [Errno 101] Network is unreachable"
    assert allowed.exit_code == 0 and allowed.stdout == "connected\n"


def test_network_isolation_is_an_unshare_prefix():
    prefix = network_isolation()
    assert Path(prefix[0]).name == "unshare" and prefix[1] in ("-n", "-rn")


def test_network_isolation_that_cannot_work_says_what_to_do(tmp_path):
    failing_unshare = tmp_path / "unshare"
    failing_unshare.write_text("#!/bin/sh\necho 'unshare failed: Operation not permitted' >&2\nexit 1\n")
    failing_unshare.chmod(0o755)
    with pytest.raises(SandboxUnavailable, match="unprivileged user namespaces") as raised:
        _probe_network_isolation(str(failing_unshare))
    assert "Operation not permitted" in str(raised.value) and "network=True" in str(raised.value)
    with pytest.raises(SandboxUnavailable, match="install util-linux"):
        _probe_network_isolation(None)


@pytest.mark.parametrize("code, limits", [
    ("import os\nprint(os.getcwd())", SandboxLimits()),
    ("import os\nprint(os.getcwd(), flush=True)\nopen('left.txt', 'w').write('x')\nwhile True:\n    pass",
     SandboxLimits(timeout_s=0.5)),
], ids=["after_exit", "after_timeout"])
def test_the_working_directory_is_fresh_and_removed_afterwards(code, limits):
    result = run_python(code, limits)
    workdir = result.stdout.strip()
    assert Path(workdir).name.startswith("raygraph-sandbox-") and workdir != os.getcwd()
    assert not Path(workdir).exists()


def test_a_directory_made_unreadable_by_the_program_is_removed_too():
    code = "import os\nos.makedirs('locked/inner')\nos.chmod('locked', 0)\nprint(os.getcwd())"
    result = run_python(code)
    assert result.exit_code == 0
    assert not Path(result.stdout.strip()).exists()


def test_the_parents_environment_does_not_reach_the_program(monkeypatch):
    monkeypatch.setenv("RAYGRAPH_FAKE_SECRET", "hunter2")
    result = run_python("import json, os\nprint(json.dumps(dict(os.environ)))")
    assert "hunter2" not in result.stdout and "RAYGRAPH_FAKE_SECRET" not in result.stdout
    environment = json.loads(result.stdout)
    assert set(environment) <= {"PATH", "HOME", "TMPDIR", "LANG", "LC_CTYPE"}
    assert environment["HOME"] == environment["TMPDIR"]


def test_python_exec_returns_what_the_model_reads():
    assert python_exec("print(sum(range(10)))") == "45"


def test_python_exec_has_a_tool_schema_with_a_required_code_string():
    schema = get_json_schema(python_exec)
    assert schema["type"] == "function"
    function = schema["function"]
    assert function["name"] == "python_exec"
    assert function["description"].startswith("Run a Python program and return what it printed.")
    assert function["parameters"]["required"] == ["code"]
    assert function["parameters"]["properties"]["code"]["type"] == "string"
    assert function["parameters"]["properties"]["code"]["description"]


@pytest.mark.parametrize("field, value", [("timeout_s", 0), ("cpu_s", -1), ("memory_mb", 0),
                                          ("max_output_bytes", 0)])
def test_limits_that_cannot_be_honoured_are_rejected(field, value):
    with pytest.raises(ValueError, match=f"SandboxLimits.{field} must be > 0"):
        SandboxLimits(**{field: value})
