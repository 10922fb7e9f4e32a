"""`proxima bench --repeat N`: intervals, the level that N runs report, the tied verdict, and the
runs themselves (fresh prompts each, against the fast stand-in)."""

from __future__ import annotations

import asyncio
import json

import pytest
from typer.testing import CliRunner

from proxima.bench import report
from proxima.bench import workload as wl
from proxima.bench.repeats import Interval, combine, compare, interval
from proxima.bench.results import CONCURRENCY, BenchResult, LevelResult, ServerRun, Stats, verdict
from proxima.bench.sweep import Observer, SweepParams, Target, level_offsets, run_sweep
from proxima.cli.main import app
from tests.fast_standin import FastStandIn


def test_interval_is_students_t():
    found = interval([1.0, 2.0, 3.0, 4.0])
    # t(0.975, 3 df) = 3.182446 (tables); sd = 1.290994; half = t * sd / sqrt(4)
    assert found.mean == 2.5 and found.n == 4
    assert found.half_width == pytest.approx(3.182446 * 1.290994 / 2, rel=1e-5)
    assert interval([5.0]) is None and interval([]) is None
    assert interval([2.0, 2.0, 2.0]) == Interval(2.0, 2.0, 2.0, 3)


def _run(server: str, rps: float, p95: float, value: float = 8, failed: int = 0) -> LevelResult:
    lv = LevelResult(server, CONCURRENCY, value, num_sent=10 + failed, completed=10, failed=failed, rps=rps,
                     output_tps=rps * 50, duration_s=10 / rps)
    lv.e2e = Stats(10, p95 / 2, p95 / 2, p95, p95)
    lv.ttft = Stats(10, p95 / 10, p95 / 10, p95 / 5, p95 / 5)
    return lv


def test_combine_sums_counts_and_means_figures():
    runs = [_run("a", 10, 1.0), _run("a", 12, 1.2, failed=1), _run("a", 14, 1.4)]
    level = combine(runs)
    assert level.num_runs == 3 and level.num_sent == 31 and level.completed == 30 and level.failed == 1
    assert level.rps == pytest.approx(12) and level.e2e.p95 == pytest.approx(1.2) and level.e2e.n == 30
    assert set(level.intervals) == {"rps", "output_tps", "ttft_p95_s", "e2e_p95_s"}
    assert level.intervals["rps"].mean == pytest.approx(12)
    assert runs[0].num_runs == 1 and not runs[0].intervals  # the runs themselves are left alone
    assert combine(runs[:1]) is runs[0]


def test_overlapping_intervals_are_tied_and_apart_ones_name_the_better_server():
    a = combine([_run("a", 10, 1.0), _run("a", 11, 1.1), _run("a", 12, 1.2)])
    close = combine([_run("b", 10.5, 1.05), _run("b", 11.5, 1.15), _run("b", 12.5, 1.25)])
    far = combine([_run("b", 30, 0.3), _run("b", 31, 0.31), _run("b", 32, 0.32)])
    assert compare(a, close, "rps") == "tied" and compare(a, close, "e2e_p95_s") == "tied"
    assert compare(a, far, "rps") == "b" and compare(a, far, "e2e_p95_s") == "b"  # lower latency is better
    assert compare(far, a, "e2e_p95_s") == "a"
    assert compare(_run("a", 1, 1), _run("b", 2, 2), "rps") is None  # one run each: no interval

    runs = [ServerRun("a", "http://a", levels=[a]), ServerRun("b", "http://b", levels=[far])]
    v = verdict(runs, 2.0, 0.1)
    assert "req/s (95% intervals over 3 runs): b better at c=8" in v["summary"]
    tied = verdict([runs[0], ServerRun("b", "http://b", levels=[close])], 2.0, 0.1)
    assert "req/s (95% intervals over 3 runs): tied at c=8" in tied["summary"]
    (record, *_) = tied["sweeps"][CONCURRENCY]["comparisons"]
    assert record["result"] == "tied" and record["a"].n == 3
    result = BenchResult("now", "cmd", {}, {}, runs, v)
    assert json.loads(result.to_json())["verdict"]["sweeps"][CONCURRENCY]["comparisons"][0]["b"]["n"] == 3
    table, _ = report.terminal_tables(result)
    assert table.row_count == 2
    rps_cells = list(table.columns[[c.header for c in table.columns].index("req/s")].cells)
    assert str(rps_cells[0]).startswith("11.00 ±")


def test_each_run_of_a_level_takes_fresh_prompts():
    work = wl.Workload("w", 0, [wl.BenchRequest(f"p{i}", 2) for i in range(40)])
    params = SweepParams(requests_per_level=5, repeat=3)
    assert level_offsets(work, [(CONCURRENCY, 1.0), (CONCURRENCY, 2.0)], params) == [[0, 5, 10], [15, 20, 25]]


def test_a_repeated_sweep_runs_each_level_n_times_and_reports_one_level():
    work = wl.generate(wl.WorkloadPlan("short-chat", 40, 1, output_override=wl.Range(3, 3)),
                       wl.WordCosts.approximate())
    params = SweepParams(requests_per_level=4, repeat=3, sample_interval_s=0, client_workers=1)
    with FastStandIn() as server:
        levels, _ = asyncio.run(run_sweep(Target("s", server.url, "standin"), work, [(CONCURRENCY, 2.0)],
                                          params, Observer()))
        prompts = server.prompts
    (level,) = levels
    assert level.num_runs == 3 and level.completed == 12 and "rps" in level.intervals
    assert prompts == {r.prompt: 1 for r in work.requests[:12]}


def test_repeat_must_be_positive():
    result = CliRunner().invoke(app, ["bench", "--url", "http://x:1", "--repeat", "0"])
    assert result.exit_code == 2 and "--repeat" in result.output
