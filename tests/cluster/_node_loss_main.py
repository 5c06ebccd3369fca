"""Run in a subprocess by test_node_loss.py: a short disaggregated GRPO run on a Ray cluster on
this machine (a head with no CPUs, for the driver and the coordinator, and two worker nodes of 1
CPU each): the policy's pool fills one worker node, the rollout+reward pool the other. Two nodes
are lost, each with its raylet and every process on it killed, no notice:

1. in step 2's rollout, the node of the rollout+reward actor (stateless): the actor is started
   again alone (stage level) on a replacement node and step 2 runs again;
2. once step 2 is checkpointed, the node of the policy: the run is rebuilt (run level) on a
   replacement node and resumes from its newest checkpoint.

Each replacement node joins a few seconds after the driver has recorded the failure, so each
restart has to wait for it.

The run is `raygraph train --address` in a child process: `ray.cluster_utils.Cluster` adds and
removes nodes only from a main thread (it installs signal handlers), and so does the trainer.

Usage: _node_loss_main.py OUT_DIR [--ray-health-checks] (the latter keeps Ray's default health
checks: slower detection, the figure a real cluster sees). Prints the measured seconds on one
`[chaos]` line per loss and everything on one `RESULT {json}` line; exits non-zero on failure.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from ray.cluster_utils import Cluster

from raygraph.batch import UID
from raygraph.config import load_config
from raygraph.run.ledger import check_ledger

ROOT = Path(__file__).resolve().parents[2]
TOY = str(ROOT / "configs" / "grpo_toy.yaml")
STEPS = 4
# (whose node is lost, once this file exists): step 2's rollout waits there for the loss (a loss
# between steps, e.g. during a checkpoint save, is recovered at run level whoever died); step 2's
# checkpoint
LOSSES = (("rollout+reward/0", "in_step_2.marker"), ("policy/0", "checkpoints/step_2"))
# A plugin every actor imports: the first generate call once step 1 is in the ledger (step 2's)
# writes its node and process into the marker and waits for the node to go (a call to the busy
# actor would wait for it).
WAITING_ROLLOUT = """
import json
import os
import time
from pathlib import Path

import ray

from raygraph.workers.rollout_hf import HFRolloutWorker

RUN = Path({run!r})
_generate = HFRolloutWorker.generate


def _waiting_generate(self, batch, **kwargs):
    ledger = RUN / "ledger.jsonl"
    if ledger.is_file() and '"step": 1' in ledger.read_text():
        try:
            fd = os.open(RUN / "in_step_2.marker", os.O_CREAT | os.O_EXCL | os.O_WRONLY)
        except FileExistsError:
            return _generate(self, batch, **kwargs)
        where = {{"node": ray.get_runtime_context().get_node_id(), "pid": os.getpid()}}
        os.write(fd, json.dumps(where).encode())
        os.close(fd)
        time.sleep(60)
    return _generate(self, batch, **kwargs)


HFRolloutWorker.generate = _waiting_generate
"""
REPLACE_AFTER_S = 2.0   # after the driver recorded the failure
# Ray declares a silent node dead after `failure_threshold` missed health checks, `period_ms`
# apart: 5 x 3 s by default (measured: 13.8 s from removal to the recorded failure); 3 x 1 s here
# to keep the test short. The driver's wait for the verdict follows these settings.
HEALTH_CHECKS = {"health_check_period_ms": 1000, "health_check_failure_threshold": 3}
ENV = {"OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1"}
NODE = {"num_cpus": 1, "env_vars": ENV}   # a 1-CPU bundle fills a node: each pool gets a node of its own


def _overrides(out: Path, model: Path, data: Path) -> list[str]:
    return [f"model.path={model}", "model.tiny=null", "run_name=node_loss", f"trainer.output_dir={out}",
            f"data.train_files=[{data / 'train.parquet'}]", f"data.val_files=[{data / 'val.parquet'}]",
            "data.val_prompts=4", f"trainer.total_steps={STEPS}", "trainer.save_every=1", "checkpoint.keep_last=0",
            "logging.mlflow=false", "trainer.resume=auto", "trainer.max_restarts=2",
            "placement.mode=disaggregated", "placement.train_workers=1", "placement.rollout_workers=1",
            "placement.placement_timeout_s=60"]


def _until(condition, proc: subprocess.Popen, timeout_s: float = 180.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if proc.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"the run ended (rc {proc.returncode}) or {timeout_s:.0f}s passed first")
        time.sleep(0.05)


def _expected_order(cfg) -> dict[int, list[str]]:
    from raygraph.run.feed import StepData

    data = StepData.load(cfg)
    return {s: list(data.next_prompts(step=s, kl_coef=0.0)[UID]) for s in range(1, STEPS + 1)}


def _figures(times: dict[str, float], failure: dict, resumed: dict) -> dict[str, float]:
    return {"detected_s": failure["time"] - times["removed"],
            "replaced_after_detection_s": times["replacement_added"] - failure["time"],
            "back_after_detection_s": resumed["time"] - failure["time"],
            "back_after_replacement_s": resumed["time"] - times["replacement_added"],
            "lost_s": resumed["time"] - times["removed"]}


def _recoveries(run_dir: Path) -> list[dict]:
    path = run_dir / "recoveries.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.is_file() else []


def _node_and_pid(actor_suffix: str) -> tuple[str, int]:
    """The node id and process id of the live named actor whose name ends with `actor_suffix`."""
    import ray

    named = [a for a in ray.util.list_named_actors(all_namespaces=True) if a["name"].endswith(actor_suffix)]
    actor = ray.get_actor(named[0]["name"], namespace=named[0]["namespace"])
    return ray.get(actor.__ray_call__.remote(lambda self: (ray.get_runtime_context().get_node_id(), os.getpid())))


def _lose_node(cluster, node, pid: int) -> None:
    """Kill the node's raylet and the actor's process at once, as a machine crash does (a worker
    whose raylet dies lives on until it notices, and a call it is running may still return)."""
    cluster.remove_node(node, allow_graceful=False)
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def main(out: Path, health_checks: dict) -> None:
    from raygraph.data.toy import write_toy_dataset
    from raygraph.models.tiny import build_tiny_lm

    model, data = build_tiny_lm(out / "tiny_lm", seed=0), out / "data"
    write_toy_dataset(data, n_train=24, n_val=4, seed=0)
    run_dir = out / "grpo_toy" / "node_loss"
    plugin = out / "waiting_rollout.py"
    plugin.write_text(WAITING_ROLLOUT.format(run=str(run_dir)))
    overrides = [*_overrides(out, model, data), f"plugins=[{plugin}]"]
    cfg = load_config(TOY, overrides)
    import ray

    cluster = Cluster(initialize_head=True, head_node_args={**NODE, "num_cpus": 0, "include_dashboard": False,
                                                             "_system_config": health_checks})
    workers = {}
    for _ in range(2):
        node = cluster.add_node(**NODE)
        workers[node.node_id] = node
    cluster.wait_for_nodes()
    ray.init(address=cluster.address)   # to find the victims' nodes
    head = cluster.head_node.node_id
    losses = []
    try:
        proc = subprocess.Popen([sys.executable, "-m", "raygraph.cli", "train", TOY, *overrides,
                                 "--address", cluster.address], env={**os.environ, **ENV})
        for victim, sign in LOSSES:
            marker = run_dir / sign   # a marker says where its writer runs once it is written
            _until(lambda m=marker: m.is_dir() or (m.is_file() and m.stat().st_size > 0), proc)
            if marker.is_file():
                where = json.loads(marker.read_text())
                node_id, pid = where["node"], where["pid"]
            else:
                node_id, pid = _node_and_pid(victim)
            coordinator_node, _ = _node_and_pid("coordinator")
            records = len(_recoveries(run_dir))
            times = {"removed": time.time()}
            _lose_node(cluster, workers.pop(node_id), pid)   # a crash: SIGKILL, no notice
            _until(lambda n=records: len(_recoveries(run_dir)) > n, proc)   # the failure is recorded
            time.sleep(REPLACE_AFTER_S)
            times["replacement_added"] = time.time()
            node = cluster.add_node(**NODE)
            workers[node.node_id] = node
            _until(lambda n=records + 1: len(_recoveries(run_dir)) > n, proc)   # and the recovery done
            losses.append({"victim": victim, "node_id": node_id, "coordinator_on_head": coordinator_node == head,
                           "times": times, "recoveries": _recoveries(run_dir)[records:records + 2]})
        rc = proc.wait(timeout=240)
    finally:
        ray.shutdown()
        cluster.shutdown()
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    result = {"rc": rc, "losses": losses, "recoveries": _recoveries(run_dir),
              "ledger_problems": check_ledger(run_dir, _expected_order(cfg)),
              "metric_steps": [m["step"] for m in metrics]}
    checks = "Ray's default health checks" if not health_checks else "Ray health checks 3 x 1 s"
    for loss in losses:
        failure, back = loss["recoveries"]
        f = loss["figures"] = _figures(loss["times"], failure, back)
        print(f"[chaos] node loss ({checks}), {failure['kind']} level: failure detected {f['detected_s']:.1f}s after "
              f"the node's removal; replacement node added {f['replaced_after_detection_s']:.1f}s later; training "
              f"again {f['back_after_detection_s']:.1f}s after detection ({f['back_after_replacement_s']:.1f}s after "
              f"the replacement came); {f['lost_s']:.1f}s lost in all; dead: {', '.join(failure['dead_actors'])}; "
              f"lost node: {', '.join(failure['lost_nodes'])}", flush=True)
    print("RESULT " + json.dumps(result), flush=True)
    sys.exit(0 if rc == 0 and not result["ledger_problems"] else 1)


if __name__ == "__main__":
    main(Path(sys.argv[1]), {} if "--ray-health-checks" in sys.argv[2:] else HEALTH_CHECKS)
