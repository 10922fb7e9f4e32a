"""`proxima model tiny DIR`: a tiny Llama-architecture model for demos and tests."""

from __future__ import annotations

from pathlib import Path

import typer

from proxima.cli.errors import fail

app = typer.Typer(no_args_is_help=True)


@app.command("tiny")
def tiny(
    out_dir: Path = typer.Argument(..., help="Directory to write the model into."),
    seed: int = typer.Option(0, help="Seed for the random weights."),
    layers: int = typer.Option(2, help="Number of transformer layers."),
) -> None:
    """Write config, seeded random weights and a local BPE tokenizer (no downloads)."""
    from proxima.tiny_model import TinyModelSpec, build_tiny_model

    if out_dir.exists() and not out_dir.is_dir():
        fail(f"{out_dir} exists and is not a directory; choose another path")
    if layers < 1:
        fail("--layers must be at least 1")
    path = build_tiny_model(out_dir, TinyModelSpec(seed=seed, num_hidden_layers=layers))
    typer.echo(f"tiny model written to {path}")
