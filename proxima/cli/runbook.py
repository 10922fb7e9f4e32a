"""`proxima runbook [NAME] [--path]`: the runbook pages installed with the package.

No name lists the pages and their titles; a name prints the page (Markdown), or with `--path` the
file's location, which is what `proxima doctor` prints under each check.
"""

from __future__ import annotations

import typer

from proxima.cli.errors import fail


def runbook(
    name: str = typer.Argument(None, metavar="NAME",
                               help="A page, e.g. oom-under-load (default: list them)."),
    path: bool = typer.Option(False, "--path", help="Print the page's file path instead of its text."),
) -> None:
    from proxima import runbooks

    if name is None:
        for page in runbooks.names():
            title = runbooks.page(page).read_text(encoding="utf-8").partition("\n")[0].lstrip("# ")
            typer.echo(f"{page:<26} {title}")
        return
    try:
        found = runbooks.page(name)
    except ValueError as err:
        fail(str(err))
    typer.echo(str(found) if path else found.read_text(encoding="utf-8"), nl=path)
