"""`proxima demo` end to end: the real model answers, the chats share their system prompt, and the
KV figures are what the engine did."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

pytestmark = pytest.mark.engine


def test_demo_runs_and_reports_what_the_engine_did(tmp_path, smol_model):
    proc = subprocess.run(
        [sys.executable, "-m", "proxima.cli.main", "demo", "--workdir", str(tmp_path),
         "--model-dir", smol_model, "--requests", "12", "--concurrency", "6", "--max-tokens", "32",
         "--kv-mib", "96"],
        capture_output=True, text=True, timeout=900, env={**os.environ, "COLUMNS": "120"},
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    out = proc.stdout
    assert re.search(r"A: .*Paris", out), out  # a real answer to the first question
    assert "12 requests served, 0 failed" in out
    tokens = int(re.search(r"(\d+) tokens generated", out).group(1))
    assert 12 <= tokens <= 12 * 32  # real answers end at the model's end of turn, or at 32 tokens
    hits, queries = map(int, re.search(r"prefix cache: (\d+) of (\d+) prompt tokens", out).groups())
    assert hits > 11 * 400 and queries >= 12 * 430  # 11 of 12 chats reuse the ~430-token system prompt
    assert re.search(r"fragmentation \(Proxima\)\s*│\s*0\.0%", out)
    assert re.search(r"slots in use after the burst\s*│\s*0", out)


def test_a_kv_budget_below_one_chat_is_refused_before_the_server_starts(tmp_path, smol_model):
    # 30 layers x 3 KV heads x 64 x (K, V) x 4 bytes = 46,080 bytes a token; 2,048 tokens: 90 MiB.
    proc = subprocess.run(
        [sys.executable, "-m", "proxima.cli.main", "demo", "--workdir", str(tmp_path),
         "--model-dir", smol_model, "--kv-mib", "48"],
        capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert "--kv-mib 48" in proc.stderr and "--kv-mib 90 or more" in proc.stderr
    assert not (tmp_path / "server.log").exists()  # nothing was started
