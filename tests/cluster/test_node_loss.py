"""Chaos: a node of a 2-node `ray.cluster_utils.Cluster` is lost mid-run (its raylet and every
process on it killed); the run waits for a replacement node, resumes from its newest checkpoint
and completes, every prompt trained exactly once.

The cluster and the run live in a subprocess (`_node_loss_main.py`): Ray connects a process to
one cluster only, and the other tests share one local instance (`ray_local`).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest


@pytest.mark.slow
def test_a_lost_node_is_waited_for_and_the_run_completes(tmp_path):
    script = Path(__file__).with_name("_node_loss_main.py")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "RAY_DEDUP_LOGS": "0"}
    proc = subprocess.run([sys.executable, str(script), str(tmp_path)], capture_output=True, text=True,
                          timeout=280, env=env)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stdout[-4000:] + proc.stderr[-4000:]
    result = json.loads(lines[-1][len("RESULT "):])
    assert result["rc"] == 0 and result["metric_steps"] == [1, 2, 3]    # every step, once each
    assert result["ledger_problems"] == []                              # none lost, none repeated

    failure, resumed = result["recoveries"]
    assert failure["kind"] == resumed["kind"] == "run" and failure["failed_step"] in (1, 2)
    lost = result["worker_node_id"][:12]
    assert [n for n in failure["lost_nodes"] if lost in n] and failure["dead_actors"], failure
    assert resumed["resumed_from"] in (0, 1)   # the node went once step 1 was in the ledger

    f = result["figures"]
    print("\n" + next(ln for ln in proc.stdout.splitlines() if ln.startswith("[chaos]")))
    assert f["back_after_replacement_s"] > 0   # 2 ranks need 2 nodes (STRICT_SPREAD): it waited for the new one
    assert f["detected_s"] < 20                # Ray's verdict: 3 health checks 1 s apart, then the ping
