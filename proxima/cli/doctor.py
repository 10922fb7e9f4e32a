"""`proxima doctor [URL] [--checks a,b] [--json] [--window S] [--compare URL]`.

Parses, runs `proxima.probes.runner`, renders: a table of checks, then each check's evidence,
advice and runbook (or one JSON document with `--json`). Progress goes to stderr. Exit codes:
0 all ok, 1 warnings, 2 failures (or a usage error), 3 could not run (server unreachable).
Load the probes start is cancelled before the command returns, Ctrl-C included.
"""

from __future__ import annotations

import typer

from proxima import fmt
from proxima.cli.errors import fail

_STYLE = {"ok": "green", "warn": "yellow", "fail": "bold red", "skip": "dim", "error": "magenta"}


def doctor(
    url: str = typer.Argument(None, metavar="URL", help="Server to diagnose, Proxima or stock vLLM "
                              "(default: http://127.0.0.1:8000)."),
    checks: str = typer.Option(None, "--checks", help="Comma-separated checks to run (default: all; a wrong "
                               "name lists them)."),
    json_output: bool = typer.Option(False, "--json", help="One JSON report on stdout, for machines."),
    window: float = typer.Option(10.0, "--window", min=1.0, help="Seconds the sampling checks (leak, "
                                 "bottleneck, adoption) watch; long windows judge memory trends."),
    compare: str = typer.Option(None, "--compare", help="A second server: determinism compares its outputs "
                                "token by token."),
    typical_tokens: int = typer.Option(None, "--typical-tokens", min=1, help="Prompt + generation tokens "
                                       "of a typical request (default: observed on the server)."),
    max_num_seqs: int = typer.Option(None, "--max-num-seqs", min=1, help="The server's --max-num-seqs "
                                     "(vLLM does not export it), for oom_risk."),
    api_key: str = typer.Option(None, "--api-key", help="Bearer key for a server started with --api-key "
                                "(default: $VLLM_API_KEY, else $OPENAI_API_KEY)."),
) -> None:
    import asyncio
    import contextlib
    import signal

    from proxima.fetch import api_key_from, normalize_url
    from proxima.probes.base import DoctorOptions
    from proxima.probes.runner import DESCRIPTIONS, parse_checks, run_doctor
    from proxima.scrape import DEFAULT_URL

    url = url or DEFAULT_URL
    for name, value in (("URL", url), ("--compare", compare)):
        if value is not None and not value.startswith(("http://", "https://")):
            fail(f"{name} {value!r} must start with http:// or https:// (e.g. http://127.0.0.1:8000)")
        try:
            if value is not None:
                normalize_url(value)
        except ValueError as err:
            fail(f"{name}: {err}")
    try:
        selected = parse_checks(checks)
    except ValueError as err:
        fail(f"--checks: {err}")
    options = DoctorOptions(window_s=window, compare_url=compare, typical_tokens=typical_tokens,
                            max_num_seqs=max_num_seqs, api_key=api_key_from(api_key))

    from rich.console import Console

    err_console = Console(stderr=True)
    with err_console.status(f"proxima doctor: connecting to {url}") as status:
        def progress(name: str, index: int, total: int) -> None:
            status.update(f"proxima doctor [{index + 1}/{total}] {name}: {DESCRIPTIONS[name]}")

        async def main():
            # SIGTERM cancels like Ctrl-C does, so that the probes' finally blocks stop their load.
            with contextlib.suppress(NotImplementedError, RuntimeError):
                asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, asyncio.current_task().cancel)
            return await run_doctor(url, selected, options, progress)

        try:
            report = asyncio.run(main())
        except (KeyboardInterrupt, asyncio.CancelledError) as err:
            err_console.print("proxima doctor: interrupted; all load stopped")
            raise typer.Exit(130 if isinstance(err, KeyboardInterrupt) else 143) from None

    if json_output:
        import json

        typer.echo(json.dumps(report.to_dict(), indent=2, default=str))
    if report.server_error is not None:
        fail(report.server_error, code=3)
    if not json_output:
        render(report, Console())
    raise typer.Exit(report.exit_code)


def _value(value: object) -> str:
    if isinstance(value, float):
        if value == int(value) and abs(value) < 1e15:
            return str(int(value))
        return f"{value:.4g}"
    return fmt.NA if value is None else str(value)


def runbook_line(ref: str) -> str:
    """The command that prints the page and where it is installed (a repo path means nothing to pip)."""
    from proxima import runbooks

    try:
        return f"proxima runbook {runbooks.page_name(ref)}  ({runbooks.page(ref)})"
    except ValueError:  # a report read back from JSON may name a page this install lacks
        return ref


def render(report, console) -> None:
    """The human report: a table of checks, then each check's evidence, advice and runbook."""
    from rich.table import Table

    title = f"Proxima doctor: {report.url}" + (f"  model {report.model}" if report.model else "")
    table = Table(title=title, title_justify="left", show_lines=False)
    table.add_column("check", style="bold")
    table.add_column("status")
    table.add_column("summary", overflow="fold")
    for r in report.results:
        style = _STYLE[r.status.value]
        table.add_row(r.check, f"[{style}]{r.status.value.upper()}[/]", r.summary)
    console.print(table)
    for r in report.results:
        style = _STYLE[r.status.value]
        console.rule(f"[{style}]{r.check}: {r.status.value.upper()}[/]", align="left")
        console.print(r.summary, markup=False)
        width = max((len(k) for k in r.evidence), default=0)
        for key, value in r.evidence.items():
            console.print(f"  {key:<{width}}  {_value(value)}", markup=False, highlight=False)
        for line in r.advice:
            console.print(f"  -> {line}", markup=False, highlight=False)
        if r.runbook:
            # Unwrapped, so that the path stays one piece to copy.
            console.print(f"  runbook: {runbook_line(r.runbook)}", markup=False, highlight=False,
                          soft_wrap=True)
    counts = {s: sum(1 for r in report.results if r.status.value == s) for s in _STYLE}
    console.print(
        f"\n{counts['ok']} ok, {counts['warn']} warn, {counts['fail']} fail, {counts['skip']} skip, "
        f"{counts['error']} error; exit code {report.exit_code}", highlight=False)
