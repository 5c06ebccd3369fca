"""A real Ray head for the job tests: `ray start --head --block` in a subprocess, torn down by pid.

The head gets its own temp dir and free ports for every listening service, so it neither
collides with other Ray instances on the machine (a second head would find port 52365, the
dashboard agent's default, taken and could not accept jobs) nor becomes the instance that a
plain `ray.init()` elsewhere would join (`ray start` records its address under its own temp
dir). Token authentication is on, with a token made for this head: the head's processes (and
so every job driver and actor) get it through `RAY_AUTH_TOKEN`; HTTP clients send it as a
bearer header. Nothing here connects the calling process to the head.

`ray stop` is never used: it stops every Ray process on the machine.
"""

from __future__ import annotations

import os
import secrets
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import psutil
import requests

__all__ = ["LocalHead"]


def _free_ports(n: int) -> list[int]:
    socks = []
    try:
        for _ in range(n):
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


class LocalHead:
    """One head node. `start()` returns once the job server accepts authenticated requests."""

    def __init__(self, temp_dir: Path, num_cpus: int = 4, env: dict[str, str] | None = None):
        self.temp_dir = Path(temp_dir)
        self.num_cpus = num_cpus
        self.token = secrets.token_hex(32)
        (self.gcs_port, self.dashboard_port, self.agent_port, self.agent_grpc_port, self.metrics_port,
         self.runtime_env_port, self.client_port, self.node_manager_port,
         self.object_manager_port) = _free_ports(9)
        self.dashboard_url = f"http://127.0.0.1:{self.dashboard_port}"
        self.headers = {"Authorization": f"Bearer {self.token}", "Content-Type": "application/json"}
        bin_dir = str(Path(sys.executable).parent)  # `python` and `raygraph` in jobs: this venv
        self.env = {**os.environ, "PATH": bin_dir + os.pathsep + os.environ.get("PATH", ""),
                    "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": self.token,
                    "RAY_USAGE_STATS_ENABLED": "0", "RAY_DEDUP_LOGS": "0", **(env or {})}
        self.env.pop("RAY_ADDRESS", None)
        self.proc: subprocess.Popen | None = None
        self._log = None

    def start(self, timeout_s: float = 90.0) -> LocalHead:
        ray_cli = str(Path(sys.executable).parent / "ray")
        cmd = [ray_cli, "start", "--head", "--block", "--disable-usage-stats",
               f"--temp-dir={self.temp_dir}", f"--num-cpus={self.num_cpus}", "--num-gpus=0",
               f"--port={self.gcs_port}", f"--dashboard-port={self.dashboard_port}",
               "--dashboard-host=127.0.0.1", f"--dashboard-agent-listen-port={self.agent_port}",
               f"--dashboard-agent-grpc-port={self.agent_grpc_port}",
               f"--metrics-export-port={self.metrics_port}", f"--runtime-env-agent-port={self.runtime_env_port}",
               f"--ray-client-server-port={self.client_port}", f"--node-manager-port={self.node_manager_port}",
               f"--object-manager-port={self.object_manager_port}",
               "--object-store-memory=200000000", "--include-log-monitor=true"]
        self._log = (self.temp_dir / "ray_start.log").open("w")
        self.proc = subprocess.Popen(cmd, env=self.env, stdout=self._log, stderr=subprocess.STDOUT,
                                     start_new_session=True)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"ray start exited with {self.proc.returncode}:\n{self.start_log()}")
            try:
                r = requests.get(f"{self.dashboard_url}/api/version", headers=self.headers, timeout=2)
                if r.status_code == 200:
                    return self
            except requests.RequestException:
                pass
            time.sleep(0.5)
        raise TimeoutError(f"the Ray head did not answer within {timeout_s:.0f}s:\n{self.start_log()}")

    def start_log(self) -> str:
        path = self.temp_dir / "ray_start.log"
        return path.read_text()[-4000:] if path.exists() else ""

    def processes(self) -> list[psutil.Process]:
        """Every process of this head: `ray start` and its descendants, plus any process whose
        command line names the head's temp dir or GCS port (job drivers run in their own session)."""
        found: dict[int, psutil.Process] = {}
        if self.proc is not None:
            try:
                root = psutil.Process(self.proc.pid)
                found[root.pid] = root
                found.update({p.pid: p for p in root.children(recursive=True)})
            except psutil.NoSuchProcess:
                pass
        markers = (str(self.temp_dir), f":{self.gcs_port}")
        for p in psutil.process_iter(["cmdline"]):
            cmdline = " ".join(p.info["cmdline"] or [])
            if p.pid != os.getpid() and "ray" in cmdline and any(m in cmdline for m in markers):
                found[p.pid] = p
                try:
                    found.update({c.pid: c for c in p.children(recursive=True)})
                except psutil.NoSuchProcess:
                    pass
        found.pop(os.getpid(), None)
        return list(found.values())

    def stop(self, grace_s: float = 3.0) -> None:
        """SIGTERM every process of the head, SIGKILL what is left after `grace_s`."""
        procs = self.processes()
        for p in procs:
            try:
                p.send_signal(signal.SIGTERM)
            except psutil.Error:
                pass
        _, alive = psutil.wait_procs(procs, timeout=grace_s)
        for p in alive:
            try:
                p.kill()
            except psutil.Error:
                pass
        psutil.wait_procs(alive, timeout=5)
        if self._log is not None:
            self._log.close()
