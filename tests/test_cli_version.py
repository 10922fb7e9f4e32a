"""`proxima --version`: the package version and the vLLM release it is pinned to, one place each."""

from __future__ import annotations

import importlib.metadata as md
import tomllib
from pathlib import Path

from typer.testing import CliRunner

import proxima
from proxima.cli import version
from proxima.cli.main import app

ROOT = Path(__file__).resolve().parents[1]


def test_version_prints_package_and_pinned_vllm():
    result = CliRunner().invoke(app, ["--version"])
    assert result.exit_code == 0, result.output
    first, second = result.output.splitlines()
    assert first == f"proxima {proxima.__version__}"
    assert second.startswith(f"vLLM {proxima.VLLM_VERSION} (pinned; ")


def test_version_names_an_unpinned_vllm(monkeypatch):
    monkeypatch.setattr("proxima.installed.dist_version",
                        lambda name: "0.25.1" if name == "vllm" else None)
    assert version.version_text().endswith("(pinned; vllm 0.25.1 installed: not the pinned release)")
    monkeypatch.setattr("proxima.installed.dist_version",  # a build's tag is not another release
                        lambda name: f"{proxima.VLLM_VERSION}+cu130" if name == "vllm" else None)
    assert version.version_text().endswith(f"(pinned; vllm {proxima.VLLM_VERSION}+cu130 installed)")
    monkeypatch.setattr("proxima.installed.dist_version", lambda name: None)
    assert version.version_text().endswith("(pinned; not installed)")


def test_version_is_written_once():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert "version" not in project["project"] and "version" in project["project"]["dynamic"]
    assert project["tool"]["setuptools"]["dynamic"]["version"] == {"attr": "proxima.__version__"}
    assert md.version("proxima-kv") == proxima.__version__
