"""`proxima serve MODEL [--proxima-allocator token|block] [vLLM flags...]`.

In order, each refusal one line and exit code 2: the model is there and the port free (no vLLM
imported: milliseconds), then the configuration built and checked by vLLM's own parser in a child
process, which then runs the server (`proxima.serve_command.start_checked`). This process stays
the server's small supervisor: it never imports torch or vLLM.
"""

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
    from proxima.serve_checks import kv_dtype_problem, model_problem, port_problem
    from proxima.serve_command import ServeRequest, start_checked, supervise

    vllm_args = list(ctx.args)
    problem = (model_problem(model) or kv_dtype_problem(vllm_args, proxima_allocator)
               or (None if check_only else port_problem(vllm_args)))
    if problem:
        fail(problem)
    try:
        server = start_checked(ServeRequest(model, proxima_allocator, vllm_args, otlp_metrics_endpoint,
                                            exact_kv_figures, tenant_salt, check_only))
    except ProximaConfigError as err:
        fail(str(err))
    except KeyboardInterrupt:
        fail("interrupted while checking the configuration; nothing was started", code=130)
    for note in server.command.notes:
        typer.echo(f"proxima: {note}", err=True)
    if check_only:
        server.process.wait()
        typer.echo(f"proxima: configuration accepted ({proxima_allocator} allocator)")
        return
    raise typer.Exit(supervise(server))
