"""`proxima top` on the command line: --once (also the automatic mode when stdout is not a terminal),
--record/--replay, and the errors a user can make. Servers here are real HTTP servers on loopback
serving /metrics text captured from real vLLM servers (tests/data/top/README.md)."""

from __future__ import annotations

import json
import socket
from pathlib import Path

import pytest
from typer.testing import CliRunner

from proxima import fmt
from proxima.cli.main import app
from proxima.scrape import parse_metrics
from proxima.tui.record import load_recording
from tests.top_support import MetricsServer

DATA = Path(__file__).parent / "data" / "top"
runner = CliRunner()


def _closed_port_url() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{s.getsockname()[1]}"


@pytest.fixture
def proxima_metrics():
    with MetricsServer((DATA / "proxima_metrics.txt").read_text()) as server:
        yield server


def test_once_prints_the_figures_the_server_reports(proxima_metrics):
    result = runner.invoke(app, ["top", proxima_metrics.url, "--interval", "0.1"])
    assert result.exit_code == 0, result.output
    snap = parse_metrics((DATA / "proxima_metrics.txt").read_text(), proxima_metrics.url)
    kv = snap.proxima
    out = result.stdout
    assert f"{fmt.count(kv.slots_used)} / {fmt.count(kv.slots_total)} used" in out
    assert f"running     {fmt.count(snap.running)}" in out
    # --once looks twice, so rates are defined; the fixed text makes them a real zero.
    assert "generation  0.0 tok/s" in out
    assert f"TTFT {fmt.seconds(snap.ttft.quantile(0.5)):>16}" in out  # since server start
    assert "since server start" in out
    assert proxima_metrics.requests == 2


def test_once_exits_non_zero_only_when_every_server_is_unreachable(proxima_metrics):
    down = _closed_port_url()
    result = runner.invoke(app, ["top", proxima_metrics.url, down, "--once", "--interval", "0.1"])
    assert result.exit_code == 0 and "DOWN" in result.stdout and "all servers" in result.stdout
    result = runner.invoke(app, ["top", down, "--once", "--interval", "0.1"])
    assert result.exit_code == 1
    assert "no server answered" in result.stderr and "Traceback" not in result.output


def test_record_then_replay(tmp_path, proxima_metrics):
    path = tmp_path / "s.jsonl"
    args = ["top", proxima_metrics.url, "--once", "--interval", "0.1", "--record", str(path)]
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.output
    rec = load_recording(path)
    assert rec.urls == (proxima_metrics.url,) and len(rec.frames) == 2
    replayed = runner.invoke(app, ["top", "--replay", str(path), "--once"])
    assert replayed.exit_code == 0, replayed.output
    assert "slots" in replayed.stdout and proxima_metrics.url.split("//")[1] in replayed.stdout


def test_replay_of_the_committed_session():
    result = runner.invoke(app, ["top", "--replay", str(DATA / "session.jsonl")])
    assert result.exit_code == 0, result.output
    assert "KV cache 100% full with 31 waiting" in result.stdout  # the stock server's last state
    assert "DOWN since" in result.stdout


@pytest.mark.parametrize("args, message", [
    (["--interval", "0"], "--interval 0 is out of range"),
    (["--window", "-1"], "--window must be a positive number"),
    (["http://x:notaport"], "bad port"),
    (["ftp://host"], "not a server URL"),
    (["http://127.0.0.1:1", "127.0.0.1:1"], "given twice"),
    (["--replay", "r.jsonl", "http://127.0.0.1:1"], "drop the server URLs"),
    (["--record", "/nonexistent-dir/x.jsonl"], "cannot write recording /nonexistent-dir/x.jsonl"),
    (["--replay", "/nonexistent-dir/x.jsonl"], "cannot read recording"),
])
def test_user_errors_are_one_clear_line(args, message):
    result = runner.invoke(app, ["top", *args])
    assert result.exit_code == 2
    assert message in result.stderr and "Traceback" not in result.output
    assert len(result.stderr.strip().splitlines()) == 1


def test_malformed_replay_names_the_line(tmp_path):
    path = tmp_path / "bad.jsonl"
    lines = (DATA / "session.jsonl").read_text().splitlines()[:4]
    broken = json.loads(lines[2])
    broken["servers"][0]["waiting"] = "lots"
    path.write_text("\n".join([lines[0], lines[1], json.dumps(broken), lines[3]]) + "\n")
    result = runner.invoke(app, ["top", "--replay", str(path)])
    assert result.exit_code == 2
    assert "line 3: servers[0].waiting: expected a number" in result.stderr
    header_only = tmp_path / "empty.jsonl"
    header_only.write_text(lines[0] + "\n")
    result = runner.invoke(app, ["top", "--replay", str(header_only)])
    assert result.exit_code == 2 and "holds no snapshots" in result.stderr
