"""What an idle local Ray costs, with and without the workers it prestarts for the driver.

    .venv/bin/python benchmarks/ray_idle.py [--seconds 60]

Each variant is a fresh process that starts a local Ray as the tests do (8 logical CPUs, no
dashboard), waits 15 s for the start-up to settle, then measures the CPU seconds of every Ray
process (GCS, raylet, agents, idle workers) over `--seconds`. "prestart" is Ray's default;
"none" sets `RAY_prestart_worker_first_driver=0`, as raygraph's own local Ray and the tests do
(raygraph's actors carry their own runtime env, so they never use those workers). Printed: JSON
with the CPU seconds per variant, the idle workers' share, and the count of idle workers.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

CHILD = r'''
import json, os, sys, time
import psutil
import ray

ray.init(address="local", num_cpus=8, include_dashboard=False, log_to_driver=False)
time.sleep(15)


def ray_processes():
    out = {}
    for proc in psutil.process_iter(["cmdline"]):
        try:
            cmd = " ".join(proc.info["cmdline"] or [])
            if proc.pid != os.getpid() and "ray" in cmd:
                cpu = proc.cpu_times()
                out[proc.pid] = (cmd, cpu.user + cpu.system)
        except psutil.Error:
            pass
    return out


before = ray_processes()
time.sleep(float(sys.argv[1]))
after = ray_processes()
spent = {pid: after[pid][1] - before[pid][1] for pid in after if pid in before}
idle = [pid for pid in spent if after[pid][0].startswith("ray::IDLE")]
print("RESULT " + json.dumps({"ray_cpu_s": round(sum(spent.values()), 2), "idle_workers": len(idle),
                              "idle_workers_cpu_s": round(sum(spent[pid] for pid in idle), 2)}))
ray.shutdown()
'''


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seconds", type=float, default=60.0)
    args = parser.parse_args()
    results = {}
    for name, value in (("prestart", None), ("none", "0")):
        env = {k: v for k, v in os.environ.items() if k != "RAY_prestart_worker_first_driver"}
        if value is not None:
            env["RAY_prestart_worker_first_driver"] = value
        done = subprocess.run([sys.executable, "-c", CHILD, str(args.seconds)], env=env, capture_output=True,
                              text=True, timeout=args.seconds + 300)
        lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
        if done.returncode != 0 or not lines:
            raise RuntimeError(f"{name} failed:\n{done.stderr[-3000:]}")
        results[name] = json.loads(lines[-1].removeprefix("RESULT "))
    print(json.dumps({"benchmark": "ray_idle", "seconds": args.seconds, "results": results}, indent=1))


if __name__ == "__main__":
    main()
