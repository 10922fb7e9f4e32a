"""`proxima demo` end to end: it builds the model, serves, drives traffic and reports real figures."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

pytestmark = pytest.mark.engine


def test_demo_runs_and_reports_what_the_engine_did(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "proxima.cli.main", "demo", "--workdir", str(tmp_path),
         "--requests", "24", "--concurrency", "12", "--kv-mib", "2"],
        capture_output=True, text=True, timeout=900, env={"COLUMNS": "120", **__import__("os").environ},
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    out = proc.stdout
    assert "24 requests served, 0 failed" in out
    tokens = int(re.search(r"(\d+) tokens generated", out).group(1))
    assert 24 * 16 <= tokens <= 24 * 96  # every request's max_tokens is in [16, 96], ignore_eos
    assert re.search(r"fragmentation \(Proxima\)\s*│\s*0\.0%", out)
    assert re.search(r"slots in use after the burst\s*│\s*0", out)
    assert (tmp_path / "tiny-model" / "config.json").exists()
