"""YAML + `a.b.c=value` overrides -> a checked `RaygraphConfig`, or a `ConfigError` listing every problem.

Order of work: read the YAML (duplicate keys are problems too), apply the overrides, validate
the schema (types, ranges, unknown keys with did-you-mean), then the cross-field and registry
checks of `raygraph.config.checks`. Problems from all stages are collected and raised together;
the cross-field and registry checks still run after schema problems, on the config with the
offending keys left out.
"""

from __future__ import annotations

import copy
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from raygraph.algos.user_code import UserCodeError, import_plugin
from raygraph.config.checks import config_problems
from raygraph.config.schema import RaygraphConfig
from raygraph.config.suggest import ANY_KEY, schema_tree, unknown_key_message
from raygraph.config.workflow_ref import Workflow, WorkflowError, load_workflow
from raygraph.errors import ConfigInvalid

__all__ = ["ConfigError", "load_config", "build_config", "apply_overrides", "to_yaml"]

KeyPath = tuple[str, ...]


class ConfigError(ConfigInvalid):
    """A config that cannot be used; `problems` holds one plain-language line per problem."""

    def __init__(self, problems: Iterable[str], source: str | None = None) -> None:
        self.problems = list(problems)
        self.source = source
        super().__init__(self.problems)

    def __str__(self) -> str:
        where = f" in {self.source}" if self.source else ""
        lines = [f"{len(self.problems)} config problem{'s' if len(self.problems) != 1 else ''}{where}:"]
        return "\n".join(lines + [f"  - {p}" for p in self.problems])


def load_config(path: str | Path, overrides: Iterable[str] = ()) -> RaygraphConfig:
    """Read a YAML config, apply `key.path=value` overrides and check everything.

    Args:
        path: the YAML file.
        overrides: items like `rollout.n=8` or `data.train_files=[a.parquet,b.parquet]`; the value
            is parsed as YAML and type-checked by the schema.

    Returns:
        The validated, frozen config.

    Raises:
        ConfigError: listing every problem found, not only the first.
    """
    data, problems = _read_yaml(Path(path))
    if data is None:
        raise ConfigError(problems, source=str(path))
    return _build(data, list(overrides), problems, source=str(path))


def build_config(data: Mapping[str, Any], overrides: Iterable[str] = ()) -> RaygraphConfig:
    """Like `load_config` for an in-memory mapping (e.g. `cfg.model_dump()` to derive a variant)."""
    return _build(copy.deepcopy(dict(data)), list(overrides), [], source=None)


def apply_overrides(data: Mapping[str, Any], overrides: Iterable[str]) -> dict[str, Any]:
    """Return a copy of `data` with `a.b.c=value` overrides applied (values parsed as YAML).

    Only the override syntax and key paths are checked here (unknown paths get a did-you-mean);
    `build_config` type-checks the result.

    Raises:
        ConfigError: for malformed items or unknown key paths, all at once.
    """
    data = copy.deepcopy(dict(data))
    problems = _apply_overrides(data, list(overrides), {})
    if problems:
        raise ConfigError(problems)
    return data


def to_yaml(cfg: RaygraphConfig) -> str:
    """The fully resolved config as YAML (defaults included); `load_config` reads it back unchanged."""
    return yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False, allow_unicode=True)


def _build(data: dict, overrides: list[str], problems: list[str], source: str | None) -> RaygraphConfig:
    origins: dict[KeyPath, str] = {}
    problems = problems + _apply_overrides(data, overrides, origins)
    try:
        cfg = RaygraphConfig.model_validate(data)
    except ValidationError as exc:
        problems += [_describe(error, origins) for error in exc.errors()]
        # Check the rest too: drop the offending keys (defaults take their place) and leave out
        # any later problem that names a dropped key, since its value was not the user's.
        fallback, dropped = _validate_without_errors(data, exc)
        if fallback is not None:
            fallback, workflow, found = _with_workflow(fallback, origins)
            found += config_problems(fallback, workflow)
            problems += [p for p in found if not any(d in p for d in dropped)]
    else:
        cfg, workflow, found = _with_workflow(cfg, origins)
        problems += found + config_problems(cfg, workflow)
    if problems:
        raise ConfigError(problems, source=source)
    return cfg


def _with_workflow(cfg: RaygraphConfig, origins: Mapping[KeyPath, str]
                   ) -> tuple[RaygraphConfig, Workflow | None, list[str]]:
    """Import the config's plugins, then its workflow; fill `algorithm.advantage` with the
    workflow's default when unset and `workflow_args` with its declared defaults."""
    problems = _import_plugins(cfg.plugins)
    try:
        workflow = load_workflow(cfg.workflow)
    except WorkflowError as exc:
        return cfg, None, problems + [f"workflow: {exc}"]
    except Exception as exc:  # noqa: BLE001 - user code: any import-time error is a config problem
        return cfg, None, problems + [f"workflow {cfg.workflow!r} fails to import: {type(exc).__name__}: {exc}"]
    if cfg.algorithm.advantage is None and workflow.default_advantage is not None:
        algorithm = cfg.algorithm.model_copy(update={"advantage": workflow.default_advantage})
        cfg = cfg.model_copy(update={"algorithm": algorithm})
    args, found = workflow.check_args(cfg.workflow_args)
    found = [_with_origin(line, origins) for line in found]
    return cfg.model_copy(update={"workflow_args": args}), workflow, problems + found


def _with_origin(line: str, origins: Mapping[KeyPath, str]) -> str:
    """A `workflow_args.<key> ...` problem, with the override it came from (as `_describe` says it)."""
    key = tuple(line.split(" ", 1)[0].split("=", 1)[0].split("."))
    item = origins.get(key)
    return f"{line} (from override {item})" if item else line


def _import_plugins(plugins: list[str]) -> list[str]:
    """Import every plugin now (its registrations precede the registry checks); problems as lines."""
    problems = []
    for i, ref in enumerate(plugins):
        try:
            import_plugin(ref)
        except UserCodeError as exc:
            problems.append(f"plugins[{i}]: {exc}")
        except Exception as exc:  # noqa: BLE001 - user code: any import-time error is a config problem
            problems.append(f"plugins[{i}]={ref!r} fails to import: {type(exc).__name__}: {exc}")
    return problems


def _validate_without_errors(data: dict, exc: ValidationError) -> tuple[RaygraphConfig | None, set[str]]:
    """Validate `data` minus the keys that failed (a few rounds); also return the dropped paths."""
    data, dropped = copy.deepcopy(data), set()
    for _ in range(3):
        for error in exc.errors():
            loc = tuple(error["loc"])
            loc = loc[:next((i for i, p in enumerate(loc) if isinstance(p, int)), len(loc))]
            if error["type"] == "missing":
                loc = loc[:-1]  # a required key: drop its whole section instead
            if not loc:
                return None, dropped
            node = data
            for key in loc[:-1]:
                node = node.get(key) if isinstance(node, dict) else None
            if isinstance(node, dict):
                node.pop(loc[-1], None)
            dropped.add(".".join(map(str, loc)))
        try:
            return RaygraphConfig.model_validate(data), dropped
        except ValidationError as again:
            exc = again
    return None, dropped


# ---- messages ---------------------------------------------------------------------------------

def _dotted(loc: tuple) -> str:
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out


def _show(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


# A required key that another key can stand in for: said beside "is required but missing".
_REQUIRED_UNLESS = {"model.path": " (a HF model id or local directory; or model.tiny=<preset> for a random-init "
                                  "tiny model, e.g. model.tiny=tiny)"}


def _describe(error: Mapping[str, Any], origins: Mapping[KeyPath, str]) -> str:
    """One pydantic error as a plain-language line."""
    loc, kind = tuple(error["loc"]), error["type"]
    path = _dotted(loc)
    if kind == "extra_forbidden":
        text = unknown_key_message(schema_tree(RaygraphConfig), tuple(str(p) for p in loc))
    elif kind == "missing":
        text = f"{path} is required but missing{_REQUIRED_UNLESS.get(path, '')}"
    elif kind in ("model_type", "model_attributes_type", "dict_type"):
        text = f"{path} must be a section (a mapping of keys), got {_show(error['input'])}"
    else:
        message = error["msg"].removeprefix("Value error, ")
        text = f"{path}={_show(error['input'])}: {message[:1].lower()}{message[1:]}"
    keys = tuple(str(p) for p in loc)
    for override_path, item in origins.items():
        shorter = min(len(keys), len(override_path))
        if keys[:shorter] == override_path[:shorter]:
            return f"{text} (from override {item})"
    return text


# ---- YAML and overrides -------------------------------------------------------------------------

class _StrictLoader(yaml.SafeLoader):
    """SafeLoader that records duplicate keys (YAML would silently keep the last one)."""

    def construct_mapping(self, node, deep=False):
        seen = set()
        for key_node, _ in node.value:
            key = key_node.value if isinstance(key_node, yaml.ScalarNode) else None
            if key is not None and key != "<<":
                if key in seen:
                    self.duplicates.append(f"line {key_node.start_mark.line + 1}: key {key!r} appears twice "
                                           "in the same section (the later value would silently win)")
                seen.add(key)
        return super().construct_mapping(node, deep=deep)


def _read_yaml(path: Path) -> tuple[dict | None, list[str]]:
    if not path.is_file():
        return None, [f"config file {path} does not exist"]
    loader = _StrictLoader(path.read_text(encoding="utf-8"))
    loader.duplicates = []
    try:
        data = loader.get_single_data()
    except yaml.YAMLError as exc:
        return None, [f"{path} is not valid YAML: {exc}"]
    finally:
        loader.dispose()
    if not isinstance(data, dict):
        return None, [f"{path} must hold a mapping of sections at the top level, got {_show(data)}"]
    return data, [f"{path} {d}" for d in loader.duplicates]


def _apply_overrides(data: dict, overrides: list[str], origins: dict[KeyPath, str]) -> list[str]:
    """Apply overrides to `data` in place; record where each value came from in `origins`."""
    problems, tree = [], schema_tree(RaygraphConfig)
    for item in overrides:
        key, sep, raw = item.partition("=")
        parts = tuple(key.strip().split("."))
        if not sep or not all(parts):
            problems.append(f"override {item!r} is not of the form key.path=value (e.g. rollout.n=8)")
            continue
        unknown = _first_unknown(tree, parts)
        if unknown is not None:
            problems.append(f"override {item}: {unknown_key_message(tree, parts[:unknown + 1])}")
            continue
        try:
            value = yaml.safe_load(raw)
        except yaml.YAMLError as exc:
            problems.append(f"override {item}: the value is not valid YAML ({exc.__class__.__name__})")
            continue
        node = data
        for i, part in enumerate(parts[:-1]):
            if node.get(part) is None:
                node[part] = {}
            node = node[part]
            if not isinstance(node, dict):
                problems.append(f"override {item}: {'.'.join(parts[:i + 1])} is a value, not a section")
                break
        else:
            node[parts[-1]] = value
            origins[parts] = item
    return problems


def _first_unknown(tree, parts: KeyPath) -> int | None:
    """Index of the first key of `parts` that is not in the schema (free-form mappings accept any)."""
    for i, part in enumerate(parts):
        if tree is None:
            return None
        if part in tree:
            tree = tree[part]
        elif ANY_KEY in tree:
            tree = tree[ANY_KEY]
        else:
            return i
    return None
