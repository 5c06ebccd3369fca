"""`ray job submit` against a real local head (docs/cluster.md): a run succeeds and leaves no
actors or placement groups behind; `ray job stop` checkpoints at a step boundary, and the same
command with `trainer.resume=auto` finishes the run.

Jobs use the repository as `working_dir` (as `ray job submit --working-dir .` does) and run the
README's command in the uploaded copy: `raygraph train configs/grpo_toy.yaml
trainer.output_dir=<absolute>/runs`, with no model or data path (the config's tiny model is built
under the output folder; its toy data is written in the job's copy), plus a run name. `raygraph` is
this venv's (the head's PATH).
"""

from __future__ import annotations

import json
import re
import shlex
import time
from dataclasses import asdict, is_dataclass
from pathlib import Path

import pytest
import requests
from ray.job_submission import JobStatus, JobSubmissionClient
from ray.util.state import StateApiClient
from ray.util.state.common import ListApiOptions, StateResource

from raygraph.run import checkpoint

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
EXPERIMENT = "grpo_toy"  # configs/grpo_toy.yaml
# Ray respects .gitignore too; these keep the upload to the code whatever else is lying around.
EXCLUDES = [".git", ".venv", "runs", "runs_*", "mlruns", ".pytest_cache", ".ruff_cache", "*.egg-info"]
STEP_LINE = re.compile(r"^\[raygraph\] step (\d+)/(\d+) ", re.MULTILINE)


@pytest.fixture(scope="module")
def client(head) -> JobSubmissionClient:
    return JobSubmissionClient(head.dashboard_url, headers=head.headers)


@pytest.fixture(scope="module")
def workdir(tmp_path_factory) -> Path:
    """The `$PWD` of the README's command: outputs and the tiny model of every job here (absolute
    paths: the job's own working directory is a temporary copy of the repository on the head)."""
    return tmp_path_factory.mktemp("ray_jobs")


def _train_command(work: Path, run_name: str, *overrides: str) -> str:
    """The README's `raygraph train configs/grpo_toy.yaml trainer.output_dir=$PWD/runs`, named."""
    args = ["raygraph", "train", "configs/grpo_toy.yaml", f"trainer.output_dir={work / 'runs'}",
            f"run_name={run_name}", *overrides]
    return shlex.join(args)


def _data(work: Path) -> list[str]:
    """Toy data outside the job's copy, so that a resumed job (a new copy) reads the same files."""
    return [f"data.train_files=[{work / 'data' / 'train.parquet'}]", f"data.val_files=[{work / 'data' / 'val.parquet'}]"]


def _submit(client: JobSubmissionClient, entrypoint: str, timeout_s: float = 60.0) -> str:
    runtime_env = {"working_dir": str(REPO), "excludes": EXCLUDES,
                   # `ray job stop` SIGKILLs the driver this long after SIGTERM (Ray's default: 3 s)
                   "env_vars": {"RAY_JOB_STOP_WAIT_TIME_S": "60"}}
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            return client.submit_job(entrypoint=entrypoint, runtime_env=runtime_env)
        except RuntimeError as exc:  # "No available agent to submit job" while the head starts
            if "No available agent" not in str(exc) or time.monotonic() > deadline:
                raise
            time.sleep(1)


def _wait_done(client: JobSubmissionClient, job_id: str, timeout_s: float = 180.0) -> JobStatus:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        status = client.get_job_status(job_id)
        if status.is_terminal():
            return status
        time.sleep(0.5)
    raise TimeoutError(f"job {job_id} still {status} after {timeout_s:.0f}s:\n{client.get_job_logs(job_id)[-4000:]}")


def _wait_log(client: JobSubmissionClient, job_id: str, pattern: str, timeout_s: float = 120.0) -> str:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        logs = client.get_job_logs(job_id)
        if re.search(pattern, logs, re.MULTILINE):
            return logs
        if client.get_job_status(job_id).is_terminal():
            break
        time.sleep(0.5)
    raise AssertionError(f"{pattern!r} not in the log of job {job_id}:\n{client.get_job_logs(job_id)[-4000:]}")


def _rows(head, resource: StateResource) -> list[dict]:
    """State API rows over HTTP (this process stays unconnected)."""
    api = StateApiClient(address=head.dashboard_url, headers=head.headers)
    rows = api.list(resource, options=ListApiOptions(limit=10_000), raise_on_missing_output=False)
    return [asdict(r) if is_dataclass(r) else dict(r) for r in rows]


def _named(head, resource: StateResource, prefix: str) -> list[dict]:
    return [r for r in _rows(head, resource) if (r.get("name") or "").startswith(prefix)]


def _wait_gauge(head, run_name: str, timeout_s: float = 60.0) -> str:
    """The run's `raygraph_step_s` gauge as the head's Prometheus endpoint serves it."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            text = requests.get(f"http://127.0.0.1:{head.metrics_port}/metrics", timeout=5).text
        except requests.RequestException:
            text = ""
        for line in text.splitlines():
            if line.startswith("ray_raygraph_step_s{") and f'run="{run_name}"' in line:
                return line
        time.sleep(1)
    raise AssertionError(f"no ray_raygraph_step_s gauge for run {run_name} within {timeout_s:.0f}s")


def _assert_nothing_left(head, run_name: str, timeout_s: float = 30.0) -> list[dict]:
    """Every actor of the run is DEAD and every placement group REMOVED; returns the actors."""
    prefix = f"{EXPERIMENT}/{run_name}/"
    deadline = time.monotonic() + timeout_s
    while True:
        actors = _named(head, StateResource.ACTORS, prefix)
        groups = _named(head, StateResource.PLACEMENT_GROUPS, prefix)
        live = [a["name"] for a in actors if a["state"] != "DEAD"]
        live += [g["name"] for g in groups if g["state"] != "REMOVED"]
        if not live or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert actors and groups, f"no actors or placement groups named {prefix}*: {actors} {groups}"
    assert not live, f"still alive after the job ended: {live}"
    return actors


def _steps(logs: str) -> list[int]:
    return [int(m.group(1)) for m in STEP_LINE.finditer(logs)]


def test_job_succeeds_and_leaves_nothing_behind(head, client, workdir):
    # before model.tiny: "model.path runs/models/tiny-lm does not exist" (relative to the job's copy,
    # so not under trainer.output_dir/models, where alone a tiny model was built)
    job = _submit(client, _train_command(workdir, "two-steps", "trainer.profile=true"))   # 2 steps (the config)
    status = _wait_done(client, job)
    logs = client.get_job_logs(job)
    assert status == JobStatus.SUCCEEDED, logs[-4000:]
    model = workdir / "runs" / "models" / "tiny-tiny"
    assert f"model.tiny=tiny: building a RANDOM-INIT tiny model at {model}" in logs
    assert (model / "config.json").is_file()

    run_dir = workdir / "runs" / EXPERIMENT / "two-steps"
    assert f"[raygraph] run directory: {run_dir}" in logs
    assert _steps(logs) == [1, 2], logs[-4000:]  # one line per step
    assert "\r" not in logs  # no progress bars or spinners in a job log
    assert [json.loads(line)["step"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()] == [1, 2]

    # <experiment>/<run>/<role>/<rank>; roles fused in one actor are joined by "+"
    names = [a["name"] for a in _assert_nothing_left(head, "two-steps")]
    assert all(re.fullmatch(r"grpo_toy/two-steps/([a-z_+]+/\d+|coordinator)", n) for n in names), names
    roles = {role for n in names for role in n.split("/")[2].split("+")}
    assert {"policy", "rollout", "reward", "coordinator"} <= roles, names
    groups = [g["name"] for g in _named(head, StateResource.PLACEMENT_GROUPS, "grpo_toy/two-steps/")]
    assert groups == ["grpo_toy/two-steps/main"]  # one pool when colocated
    # profile: every stage is a task named <role>.<method> in the dashboard, and in timeline.json
    tasks = {t["name"] for t in _rows(head, StateResource.TASKS)}
    assert {"rollout.generate", "reward.score", "policy.update"} <= tasks, sorted(tasks)
    events = json.loads((run_dir / "timeline.json").read_text())
    assert {"task::rollout.generate", "task::policy.update"} <= {e.get("cat") for e in events}


def test_stop_checkpoints_then_resume_finishes(head, client, workdir):
    run_name = "stop-resume"
    run_dir = workdir / "runs" / EXPERIMENT / run_name
    job = _submit(client, _train_command(workdir, run_name, *_data(workdir), "logging.mlflow=false",
                                         "trainer.resume=auto", "trainer.total_steps=1000", "trainer.save_every=0"))
    _wait_log(client, job, r"^\[raygraph\] step 3/1000 ")
    assert 'experiment="grpo_toy"' in _wait_gauge(head, run_name)  # the dashboard's Metrics view
    assert client.stop_job(job)
    status = _wait_done(client, job, timeout_s=90)
    logs = client.get_job_logs(job)
    assert status == JobStatus.STOPPED, logs[-4000:]
    assert "stop requested (signal 15)" in logs, logs[-4000:]

    complete = checkpoint.list_complete(run_dir)
    assert len(complete) == 1, (complete, logs[-4000:])  # save_every=0: the stop wrote the only one
    stopped_at, ckpt = complete[0]
    assert 3 <= stopped_at < 1000 and checkpoint.read_trainer_state(ckpt)["step"] == stopped_at
    assert (ckpt / "hf" / "config.json").is_file() and (ckpt / "policy").is_dir()
    assert f"[raygraph] checkpoint written: {ckpt}" in logs
    assert f"[raygraph] stopped after step {stopped_at} " in logs
    assert max(_steps(logs)) == stopped_at
    _assert_nothing_left(head, run_name)

    # The same command, resumed (trainer.resume=auto) and ending two steps later.
    end = stopped_at + 2
    job = _submit(client, _train_command(workdir, run_name, *_data(workdir), "logging.mlflow=false",
                                         "trainer.resume=auto", f"trainer.total_steps={end}"))
    status = _wait_done(client, job)
    logs = client.get_job_logs(job)
    assert status == JobStatus.SUCCEEDED, logs[-4000:]
    assert f"[raygraph] resumed from {ckpt} (step {stopped_at})" in logs
    assert _steps(logs) == [stopped_at + 1, end]
    steps = [json.loads(line)["step"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert steps == list(range(1, end + 1))
    assert checkpoint.latest(run_dir).name == f"step_{end}"
    _assert_nothing_left(head, run_name)
