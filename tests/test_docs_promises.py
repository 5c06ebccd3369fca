"""docs/guarantees.md ends with every promise of the docs and the test that proves it: each test
it names must exist (a renamed or deleted test would leave a promise with nothing behind it)."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_every_test_the_promise_table_names_exists():
    text = (ROOT / "docs" / "guarantees.md").read_text()
    table = text[text.index("## Every promise and the test that proves it"):]
    named = set(re.findall(r"`(tests/[\w/]+\.py)::(\w+)", table))
    assert len(named) > 200
    missing = [f"{path}::{name}" for path, name in sorted(named)
               if not (ROOT / path).is_file() or not re.search(rf"^(async )?def {name}\(", (ROOT / path).read_text(),
                                                              re.MULTILINE)]
    assert missing == []
