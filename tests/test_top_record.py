"""Record/replay of `proxima top` sessions: lossless round trips, and clear errors naming the line."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from proxima.gpu import GpuSnapshot
from proxima.scrape import parse_metrics
from proxima.tui.model import Frame
from proxima.tui.record import Recorder, RecordingError, frame_from_line, frame_to_line, load_recording

DATA = Path(__file__).parent / "data" / "top"
URLS = ("http://127.0.0.1:8471", "http://127.0.0.1:8472")


def _frame(t: float = 1000.0) -> Frame:
    prox = parse_metrics((DATA / "proxima_metrics.txt").read_text(), URLS[0], taken_at=t)
    stock = parse_metrics((DATA / "stock_metrics.txt").read_text(), URLS[1], taken_at=t)
    gpu = GpuSnapshot(0, "NVIDIA H200", 1 << 30, 140 << 30, 37.0, None)
    return Frame(t, (prox, stock), (gpu,))


def test_frame_round_trip_is_lossless():
    frame = _frame()
    line = frame_to_line(frame)
    assert line.endswith("\n") and "\n" not in line[:-1]
    json.loads(line)  # strict JSON: +Inf bucket bounds are strings, not the non-standard Infinity
    assert "Infinity" not in line
    back = frame_from_line(line, 2)
    assert back == frame
    assert math.isinf(back.servers[0].ttft.buckets[-1][0])
    assert back.servers[0].proxima.allocator_latency == frame.servers[0].proxima.allocator_latency


def test_recorder_writes_incrementally_and_loads_back(tmp_path):
    path = tmp_path / "s.jsonl"
    recorder = Recorder(path, URLS, 0.5, 999.0)
    recorder.write(_frame(1000.0))
    # Flushed per frame: readable while the recorder is still open (a live post-mortem).
    assert len(path.read_text().splitlines()) == 2
    recorder.write(_frame(1000.5))
    recorder.close()
    rec = load_recording(path)
    assert rec.urls == URLS and rec.interval_s == 0.5 and rec.started_at == 999.0
    assert [f.taken_at for f in rec.frames] == [1000.0, 1000.5] and not rec.truncated_last_line
    assert rec.frames[1] == _frame(1000.5)


def test_recorder_bad_path_is_a_clear_error(tmp_path):
    with pytest.raises(RecordingError, match="cannot write recording .*: .*writable"):
        Recorder(tmp_path / "missing-dir" / "s.jsonl", URLS, 0.5, 0.0)
    with pytest.raises(RecordingError, match="cannot write recording"):
        Recorder(tmp_path, URLS, 0.5, 0.0)  # a directory


def _write(tmp_path, lines: list[str], end: str = "\n") -> Path:
    path = tmp_path / "r.jsonl"
    path.write_text("\n".join(lines) + end)
    return path


def _header(urls=URLS) -> str:
    return json.dumps({"format": "proxima-top-recording", "version": 1, "urls": list(urls), "interval_s": 0.5,
                       "started_at": 0.0})


def test_cut_off_last_line_is_forgiven_and_reported(tmp_path):
    good = frame_to_line(_frame()).rstrip("\n")
    path = _write(tmp_path, [_header(), good, good[: len(good) // 2]], end="")
    rec = load_recording(path)
    assert len(rec.frames) == 1 and rec.truncated_last_line


@pytest.mark.parametrize("lines, message", [
    ([], "line 1: empty"),
    (['{"hello": 1}'], "line 1: not a proxima top recording header"),
    (["not json"], "line 1: not a proxima top recording header"),
    (['{"format": "proxima-top-recording", "version": 9, "urls": ["http://a"]}'],
     "line 1: recording version 9"),
    (['{"format": "proxima-top-recording", "version": 1, "urls": []}'], 'line 1: "urls"'),
    ([_header(), "{not json"], "line 2: not valid JSON"),
    ([_header(), '{"t": 1}'], 'line 2: expected a frame object with "t" and "servers"'),
    ([_header(), '{"t": 1, "servers": []}'], "line 2: servers: 0 snapshots, the header names 2 URLs"),
    ([_header(), '{"t": "x", "servers": [{}, {}]}'], "line 2: servers[0].url: missing"),
])
def test_malformed_recordings_name_the_line(tmp_path, lines, message):
    with pytest.raises(RecordingError, match=message.replace("[", r"\[").replace("(", r"\(")):
        load_recording(_write(tmp_path, lines) if lines else _write(tmp_path, [], end=""))


def test_bad_field_value_names_the_line_and_field(tmp_path):
    good = json.loads(frame_to_line(_frame()))
    good["servers"][1]["running"] = "many"
    path = _write(tmp_path, [_header(), frame_to_line(_frame()).rstrip("\n"), json.dumps(good)])
    with pytest.raises(RecordingError, match=r"line 3: servers\[1\]\.running: expected a number, got 'many'"):
        load_recording(path)


def test_time_going_backwards_is_refused(tmp_path):
    a, b = (frame_to_line(_frame(t)).rstrip("\n") for t in (2000.0, 1000.0))
    with pytest.raises(RecordingError, match="line 3: time goes backwards"):
        load_recording(_write(tmp_path, [_header(), a, b]))


def test_unknown_keys_are_ignored_and_missing_optional_fields_default(tmp_path):
    data = json.loads(frame_to_line(_frame()))
    data["servers"][0]["a_field_from_the_future"] = 1
    del data["servers"][1]["queue_time"]
    rec = load_recording(_write(tmp_path, [_header(), json.dumps(data)]))
    assert rec.frames[0].servers[0] == _frame().servers[0]
    assert rec.frames[0].servers[1].queue_time.count == 0


def test_missing_file_is_a_clear_error(tmp_path):
    with pytest.raises(RecordingError, match="cannot read recording .*No such file"):
        load_recording(tmp_path / "nope.jsonl")


def test_committed_session_fixture_loads():
    rec = load_recording(DATA / "session.jsonl")
    assert len(rec.frames) >= 60 and not rec.truncated_last_line
