"""A CPU role actor, and a process that runs a vLLM engine on CPU, keep freed memory for reuse
(raygraph.workers.freed_memory): a large block allocated again after being freed faults in no new pages."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from raygraph.cluster import PoolSpec, RoleSpec, build_roles
from raygraph.workers import freed_memory

# The same 200 MB block malloc'ed, filled and freed three times; the minor page faults of each round.
REUSE_PROBE = """
import ctypes, resource
libc = ctypes.CDLL(None)
libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
libc.free.argtypes, libc.memset.argtypes = [ctypes.c_void_p], [ctypes.c_void_p, ctypes.c_int, ctypes.c_size_t]
faults = []
for _ in range(3):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    block = libc.malloc(200 << 20)
    libc.memset(block, 1, 200 << 20)
    libc.free(block)
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""
PAGES = (200 << 20) // os.sysconf("SC_PAGESIZE")   # 51,200 with 4 KiB pages


def reuse_faults() -> list[int]:
    """REUSE_PROBE run in this process: the page faults of each of its three rounds."""
    scope: dict = {}
    exec(REUSE_PROBE, scope)
    return scope["faults"]


def _probe(**env: str) -> dict:
    code = f"from raygraph.workers.freed_memory import keep_freed_memory\nkept = keep_freed_memory()\n{REUSE_PROBE}\n" \
           "import json; print(json.dumps({'kept': kept, 'faults': faults}))"
    done = subprocess.run([sys.executable, "-c", code], env={**os.environ, **env}, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc settings")
def test_a_freed_block_is_reused_without_new_page_faults_and_the_switch_turns_it_off():
    kept = _probe()
    assert kept["kept"] is True
    assert kept["faults"][0] > PAGES // 2                 # the first time the pages are new
    assert max(kept["faults"][1:]) < PAGES // 20         # then the freed block is reused
    plain = _probe(**{freed_memory.KEEP_ENV: "0"})
    assert plain["kept"] is False
    assert min(plain["faults"][1:]) > PAGES // 2          # malloc's default: unmapped, faulted in again


class FaultProbe:
    """A role worker that runs REUSE_PROBE in its actor's process."""

    def faults(self) -> list[int]:
        return reuse_faults()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc settings")
def test_a_role_actor_on_cpu_reuses_freed_blocks(ray_local):
    ray_local.cloudpickle.register_pickle_by_value(sys.modules[__name__])
    roles = build_roles("test-freed-memory/run", {"train": PoolSpec(bundles=1, cpus_per_bundle=1.0)},
                        {"policy": RoleSpec(FaultProbe, {}, pool="train")})
    try:
        faults = roles.policy.call_rank0("faults")
    finally:
        roles.shutdown()
    assert faults[0] > PAGES // 2 and max(faults[1:]) < PAGES // 20
