"""Find a workflow by registry name (`grpo`) or by path (`my_algo.py:build`)."""

from __future__ import annotations

import importlib
import importlib.util
import pkgutil
from collections.abc import Callable
from pathlib import Path

import workflows as _shipped

__all__ = ["workflow_names", "load_workflow", "check_workflow_ref"]


def workflow_names() -> list[str]:
    """Names of the workflows shipped in the `workflows` package."""
    return sorted(m.name for m in pkgutil.iter_modules(_shipped.__path__) if not m.name.startswith("_"))


def _split_ref(ref: str) -> tuple[str, str]:
    path, _, attr = ref.rpartition(":") if ".py:" in ref else (ref, "", "build")
    return path, attr or "build"


def check_workflow_ref(ref: str) -> str | None:
    """Return an error message if `ref` names no workflow, else None (does not import it)."""
    if ref.endswith(".py") or ".py:" in ref:
        path, _ = _split_ref(ref)
        return None if Path(path).is_file() else f"workflow file {path!r} does not exist"
    if ref in workflow_names():
        return None
    return f"unknown workflow {ref!r}; valid names: {', '.join(workflow_names())} (or a path like my_algo.py:build)"


def load_workflow(ref: str) -> Callable:
    """Return the `build(roles, cfg)` function named by `ref`."""
    error = check_workflow_ref(ref)
    if error:
        raise ValueError(error)
    if ref.endswith(".py") or ".py:" in ref:
        path, attr = _split_ref(ref)
        spec = importlib.util.spec_from_file_location(f"raygraph_user_workflow_{Path(path).stem}", path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    else:
        module, attr = importlib.import_module(f"workflows.{ref}"), "build"
    build = getattr(module, attr, None)
    if not callable(build):
        raise ValueError(f"workflow {ref!r} has no callable {attr!r}")
    return build
