"""The tools trust nothing they read: a malformed or huge /metrics, a server that trickles, a
recording with odd numbers, a /v1/models of another shape, a bad URL, an unwritable --out. Each
becomes one server's error or one clear line, never a traceback or another server's blank."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

from proxima.bench.plan import LaunchPlan
from proxima.bench.servers import _server
from proxima.cli.main import app
from proxima.scrape import scrape, scrape_sync
from proxima.tui.collector import Collector
from tests.standin_servers import StandInServer, json_body, vllm_routes
from tests.top_support import MetricsServer

DATA = Path(__file__).parent / "data" / "top"
PROXIMA_TEXT = (DATA / "proxima_metrics.txt").read_text()
runner = CliRunner()

NO_LE = PROXIMA_TEXT + 'vllm:time_to_first_token_seconds_bucket{engine="0",model_name="m"} 3.0\n'
NO_SEGMENT = PROXIMA_TEXT + 'proxima_kv_occupancy_ratio{engine="0"} 0.5\n'


def _no_gpus() -> tuple:
    return ()


@pytest.mark.parametrize("bad", [NO_LE, NO_SEGMENT], ids=["bucket-without-le", "segment-without-label"])
def test_a_malformed_exposition_is_that_servers_error_and_the_others_still_show(bad):
    with MetricsServer(PROXIMA_TEXT) as good, MetricsServer(bad) as broken:
        frame = asyncio.run(Collector([good.url, broken.url], gpu_reader=_no_gpus).collect(timeout=5))
    ok, down = frame.servers
    assert ok.ok and ok.proxima is not None
    assert not down.ok and "unreadable /metrics" in down.error and "label" in down.error


def test_top_once_with_a_malformed_server_prints_no_traceback():
    with MetricsServer(PROXIMA_TEXT) as good, MetricsServer(NO_LE) as broken:
        result = runner.invoke(app, ["top", good.url, broken.url, "--once", "--interval", "0.1"])
    assert result.exit_code == 0, result.output
    assert result.exception is None and "Traceback" not in result.output
    assert "unreadable /metrics" in result.stdout


def test_an_oversized_metrics_body_is_refused_not_parsed():
    huge = PROXIMA_TEXT + "".join(f'proxima_kv_slots{{engine="{k}"}} 1\n' for k in range(200_000))
    with MetricsServer(huge) as server:
        start = time.monotonic()
        snap = scrape_sync(server.url, timeout=10)
    assert not snap.ok and "larger than 4 MiB" in snap.error
    assert time.monotonic() - start < 5


def test_a_trickling_server_costs_one_budget_and_the_others_still_show():
    with StandInServer({"/metrics": (200, PROXIMA_TEXT.encode())}, trickle_s=0.01) as slow, \
            MetricsServer(PROXIMA_TEXT) as good:
        start = time.monotonic()
        frame = asyncio.run(Collector([slow.url, good.url], gpu_reader=_no_gpus).collect(timeout=1.0))
        elapsed = time.monotonic() - start
        sync_start = time.monotonic()
        sync = scrape_sync(slow.url, timeout=1.0)
        sync_elapsed = time.monotonic() - sync_start
    trickled, ok = frame.servers
    assert not trickled.ok and trickled.error == "timed out (no complete answer within 1 s)"
    assert ok.ok
    assert elapsed < 2.0, elapsed  # the whole body would take minutes at a byte per 10 ms
    assert not sync.ok and sync_elapsed < 2.5, sync_elapsed


def test_parsing_a_large_exposition_leaves_the_event_loop_free(monkeypatch):
    # Under the size cap, but seconds of pure-Python parsing: it must run off the event loop's
    # thread (top's key handling and redraws share that loop). Checked by where the parser runs,
    # not by timing the loop's gaps, which a busy 2-core machine stretches at random.
    import proxima.scrape as scrape_module

    big = PROXIMA_TEXT + "".join(f'vllm:num_requests_running{{engine="{k}",model_name="m"}} 0\n'
                                 for k in range(30_000))
    parsed_on: list[tuple[int, bool]] = []
    real_parse = scrape_module.parse_or_error

    def spied(*args, **kwargs):
        try:
            asyncio.get_running_loop()
            on_loop = True
        except RuntimeError:
            on_loop = False
        parsed_on.append((threading.get_ident(), on_loop))
        return real_parse(*args, **kwargs)

    monkeypatch.setattr(scrape_module, "parse_or_error", spied)

    async def main(url: str):
        import httpx

        async with httpx.AsyncClient() as client:
            return threading.get_ident(), await scrape(client, url, timeout=30)

    with MetricsServer(big) as server:
        loop_thread, snap = asyncio.run(main(server.url))
    assert snap.ok
    assert parsed_on and all(t != loop_thread and not on_loop for t, on_loop in parsed_on), parsed_on


# ------------------------------------------------------------------ top --replay / --record

def _recording(tmp_path: Path, frame_line: str) -> Path:
    header = (DATA / "session.jsonl").read_text().splitlines()[0]
    path = tmp_path / "bad.jsonl"
    path.write_text(header + "\n" + frame_line + "\n")
    return path


def _frame(**changes) -> str:
    frame = json.loads((DATA / "session.jsonl").read_text().splitlines()[1])
    frame.update(changes)
    return json.dumps(frame)


FIRST_FRAME = (DATA / "session.jsonl").read_text().splitlines()[1]
BAD_FRAMES = {
    "nan-timestamp": FIRST_FRAME.replace('{"t":', '{"t":NaN,"t0":', 1),
    "infinite-timestamp": FIRST_FRAME.replace('{"t":', '{"t":1e999,"t0":', 1),
    "400-digit-integer": FIRST_FRAME.replace('"running":0.0', '"running":' + "9" * 400, 1),
    "400-digit-int-field": FIRST_FRAME.replace('"block_size":1,', '"block_size":' + "9" * 400 + ",", 1),
    "deep-nesting": '{"t": 1, "servers": ' + "[" * 100_000 + "]" * 100_000 + "}",
}


@pytest.mark.parametrize("line", BAD_FRAMES.values(), ids=BAD_FRAMES.keys())
def test_replay_of_a_hostile_recording_is_one_line_naming_file_and_line(tmp_path, line):
    path = _recording(tmp_path, line)
    assert line != FIRST_FRAME
    result = runner.invoke(app, ["top", "--replay", str(path), "--once"])
    assert result.exit_code == 2, result.output
    assert result.exception is None or isinstance(result.exception, SystemExit)
    assert f"{path}, line 2:" in result.stderr
    assert "Traceback" not in result.output and len(result.stderr.strip().splitlines()) == 1


def test_record_never_truncates_an_existing_file(tmp_path):
    path = tmp_path / "yesterday.jsonl"
    path.write_text("precious post-mortem\n")
    with MetricsServer(PROXIMA_TEXT) as server:
        result = runner.invoke(app, ["top", server.url, "--once", "--interval", "0.1", "--record", str(path)])
    assert result.exit_code == 2
    assert "already exists" in result.stderr
    assert path.read_text() == "precious post-mortem\n"


# ------------------------------------------------------------------ doctor and bench

NOT_OPENAI = {
    "a-list": json_body([{"id": "m"}]),
    "data-not-a-list": json_body({"data": "m"}),
    "model-without-id": json_body({"data": [{"name": "m"}]}),
    "not-json": b"<html>hello</html>",
}


@pytest.mark.parametrize("body", NOT_OPENAI.values(), ids=NOT_OPENAI.keys())
def test_doctor_and_bench_on_a_server_that_is_not_openai_shaped_say_so_in_one_line(body, tmp_path):
    routes = {"/v1/models": (200, body), "/metrics": (200, PROXIMA_TEXT.encode())}
    with StandInServer(routes) as server:
        doctor = runner.invoke(app, ["doctor", server.url, "--checks", "oom_risk"])
        bench = runner.invoke(app, ["bench", "--url", server.url, "-c", "1", "-n", "1"])
    for result, code in ((doctor, 3), (bench, 2)):
        assert result.exit_code == code, result.output
        assert result.exception is None or isinstance(result.exception, SystemExit), result.exception
        assert "OpenAI" in result.stderr or "lists no model" in result.stderr, result.stderr
        assert "Traceback" not in result.output


@pytest.mark.parametrize("args", [["doctor", "http://[::1"], ["bench", "--url", "http://[::1"],
                                  ["doctor", "http://127.0.0.1:8000", "--compare", "http://[::1"]])
def test_a_malformed_url_is_one_line(args):
    result = runner.invoke(app, args)
    assert result.exit_code == 2, result.output
    assert result.exception is None or isinstance(result.exception, SystemExit), result.exception
    assert "http://[::1" in result.stderr and "Traceback" not in result.output


def _failing_completions(on_post=None) -> StandInServer:
    error = {"error": {"message": "[/bold] model [red]overloaded[/red] [/]", "type": "BadRequestError"}}
    return StandInServer({
        "/v1/models": (200, json_body({"data": [{"id": "m", "max_model_len": 512}]})),
        "/v1/completions": (400, json_body(error)),
        "/metrics": (200, PROXIMA_TEXT.encode()),
    }, on_post=on_post)


def test_bench_shows_a_servers_error_containing_rich_markup_as_text(tmp_path):
    with _failing_completions() as server:
        result = runner.invoke(app, ["bench", "--url", server.url, "-c", "1", "-n", "2",
                                     "--sample-interval", "0", "--out", str(tmp_path / "out")])
    assert result.exception is None or isinstance(result.exception, SystemExit), repr(result.exception)
    assert "Concurrency sweep" in result.stdout
    assert result.exit_code == 0, result.output
    assert "(HTTP 400: [/bold] model [red]overloaded[/red] [/])" in result.stdout  # in the verdict, verbatim
    assert json.loads((tmp_path / "out" / "results.json").read_text())["runs"]


def test_bench_refuses_an_unwritable_out_before_sending_anything(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    with _failing_completions() as server:
        result = runner.invoke(app, ["bench", "--url", server.url, "-c", "1", "-n", "1",
                                     "--out", str(blocker / "out")])
        sent = server.hits.get("/v1/completions", 0)
    assert result.exit_code == 2
    assert "--out" in result.stderr and "choose a writable directory" in result.stderr
    assert sent == 0


def test_bench_keeps_the_measurement_when_out_breaks_during_the_run(tmp_path):
    out = tmp_path / "out"
    out.mkdir()

    def break_out(path: str) -> None:  # the disk under --out goes away mid-run
        if path == "/v1/completions" and out.is_dir():
            out.rmdir()
            out.write_text("not a directory any more")

    with _failing_completions(on_post=break_out) as server:
        result = runner.invoke(app, ["bench", "--url", server.url, "-c", "1", "-n", "2",
                                     "--sample-interval", "0", "--out", str(out)])
    assert result.exit_code == 1, result.output
    assert "Concurrency sweep" in result.stdout  # the figures were printed first
    assert "written to" in result.stderr
    fallback = Path(result.stderr.split("written to ")[1].split(" instead")[0].strip())
    assert json.loads((fallback / "results.json").read_text())["runs"]


def test_a_bench_label_with_a_slash_names_a_log_file_in_the_log_directory(tmp_path):
    plan = LaunchPlan("model", ("token",), ("proxima/token",), (), False, tmp_path / "logs")
    server = _server(plan, "token", "proxima/token")
    assert server.spec.log_path.parent == tmp_path / "logs"


def test_bench_out_never_writes_through_a_planted_symlink(tmp_path):
    """A link planted where bench writes (its old fixed temporary names, or the results files
    themselves) is replaced, never followed: the file it points to is left as it was."""
    victim = tmp_path / "victim.txt"
    victim.write_text("precious")
    out = tmp_path / "out"
    out.mkdir()
    names = ("results.json", "results.csv", "report.html", "workload.jsonl", "report.png")
    for name in names:
        (out / name).symlink_to(victim)
        (out / f".{name}.tmp").symlink_to(victim)
    with StandInServer(vllm_routes()) as server:
        result = runner.invoke(app, ["bench", "--url", server.url, "-c", "1", "-n", "1", "--max-tokens", "4",
                                     "--sample-interval", "0", "--out", str(out)])
    assert result.exit_code == 0, result.output
    assert victim.read_text() == "precious"
    written = [name for name in names if (out / name).exists() and not (out / name).is_symlink()]
    assert "results.json" in written and "workload.jsonl" in written, written
    assert json.loads((out / "results.json").read_text())["runs"]
    assert sorted(p.name for p in out.iterdir() if p.name.endswith(".tmp") and not p.is_symlink()) == []


def test_writers_into_one_file_never_mix_or_leave_temporary_files(tmp_path):
    import threading

    from proxima.files import write_atomic

    path = tmp_path / "results.json"
    texts = [str(k) * 200_000 for k in range(8)]
    threads = [threading.Thread(target=write_atomic, args=(path, text)) for text in texts]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert path.read_text() in texts  # one writer's whole file, not a mix
    assert [p.name for p in tmp_path.iterdir()] == ["results.json"]
