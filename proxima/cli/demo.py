"""`proxima demo`: build the tiny model, serve it with Proxima, drive traffic, show the KV cache."""

from __future__ import annotations

import asyncio
from pathlib import Path

import typer

from proxima.cli.errors import fail

SHADES = " ▁▂▃▄▅▆▇█"


def _strip(occupancy: tuple[float, ...]) -> str:
    return "".join(SHADES[min(len(SHADES) - 1, round(v * (len(SHADES) - 1)))] for v in occupancy)


def demo(
    workdir: Path = typer.Option(Path(".proxima/demo"), help="Where the model and server log go."),
    requests: int = typer.Option(96, min=1, help="Requests in the burst."),
    concurrency: int = typer.Option(48, min=1, help="Requests in flight at once."),
    kv_mib: int = typer.Option(4, min=1, help="KV cache budget in MiB (the tiny model: 1 KiB per token)."),
    port: int = typer.Option(0, help="Server port (0: any free port)."),
    keep: bool = typer.Option(False, help="Leave the server running after the demo (Ctrl-C stops it)."),
    seed: int = typer.Option(0, help="Seed for the prompts."),
) -> None:
    from rich.console import Console
    from rich.table import Table

    from proxima.demo import DemoResult, drive, hello, start_server
    from proxima.server_process import ServerStartError
    from proxima.tiny_model import build_tiny_model

    console = Console()
    try:
        workdir.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        fail(f"cannot use --workdir {workdir}: {err.strerror}; choose a writable directory")
    model_dir = workdir / "tiny-model"
    with console.status("building the tiny model (random weights, local tokenizer)"):
        build_tiny_model(model_dir)
    server = start_server(model_dir, kv_mib << 20, port, workdir / "server.log")
    try:
        with console.status(f"starting proxima serve (log: {workdir / 'server.log'})"):
            server.start()
    except ServerStartError as err:
        fail(f"the server did not start:\n{err}")
    try:
        answer = hello(server.url, str(model_dir))
        if not answer.ok:
            fail(f"the server did not answer a first request: {answer.error}; see {workdir / 'server.log'}",
                 code=1)
        text = answer.text
        console.print(f"[bold]server up[/] at {server.url}; hello world -> {text!r}")
        result = DemoResult(url=server.url, hello_text=text)
        with console.status(f"{requests} requests, {concurrency} at a time"):
            asyncio.run(drive(server.url, str(model_dir), requests, concurrency, seed, result))
        _render(console, result, Table)
        if keep:
            console.print(f"server left running at {server.url}: try [bold]proxima top {server.url}[/] "
                          f"or [bold]proxima doctor {server.url}[/]; Ctrl-C to stop")
            try:
                while server.alive():
                    asyncio.run(asyncio.sleep(1))
            except KeyboardInterrupt:
                pass
    finally:
        server.stop()


def _render(console, result, Table) -> None:
    peak, last = result.peak, result.last
    console.print(f"{result.requests_ok} requests served, {result.requests_failed} failed, "
                  f"{result.output_tokens} tokens generated in {result.wall_s:.1f} s "
                  f"({result.output_tokens / max(result.wall_s, 1e-9):.0f} tokens/s on this machine)")
    if peak is None or peak.proxima is None:
        console.print("[red]no Proxima telemetry was sampled[/]")
        return
    kv = peak.proxima
    table = Table(title="KV cache at its fullest moment", show_header=True)
    table.add_column("what")
    table.add_column("value", justify="right")
    table.add_row("slots in use / total", f"{kv.slots_used:.0f} / {kv.slots_total:.0f}")
    table.add_row("live tokens", f"{kv.live_tokens:.0f}")
    table.add_row("requests holding slots", f"{kv.requests_holding_slots:.0f}")
    table.add_row("fragmentation (Proxima)", f"{kv.fragmentation:.1%}")
    table.add_row("fragmentation at 16-token blocks", f"{kv.block_fragmentation:.1%}")
    table.add_row("usage: tokens / 16-token blocks", f"{kv.token_usage:.1%} / {kv.block_usage:.1%}")
    if last is not None and last.proxima is not None:
        lat = last.proxima.allocator_latency
        for op in ("allocate", "step"):
            p50, p99 = lat[op].quantile(0.5), lat[op].quantile(0.99)
            if p50 is not None:
                table.add_row(f"{op} latency p50 / p99", f"{p50 * 1e6:.0f} / {p99 * 1e6:.0f} µs")
        table.add_row("preemptions (KV full)", f"{last.proxima.preemptions_total:.0f}")
        table.add_row("slots in use after the burst", f"{last.proxima.slots_used:.0f}")
    console.print(table)
    console.print("occupancy map at peak (each cell: 1/64 of the cache):")
    console.print(f"[green]|{_strip(kv.occupancy)}|[/]")
