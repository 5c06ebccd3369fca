"""Code run around the loading of a named module: the hook raygraph's start-up savings use
(`raygraph.models.transformers_index`, `raygraph.models.lean_imports`).

    wrap_exec("some.module", lambda exec_module, module: (exec_module(module), adjust(module)))

From then on, when `some.module` is first imported it is executed through the hook, which must
call `exec_module(module)` (and may do something before or after). A module already imported is
not executed again: the caller handles that case itself.
"""

from __future__ import annotations

import importlib.machinery
import sys
from collections.abc import Callable
from types import ModuleType

__all__ = ["ExecHook", "wrap_exec"]

ExecHook = Callable[[Callable[[ModuleType], None], ModuleType], None]
_HOOKS: dict[str, ExecHook] = {}


def wrap_exec(name: str, hook: ExecHook) -> None:
    """Execute module `name` through `hook` when it is first imported (a later call replaces the hook)."""
    _HOOKS[name] = hook
    if not any(isinstance(finder, _HookedFinder) for finder in sys.meta_path):
        sys.meta_path.insert(0, _HookedFinder())


class _HookedFinder:
    """A meta-path finder that lets Python find a hooked module as usual, then routes its execution
    through the hook. Any other module, or one whose loader has no `exec_module`, is left alone."""

    def find_spec(self, name, path=None, target=None):
        hook = _HOOKS.get(name)
        if hook is None:
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path, target)
        if spec is None or not hasattr(spec.loader, "exec_module"):
            return spec
        exec_module = spec.loader.exec_module

        def exec_through_hook(module: ModuleType) -> None:
            hook(exec_module, module)

        spec.loader.exec_module = exec_through_hook
        return spec
