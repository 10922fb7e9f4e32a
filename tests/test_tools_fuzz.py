"""Every tool on a server that misbehaves on one endpoint: `top --once`, `doctor` and `bench`
each finish within a stated bound, with no traceback, and with the right verdict.

The server is a loopback stand-in (`tests/standin_servers.py`) that answers like vLLM on every
endpoint the tools read except one, which answers with NaN or Infinity, too much, too deep,
forever, a byte at a time, cut short, or the wrong types. The verdicts: an unusable /metrics is
an error naming the reason (never an idle server), a broken /v1/models ends the tool in one line
naming it, a broken /tokenize makes bench approximate its workload, and a broken completion or
stream is a failed request in bench's counts (never a lost one).

Bounds are the tools' own budgets plus start-up: `top --once --interval 0.1` scrapes twice with a
2 s budget each; `doctor` reads /v1/models within 10 s and its first /metrics within 20 s;
`bench --timeout 2` gives every read 2 s.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

from proxima.cli.main import app
from tests.standin_servers import (
    METRICS_AT_REST,
    MODEL,
    Reply,
    StandInServer,
    json_body,
    sse,
    token_chunk,
    vllm_routes,
)

runner = CliRunner()

TOP_BOUND_S, DOCTOR_BOUND_S, BENCH_BOUND_S = 10.0, 30.0, 30.0
TRICKLE = 0.01  # a byte every 10 ms: any real answer would take minutes
DEEP = b"[" * 200_000 + b"]" * 200_000
HUGE_JSON = b'{"data": [' + b'{"id": "m"},' * 5_000_000 + b'{"id": "m"}]}'  # ~60 MB
ENDLESS_JSON = Reply(body=b'{"data": [', endless=b'{"id": "m"},' * 1000)

RUNNING = 'vllm:num_requests_running{engine="0",model_name="/tmp/top-tiny"} 0.0'
PREEMPTIONS = 'vllm:num_preemptions_total{engine="0",model_name="/tmp/top-tiny"} 0.0'
SLOTS = 'proxima_kv_slots{engine="0"} 32768.0'
USED = 'proxima_kv_slots_used{engine="0"} 11158.0'
USAGE = 'vllm:kv_cache_usage_perc{engine="0",model_name="/tmp/top-tiny"} 0.3380126953125'
for line in (RUNNING, PREEMPTIONS, SLOTS, USED, USAGE):
    assert line in METRICS_AT_REST, line


def _metrics(old: str, new: str) -> tuple[int, bytes]:
    return 200, METRICS_AT_REST.replace(old, new).encode()


# /metrics as it must never be read: (answer, what the error names).
METRICS = {
    "nan-gauge": (_metrics(RUNNING, RUNNING.replace("0.0", "NaN")), "not a finite number"),
    "inf-counter": (_metrics(PREEMPTIONS, PREEMPTIONS.replace("0.0", "+Inf")), "not a finite number"),
    "inf-capacity": (_metrics(SLOTS, SLOTS.replace("32768.0", "+Inf")), "not a finite number"),
    "negative-running": (_metrics(RUNNING, RUNNING.replace("0.0", "-5")), "negative"),
    "negative-slots": (_metrics(SLOTS, SLOTS.replace("32768.0", "-8192")), "negative"),
    "usage-over-1": (_metrics(USAGE, USAGE.replace("0.3380126953125", "122070312.5")), "above 1"),
    "used-over-total": (_metrics(USED, USED.replace("11158.0", "99999.0")), "more than the 32768 slots"),
    "family-twice": ((200, (METRICS_AT_REST * 2).encode()), "declared twice"),
    "empty": ((200, b""), "no vLLM metrics"),
    "binary": ((200, bytes(range(256)) * 64), "no vLLM metrics"),
    "proxy-page": ((200, b"<html><body>502 Bad Gateway</body></html>"), "no vLLM metrics"),
    "wrong-typed": (_metrics(RUNNING, RUNNING.replace("0.0", "many")), "unreadable /metrics"),
    "huge": (Reply(body=METRICS_AT_REST.encode() * 100), "larger than 4 MiB"),
    "endless": (Reply(body=METRICS_AT_REST.encode(), endless=b"vllm:x 1\n" * 1000), "larger than 4 MiB"),
    "trickled": (Reply(body=METRICS_AT_REST.encode(), trickle_s=TRICKLE), "timed out"),
    "truncated": (Reply(body=METRICS_AT_REST.encode(), truncate_at=1000), "connection lost"),
    "http-404": ((404, b"not found"), "HTTP 404"),
    "http-500": ((500, b"oops"), "HTTP 500"),
}

# /v1/models as it must never be read.
MODELS = {
    "nan": ((200, b'{"data": [{"id": "m", "max_model_len": NaN}]}'), "NaN"),
    "infinity": ((200, b'{"data": [{"id": "m", "max_model_len": Infinity}]}'), "Infinity"),
    "deep": ((200, DEEP), "nested more than"),
    "huge": (Reply(body=HUGE_JSON), "larger than 4 MiB"),
    "endless": (ENDLESS_JSON, "larger than 4 MiB"),
    "trickled": (Reply(body=json_body({"data": [{"id": MODEL}]}), trickle_s=1.0), "timed out"),
    "truncated": (Reply(body=json_body({"data": [{"id": MODEL}]}), truncate_at=10), "connection lost"),
    "id-not-a-string": ((200, json_body({"data": [{"id": 5}]})), 'without an "id"'),
    "data-an-object": ((200, json_body({"data": {}})), "not an OpenAI model list"),
    "empty-list": ((200, json_body({"data": []})), "lists no model"),
    "http-500": ((500, b"oops"), "HTTP 500"),
    "http-401": ((401, json_body({"error": "Unauthorized"})), "--api-key"),
}

# /tokenize as it must never be read: bench then counts no tokens and says so.
TOKENIZE = {
    "a-list": (200, b"[]"),
    "count-null": (200, json_body({"count": None})),
    "count-a-word": (200, json_body({"count": "many"})),
    "count-nan": (200, b'{"count": NaN}'),
    "deep": (200, DEEP),
    "endless": Reply(body=b'{"count": 3, "tokens": [', endless=b"1," * 10_000),
    "trickled": Reply(body=json_body({"count": 3}), trickle_s=1.0),
}


def _stream(*events: object) -> dict:
    """A /v1/completions route whose streams are these events (whole answers stay correct)."""
    good = vllm_routes()["/v1/completions"]
    return lambda request: (200, sse(*events)) if request.get("stream") else good(request)


# A streamed completion as it must never be counted as anything but failed (or timed out).
STREAMS = {
    "chunk-a-list": (_stream(b"[1,2]", b"[DONE]"), "not an object"),
    "chunk-a-number": (_stream(b"42", b"[DONE]"), "not an object"),
    "usage-a-list": (_stream(token_chunk(), {"usage": [1]}, b"[DONE]"), '"usage" is not an object'),
    "choices-a-string": (_stream({"choices": "x"}, b"[DONE]"), '"choices" is not a list'),
    "text-a-number": (_stream({"choices": [{"text": 5}]}, b"[DONE]"), '"text" is not a string'),
    "usage-nan": (_stream(token_chunk(), b'{"usage": {"completion_tokens": NaN}}', b"[DONE]"), "NaN"),
    "usage-too-many": (_stream(token_chunk(), {"usage": {"completion_tokens": 10**9}}, b"[DONE]"),
                       "more than the"),
    "deep-chunk": (_stream(DEEP, b"[DONE]"), "nested more than"),
    "no-done": (_stream(token_chunk()), "stream ended before [DONE]"),
    "endless-tokens": (lambda r: Reply(body=sse(token_chunk()), endless=sse(token_chunk())),
                       "more token chunks"),
    "endless-event": (lambda r: Reply(body=b"data: {", endless=b"x" * 65536), "over 1 MiB"),
    "trickled": (lambda r: Reply(body=sse(token_chunk(), b"[DONE]"), trickle_s=0.05), "no complete answer"),
    "truncated": (lambda r: Reply(body=sse(token_chunk(), b"[DONE]"), truncate_at=20), "connection lost"),
    "http-500-deep": (lambda r: (500, DEEP[:5000]), "HTTP 500"),
}

# A whole (non-streamed) completion as it must never be taken for an answer: the doctor's
# determinism check reads these.
WHOLE = {
    "choices-missing": (200, json_body({"usage": {}})),
    "text-a-number": (200, json_body({"choices": [{"text": 5}]})),
    "token-ids-words": (200, json_body({"choices": [{"text": "a", "token_ids": ["a"]}]})),
    "usage-nan": (200, b'{"choices": [{"text": "a"}], "usage": {"completion_tokens": NaN}}'),
    "deep": (200, DEEP), "huge": Reply(body=json_body({"choices": [{"text": "a" * (5 << 20)}]})),
    "endless": Reply(body=b'{"choices": [{"text": "', endless=b"a" * 65536),
    "truncated": Reply(body=json_body({"choices": [{"text": "a"}]}), truncate_at=8),
}

VERSION = {
    "deep": (200, DEEP), "nan": (200, b'{"version": NaN}'), "a-list": (200, json_body({"version": [1]})),
    "endless": Reply(body=b'{"version": "', endless=b"0" * 65536),
    "trickled": Reply(body=json_body({"version": "0.26.0"}), trickle_s=1.0),
}


def _server(path: str, route) -> StandInServer:
    return StandInServer({**vllm_routes(), path: route})


def _invoke(args: list[str]) -> tuple[object, float]:
    start = time.monotonic()
    result = runner.invoke(app, args)
    return result, time.monotonic() - start


def _one_line_error(result, *fragments: str) -> str:
    """The tool ended on its own terms in one stderr line that holds every fragment."""
    assert result.exception is None or isinstance(result.exception, SystemExit), repr(result.exception)
    assert "Traceback" not in result.output, result.output
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, result.stderr
    for fragment in fragments:
        assert fragment in lines[0], (fragment, lines[0])
    return lines[0]


# ------------------------------------------------------------------ /metrics: top, doctor, bench

@pytest.mark.parametrize(("answer", "reason"), METRICS.values(), ids=METRICS.keys())
def test_top_once_names_why_a_metrics_page_is_unusable(answer, reason):
    with _server("/metrics", answer) as server:
        result, took = _invoke(["top", server.url, "--once", "--interval", "0.1"])
    assert result.exit_code == 1, result.output
    _one_line_error(result, server.url, reason)
    assert "start one with" not in result.stderr  # it answered: the reason is its page, not its absence
    assert took < TOP_BOUND_S, took


# The doctor reads /metrics through the same layer as top (whose test above covers every case):
# one case of each kind of fault here, the trickled one for the doctor's own 20 s budget.
DOCTOR_METRICS = ("nan-gauge", "negative-slots", "usage-over-1", "family-twice", "empty", "huge", "trickled",
                  "truncated", "http-500")


@pytest.mark.parametrize(("answer", "reason"), [METRICS[k] for k in DOCTOR_METRICS], ids=DOCTOR_METRICS)
def test_doctor_refuses_to_judge_an_unusable_metrics_page(answer, reason):
    with _server("/metrics", answer) as server:
        result, took = _invoke(["doctor", server.url, "--checks", "leak,oom_risk"])
    assert result.exit_code == 3, result.output
    _one_line_error(result, f"{server.url}/metrics is unusable", reason)
    assert took < DOCTOR_BOUND_S, took


BENCH = ["-c", "2", "-n", "2", "--timeout", "2", "--sample-interval", "0.2", "--max-tokens", "4"]


def _bench(server: StandInServer, tmp_path: Path, *extra: str,
           built_in: bool = False) -> tuple[object, float, dict | None]:
    """bench against the stand-in: a two-prompt workload file, unless `built_in` (the built-in
    workload, whose every word bench first prices with /tokenize)."""
    out = tmp_path / "out"
    workload = tmp_path / "two.jsonl"
    workload.write_text('{"prompt": "the quick brown fox"}\n{"prompt": "memory slots cache"}\n')
    extra = extra if built_in else ("--workload", str(workload), *extra)
    result, took = _invoke(["bench", "--url", server.url, *BENCH, "--out", str(out), *extra])
    assert result.exception is None or isinstance(result.exception, SystemExit), repr(result.exception)
    assert "Traceback" not in result.output, result.output
    assert took < BENCH_BOUND_S, took
    path = out / "results.json"
    return result, took, json.loads(path.read_text()) if path.exists() else None


@pytest.mark.parametrize(("answer", "reason"), [METRICS[k] for k in ("nan-gauge", "negative-slots", "empty",
                                                                       "family-twice", "trickled")],
                         ids=["nan-gauge", "negative-slots", "empty", "family-twice", "trickled"])
def test_bench_measures_without_an_unusable_metrics_page_and_says_so(answer, reason, tmp_path):
    with _server("/metrics", answer) as server:
        result, _, results = _bench(server, tmp_path)
    assert result.exit_code == 0, result.output
    (run,) = results["runs"]
    assert run["levels"][0]["completed"] == 2  # the load itself was served
    assert reason in run["metrics_error"]
    assert run["kv_capacity_tokens"] is None  # nothing read from a page that cannot be true
    assert any("metrics could not be used" in n and reason in n for n in results["notes"])


# ------------------------------------------------------------------ /v1/models: doctor, bench

@pytest.mark.parametrize(("answer", "reason"), MODELS.values(), ids=MODELS.keys())
def test_doctor_and_bench_end_in_one_line_on_a_broken_model_list(answer, reason, tmp_path):
    with _server("/v1/models", answer) as server:
        doctor, doctor_took = _invoke(["doctor", server.url, "--checks", "oom_risk"])
        bench, bench_took = _invoke(["bench", "--url", server.url, *BENCH, "--out", str(tmp_path / "o")])
        sent = server.hits.get("/v1/completions", 0)
    assert doctor.exit_code == 3 and bench.exit_code == 2, (doctor.output, bench.output)
    for result in (doctor, bench):
        _one_line_error(result, f"{server.url}/v1/models", reason)
    assert sent == 0 and not (tmp_path / "o").exists()
    assert doctor_took < DOCTOR_BOUND_S and bench_took < BENCH_BOUND_S, (doctor_took, bench_took)


# ------------------------------------------------------------------ /tokenize: bench

@pytest.mark.parametrize("answer", TOKENIZE.values(), ids=TOKENIZE.keys())
def test_bench_approximates_its_workload_when_tokenize_answers_wrongly(answer, tmp_path):
    with _server("/tokenize", answer) as server:
        result, _, results = _bench(server, tmp_path, built_in=True)
    assert result.exit_code == 0, result.output
    assert results["workload"]["token_counting"].startswith("approximate")  # not counted by the server
    assert results["runs"][0]["levels"][0]["completed"] == 2


# ------------------------------------------------------------------ streamed completions: bench

@pytest.mark.parametrize(("route", "reason"), STREAMS.values(), ids=STREAMS.keys())
def test_bench_counts_every_broken_stream_as_a_failed_request(route, reason, tmp_path):
    with _server("/v1/completions", route) as server:
        result, _, results = _bench(server, tmp_path)
    assert result.exit_code == 0, result.output
    (level,) = results["runs"][0]["levels"]
    assert level["num_sent"] == 2 and level["completed"] == 0 and level["cancelled"] == 0, level
    assert level["failed"] + level["timed_out"] == 2, level  # none lost from the counts
    assert any(reason in error for error in level["errors"]), level["errors"]


# ------------------------------------------------------------------ whole completions, /version: doctor

@pytest.mark.parametrize("answer", WHOLE.values(), ids=WHOLE.keys())
def test_doctor_determinism_takes_no_malformed_answer_for_one(answer):
    good = vllm_routes()["/v1/completions"]

    def route(request):
        return good(request) if request.get("stream") else answer

    with _server("/v1/completions", route) as server:
        result, took = _invoke(["doctor", server.url, "--checks", "determinism", "--json"])
    assert result.exception is None or isinstance(result.exception, SystemExit), repr(result.exception)
    assert result.exit_code == 3, result.output
    (check,) = json.loads(result.stdout)["checks"]
    assert check["status"] == "error" and "reference requests failed" in check["summary"], check
    assert took < DOCTOR_BOUND_S, took


@pytest.mark.parametrize("answer", VERSION.values(), ids=VERSION.keys())
def test_doctor_environment_reads_an_odd_version_as_unknown(answer):
    with _server("/version", answer) as server:
        result, took = _invoke(["doctor", server.url, "--checks", "environment", "--json"])
    assert result.exception is None or isinstance(result.exception, SystemExit), repr(result.exception)
    (check,) = json.loads(result.stdout)["checks"]
    assert check["evidence"]["server_vllm"].startswith("unknown"), check
    assert took < DOCTOR_BOUND_S, took


# ------------------------------------------------------------------ API keys

@pytest.fixture
def no_key_in_env(monkeypatch):
    for name in ("VLLM_API_KEY", "OPENAI_API_KEY"):
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


def test_without_the_key_doctor_and_bench_say_what_is_missing(no_key_in_env, tmp_path):
    with StandInServer(vllm_routes(), api_key="sesame") as server:
        doctor, _ = _invoke(["doctor", server.url, "--checks", "oom_risk"])
        bench, _ = _invoke(["bench", "--url", server.url, *BENCH])
    for result in (doctor, bench):
        _one_line_error(result, f"{server.url}/v1/models", "HTTP 401", "--api-key")


@pytest.mark.parametrize("how", ["option", "VLLM_API_KEY", "OPENAI_API_KEY"])
def test_doctor_bench_and_top_send_the_key(no_key_in_env, tmp_path, how):
    key = ["--api-key", "sesame"] if how == "option" else []
    if how != "option":
        no_key_in_env.setenv(how, "sesame")
    with StandInServer(vllm_routes(), api_key="sesame") as server:
        doctor, _ = _invoke(["doctor", server.url, "--checks", "determinism", "--json", *key])
        result, _, results = _bench(server, tmp_path, *key)
        top, _ = _invoke(["top", server.url, "--once", "--interval", "0.1", *key])
        refused = server.refused
    assert refused == 0
    assert doctor.exit_code == 0, doctor.output
    assert result.exit_code == 0 and results["runs"][0]["levels"][0]["completed"] == 2, result.output
    assert "sesame" not in json.dumps(results)  # the key is never written to the results
    assert top.exit_code == 0, top.output
