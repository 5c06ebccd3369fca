"""A disaggregated layout spanning two simulated nodes (`ray.cluster_utils.Cluster`).

Ray connects a process to one cluster only and the other tests share one local instance
(`ray_local`), so the two-node cluster lives in a subprocess (`_multinode_main.py`).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest


@pytest.mark.slow
def test_disaggregated_across_two_nodes():
    script = Path(__file__).with_name("_multinode_main.py")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "RAY_DEDUP_LOGS": "0"}
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=240, env=env)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(lines[-1][len("RESULT "):])
    assert len(result["rollout_nodes"]) == 2 and len(result["policy_nodes"]) == 2 and all(result["equal"])
    assert [s["weights/verified"] for s in result["syncs"]] == [1.0, 1.0]
    v0 = result["first"]["weights/version"]
    assert [s["weights/version"] for s in result["syncs"]] == [v0 + 1, v0 + 2]
