"""The README and the documentation site's pages as text, for the tests that check what they tell a reader."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
README = ROOT / "README.md"


def page(name: str) -> str:
    """One page of the site by its path under docs/ (e.g. "cluster/install.md")."""
    return (DOCS / name).read_text()


def section(text: str, heading: str) -> str:
    """The text under a markdown heading (given with its #s), up to the next heading of that level or higher."""
    level = len(heading) - len(heading.lstrip("#"))
    body = text.split(heading + "\n", 1)[1]
    end = re.search(rf"^#{{1,{level}}} ", body, flags=re.MULTILINE)
    return body[:end.start()] if end else body


def all_text() -> str:
    """The README and every page, each once (what a reader can find anywhere)."""
    return "\n".join([README.read_text(), *(p.read_text() for p in sorted(DOCS.rglob("*.md")))])
