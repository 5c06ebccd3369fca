"""Find a workflow by registry name (`grpo`) or by path (`my_algo.py:build`)."""

from __future__ import annotations

import importlib
import importlib.util
import pkgutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import workflows as _shipped

__all__ = ["Workflow", "workflow_names", "load_workflow", "check_workflow_ref"]

DEFAULT_ROLES = ("policy", "rollout", "reward")


@dataclass(frozen=True)
class Workflow:
    """A loaded workflow: its `build(roles, cfg)` and what it needs from the trainer.

    A workflow module may declare `ROLES` (the roles its DAG binds; the reference role is added
    by the trainer whenever the config uses a KL term), `DATA_FORMAT` ("rl" prompts,
    "sft" prompt/response pairs or "dpo" preference pairs) and `MAX_STALENESS` (the largest
    `placement.max_staleness` its DAG implements; 0, synchronous only, by default).
    """

    ref: str
    build: Callable
    roles: tuple[str, ...] = DEFAULT_ROLES
    data_format: str = "rl"
    max_staleness: int = 0


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


def load_workflow(ref: str) -> Workflow:
    """Import the workflow named by `ref` (a shipped name or `path.py[:function]`)."""
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
    return Workflow(ref, build, tuple(getattr(module, "ROLES", DEFAULT_ROLES)),
                    getattr(module, "DATA_FORMAT", "rl"), int(getattr(module, "MAX_STALENESS", 0)))
