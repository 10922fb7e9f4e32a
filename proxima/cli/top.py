"""`proxima top` (placeholder until its issue lands)."""

from __future__ import annotations

from proxima.cli.errors import fail


def top() -> None:
    fail("`proxima top` is not built yet")
