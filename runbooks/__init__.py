"""The runbook pages, shipped inside the package as `proxima.runbooks` (pyproject's package-dir).

A page is named everywhere as `runbooks/NAME.md`: the path in a checkout, and also its path inside
the installed `proxima` package, so a pip user's doctor and `proxima runbook NAME` find the same
file. Only reads package data; no page text lives in code.
"""

from __future__ import annotations

import re
from importlib.resources import files
from importlib.resources.abc import Traversable

_REF = re.compile(r"(?:runbooks/)?([A-Za-z0-9_-]+)(?:\.md)?")


def page_name(ref: str) -> str:
    """`runbooks/oom-under-load.md`, `oom-under-load.md` or `oom-under-load` -> `oom-under-load`."""
    match = _REF.fullmatch(ref.strip())
    if match is None:
        raise ValueError(f"not a runbook reference: {ref!r}")
    return match.group(1)


def names() -> tuple[str, ...]:
    """Every page shipped (README.md is the index, not a page)."""
    return tuple(sorted(p.name.removesuffix(".md") for p in files(__name__).iterdir()
                        if p.name.endswith(".md") and p.name != "README.md"))


def page(ref: str) -> Traversable:
    """The installed file of a runbook; ValueError naming the pages when there is none."""
    name = page_name(ref)
    found = files(__name__) / f"{name}.md"
    if name == "README" or not found.is_file():
        raise ValueError(f"no runbook {name!r}; runbooks: {', '.join(names())}")
    return found
