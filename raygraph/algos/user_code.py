"""User code by reference: plugins (files or modules imported in every process) and `file.py:fn`
references to single functions.

    import_plugins(["/abs/my_code.py", "my_pkg.losses"])   # runs their registrations
    fn = load_function("/abs/my_code.py:cispo")             # or "my_pkg.losses:cispo"

A plugin file is imported once per process under a name derived from its absolute path
(`raygraph_plugin_<stem>_<hash>`), so importing it again (the config check, then the trainer)
is a no-op and its registrations run once. Relative paths are resolved against the working
directory (`absolute_ref`); the config stores them absolute, so every actor imports the same file
whatever its working directory. Errors are `UserCodeError` (a `ValueError`) with a plain message.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import inspect
import sys
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from types import ModuleType
from typing import Any

from raygraph.errors import ConfigInvalid

__all__ = ["UserCodeError", "is_code_ref", "absolute_ref", "import_plugin", "import_plugins", "load_attribute",
           "load_function", "check_keywords"]


class UserCodeError(ConfigInvalid, ValueError):
    """A plugin or a `file.py:fn` reference that cannot be imported or does not fit."""


def _is_file(ref: str) -> bool:
    return ref.endswith(".py")


def is_code_ref(name: object) -> bool:
    """Whether a registry name is a reference to user code: `file.py:fn` or `package.module:fn`."""
    return isinstance(name, str) and ":" in name


def absolute_ref(ref: str, base: Path | None = None) -> str:
    """`ref` with a relative file path made absolute (against `base`, default the working
    directory); module names and absolute paths are returned unchanged."""
    target, sep, attr = ref.rpartition(":") if ":" in ref else (ref, "", "")
    if not _is_file(target) or Path(target).is_absolute():
        return ref
    return str((base or Path.cwd()) / target) + sep + attr


def import_plugin(ref: str) -> ModuleType:
    """Import a plugin: a `.py` file path or a dotted module name (idempotent within a process)."""
    if not _is_file(ref):
        try:
            return importlib.import_module(ref)
        except ImportError as exc:
            raise UserCodeError(f"plugin module {ref!r} cannot be imported: {exc}") from exc
    path = Path(ref).resolve()
    if not path.is_file():
        raise UserCodeError(f"file {ref!r} does not exist")
    name = f"raygraph_plugin_{path.stem}_{hashlib.sha1(str(path).encode()).hexdigest()[:8]}"
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module   # before exec: a dataclass or pickle in the file may look itself up
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[name]
        raise
    return module


def import_plugins(refs: Iterable[str]) -> list[ModuleType]:
    """Import every plugin of `refs`, in order."""
    return [import_plugin(ref) for ref in refs]


def load_attribute(ref: str, fits: Callable[[object], bool], kind: str,
                   error: type[UserCodeError] = UserCodeError) -> Any:
    """The attribute named by `file.py:name` or `package.module:name` (its file imported as a
    plugin), when `fits(attribute)`; otherwise `error` naming what the module defines of `kind`."""
    target, _, attr = ref.rpartition(":")
    if not target or not attr:
        raise error(f"{ref!r} is not a reference of the form file.py:{kind} or module:{kind}")
    try:
        module = import_plugin(target)
    except UserCodeError:
        raise
    except Exception as exc:  # noqa: BLE001 - user code: any import-time error is reported as such
        raise error(f"{target!r} fails to import: {type(exc).__name__}: {exc}") from exc
    value = getattr(module, attr, None)
    if not fits(value):
        public = sorted(n for n, v in vars(module).items() if fits(v) and not n.startswith("_")
                        and getattr(v, "__module__", None) == module.__name__)
        raise error(f"{target!r} has no {kind} named {attr!r}; it defines: {', '.join(public) or 'none'}")
    return value


def load_function(ref: str) -> Callable:
    """The function named by `file.py:fn` or `package.module:fn` (its file imported as a plugin)."""
    return load_attribute(ref, callable, "function")


def check_keywords(fn: Callable, keywords: Sequence[str], what: str) -> None:
    """Raise `UserCodeError` unless `fn` can be called with exactly the keyword arguments `keywords`
    (each accepted by name or through `**kwargs`; no other argument required)."""
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return   # builtins without a signature: trust the caller
    by_name = {p.name: p for p in params}
    var_kw = any(p.kind is p.VAR_KEYWORD for p in params)
    named = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    missing = [k for k in keywords if not var_kw and (k not in by_name or by_name[k].kind not in named)]
    extra = [p.name for p in params if p.name not in keywords and p.default is p.empty
             and p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL)]
    if missing or extra:
        problems = ([f"does not accept {', '.join(missing)}"] if missing else []) + (
            [f"requires {', '.join(extra)}, which is never passed"] if extra else [])
        raise UserCodeError(f"{what} must take the keyword arguments ({', '.join(keywords)}); "
                            f"it {' and '.join(problems)}")
