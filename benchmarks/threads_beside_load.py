"""Do waiting OpenMP threads cost an update its speed when another process wants a core? Prints JSON.

    .venv/bin/python benchmarks/threads_beside_load.py [--model runs/models/smollm2-135m-instruct]
        [--threads 2] [--iterations 3] [--rounds 2]

Each run is a fresh process (OMP_WAIT_POLICY is read when torch loads) doing update-like work:
forward, backward and an AdamW step on 8 x 160 tokens, fp32, `--threads` torch threads, timed
over `--iterations` after one warm-up. `policy`: `default` (OMP_WAIT_POLICY unset: libgomp spins
before it sleeps), `passive` (what raygraph gives its actors) or `spin:N` (GOMP_SPINCOUNT=N); `load`: `idle` or `busy` (one
other process spinning on one core the whole time, as a second actor or test would). Without
`--model` a random-init 25M model (`model.tiny: 25m`) is built in a temporary folder.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time


def _one(model: str, threads: int, iterations: int) -> float:
    import torch
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(threads)
    policy = AutoModelForCausalLM.from_pretrained(model, torch_dtype=torch.float32)
    optim = torch.optim.AdamW(policy.parameters(), lr=1e-6)
    ids = torch.randint(0, policy.config.vocab_size, (8, 160), generator=torch.Generator().manual_seed(0))
    times = []
    for _ in range(iterations + 1):
        start = time.perf_counter()
        policy(input_ids=ids, labels=ids).loss.backward()
        optim.step()
        optim.zero_grad()
        times.append(time.perf_counter() - start)
    return statistics.median(times[1:])


def _spin() -> None:
    while True:
        pass


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--iterations", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--policies", default="default,passive",
                        help="comma-separated: default, passive, or spin:N (GOMP_SPINCOUNT=N)")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps({"iteration_s": _one(args.model, args.threads, args.iterations)}))
        return
    with tempfile.TemporaryDirectory() as tmp:
        model = args.model
        if model is None:
            from raygraph.models.tiny import build_tiny_lm

            model = str(build_tiny_lm(os.path.join(tmp, "25m"), size="25m"))
        for round_ in range(args.rounds):
            for load in ("idle", "busy"):
                for policy in args.policies.split(","):
                    env = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
                    if policy == "passive":
                        env["OMP_WAIT_POLICY"] = "PASSIVE"
                    elif policy.startswith("spin:"):
                        env["GOMP_SPINCOUNT"] = policy.removeprefix("spin:")
                    spinner = subprocess.Popen([sys.executable, "-c", "while True: pass"]) if load == "busy" else None
                    try:
                        out = subprocess.run([sys.executable, __file__, "--child", "--model", model, "--threads",
                                              str(args.threads), "--iterations", str(args.iterations)],
                                             env=env, capture_output=True, text=True, check=True)
                    finally:
                        if spinner is not None:
                            spinner.kill()
                    result = json.loads(out.stdout.strip().splitlines()[-1])
                    print(json.dumps({"round": round_, "load": load, "policy": policy, "threads": args.threads,
                                      "model": model if args.model else "tiny 25m", **result}), flush=True)


if __name__ == "__main__":
    main()
