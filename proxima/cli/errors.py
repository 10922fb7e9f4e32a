"""One way for every command to end on a user's mistake: one clear line, a non-zero exit."""

from __future__ import annotations

from typing import NoReturn

import typer


def fail(message: str, code: int = 2) -> NoReturn:
    typer.secho(f"proxima: error: {message}", fg=typer.colors.RED, err=True)
    raise typer.Exit(code)
