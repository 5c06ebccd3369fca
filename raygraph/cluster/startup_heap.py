"""An actor's start-up without the garbage collector's repeated full passes.

A role worker's construction imports torch, transformers and the model code (~1.5 million
objects). Python's cyclic garbage collector runs a full pass each time the heap has grown by a
quarter, so these imports paid several passes over an ever larger heap; and every later full pass
(vLLM's engine start calls `gc.collect()` five times) walked all of it again.

`quiet_heap` stops the full passes for the start-up (the young generations are still collected,
so short-lived garbage cycles, e.g. of a model load, are freed as before), collects once at its
end, and moves what is left, which lives as long as the process, out of the collector's view
(`gc.freeze`). Memory is still freed by reference counting; a frozen object that later becomes
part of a garbage cycle is not collected (`gc.unfreeze` puts the frozen objects back in view:
`raygraph.workers.vllm_in_process` does so after an engine start). Measured in
docs/benchmarks.md section 18.
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator

__all__ = ["quiet_heap"]

_NO_FULL_PASS = 1 << 30   # the oldest generation's threshold: never reached in a start-up


@contextlib.contextmanager
def quiet_heap() -> Iterator[None]:
    """Run the block without full collections; then collect once and freeze what is left."""
    thresholds = gc.get_threshold()
    gc.set_threshold(thresholds[0], thresholds[1], _NO_FULL_PASS)
    try:
        yield
    finally:
        gc.set_threshold(*thresholds)
        gc.collect()
        gc.freeze()
