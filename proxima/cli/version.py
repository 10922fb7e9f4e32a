"""`proxima --version`: Proxima's version, the vLLM release it is pinned to, and the vLLM installed.

Reads package metadata only (vLLM is not imported), so it answers instantly even where vLLM is broken.
"""

from __future__ import annotations

import typer


def version_text() -> str:
    from proxima import VLLM_VERSION, __version__
    from proxima.installed import VLLM_DISTRIBUTIONS, dist_version, release_of

    installed = next(((name, v) for name in VLLM_DISTRIBUTIONS if (v := dist_version(name))), None)
    if installed is None:
        found = "not installed"
    else:
        name, version = installed
        mismatch = "" if release_of(version) == VLLM_VERSION else ": not the pinned release"
        found = f"{name} {version} installed{mismatch}"
    return f"proxima {__version__}\nvLLM {VLLM_VERSION} (pinned; {found})"


def print_version(value: bool) -> None:
    """Eager option callback: print and exit before any command runs."""
    if value:
        typer.echo(version_text())
        raise typer.Exit()
