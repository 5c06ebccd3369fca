"""A tiny name -> function registry used by every family in `raygraph.algos`.

Each family (advantage estimators, policy losses, KL estimators, DPO kinds) owns one
`Registry`; built-in entries are added with the `register` decorator when the module is
imported, user entries when a plugin is imported (`raygraph.register_policy_loss`, ...; see
docs/custom-algorithm.md), and a name is never rebound, so lookups are pure. A name may also be
a reference to user code, `file.py:fn` or `module:fn`, looked up without registering it. A
family that declares its `keywords` checks every entry (built-in, registered or referenced)
against them. An unknown name raises `ValueError` listing the valid names, so a typo in a
config is caught with a helpful message.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

from raygraph.algos.user_code import check_keywords, is_code_ref, load_function

__all__ = ["Registry"]

F = TypeVar("F", bound=Callable)


class Registry:
    """Maps names (and aliases) to functions of one family that share one signature.

    Args:
        family: human-readable family name used in error messages, e.g. "advantage estimator".
        keywords: the keyword arguments every entry is called with (None: not checked).
    """

    def __init__(self, family: str, keywords: tuple[str, ...] | None = None) -> None:
        self.family = family
        self.keywords = keywords
        self._entries: dict[str, Callable] = {}
        self._info: dict[str, dict[str, Any]] = {}

    def register(self, name: str, *aliases: str, **info: Any) -> Callable[[F], F]:
        """Decorator registering `fn` under `name` and any `aliases`.

        `info` declares facts about the entry that others read from here (e.g. which inputs an
        advantage estimator needs), so they are stated once, where the entry is defined.

        Raises:
            ValueError: if a name is already taken (two entries must never share a name), holds
                a ':' (kept for `file.py:fn` references), or `fn` does not take `keywords`.
        """

        def decorator(fn: F) -> F:
            self._check(fn, name)
            for key in (name, *aliases):
                if key in self._entries:
                    raise ValueError(f"{self.family} {key!r} is already registered")
                if not isinstance(key, str) or not key or is_code_ref(key):
                    raise ValueError(f"{self.family} name {key!r} must be a non-empty string without ':'")
                self._entries[key] = fn
                self._info[key] = dict(info)
            return fn

        return decorator

    def info(self, name: str) -> dict[str, Any]:
        """What was declared with `name` at registration (raises like `get` for an unknown name)."""
        self.get(name)
        return dict(self._info.get(name, {}))   # a `file.py:fn` reference declares nothing

    def get(self, name: str) -> Callable:
        """Return the function registered as `name`, or referenced by `file.py:fn` / `module:fn`.

        Raises:
            ValueError: for an unknown name (the message lists every valid name), or a reference
                that cannot be imported or does not take the family's keywords.
        """
        try:
            return self._entries[name]
        except (KeyError, TypeError):
            if is_code_ref(name):
                fn = load_function(name)
                self._check(fn, name)
                return fn
            valid = ", ".join(self.names())
            raise ValueError(f"unknown {self.family} {name!r}; valid names: {valid} "
                             "(or a reference to your own: file.py:function)") from None

    def _check(self, fn: Callable, name: str) -> None:
        if self.keywords is not None:
            check_keywords(fn, self.keywords, f"{self.family} {name!r}")

    def names(self) -> tuple[str, ...]:
        """All registered names and aliases, sorted."""
        return tuple(sorted(self._entries))

    def __contains__(self, name: object) -> bool:
        return name in self._entries
