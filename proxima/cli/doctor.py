"""`proxima doctor` (placeholder until its issue lands)."""

from __future__ import annotations

from proxima.cli.errors import fail


def doctor() -> None:
    fail("`proxima doctor` is not built yet")
