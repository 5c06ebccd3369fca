"""A config's workflow reference: a registry name (`grpo`) or a path (`my_algo.py:build`).

Resolving it imports the workflow module and reads what it declares (module-level constants):

    ROLES          the roles its graph binds (the reference role is added whenever a KL term is on)
    ADVANTAGES     the advantage estimators it accepts, the first being the default; () when it
                   computes no advantages (SFT, DPO); undeclared = any registered estimator,
                   default "grpo"
    DATA_FORMAT    "rl" prompts (default), "sft" prompt/response pairs or "dpo" preference pairs
    MAX_STALENESS  the largest `placement.max_staleness` its graph implements (default 0)

The shipped workflows live in the repository's `workflows/` folder, installed as
`raygraph.workflows`.
"""

from __future__ import annotations

import importlib
import importlib.util
import pkgutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import raygraph.workflows as _shipped

__all__ = ["Workflow", "WorkflowError", "workflow_names", "load_workflow", "check_workflow_ref"]

DEFAULT_ROLES = ("policy", "rollout", "reward")
DEFAULT_ADVANTAGE = "grpo"   # for a workflow that does not declare ADVANTAGES

# Modules of raygraph < 0.2 that a workflow written against the old layout may import.
_MOVED = {
    "raygraph.dag": "from raygraph.graph import InputNode, MultiOutputNode",
    "raygraph.steps": "from raygraph.graph import whole_batch (then whole_batch.compute_advantages, ...)",
    "raygraph.workflow_parts": "from raygraph.graph.fragments import rollout_columns",
    "raygraph.workflow_loader": "from raygraph.config.workflow_ref import load_workflow",
    "workflows": "from raygraph.workflows import grpo",
}


class WorkflowError(ValueError):
    """A workflow reference that names nothing, or a module that fails to import or declare."""


@dataclass(frozen=True)
class Workflow:
    """A loaded workflow: its `build(roles, cfg)` and what it declares (see the module docstring)."""

    ref: str
    build: Callable
    roles: tuple[str, ...] = DEFAULT_ROLES
    advantages: tuple[str, ...] | None = None   # None: undeclared (any registered estimator)
    data_format: str = "rl"
    max_staleness: int = 0

    @property
    def default_advantage(self) -> str | None:
        """The estimator used when `algorithm.advantage` is unset (None: the workflow uses none)."""
        if self.advantages is None:
            return DEFAULT_ADVANTAGE
        return self.advantages[0] if self.advantages else None


def workflow_names() -> list[str]:
    """Names of the workflows shipped in `raygraph.workflows`."""
    return sorted(m.name for m in pkgutil.iter_modules(_shipped.__path__) if not m.name.startswith("_"))


def _is_path(ref: str) -> bool:
    return ref.endswith(".py") or ".py:" in ref


def _split_ref(ref: str) -> tuple[str, str]:
    path, _, attr = ref.rpartition(":") if ".py:" in ref else (ref, "", "build")
    return path, attr or "build"


def check_workflow_ref(ref: str) -> str | None:
    """Return an error message if `ref` names no workflow, else None (does not import it)."""
    if _is_path(ref):
        path, _ = _split_ref(ref)
        return None if Path(path).is_file() else f"workflow file {path!r} does not exist"
    if ref in workflow_names():
        return None
    return f"unknown workflow {ref!r}; valid names: {', '.join(workflow_names())} (or a path like my_algo.py:build)"


def _import(ref: str):
    if not _is_path(ref):
        return importlib.import_module(f"raygraph.workflows.{ref}"), "build"
    path, attr = _split_ref(ref)
    spec = importlib.util.spec_from_file_location(f"raygraph_user_workflow_{Path(path).stem}", path)
    module = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)
    except ModuleNotFoundError as exc:
        hint = _MOVED.get(exc.name or "")
        if hint is None:
            raise
        raise WorkflowError(f"workflow file {path!r} imports {exc.name!r}, which moved in raygraph 0.2; "
                            f"use: {hint} (see docs/custom-algorithm.md)") from None
    return module, attr


def load_workflow(ref: str) -> Workflow:
    """Import the workflow named by `ref` (a shipped name or `path.py[:function]`).

    Raises:
        WorkflowError: `ref` names nothing, the module has no callable `build` (or the named
            function), imports a module of the old layout, or declares something malformed.
    """
    error = check_workflow_ref(ref)
    if error:
        raise WorkflowError(error)
    module, attr = _import(ref)
    build = getattr(module, attr, None)
    if not callable(build):
        raise WorkflowError(f"workflow {ref!r} has no callable {attr!r}")
    advantages = getattr(module, "ADVANTAGES", None)
    if advantages is not None and (isinstance(advantages, str)
                                   or not all(isinstance(a, str) for a in advantages)):
        raise WorkflowError(f"workflow {ref!r}: ADVANTAGES must be a tuple of estimator names, got {advantages!r}")
    return Workflow(ref, build, tuple(getattr(module, "ROLES", DEFAULT_ROLES)),
                    None if advantages is None else tuple(advantages),
                    getattr(module, "DATA_FORMAT", "rl"), int(getattr(module, "MAX_STALENESS", 0)))
