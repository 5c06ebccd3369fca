"""A tiny name -> function registry used by every family in `raygraph.algos`.

Each family (advantage estimators, policy losses, KL estimators, DPO kinds) owns one
`Registry`; entries are added with the `register` decorator when the module is imported and
never afterwards, so lookups are pure. An unknown name raises `ValueError` listing the valid
names, so a typo in a config is caught with a helpful message.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

__all__ = ["Registry"]

F = TypeVar("F", bound=Callable)


class Registry:
    """Maps names (and aliases) to functions of one family that share one signature.

    Args:
        family: human-readable family name used in error messages, e.g. "advantage estimator".
    """

    def __init__(self, family: str) -> None:
        self.family = family
        self._entries: dict[str, Callable] = {}
        self._info: dict[str, dict[str, Any]] = {}

    def register(self, name: str, *aliases: str, **info: Any) -> Callable[[F], F]:
        """Decorator registering `fn` under `name` and any `aliases`.

        `info` declares facts about the entry that others read from here (e.g. which inputs an
        advantage estimator needs), so they are stated once, where the entry is defined.

        Raises:
            ValueError: if a name is already taken (two entries must never share a name).
        """

        def decorator(fn: F) -> F:
            for key in (name, *aliases):
                if key in self._entries:
                    raise ValueError(f"{self.family} {key!r} is already registered")
                self._entries[key] = fn
                self._info[key] = dict(info)
            return fn

        return decorator

    def info(self, name: str) -> dict[str, Any]:
        """What was declared with `name` at registration (raises like `get` for an unknown name)."""
        self.get(name)
        return dict(self._info[name])

    def get(self, name: str) -> Callable:
        """Return the function registered as `name`.

        Raises:
            ValueError: for an unknown name; the message lists every valid name.
        """
        try:
            return self._entries[name]
        except (KeyError, TypeError):
            valid = ", ".join(self.names())
            raise ValueError(f"unknown {self.family} {name!r}; valid names: {valid}") from None

    def names(self) -> tuple[str, ...]:
        """All registered names and aliases, sorted."""
        return tuple(sorted(self._entries))

    def __contains__(self, name: object) -> bool:
        return name in self._entries
