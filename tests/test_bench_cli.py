"""`proxima bench` end to end through its command line, against a loopback stand-in of vLLM
(`tests/standin_servers.py`): what a user types is what is run and written.
"""

from __future__ import annotations

import json

from typer.testing import CliRunner

from proxima.cli.main import app
from tests.standin_servers import StandInServer, vllm_routes

runner = CliRunner()


def test_bench_writes_its_files_to_out(tmp_path):
    """--out is a Path however the installed typer hands its options over (issue 29: a release
    whose ctx.params held the raw str made bench crash before writing anything)."""
    out = tmp_path / "new" / "out"
    with StandInServer(vllm_routes()) as server:
        result = runner.invoke(app, ["bench", "--url", server.url, "-c", "2", "-n", "4", "--max-tokens", "3",
                                     "--timeout", "5", "--sample-interval", "0", "--out", str(out)])
    assert result.exit_code == 0, result.output
    assert {"results.json", "results.csv", "workload.jsonl", "report.html"} <= {p.name for p in out.iterdir()}
    data = json.loads((out / "results.json").read_text())
    (level,) = data["runs"][0]["levels"]
    assert level["completed"] == 4
    assert f"--out {out}" in data["command"]


def test_bench_with_workers_and_repeats_reports_intervals(tmp_path):
    out = tmp_path / "out"
    with StandInServer(vllm_routes()) as server:
        result = runner.invoke(app, ["bench", "--url", server.url, "-c", "4", "-n", "6", "--max-tokens", "3",
                                     "--timeout", "5", "--sample-interval", "0", "--client-workers", "2",
                                     "--repeat", "2", "--out", str(out)])
    assert result.exit_code == 0, result.output
    data = json.loads((out / "results.json").read_text())
    (level,) = data["runs"][0]["levels"]
    assert level["completed"] == 12 and level["num_runs"] == 2 and level["client_workers"] == 2
    assert set(level["intervals"]) == {"rps", "output_tps", "ttft_p95_s", "e2e_p95_s"}
    assert data["config"]["repeat"] == 2 and data["config"]["client_workers"] == 2
    assert "--client-workers 2" in data["command"] and "--repeat 2" in data["command"]
