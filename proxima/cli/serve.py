"""`proxima serve MODEL [--proxima-allocator token|block] [vLLM flags...]`."""

from __future__ import annotations

import typer

from proxima.cli.errors import fail


def serve(
    ctx: typer.Context,
    model: str = typer.Argument(..., help="Model directory or name, as for `vllm serve`."),
    proxima_allocator: str = typer.Option(
        "token", "--proxima-allocator",
        help="token: Proxima's per-token slots. block: stock vLLM allocation (A/B, rollback).",
    ),
    otlp_metrics_endpoint: str = typer.Option(
        None, "--otlp-metrics-endpoint",
        help="Also export Proxima's KV metrics and per-request KV spans over OTLP/HTTP to this URL.",
    ),
    exact_kv_figures: bool = typer.Option(
        False, "--proxima-exact-kv-figures",
        help="Publish token-exact prefix-cache figures. Only for a server whose clients may learn what "
             "each other cached: by default hits are reported in whole 16-token blocks, as vLLM's "
             "block cache reports them (docs/security.md).",
    ),
    tenant_salt: str = typer.Option(
        None, "--proxima-tenant-salt",
        help="Give each tenant its own prefix cache without client changes: api-key (one per "
             "--api-key key) or header:NAME (the tenant named in header NAME by your gateway).",
    ),
    check_only: bool = typer.Option(False, "--check", help="Validate the configuration and exit."),
) -> None:
    from proxima.engine.settings import ProximaConfigError
    from proxima.serve_command import build_serve_command, preflight, run_server

    try:
        command = build_serve_command(model, proxima_allocator, list(ctx.args),
                                      otlp_endpoint=otlp_metrics_endpoint,
                                      exact_kv_figures=exact_kv_figures, tenant_salt=tenant_salt)
        problems = preflight(command)
    except ProximaConfigError as err:
        fail(str(err))
    except SystemExit as err:  # vLLM's argument parser rejected a flag (it printed why)
        raise typer.Exit(2) from err
    if problems:
        fail("Proxima cannot serve this configuration:\n  - " + "\n  - ".join(problems))
    for note in command.notes:
        typer.echo(f"proxima: {note}", err=True)
    if check_only:
        typer.echo(f"proxima: configuration accepted ({proxima_allocator} allocator)")
        return
    raise typer.Exit(run_server(command))
