"""Chaos: two nodes of a disaggregated run are lost mid-run (each with its raylet and every
process on it killed, no notice). The one holding the rollout+reward actor: that stateless actor
is started again alone (stage level) once a replacement node comes, and the step runs again. The
one holding the policy: the run is rebuilt on a replacement node (run level) from its newest
checkpoint. The run completes, every prompt trained exactly once.

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
def test_lost_nodes_are_waited_for_and_the_run_completes(tmp_path):
    script = Path(__file__).with_name("_node_loss_main.py")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "RAY_DEDUP_LOGS": "0"}
    proc = subprocess.run([sys.executable, str(script), str(tmp_path)], capture_output=True, text=True,
                          timeout=400, env=env)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stdout[-4000:] + proc.stderr[-4000:]
    result = json.loads(lines[-1][len("RESULT "):])
    assert result["rc"] == 0 and result["metric_steps"] == [1, 2, 3, 4]   # every step, once each
    assert result["ledger_problems"] == []                                # none lost, none repeated
    assert len(result["recoveries"]) == 4
    print("\n" + "\n".join(ln for ln in proc.stdout.splitlines() if ln.startswith("[chaos]")))

    rollout_node, policy_node = result["losses"]
    failure, back = rollout_node["recoveries"]
    assert failure["kind"] == back["kind"] == "stage" and failure["failed_step"] == 2, failure
    assert failure["dead_actors"] == ["grpo_toy/node_loss/rollout+reward/0"], failure   # the policy lives on
    assert back["rerun_step"] == failure["failed_step"] and back["weights_verified"] == 1.0

    failure, back = policy_node["recoveries"]
    assert failure["kind"] == back["kind"] == "run", failure
    assert "grpo_toy/node_loss/policy/0" in failure["dead_actors"], failure
    assert failure["failed_step"] == 3 and back["resumed_from"] == 2

    for loss in result["losses"]:
        failure = loss["recoveries"][0]
        assert [n for n in failure["lost_nodes"] if loss["node_id"][:12] in n], failure
        assert loss["coordinator_on_head"]                 # with the driver, never on a lost node
        assert "grpo_toy/node_loss/coordinator" not in failure["dead_actors"]
        f = loss["figures"]
        assert f["back_after_replacement_s"] > 0   # each pool needs a node of its own: it waited for the new one
        assert f["detected_s"] < 20                # Ray's verdict: 3 health checks 1 s apart, then the ping
