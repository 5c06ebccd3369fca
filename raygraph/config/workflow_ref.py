"""A config's workflow reference: a registry name (`grpo`) or a path (`my_algo.py:build`).

Resolving it imports the workflow module and reads what it declares (module-level constants):

    ROLES          the roles its graph binds (the reference role is added whenever a KL term is on)
    ESTIMATORS     the advantage estimators it accepts, the first being the default; () when it
                   computes no advantages (SFT, DPO); undeclared = any registered estimator,
                   default "grpo"
    DATA_FORMAT    "rl" prompts (default), "sft" prompt/response pairs or "dpo" preference pairs
    MAX_STALENESS  the largest `placement.max_staleness` its graph implements (default 0)
    ARGS           a pydantic model of its arguments (the config's `workflow_args`); build then
                   receives `args=ARGS(...)`. Without it, the keyword-only arguments of build
                   (`def build(roles, cfg, *, min_std: float = 0.0)`) are its arguments.

What its graph does is not declared: whether it honours DAPO's shaping options, reads extra
prompt batches or computes the KL the adaptive controller needs is read off the built graph
(`raygraph.graph.report.graph_facts`, checked by `raygraph.run.graphs.check_graph_honours`).

The shipped workflows live in the repository's `workflows/` folder, installed as
`raygraph.workflows`.
"""

from __future__ import annotations

import difflib
import importlib
import importlib.util
import inspect
import pkgutil
import typing
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, ValidationError, create_model

import raygraph.workflows as _shipped
from raygraph.config.role_kinds import DEFAULT_ROLES
from raygraph.errors import ConfigInvalid

__all__ = ["Workflow", "WorkflowError", "workflow_names", "load_workflow", "check_workflow_ref"]

DEFAULT_ADVANTAGE = "grpo"   # for a workflow that does not declare ESTIMATORS


class WorkflowError(ConfigInvalid, ValueError):
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
    args: type[BaseModel] | None = None   # its arguments (`workflow_args`); None: it takes none
    args_as_model: bool = False           # True: declared as ARGS, passed as `args=`; else as keywords

    @property
    def default_advantage(self) -> str | None:
        """The estimator used when `algorithm.advantage` is unset (None: the workflow uses none)."""
        if self.advantages is None:
            return DEFAULT_ADVANTAGE
        return self.advantages[0] if self.advantages else None

    def check_args(self, values: dict[str, Any]) -> tuple[dict[str, Any], list[str]]:
        """`workflow_args` against the declared arguments: (the values with every default filled
        in, as plain YAML values; problems, one line each with a did-you-mean)."""
        if self.args is None:
            return values, ([f"workflow_args: workflow {self.ref!r} takes no arguments (declare keyword-only "
                             "arguments of its build function, or an ARGS model); remove "
                             + ", ".join(f"workflow_args.{k}" for k in values)] if values else [])
        try:
            return self.args.model_validate(values).model_dump(mode="json"), []
        except ValidationError as exc:
            return values, [self._describe(error) for error in exc.errors()]

    def build_graph(self, roles, cfg):
        """Call the workflow's build with the config's (checked) `workflow_args`."""
        if self.args is None:
            return self.build(roles, cfg)
        args = self.args.model_validate(cfg.workflow_args)
        return self.build(roles, cfg, args=args) if self.args_as_model else self.build(roles, cfg, **dict(args))

    def _describe(self, error) -> str:
        key = ".".join(str(p) for p in error["loc"])
        names = list(self.args.model_fields)
        if error["type"] == "extra_forbidden":
            close = difflib.get_close_matches(key, names, n=1, cutoff=0.6)
            hint = f" (did you mean workflow_args.{close[0]}?)" if close else ""
            return (f"workflow_args.{key} is not an argument of workflow {self.ref!r}{hint}; "
                    f"it takes: {', '.join(names)}")
        if error["type"] == "missing":
            return f"workflow_args.{key} is required by workflow {self.ref!r}"
        message = error["msg"].removeprefix("Value error, ")
        return f"workflow_args.{key}={error['input']!r}: {message[:1].lower()}{message[1:]}"


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
    except ImportError as exc:   # the file's own imports: say which file, without a traceback wall
        raise WorkflowError(f"workflow file {path!r} cannot be imported: {type(exc).__name__}: {exc}") from None
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
    if isinstance(getattr(module, "ADVANTAGES", None), (tuple, list)):   # the column name is a str: fine
        raise WorkflowError(f"workflow {ref!r} declares ADVANTAGES; the estimators a workflow accepts are "
                            "declared as ESTIMATORS (ADVANTAGES is the column name in raygraph.batch)")
    advantages = getattr(module, "ESTIMATORS", None)
    if advantages is not None and (isinstance(advantages, str)
                                   or not all(isinstance(a, str) for a in advantages)):
        raise WorkflowError(f"workflow {ref!r}: ESTIMATORS must be a tuple of estimator names, got {advantages!r}")
    declared = getattr(module, "ARGS", None)
    if declared is not None and not (isinstance(declared, type) and issubclass(declared, BaseModel)):
        raise WorkflowError(f"workflow {ref!r}: ARGS must be a pydantic model class, got {declared!r}")
    args = _strict(declared) if declared is not None else _keyword_args(ref, build)
    return Workflow(ref, build, tuple(getattr(module, "ROLES", DEFAULT_ROLES)),
                    None if advantages is None else tuple(advantages),
                    getattr(module, "DATA_FORMAT", "rl"), int(getattr(module, "MAX_STALENESS", 0)),
                    args, declared is not None)


def _strict(model: type[BaseModel]) -> type[BaseModel]:
    """`model` with unknown keys forbidden, as everywhere in the config."""
    if model.model_config.get("extra") == "forbid":
        return model
    return type(model.__name__, (model,), {"model_config": ConfigDict(**{**model.model_config, "extra": "forbid"}),
                                           "__module__": model.__module__})


def _keyword_args(ref: str, build: Callable) -> type[BaseModel] | None:
    """A model of build's keyword-only arguments (their annotations, else the type of the default)."""
    params = [p for p in inspect.signature(build).parameters.values() if p.kind is p.KEYWORD_ONLY]
    if not params:
        return None
    try:
        hints = typing.get_type_hints(build)
    except Exception:  # noqa: BLE001 - an annotation naming what the module does not import
        hints = {}
    fields = {}
    for p in params:
        guess = type(p.default) if isinstance(p.default, (bool, int, float, str)) else Any
        fields[p.name] = (hints.get(p.name, guess), ... if p.default is p.empty else p.default)
    try:
        return create_model("WorkflowArgs", __config__=ConfigDict(extra="forbid", frozen=True), **fields)
    except Exception as exc:  # noqa: BLE001 - e.g. a default that does not fit its annotation
        raise WorkflowError(f"workflow {ref!r}: its keyword-only arguments cannot be checked: {exc}") from None
