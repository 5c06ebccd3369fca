"""Under CI a skipped test fails (tests/ci_skips.py), except a GPU test on a machine without one."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

TESTS = Path(__file__).resolve().parent
CASES = '''
import pytest


def test_runs():
    pass


def test_skipped_for_a_missing_wheel():
    pytest.skip("SmolLM2 could not be fetched: no index")


@pytest.mark.skip(reason="needs a CUDA device")
def test_on_a_gpu():
    pass
'''


def _pytest(tmp_path: Path, ci: str | None, *files: str) -> subprocess.CompletedProcess:
    (tmp_path / "test_cases.py").write_text(CASES)
    (tmp_path / "test_no_module.py").write_text("import pytest\n\npytest.importorskip('no_such_module_here')\n")
    env = {k: v for k, v in os.environ.items() if k != "CI"} | ({} if ci is None else {"CI": ci})
    env["PYTHONPATH"] = str(TESTS)
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "ci_skips",
                           "-rfs", *files], capture_output=True, text=True, env=env, cwd=tmp_path, check=False)


def test_a_skip_fails_under_ci_but_a_gpu_skip_does_not(tmp_path):
    out = _pytest(tmp_path, "true", "test_cases.py")
    assert out.returncode == 1 and "1 failed, 1 passed, 1 skipped" in out.stdout, out.stdout
    assert "test_skipped_for_a_missing_wheel was skipped under CI (SmolLM2 could not be fetched: no index)" in out.stdout
    out = _pytest(tmp_path, "true", "test_no_module.py")   # a module skipped at import stops the session
    assert out.returncode == 2 and "test_no_module.py was skipped under CI" in out.stdout, out.stdout
    assert "no_such_module_here" in out.stdout


def test_outside_ci_a_skip_is_a_skip(tmp_path):
    for ci in (None, "false"):
        out = _pytest(tmp_path, ci, "test_cases.py", "test_no_module.py")
        assert out.returncode == 0 and "1 passed, 3 skipped" in out.stdout, out.stdout
