"""The code blocks of docs/custom-algorithm.md that tests run as users would copy them."""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def doc_blocks() -> dict[str, str]:
    """docs/custom-algorithm.md's code blocks whose first line names a file, by file name."""
    text = (REPO / "docs" / "custom-algorithm.md").read_text()
    return dict(re.findall(r"```(?:python|yaml)\n# (\S+?\.(?:py|yaml))\b.*?\n(.*?)```", text, re.S))
