"""Where metrics go: `metrics.jsonl`, MLflow, the console, and Ray metrics for the dashboard.

`Tracker.log(step, metrics)` writes one JSON object per step (always with `step`) and forwards
the same numbers to every sink. Sinks that fail to start (no MLflow server, no Ray) are reported
once and skipped; the jsonl file is never skipped.

One run directory is one run, however often it is resumed: a Tracker that starts at step N
moves the lines of steps after N (redone now) from `metrics.jsonl` to `metrics_redone.jsonl`, so
`metrics.jsonl` holds each step once, and reopens the MLflow run recorded in `mlflow_run.json`
(same tracking URI) instead of starting another.
"""

from __future__ import annotations

import json
import logging
import math
import os
import re
import sys
import time
from pathlib import Path
from typing import Any

__all__ = ["Tracker", "ConsoleProgress"]

log = logging.getLogger("raygraph")

# Metrics that the console line and the dashboard show (the rest are in jsonl and MLflow).
_HEADLINE = {
    "reward/mean": "reward",
    "val/accuracy": "val_acc",
    "timing/step_s": "step_s",
    "perf/tokens_per_s": "tok/s",
}


NON_FINITE_COUNT = "health/non_finite_metrics"


def _numbers(metrics: dict[str, Any]) -> dict[str, float]:
    """Every numeric metric as a float, non-finite ones included (a NaN is news, never dropped),
    plus `health/non_finite_metrics`, how many of them are NaN or Inf."""
    out = {}
    for key, value in metrics.items():
        try:
            out[key] = float(value)
        except (TypeError, ValueError):
            continue
    out[NON_FINITE_COUNT] = float(sum(not math.isfinite(v) for v in out.values()))
    return out


def _jsonable(value: float) -> float | str:
    """JSON has no NaN/Infinity: write them as the strings "nan", "inf", "-inf"."""
    return value if math.isfinite(value) else str(value)


class ConsoleProgress:
    """One line per step. On a terminal the line also shows an ETA; in a log it stays plain."""

    def __init__(self, total_steps: int, mode: str = "auto", stream=None):
        self.total = total_steps
        self.stream = stream or sys.stdout
        self.tty = mode == "bar" or (mode == "auto" and self.stream.isatty())
        self._start = time.monotonic()
        self._first_step: int | None = None

    def update(self, step: int, metrics: dict[str, float]) -> None:
        if self._first_step is None:
            self._first_step = step - 1
        parts = [f"step {step}/{self.total}"]
        for key, short in _HEADLINE.items():
            if key in metrics:
                parts.append(f"{short}={metrics[key]:.4g}")
        done = step - self._first_step
        if self.tty and done > 0:
            eta = (time.monotonic() - self._start) / done * (self.total - step)
            parts.append(f"eta={eta:.0f}s")
        print("[raygraph] " + " ".join(parts), file=self.stream, flush=True)


_MLFLOW_RUN = "mlflow_run.json"  # {"run_id", "tracking_uri"} of the run directory's MLflow run


class _MlflowSink:
    """Starts the run directory's MLflow run, or reopens it (recorded in `mlflow_run.json`)."""

    def __init__(self, tracking_uri: str, experiment: str, run_name: str, params: dict, run_dir: Path):
        import mlflow

        self.mlflow = mlflow
        mlflow.set_tracking_uri(tracking_uri)
        mlflow.set_experiment(experiment)
        record = run_dir / _MLFLOW_RUN
        previous = json.loads(record.read_text()) if record.is_file() else {}
        self.run = None
        if previous.get("tracking_uri") == tracking_uri:
            try:
                self.run = mlflow.start_run(run_id=previous["run_id"])
            except Exception as exc:  # deleted, or another store: say so and start a new one
                log.warning("cannot reopen MLflow run %s (%s); starting a new one", previous["run_id"], exc)
        if self.run is None:
            self.run = mlflow.start_run(run_name=run_name)
            flat = _flatten(params)  # a reopened run keeps its params: MLflow refuses to change one
            for i in range(0, len(flat), 100):  # MLflow caps a params batch at 100
                mlflow.log_params(dict(list(flat.items())[i:i + 100]))
        self.run_id = self.run.info.run_id
        record.write_text(json.dumps({"run_id": self.run_id, "tracking_uri": tracking_uri}) + "\n")
        for name in ("config.yaml", "resumes.jsonl"):
            if (run_dir / name).is_file():
                mlflow.log_artifact(str(run_dir / name))

    def log(self, step: int, metrics: dict[str, float]) -> None:
        self.mlflow.log_metrics({mlflow_name(k): v for k, v in metrics.items()}, step=step)

    def log_samples(self, path: Path, records: list[dict]) -> None:
        self.mlflow.log_artifact(str(path), artifact_path="samples")
        columns = sorted({k for r in records for k in r})
        table = {c: [_cell(r.get(c)) for r in records] for c in columns}
        self.mlflow.log_table(data=table, artifact_file=f"tables/{path.stem}.json")

    def close(self, status: str) -> None:
        self.mlflow.end_run(status=status)


def _cell(value):
    """A table cell: scalars as they are, a multi-turn conversation one `role: text` line per
    message, anything else as its string."""
    if isinstance(value, (int, float, str, type(None))):
        return value
    if isinstance(value, list) and all(isinstance(m, dict) and "role" in m for m in value):
        return "\n".join(f"{m['role']}: {m.get('text', '')}" for m in value)
    return str(value)


class _RayMetricsSink:
    """Gauges exported with `ray.util.metrics`, shown in the dashboard's Metrics view.

    Prometheus sees them as `ray_raygraph_reward`, `ray_raygraph_val_acc`, `ray_raygraph_step_s`
    and `ray_raygraph_tok_per_s`, tagged with the experiment and the run.
    """

    def __init__(self, experiment: str, run_name: str):
        from ray.util import metrics as ray_metrics

        self.tags = {"experiment": experiment, "run": run_name}
        self.gauges = {
            key: ray_metrics.Gauge(f"raygraph_{short.replace('/', '_per_')}", description=key,
                                   tag_keys=("experiment", "run"))
            for key, short in _HEADLINE.items()
        }

    def log(self, step: int, metrics: dict[str, float]) -> None:
        for key, gauge in self.gauges.items():
            if key in metrics:
                gauge.set(metrics[key], tags=self.tags)


def mlflow_name(key: str) -> str:
    """A metric key as MLflow accepts it: `val/accuracy@gsm8k` -> `val/accuracy_at_gsm8k`,
    `perf/peak_rss_gb/policy+rollout` -> `perf/peak_rss_gb/policy_rollout`."""
    key = key.replace("@", "_at_")
    return re.sub(r"[^A-Za-z0-9_\-. :/]", "_", key)


def _flatten(tree: dict, prefix: str = "") -> dict[str, str]:
    out: dict[str, str] = {}
    for key, value in tree.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            out.update(_flatten(value, name + "."))
        else:
            out[name] = str(value)[:500]
    return out


def _drop_redone(path: Path, start_step: int) -> None:
    """Keep the lines of steps <= `start_step` in `path`; append the others to `metrics_redone.jsonl`."""
    if not path.is_file():
        return
    keep, redone = [], []
    for line in path.read_text().splitlines(keepends=True):
        try:
            step = json.loads(line)["step"]
        except (ValueError, KeyError, TypeError):  # a line cut short by a kill is not a step
            step = None
        (keep if step is not None and step <= start_step else redone).append(line if line.endswith("\n") else line + "\n")
    if not redone:
        return
    with (path.parent / "metrics_redone.jsonl").open("a") as f:
        f.writelines(redone)
    tmp = path.with_suffix(".jsonl.tmp")
    tmp.write_text("".join(keep))
    os.replace(tmp, path)
    log.warning("metrics.jsonl: %d line(s) after step %d are redone by this run; moved to metrics_redone.jsonl",
                len(redone), start_step)


class Tracker:
    """Fan-out of per-step metrics to jsonl (always), MLflow, Ray metrics and the console.

    Args:
        run_dir: the run directory; `metrics.jsonl` is appended there (resume keeps history).
        total_steps: for the console line.
        start_step: the step this run continues from (0: from the start); lines of later steps
            are moved out of `metrics.jsonl`, to be written again.
        mlflow_uri: tracking URI, or None to skip MLflow.
        experiment, run_name: MLflow names.
        params: the resolved config as a nested dict (MLflow params).
        ray_metrics: export headline metrics with `ray.util.metrics`.
        console: "auto" | "bar" | "lines".
        log_every: send every N-th step to the console, MLflow and Ray metrics (`log(force=True)`
            sends any step); `metrics.jsonl` gets every step.
    """

    def __init__(self, run_dir: Path, *, total_steps: int, mlflow_uri: str | None, experiment: str,
                 run_name: str, params: dict, ray_metrics: bool = True, console: str = "auto",
                 log_every: int = 1, start_step: int = 0):
        self.run_dir = Path(run_dir)
        self.log_every = log_every
        _drop_redone(self.run_dir / "metrics.jsonl", start_step)
        self.jsonl = (self.run_dir / "metrics.jsonl").open("a")
        self.console = ConsoleProgress(total_steps, console)
        self.sinks: list[Any] = []
        self.mlflow_run_id: str | None = None
        if mlflow_uri:
            self._start_sink(lambda: _MlflowSink(mlflow_uri, experiment, run_name, params, self.run_dir), "MLflow")
            if self.sinks:
                self.mlflow_run_id = self.sinks[-1].run_id
        if ray_metrics:
            self._start_sink(lambda: _RayMetricsSink(experiment, run_name), "Ray metrics")

    def _start_sink(self, make, what: str) -> None:
        try:
            self.sinks.append(make())
        except Exception as exc:  # a tracking backend must never stop training
            log.warning("%s logging disabled: %s", what, exc)

    def log(self, step: int, metrics: dict[str, Any], force: bool = False) -> None:
        """Append `metrics` to metrics.jsonl; on every `log_every`-th step (or with `force`) also
        send them to the console, MLflow and Ray metrics."""
        clean = _numbers(metrics)
        bad = sorted(k for k, v in clean.items() if not math.isfinite(v))
        if bad:
            log.warning("step %d: non-finite metrics %s", step, ", ".join(f"{k}={clean[k]}" for k in bad))
        self.jsonl.write(json.dumps({"step": step, **{k: _jsonable(v) for k, v in clean.items()}},
                                    sort_keys=True, allow_nan=False) + "\n")
        self.jsonl.flush()
        if not force and step % self.log_every:
            return
        for sink in self.sinks:
            try:
                sink.log(step, clean)
            except Exception as exc:
                log.warning("dropping a metrics sink after an error: %s", exc)
                self.sinks.remove(sink)
        self.console.update(step, clean)

    def log_samples(self, path: Path, records: list[dict]) -> None:
        """Send a samples file (`raygraph.run.samples`) to the sinks that keep artifacts (MLflow)."""
        for sink in self.sinks:
            if hasattr(sink, "log_samples"):
                try:
                    sink.log_samples(path, records)
                except Exception as exc:  # a tracking backend must never stop training
                    log.warning("could not log samples %s to %s: %s", path.name, type(sink).__name__, exc)

    def close(self, status: str = "FINISHED") -> None:
        self.jsonl.close()
        for sink in self.sinks:
            if hasattr(sink, "close"):
                sink.close(status)
