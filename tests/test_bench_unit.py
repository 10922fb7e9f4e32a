"""`proxima bench` without a server: workloads, file validation, statistics, verdict, avalanche, reports.

The CLI error tests point at a closed port on purpose: a bad workload must be caught before any
server is contacted, so they pass only if validation comes first.
"""

from __future__ import annotations

import asyncio
import json
import random
import re
import xml.dom.minidom
from dataclasses import replace

import numpy as np
import pytest
from rich.console import Console
from typer.testing import CliRunner

from proxima.bench import report
from proxima.bench import workload as wl
from proxima.bench.results import (
    CONCURRENCY,
    RATE,
    BenchResult,
    LevelResult,
    ServerRun,
    Stats,
    percentile,
    to_csv,
    verdict,
)
from proxima.bench.results import TimelinePoint as Sample
from proxima.bench.sweep import SweepParams, _LevelState
from proxima.cli.main import app
from proxima.installed import cpu_build_of_vllm
from proxima.server_process import free_port
from proxima.streaming import FAILED, OK, RequestResult

runner = CliRunner()


def approx_plan(source: str, n: int = 200, seed: int = 3, **kw) -> wl.Workload:
    return wl.generate(wl.WorkloadPlan(source, n, seed, **kw), wl.WordCosts.approximate())


@pytest.mark.parametrize("source", wl.BUILTIN)
def test_generators_are_seeded_and_within_their_shape(source):
    work = approx_plan(source)
    again = approx_plan(source)
    other = approx_plan(source, seed=4)
    assert [r.prompt for r in work.requests] == [r.prompt for r in again.requests]
    assert [r.prompt for r in work.requests] != [r.prompt for r in other.requests]
    shape = wl.SHAPES[source]
    for r in work.requests:
        assert set(r.prompt.split()) <= set(wl.VOCABULARY)
        # With one token per word, the recorded count is the word count exactly.
        assert r.prompt_tokens == len(r.prompt.split())
        body = r.prompt_tokens - shape.shared_prefix_tokens
        is_long = shape.long_prompt is not None and body > shape.prompt.high
        prompt, output = (shape.long_prompt, shape.long_output) if is_long else (shape.prompt, shape.output)
        assert prompt.low <= body <= prompt.high
        assert output.low <= r.max_tokens <= output.high
    assert work.token_counting == wl.APPROXIMATE


def test_mixed_has_both_kinds_and_shared_prefix_shares_its_prefix():
    mixed = approx_plan("mixed", 400)
    longs = sum(r.prompt_tokens >= 1000 for r in mixed.requests)
    assert 40 <= longs <= 120  # 20% of 400, loosely
    shared = approx_plan("shared-prefix", 20)
    prefix = " ".join(shared.requests[0].prompt.split()[:200])
    assert all(r.prompt.startswith(prefix) for r in shared.requests)
    assert len({r.prompt for r in shared.requests}) == 20


def test_word_costs_hit_exact_token_targets_with_multi_token_words():
    rng = random.Random(0)
    first = {w: 1 + (i % 3) for i, w in enumerate(wl.VOCABULARY)}
    later = {w: 1 + (i % 4) for i, w in enumerate(wl.VOCABULARY)}
    costs = wl.WordCosts(first, later, special=1)
    for target in (1, 2, 5, 37, 150):
        text, counted = costs.build(rng, target)
        words = text.split()
        total = 1 + first[words[0]] + sum(later[w] for w in words[1:])
        assert counted == total == max(target, 1 + first[words[0]])


def test_generation_clamps_to_the_servers_context_and_says_so():
    work = wl.generate(wl.WorkloadPlan("long-doc", 10, 0), wl.WordCosts.approximate(), max_model_len=1024)
    assert all(r.prompt_tokens + r.max_tokens < 1024 for r in work.requests)
    assert any("max_model_len=1024" in n for n in work.notes)


def test_overrides_and_ranges():
    work = approx_plan("short-chat", 30, prompt_override=wl.Range(5, 5), output_override=wl.Range(16, 16))
    assert {r.prompt_tokens for r in work.requests} == {5}
    assert {r.max_tokens for r in work.requests} == {16}
    assert wl.parse_range("8-32", "--x") == wl.Range(8, 32)
    for bad in ("0", "9-3", "a", "1-b"):
        with pytest.raises(wl.WorkloadError, match="--x"):
            wl.parse_range(bad, "--x")


def test_jsonl_roundtrip(tmp_path):
    work = approx_plan("short-chat", 5)
    path = tmp_path / "w.jsonl"
    wl.write_jsonl(work, path)
    loaded = wl.load_jsonl(path)
    assert loaded == work.requests
    assert not list(tmp_path.glob(".*tmp"))


BAD_FILES = [
    ('{"prompt": "hi"}\nnot json\n', 2, "not valid JSON"),
    ('{"prompt": "hi"}\n\n{"max_tokens": 3}\n', 3, 'missing "prompt"'),
    ('{"prompt": ""}\n', 1, 'missing "prompt"'),
    ('{"prompt": "hi", "max_tokens": 0}\n', 1, '"max_tokens" must be a positive integer, got 0'),
    ('{"prompt": "hi", "max_tokens": -4}\n', 1, "got -4"),
    ('{"prompt": "hi", "max_tokens": "64"}\n', 1, 'got "64"'),
    ('{"prompt": "hi", "max_tokens": 2.5}\n', 1, "got 2.5"),
    ('{"prompt": "hi", "max_token": 8}\n', 1, "unknown key 'max_token'"),
    ('["hi"]\n', 1, "not an object"),
]


@pytest.mark.parametrize(("text", "line", "fragment"), BAD_FILES)
def test_bad_workload_file_names_file_line_and_fix(tmp_path, text, line, fragment):
    path = tmp_path / "bad.jsonl"
    path.write_text(text)
    with pytest.raises(wl.WorkloadError) as err:
        wl.load_jsonl(path)
    message = str(err.value)
    assert f"{path}:{line}:" in message and fragment in message
    assert "\n" not in message


def _closed_url() -> str:
    return f"http://127.0.0.1:{free_port()}"


@pytest.mark.parametrize(("text", "expected"), [
    (None, "not found"),
    ("", "no requests"),
    ('{"prompt": "a"}\n{"prompt": "b", "max_tokens": -1}\n', ":2:"),
    ("{oops\n", ":1: not valid JSON"),
])
def test_cli_rejects_bad_workload_before_anything(tmp_path, text, expected):
    path = tmp_path / "w.jsonl"
    if text is not None:
        path.write_text(text)
    out = tmp_path / "out"
    result = runner.invoke(app, ["bench", "--url", _closed_url(), "--workload", str(path), "--out", str(out)])
    assert result.exit_code == 2, result.output
    lines = [ln for ln in result.output.splitlines() if ln.strip()]
    assert len(lines) == 1 and expected in lines[0] and "Traceback" not in result.output
    assert not out.exists()


def test_cli_unreachable_server_is_one_clear_line(tmp_path):
    url = _closed_url()
    result = runner.invoke(app, ["bench", "--url", url, "-c", "1", "-n", "1", "--out", str(tmp_path / "o")])
    assert result.exit_code == 2
    assert f"cannot reach {url}: connection refused" in result.output
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize(("args", "expected"), [
    ([], "say which server"),
    (["--a", "http://x:1"], "needs both --a URL and --b URL"),
    (["--url", "http://x:1", "--launch", "m"], "not both"),
    (["--url", "http://x:1", "-c", "4,x"], "--concurrency takes comma-separated positive integers"),
    (["--url", "http://x:1", "--rate", "0"], "--rate takes"),
    (["--url", "http://x:1", "--", "--dtype", "float32"], "only used with --launch"),
    (["--launch", "m", "--variants", "token,paged"], "--variants takes"),
    (["--url", "http://x:1", "--max-error-rate", "2"], "--max-error-rate"),
    (["--url", "http://x:1", "--warmup", "-1"], "--warmup is how many unmeasured requests"),
])
def test_cli_option_errors(args, expected):
    result = runner.invoke(app, ["bench", *args])
    assert result.exit_code == 2, result.output
    assert expected in result.output


@pytest.mark.skipif(not cpu_build_of_vllm(), reason="the refusal is for vLLM's CPU build")
def test_launching_stock_with_a_kv_dtype_its_cpu_backend_cannot_serve_is_refused_before_anything(tmp_path):
    args = ["bench", "--launch", "m", "--out", str(tmp_path / "o"), "-c", "4"]
    for variants in ("stock,token", "block,token", "token,block"):
        result = runner.invoke(app, [*args, "--variants", variants,
                                     "--", "--kv-cache-dtype", "int4_per_token_head"])
        assert result.exit_code == 2, result.output
        text = " ".join(result.output.split())
        assert f"--variants {variants}: --kv-cache-dtype int4_per_token_head: vLLM's CPU backend" in text
        assert "use the token allocator" in text
    assert not (tmp_path / "o").exists()  # nothing launched or written


def test_percentile_matches_numpy():
    rng = np.random.default_rng(1)
    for n in (1, 2, 7, 100):
        values = list(rng.exponential(size=n))
        for q in (0, 50, 95, 99, 100):
            assert percentile(values, q) == pytest.approx(np.percentile(values, q))
    assert percentile([], 50) is None


def _level(server, kind, value, p95, rps, failed=0, aborted=None, completed=10) -> LevelResult:
    lv = LevelResult(server, kind, value, num_sent=completed + failed, completed=completed, failed=failed,
                     rps=rps, output_tps=rps * 100, aborted=aborted)
    lv.e2e = Stats(completed, p95 / 2, p95 / 2, p95, p95 * 1.1) if completed else Stats()
    lv.timeline = [Sample(0.0, True, 1, 0, 0.1 * value / 8, 0.1, 0.05, 0),
                   Sample(0.5, True, 2, 0, 0.2, 0.2, 0.1, 0)]
    return lv


def _ab_result() -> BenchResult:
    a = ServerRun("block", "http://a", "m", levels=[
        _level("block", CONCURRENCY, 4, 0.5, 10), _level("block", CONCURRENCY, 8, 1.5, 18),
        _level("block", CONCURRENCY, 16, 2.5, 20),
        _level("block", CONCURRENCY, 32, 9.0, 12, aborted="P95 E2E 9.00s > 3x SLO (6s)"),
        _level("block", RATE, 2, 0.4, 2)])
    a.stopped = "concurrency sweep stopped at c=32 (P95 E2E 9.00s > 3x SLO (6s)); not run: 64"
    b = ServerRun("token", "http://b", "m", levels=[
        _level("token", CONCURRENCY, 4, 0.5, 10), _level("token", CONCURRENCY, 8, 1.0, 19),
        _level("token", CONCURRENCY, 16, 1.6, 30), _level("token", CONCURRENCY, 32, 1.9, 36),
        _level("token", CONCURRENCY, 64, 2.4, 37, failed=3), _level("token", RATE, 2, 0.4, 2)])
    runs = [a, b]
    return BenchResult("2026-01-01T00:00:00+00:00", "proxima bench ...", {"slo_p95_e2e_s": 2.0},
                       approx_plan("short-chat", 3).describe(), runs, verdict(runs, 2.0, 0.1))


def test_verdict_finds_each_knee_and_the_ratio():
    v = _ab_result().verdict
    knees = {k["server"]: k for k in v["sweeps"]["concurrency"]["knees"]}
    assert knees["block"]["best_value"] == 8 and knees["block"]["breaks_at"] == 16
    assert "P95 E2E 2.50s > SLO 2s" in knees["block"]["break_reason"]
    assert knees["token"]["best_value"] == 32 and knees["token"]["breaks_at"] == 64
    assert knees["token"]["break_reason"].startswith("error rate 23%")
    assert v["sweeps"]["concurrency"]["ratio_value"] == pytest.approx(4.0)
    assert v["sweeps"]["concurrency"]["ratio_rps"] == pytest.approx(2.0)
    ratio_line = "token / block: 4.00x sustainable concurrency, 2.00x RPS"
    assert any(line.startswith(ratio_line) for line in v["summary"])
    rate = {k["server"]: k for k in v["sweeps"]["rate"]["knees"]}
    assert rate["token"]["breaks_at"] is None and "did not break" in " ".join(v["summary"])


def test_reports_render_and_are_well_formed(tmp_path):
    result = _ab_result()
    work = approx_plan("short-chat", 3)
    written = report.write_outputs(result, work, tmp_path / "out")
    names = {p.name for p in written}
    assert {"results.json", "results.csv", "workload.jsonl", "report.html"} <= names
    assert not list((tmp_path / "out").glob(".*tmp*"))
    data = json.loads((tmp_path / "out" / "results.json").read_text())
    assert [len(r["levels"]) for r in data["runs"]] == [5, 6]
    assert data["runs"][1]["levels"][4]["error_rate"] == pytest.approx(3 / 13)
    rows = to_csv(result).strip().splitlines()
    assert len(rows) == 1 + 11
    page = (tmp_path / "out" / "report.html").read_text()
    svgs = re.findall(r"<svg.*?</svg>", page, re.DOTALL)
    assert len(svgs) >= 7  # 3 per sweep kind + KV occupancy + fragmentation
    for svg in svgs:
        xml.dom.minidom.parseString(svg)
    assert "SLO 2s" in page and "token / block: 4.00x" in page
    assert "KV cache occupancy over time" in page
    tables = report.terminal_tables(result)
    sweeps = ("Concurrency sweep", "Poisson rate sweep")
    parts = ("throughput and latency", "memory and client")
    assert [t.title for t in tables] == [f"{sweep}: {part}" for sweep in sweeps for part in parts]
    # Each fits a 120-column terminal, level by level the same rows, every judged column shown once.
    console = Console(width=300, record=True, color_system=None)
    for table in tables:
        console.print(table)
    widths = [len(line.rstrip()) for line in console.export_text().splitlines()]
    assert 0 < max(widths) <= 120, max(widths)
    assert tables[0].row_count == tables[1].row_count and tables[0].row_count + tables[2].row_count == 11
    headers = [c.header.replace("\n", " ") for t in tables[:2] for c in t.columns]
    assert headers.count("server") == headers.count("level") == 2 and len(headers) == len(set(headers)) + 2


def _finished(status: str, e2e: float = 0.1) -> RequestResult:
    r = RequestResult(0, status=status, sent_at=1.0, e2e=e2e if status == OK else None)
    return r


def test_avalanche_on_errors_and_on_latency_including_requests_in_flight():
    async def scenario():
        params = SweepParams(slo_p95_s=1.0, max_error_rate=0.1, avalanche_factor=3.0, min_samples=10)
        errors = _LevelState(params, total=100)
        for i in range(10):
            r = _finished(OK if i < 8 else FAILED)
            r.error = None if i < 8 else "connection refused"
            errors.started(r)
            errors.finished(r)
        assert errors.stop.is_set() and "error rate 20% > 10%" in errors.aborted
        assert "connection refused" in errors.aborted

        slow = _LevelState(params, total=100)
        for _ in range(10):
            r = _finished(OK, 0.2)
            slow.started(r)
            slow.finished(r)
        assert not slow.stop.is_set()
        import time
        for _ in range(4):  # stuck for 10 s: counted with their age though not finished
            stuck = RequestResult(0, sent_at=time.perf_counter() - 10.0)
            slow.started(stuck)
        slow.check()
        assert slow.stop.is_set() and "> 3x SLO (3s)" in slow.aborted

    asyncio.run(scenario())


def test_multi_turn_conversations_resend_the_answer_and_round_trip_through_jsonl(tmp_path):
    work = approx_plan("multi-turn", 6)
    conv = work.requests[0]
    assert len(conv.followups) == 3 and all(r.followups for r in work.requests)
    second = conv.next_turn(" the answer")
    assert second.prompt == conv.prompt + " the answer" + conv.followups[0]
    assert second.followups == conv.followups[1:] and second.max_tokens == conv.max_tokens
    last = second.next_turn(" a").next_turn(" b")
    assert last.followups == () and last.next_turn(" c") is None
    path = tmp_path / "w.jsonl"
    wl.write_jsonl(work, path)
    assert wl.load_jsonl(path) == work.requests


def test_multi_turn_conversations_fit_the_context_whole():
    work = wl.generate(wl.WorkloadPlan("multi-turn", 20, 0), wl.WordCosts.approximate(), max_model_len=512)
    for r in work.requests:
        body = r.prompt_tokens - wl.SHAPES["multi-turn"].shared_prefix_tokens
        assert 200 + 4 * (body + r.max_tokens) < 512


def test_a_signal_while_results_are_written_waits_until_they_are_complete():
    """Real signals to this process: while measuring, SIGTERM interrupts as Ctrl-C does; once the
    results are being written, SIGTERM and SIGINT are held, not raised; the handlers before the
    run are back afterwards."""
    import os
    import signal
    import time

    from proxima.cli.bench import _BenchSignals

    before = signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)
    with _BenchSignals() as signals:
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(5)  # the handler raises at once; the sleep only bounds a late delivery
        signals.hold()
        os.kill(os.getpid(), signal.SIGTERM)
        os.kill(os.getpid(), signal.SIGINT)
        written = "still here"
    assert written == "still here" and signals.late == [signal.SIGTERM, signal.SIGINT]
    assert (signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)) == before


def test_answer_check_counts_ties_drift_clear_differences_and_failures():
    from proxima.bench.answers import QUESTIONS, Answers, compare
    from proxima.load import Completion
    from proxima.probes.determinism import compare_runs

    def answer(ids, top=None):
        return Completion(ok=True, token_ids=ids, top_logprobs=top)

    tied = ({" a": -0.1}, {" x": -0.70, " y": -0.71})
    ref = Answers([answer((1, 2), tied), answer((1, 2)), answer((1, 2)), answer((1, 2)), answer((4, 5))])
    completions = [answer((1, 3), ({" a": -0.1}, {" y": -0.69, " x": -0.72})), answer((9, 9)),
                   Completion(ok=False, error="HTTP 500"), answer((1, 2)), answer((4, 6))]
    found = compare_runs(ref.completions, completions)
    # Teacher-forced on the test server: prompt 4's parting is drift (31/32), prompt 1's is not (12/32).
    found[4] = replace(found[4], forced=(31, 32))
    found[1] = replace(found[1], forced=(12, 32))
    test = Answers(completions, found)
    check = compare("stock", ref, "token", test, ("auto", "auto"))
    counts = (check.num_prompts, check.identical, check.near_ties, check.drift, check.differ, check.failed)
    assert counts == (5, 1, 1, 1, 1, 1)
    assert check.examples == (f"{QUESTIONS[1]!r} at token 0 (1 vs 9)",)
    text = check.describe()
    assert text.startswith("answers, token against stock: 1/5 greedy answers identical")
    assert "1 part at a near tie" in text and "1 differ at a clear margin" in text and "1 failed" in text
    assert "1 part at a clear margin after rounding drift" in text
    assert check.forced == ((1, 12, 32), (4, 31, 32))
    assert "teacher-forced agreement at the clear partings 12/32 at lowest (prompt 1)" in text
    assert "Same KV dtype" in text
    # Without teacher forcing (a server that could not be asked) both clear partings count as differing.
    untested = compare("stock", ref, "token", Answers(completions), ("auto", "auto"))
    assert (untested.drift, untested.differ, untested.forced) == (0, 2, ())
    assert "teacher-forced" not in untested.describe()
    other = compare("stock", ref, "token-int4", test, ("auto", "int4_per_token_head"))
    assert other.expected_to_differ and "expected to differ" in other.describe()
