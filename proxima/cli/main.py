"""`proxima` command line: one module per subcommand; this file only wires them together.

The CLI parses and renders; the work lives in the engine, scrape, probes, bench and tui layers.
Heavy imports (vLLM, torch, textual) happen inside each command, so `proxima --help` is instant.
"""

from __future__ import annotations

import typer

from proxima.cli import bench, demo, doctor, model, runbook, serve, top, version

app = typer.Typer(
    name="proxima",
    help="Token-granular KV cache for vLLM, and the tools to watch and judge it.",
    no_args_is_help=True,
    add_completion=False,
)


@app.callback()
def main(
    _version: bool = typer.Option(False, "--version", is_eager=True, callback=version.print_version,
                                  help="Print Proxima's version and the vLLM release it is pinned to."),
) -> None:
    """Token-granular KV cache for vLLM, and the tools to watch and judge it."""


app.command(
    "serve",
    context_settings={"allow_extra_args": True, "ignore_unknown_options": True},
    help="Run vLLM's OpenAI-compatible server with Proxima (vLLM flags pass through; every vLLM flag: "
    "python -m vllm.entrypoints.openai.api_server --help).",
)(serve.serve)
app.add_typer(model.app, name="model", help="Build models for demos and tests.")
app.command("demo", help="Serve a real model with Proxima, drive a burst of chats, show the KV cache.")(
    demo.demo
)
app.command("top", help="Live terminal dashboard of KV memory and serving health.")(top.top)
app.command("doctor", help="Diagnose a live deployment: OOM, leak, determinism, bottleneck.")(doctor.doctor)
app.command("bench", help="A/B load test: stock vLLM against Proxima.")(bench.bench)
app.command("runbook", help="Print a runbook page (the one doctor and the alerts name), or list them.")(
    runbook.runbook
)

if __name__ == "__main__":  # python -m proxima.cli.main (what proxima.server_process runs)
    app()
