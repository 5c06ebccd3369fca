"""Two imports that loading a causal LM pulls in and never uses, put off until they are used.

Importing a transformers model class (every policy, reference, critic and HF rollout actor does)
also imports:

* **SciPy** (~0.3 CPU-s): transformers' object-detection losses (DETR and its relatives, imported
  with every model's loss table) take `scipy.optimize.linear_sum_assignment` at import time. Those
  modules are now imported while transformers is told SciPy is absent, then each gets a
  `linear_sum_assignment` that imports SciPy's on its first call: the same function, loaded when
  a detection loss runs, never for a language model.
* **Triton** (~0.15 CPU-s): `torch._dynamo` (which transformers' attention masks import) imports
  it where the package is installed (vLLM's dependencies install it). torch compiles with Triton
  only for a GPU or for a Triton CPU backend. On a torch build without CUDA, ROCm or XPU and a
  Triton without a `cpu` backend, torch is told the package is absent (`has_triton_package()`
  False), which is what it would conclude on first use. vLLM decides about Triton by itself.

Measured: docs/benchmarks.md section 21. `import raygraph` installs both (`skip_unused_imports`);
`RAYGRAPH_LEAN_IMPORTS=0` turns them off. A module already imported is left as it is.
"""

from __future__ import annotations

import functools
import importlib.util
import os
import sys
from pathlib import Path

from raygraph.models import import_hooks

__all__ = ["LEAN_ENV", "skip_unused_imports", "triton_unusable"]

LEAN_ENV = "RAYGRAPH_LEAN_IMPORTS"
_LOSSES = "transformers.loss.loss_utils"   # imports every loss module of transformers
_TRITON_CHECK = "torch.utils._triton"


def skip_unused_imports() -> None:
    """Put off SciPy and (where torch cannot use it) Triton as described above."""
    if os.environ.get(LEAN_ENV, "1") == "0":
        return
    if _LOSSES not in sys.modules:
        import_hooks.wrap_exec(_LOSSES, _losses_without_scipy)
    if _TRITON_CHECK not in sys.modules:
        import_hooks.wrap_exec(_TRITON_CHECK, _triton_check_answered)


def _losses_without_scipy(exec_module, module) -> None:
    import transformers.utils as utils

    real = utils.is_scipy_available
    utils.is_scipy_available = _absent   # what each loss module binds by `from ..utils import ...`
    try:
        exec_module(module)
    finally:
        utils.is_scipy_available = real
    for name, loaded in list(sys.modules.items()):
        if name.startswith("transformers.loss.") and getattr(loaded, "is_scipy_available", None) is _absent:
            loaded.is_scipy_available = real
            if real() and "linear_sum_assignment" not in vars(loaded):
                loaded.linear_sum_assignment = linear_sum_assignment


def linear_sum_assignment(*args, **kwargs):
    """`scipy.optimize.linear_sum_assignment`, imported on the first call."""
    from scipy.optimize import linear_sum_assignment as solve

    return solve(*args, **kwargs)


@functools.cache   # as the checks it stands in for (callers may `cache_clear()` them)
def _absent() -> bool:
    return False


def _triton_check_answered(exec_module, module) -> None:
    exec_module(module)
    check = getattr(module, "has_triton_package", None)
    if check is not None and hasattr(check, "cache_clear") and triton_unusable():
        module.has_triton_package = _absent


def triton_unusable() -> bool:
    """True when this torch build has no GPU backend and the installed Triton (if any) no CPU
    backend, judged without importing either (torch.version is loaded before torch.utils)."""
    import torch.version

    if any(getattr(torch.version, backend, None) for backend in ("cuda", "hip", "xpu")):
        return False
    spec = importlib.util.find_spec("triton")
    if spec is None or not spec.submodule_search_locations:
        return True
    return not any((Path(location) / "backends" / "cpu").is_dir() for location in spec.submodule_search_locations)
