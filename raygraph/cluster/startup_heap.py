"""An actor's start-up without the garbage collector's repeated full passes.

A role worker's construction imports torch, transformers and the model code (~1.5 million
objects). Python's cyclic garbage collector runs a full pass each time the heap has grown by a
quarter, so these imports paid several passes over an ever larger heap; and every later full pass
(vLLM's engine start calls `gc.collect()` five times) walked all of it again.

`quiet_heap` turns the collector off for the start-up, collects once at its end (no cyclic
garbage of the start-up is kept), and moves what is left, which lives as long as the process, out
of the collector's view (`gc.freeze`). Memory is still freed by reference counting as before; a
frozen object that later becomes part of a garbage cycle is not collected (`gc.unfreeze` puts the
frozen objects back in view: `raygraph.workers.vllm_in_process` does so after an engine start).
Measured in docs/benchmarks.md section 18.
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator

__all__ = ["quiet_heap"]


@contextlib.contextmanager
def quiet_heap() -> Iterator[None]:
    """Run the block with the cyclic garbage collector off; then collect once and freeze what is
    left. The collector is on afterwards if it was before."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        gc.collect()
        gc.freeze()
        if was_enabled:
            gc.enable()
