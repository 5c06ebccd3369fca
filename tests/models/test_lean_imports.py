"""Loading a transformers model class leaves SciPy and (on a CPU-only torch) Triton unimported,
and what used them still works (raygraph.models.lean_imports, raygraph.models.import_hooks)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from raygraph.models import import_hooks, lean_imports

_PROBE = """
import json, sys
import numpy as np
import raygraph
import transformers.models.qwen2.modeling_qwen2
loaded = {name: name in sys.modules for name in ("scipy", "triton")}
import transformers.loss.loss_for_object_detection as detr
import transformers.loss.loss_rt_detr as rt_detr
from transformers.utils import import_utils
import torch.utils._triton as torch_triton
costs = np.array([[4.0, 1.0, 3.0], [2.0, 0.0, 5.0], [3.0, 2.0, 2.0]])
rows, cols = rt_detr.linear_sum_assignment(costs)
print(json.dumps({**loaded, "rows": rows.tolist(), "cols": cols.tolist(), "scipy_after_call": "scipy" in sys.modules,
                  "check_restored": detr.is_scipy_available is import_utils.is_scipy_available,
                  "torch_sees_triton": torch_triton.has_triton_package(),
                  "matcher": type(detr.HungarianMatcher(class_cost=1, bbox_cost=1, giou_cost=1)).__name__}))
"""


def _probe(**env: str) -> dict:
    done = subprocess.run([sys.executable, "-c", _PROBE], env={**os.environ, **env}, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.slow   # two subprocesses: not in `make test-fast`
def test_a_model_class_loads_without_scipy_and_triton_and_the_detection_losses_still_solve():
    """The cheapest assignment of the 3x3 cost matrix (hand-computed: 1 + 2 + 2 = 5, rows 0-2 to
    columns 1, 0, 2) comes from the put-off SciPy solver; switched off, both packages load as before."""
    lean = _probe()
    assert lean["scipy"] is False and lean["triton"] is False
    assert (lean["rows"], lean["cols"]) == ([0, 1, 2], [1, 0, 2]) and lean["scipy_after_call"]
    assert lean["check_restored"] and lean["matcher"] == "HungarianMatcher"   # SciPy seen as installed again
    assert lean["torch_sees_triton"] is False   # this torch is CPU-only and Triton has no CPU backend
    plain = _probe(**{lean_imports.LEAN_ENV: "0"})
    assert plain["scipy"] is True and plain["triton"] is True and plain["torch_sees_triton"] is True
    assert (plain["rows"], plain["cols"]) == ([0, 1, 2], [1, 0, 2])


def _fake_triton(root: Path, *backends: str) -> None:
    (root / "triton" / "backends").mkdir(parents=True)
    (root / "triton" / "__init__.py").write_text("raise ImportError('never imported by the check')\n")
    for backend in backends:
        (root / "triton" / "backends" / backend).mkdir()


def test_triton_counts_as_unusable_only_without_a_gpu_build_and_a_cpu_backend(tmp_path, monkeypatch):
    _fake_triton(tmp_path / "gpu_only", "nvidia", "amd")
    _fake_triton(tmp_path / "with_cpu", "nvidia", "cpu")
    for backend in ("cuda", "hip", "xpu"):
        monkeypatch.setattr(torch.version, backend, None, raising=False)
    monkeypatch.delitem(sys.modules, "triton", raising=False)   # imported by an earlier test: find_spec would name it
    monkeypatch.syspath_prepend(str(tmp_path / "gpu_only"))
    assert lean_imports.triton_unusable()
    monkeypatch.setattr(torch.version, "cuda", "13.0")   # a CUDA build: torch decides itself
    assert not lean_imports.triton_unusable()
    monkeypatch.setattr(torch.version, "cuda", None)
    monkeypatch.syspath_prepend(str(tmp_path / "with_cpu"))   # a Triton with a CPU backend
    assert not lean_imports.triton_unusable()


def test_a_hooked_module_runs_through_its_hook_once_and_others_are_untouched(tmp_path, monkeypatch):
    (tmp_path / "hooked_probe_module.py").write_text("VALUE = 1\n")
    (tmp_path / "plain_probe_module.py").write_text("VALUE = 1\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    calls = []

    def hook(exec_module, module):
        calls.append("before")
        exec_module(module)
        module.VALUE += 1
        calls.append("after")

    import_hooks.wrap_exec("hooked_probe_module", hook)
    try:
        import hooked_probe_module
        import plain_probe_module

        assert hooked_probe_module.VALUE == 2 and plain_probe_module.VALUE == 1 and calls == ["before", "after"]
        import hooked_probe_module as again  # already imported: not executed again

        assert again.VALUE == 2 and calls == ["before", "after"]
    finally:
        import_hooks._HOOKS.pop("hooked_probe_module", None)
        for name in ("hooked_probe_module", "plain_probe_module"):
            sys.modules.pop(name, None)
