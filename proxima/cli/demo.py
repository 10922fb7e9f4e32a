"""`proxima demo` (placeholder until its issue lands)."""

from __future__ import annotations

from proxima.cli.errors import fail


def demo() -> None:
    fail("`proxima demo` is not built yet")
