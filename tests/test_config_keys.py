"""No config key without an effect: every key of the schema is read by code that acts on it.

A key counts as read when some module outside the config's own checks accesses it as an attribute
(`cfg.rollout.top_p`, or `section.top_p` on a section object) or names it as a string (a dumped
mapping). The schema's derived properties (`RaygraphConfig.uses_reference`, ...) count, since the
driver acts on them; `raygraph/config/checks.py` and `loading.py` do not: a key that only a check
looks at would look like it works and do nothing.
"""

from __future__ import annotations

import re
import typing
from pathlib import Path

from pydantic import BaseModel

from raygraph.config.schema import RaygraphConfig

ROOT = Path(__file__).resolve().parents[1]
NOT_EFFECTS = {"raygraph/config/checks.py", "raygraph/config/loading.py", "raygraph/config/suggest.py"}


def _sections(annotation) -> list[type[BaseModel]]:
    found, stack = [], [annotation]
    while stack:
        a = stack.pop()
        if isinstance(a, type) and issubclass(a, BaseModel):
            found.append(a)
        stack.extend(typing.get_args(a))
    return found


def _leaf_keys(model: type[BaseModel], prefix: tuple[str, ...] = ()) -> list[tuple[str, ...]]:
    keys = []
    for name, field in model.model_fields.items():
        sections = _sections(field.annotation)
        keys.append(prefix + (name,))
        for section in sections:
            keys += _leaf_keys(section, prefix + (name,))
    return keys


def _sources() -> dict[str, str]:
    files = [*ROOT.joinpath("raygraph").rglob("*.py"), *ROOT.joinpath("workflows").rglob("*.py")]
    return {str(f.relative_to(ROOT)): f.read_text() for f in files if str(f.relative_to(ROOT)) not in NOT_EFFECTS}


def test_every_schema_key_is_read_somewhere():
    sources = _sources()
    unread = []
    for key in _leaf_keys(RaygraphConfig):
        name = key[-1]
        attribute, string = re.compile(rf"\.{name}\b"), re.compile(rf"[\"']{name}[\"']")
        if not any(attribute.search(text) or (string.search(text) and path != "raygraph/config/schema.py")
                   for path, text in sources.items()):
            unread.append(".".join(key))
    assert not unread, f"config keys that nothing reads (implement or remove them): {unread}"


def test_the_key_scan_sees_nested_sections():
    keys = {".".join(k) for k in _leaf_keys(RaygraphConfig)}
    assert {"actor.optim.lr", "placement.pools", "placement.pools.bundles", "trainer.warm_start.steps",
            "algorithm.kl_in_reward.coef"} <= keys
