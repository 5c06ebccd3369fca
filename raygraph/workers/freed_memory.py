"""Freed memory kept for reuse in a process that trains, scores or generates on CPU.

glibc's malloc serves blocks of more than 32 MiB with a fresh `mmap` and unmaps them when they are
freed (its threshold for that adapts up to 32 MiB only). A CPU training process allocates and frees
such blocks all the time: a policy update's activations and gradients every micro-batch, and after
every weight reload vLLM's CPU build re-packs each linear layer into oneDNN's layout and frees the
layer's unpacked weights (~450 MB of 4-113 MB buffers for SmolLM2-135M). Each time the new mapping
is faulted in page by page: a reload of that model took ~115k minor page faults and ~0.17 s of
kernel time of its 0.55 s.

`keep_freed_memory` raises malloc's mmap and trim thresholds to 1 GiB with `mallopt`: blocks up
to that size come from the heap, and freed ones stay there for the next use. Measured on the 135M
model (docs/benchmarks.md section 22): a reload 0.545-0.553 s -> 0.46-0.48 s (page faults per
reload ~115k -> mostly none); a colocated GRPO step with vLLM 24.2-26.0 s -> 21.0 s and with the HF
sampler 20.3-20.7 s -> 19.0-19.6 s; a process holds a few hundred MB more (what it freed, kept).

Called by every role actor without a GPU (`raygraph.cluster.host.RoleHost`) and by every vLLM
rollout worker on the CPU build before its engine is built (an engine core process of its own is
forked from it and inherits the setting). Only glibc has these settings; elsewhere nothing
changes. `RAYGRAPH_KEEP_FREED_MEMORY=0` in the workers' environment turns it off.
"""

from __future__ import annotations

import ctypes
import os
import platform

__all__ = ["KEEP_ENV", "THRESHOLD_BYTES", "keep_freed_memory"]

KEEP_ENV = "RAYGRAPH_KEEP_FREED_MEMORY"
THRESHOLD_BYTES = 1 << 30
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3   # glibc's <malloc.h>


def keep_freed_memory() -> bool:
    """Raise this process's malloc thresholds as described above; True when it was done."""
    if os.environ.get(KEEP_ENV, "1") == "0" or platform.libc_ver()[0] != "glibc":
        return False
    mallopt = ctypes.CDLL(None).mallopt
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return bool(mallopt(_M_MMAP_THRESHOLD, THRESHOLD_BYTES) and mallopt(_M_TRIM_THRESHOLD, THRESHOLD_BYTES))
