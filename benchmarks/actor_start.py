"""What starting one actor costs, with and without a Ray runtime env.

    .venv/bin/python benchmarks/actor_start.py [--actors 8] [--rounds 3]

Any runtime env, even one of environment variables only, makes Ray start the actor's process
through its `setup_worker` process, which imports part of Ray and then replaces itself with the
worker. raygraph's actors used to carry one (OMP_NUM_THREADS and TOKENIZERS_PARALLELISM per
actor); now they set those themselves as they start (`raygraph.cluster.roles.START_ENV`).

Each round is a fresh process per variant (alternating): a local Ray (4 logical CPUs, no
dashboard, no prestarted workers), then `--actors` actors started one after another, each pinged
once and killed. Measured: the whole machine's busy CPU seconds (/proc/stat) and wall seconds per
actor, so run it on an otherwise idle machine. Printed: JSON with the median per variant and their
ratio. The actor does nothing else: the figure is Ray's part of every raygraph actor's start.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

CHILD = r'''
import json, os, sys, time
import ray

ray.init(address="local", num_cpus=4, include_dashboard=False, log_to_driver=False)


@ray.remote(num_cpus=0)
class Bare:
    def ping(self):
        return os.getpid()


def busy_s():
    with open("/proc/stat") as f:
        ticks = [int(x) for x in f.readline().split()[1:]]
    return (sum(ticks) - ticks[3] - ticks[4]) / os.sysconf("SC_CLK_TCK")


time.sleep(3)   # Ray's own start-up settles
options = {"runtime_env": {"env_vars": {"OMP_NUM_THREADS": "1"}}} if sys.argv[1] == "runtime_env" else {}
n = int(sys.argv[2])
cpu0, t0 = busy_s(), time.perf_counter()
for _ in range(n):
    actor = Bare.options(**options).remote()
    ray.get(actor.ping.remote())
    ray.kill(actor)
print("RESULT " + json.dumps({"cpu_s": (busy_s() - cpu0) / n, "wall_s": (time.perf_counter() - t0) / n}))
ray.shutdown()
'''


def _one(variant: str, actors: int) -> dict:
    env = {**os.environ, "RAY_prestart_worker_first_driver": "0"}
    proc = subprocess.run([sys.executable, "-c", CHILD, variant, str(actors)], capture_output=True, text=True,
                          env=env, timeout=600)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        raise SystemExit(f"{variant}: exit {proc.returncode}\n{proc.stderr[-3000:]}")
    return json.loads(lines[-1][len("RESULT "):])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--actors", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    runs: dict[str, list[dict]] = {"runtime_env": [], "none": []}
    for _ in range(args.rounds):
        for variant in runs:
            runs[variant].append(_one(variant, args.actors))
    out = {variant: {key: round(statistics.median(r[key] for r in rs), 3) for key in ("cpu_s", "wall_s")}
           for variant, rs in runs.items()}
    out["cpu_ratio_none_to_runtime_env"] = round(out["none"]["cpu_s"] / out["runtime_env"]["cpu_s"], 3)
    out["actors_per_round"], out["rounds"] = args.actors, args.rounds
    print(json.dumps(out))


if __name__ == "__main__":
    main()
