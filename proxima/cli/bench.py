"""`proxima bench` (placeholder until its issue lands)."""

from __future__ import annotations

from proxima.cli.errors import fail


def bench() -> None:
    fail("`proxima bench` is not built yet")
