"""A real Ray head (`ray start --head`) for the job tests, torn down even when a test fails.

The pytest process never connects to it: jobs go through `JobSubmissionClient` and the state
API over HTTP. The other tests share an in-process `ray.init` (`ray_local`), and a process can
be connected to one Ray cluster only.
"""

from __future__ import annotations

import shutil
import sys
import tempfile
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from _jobhead import LocalHead  # noqa: E402


@pytest.fixture(scope="module")
def head():
    # A short path: Ray's unix sockets live under the temp dir (at most 107 characters).
    temp_dir = Path(tempfile.mkdtemp(prefix="rgjob", dir="/tmp" if Path("/tmp").is_dir() else None))
    local = LocalHead(temp_dir, num_cpus=4)
    try:
        local.start()
        yield local
    finally:
        local.stop()
        shutil.rmtree(temp_dir, ignore_errors=True)
