"""`proxima bench` against real vLLM servers on loopback (tiny model, CPU).

- the client's counts agree with the server's own counters (scraped independently here);
- a request the server rejects is a failed request with the server's reason;
- `--launch` brings up block then token, one after the other, and compares them; the token
  server, bench's own ManagedServer, is killed in the middle of a level and is reported (failed
  requests, an aborted level, higher levels not run), never a crash. One launch serves both
  tests: server starts are the slow part on CPU.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from typer.testing import CliRunner

from proxima.bench import report
from proxima.bench import workload as wl
from proxima.bench.plan import BenchPlan, LaunchPlan
from proxima.bench.results import CONCURRENCY
from proxima.bench.runner import run_bench
from proxima.bench.sweep import Observer, SweepParams, levels_to_run
from proxima.cli.main import app
from proxima.scrape import scrape_sync
from proxima.streaming import OK
from tests.conftest import SERVER_ARGS

pytestmark = pytest.mark.engine
runner = CliRunner()


def test_sweep_agrees_with_the_servers_counters(proxima_server, tmp_path):
    out = tmp_path / "out"
    before = scrape_sync(proxima_server.url)
    result = runner.invoke(app, [
        "bench", "--url", proxima_server.url, "-c", "1,4", "--rate", "20", "-n", "8",
        "--prompt-tokens", "20-60", "--max-tokens", "16", "--sample-interval", "0.1", "--out", str(out),
    ])
    after = scrape_sync(proxima_server.url)
    assert result.exit_code == 0, result.output
    assert before.ok and after.ok

    data = json.loads((out / "results.json").read_text())
    (run,) = data["runs"]
    assert run["allocator"] == "token" and run["label"] == "token"
    levels = run["levels"]
    expected = [("concurrency", 1), ("concurrency", 4), ("rate", 20)]
    assert [(lv["kind"], lv["value"]) for lv in levels] == expected
    sent = [json.loads(line) for line in (out / "workload.jsonl").read_text().splitlines()]
    assert data["workload"]["token_counting"] == wl.SERVER_TOKENIZER
    for lv in levels:
        assert (lv["completed"], lv["failed"], lv["timed_out"], lv["aborted"]) == (8, 0, 0, None)
        assert lv["output_tokens"] == 8 * 16  # ignore_eos: exactly max_tokens each
        # Per level, the bench's own before/after scrape of the server agrees with the client.
        assert lv["server_requests_finished"] == lv["completed"]
        assert lv["server_generation_tokens"] == lv["output_tokens"]
        assert lv["server_prompt_tokens"] == lv["prompt_tokens"]
        assert 0 < lv["ttft"]["p50"] <= lv["e2e"]["p50"]
        assert 0 < lv["itl"]["p50"] and 0 < lv["tpot"]["p50"] < lv["e2e"]["p50"]
        assert lv["e2e"]["p50"] <= lv["e2e"]["p95"] <= lv["e2e"]["p99"]
        assert lv["rps"] > 0 and lv["output_tps"] > lv["rps"]
        assert lv["peak_gpu_memory_bytes"] is None  # no NVML here: N/A, not zero
        assert lv["timeline"] and lv["peak_kv_usage"] is not None and lv["peak_fragmentation"] is not None
        if lv["kind"] == "concurrency":
            assert lv["peak_in_flight"] == lv["value"]
        assert lv["client_cpu"] > 0

    # Totals against this test's own scrape of the server's counters: the levels' requests and
    # the 8 unmeasured warm-up requests (bench's default --warmup) sent before the first level.
    assert data["config"]["warmup_requests"] == 8 and run["warmup_failed"] == 0
    completed = sum(lv["completed"] for lv in levels)
    assert after.requests_finished_total - before.requests_finished_total == completed + 8 == 24 + 8
    generated = sum(lv["output_tokens"] for lv in levels)
    assert after.generation_tokens_total - before.generation_tokens_total == generated + 8 * 16
    prompt_total = sum(lv["prompt_tokens"] for lv in levels)
    warmup_prompts = run["warmup_prompt_tokens"]
    assert warmup_prompts > 0
    assert after.prompt_tokens_total - before.prompt_tokens_total == prompt_total + warmup_prompts
    # The prompt lengths the workload recorded (server /tokenize) are the ones the server saw.
    assert sum(r["prompt_tokens"] for r in sent) == prompt_total
    assert all(20 <= r["prompt_tokens"] <= 60 and r["max_tokens"] == 16 for r in sent)

    assert len((out / "results.csv").read_text().strip().splitlines()) == 1 + 3
    page = (out / "report.html").read_text()
    assert page.count("<svg") >= 7 and "KV cache occupancy over time" in page
    assert "within P95 E2E <= 2s" in result.output and "Concurrency sweep" in result.output


def test_a_rejected_request_is_a_failure_with_the_servers_reason(proxima_server, tmp_path):
    path = tmp_path / "w.jsonl"
    too_long = " ".join(["memory"] * 3000)  # beyond --max-model-len 1024
    path.write_text("\n".join(json.dumps(r) for r in (
        {"prompt": "the cache", "max_tokens": 4}, {"prompt": too_long, "max_tokens": 4},
        {"prompt": "free slots", "max_tokens": 4})) + "\n")
    plan = BenchPlan(wl.WorkloadPlan(str(path), 3), levels_to_run([1], []),
                     SweepParams(requests_per_level=3, max_error_rate=0.5, sample_interval_s=0.2),
                     urls=[proxima_server.url], labels=["p"])
    result, work = run_bench(plan, Observer())
    (level,) = result.runs[0].levels
    assert (level.completed, level.failed, level.aborted) == (2, 1, None)
    (message,) = level.errors
    assert message.startswith("HTTP 400") and "1024" in message
    assert work.token_counting == wl.SERVER_TOKENIZER and work.requests[1].prompt_tokens >= 3000


class _Order(Observer):
    def __init__(self) -> None:
        self.started: list[tuple[str, float]] = []

    def level_started(self, target, kind, value, total) -> None:
        self.started.append((target.label, value))


def test_two_servers_take_turns_level_by_level_on_the_same_requests(proxima_server):
    """Two URLs (here one server under two names, to start no other): A, B, A, B, same prompts."""
    order = _Order()
    plan = BenchPlan(wl.WorkloadPlan("short-chat", 12, prompt_override=wl.Range(10, 30),
                                     output_override=wl.Range(4, 4)),
                     levels_to_run([1, 2], []), SweepParams(requests_per_level=3, sample_interval_s=0),
                     urls=[proxima_server.url, proxima_server.url], labels=["x", "y"])
    result, _ = run_bench(plan, order)
    assert order.started == [("x", 1), ("y", 1), ("x", 2), ("y", 2)]
    x, y = result.runs
    assert [lv.prompt_tokens for lv in x.levels] == [lv.prompt_tokens for lv in y.levels]
    assert x.levels[0].prompt_tokens != x.levels[1].prompt_tokens  # each level its own prompts
    assert all(lv.completed == 3 and lv.timeline == [] for lv in x.levels + y.levels)  # sampling off
    assert (x.kv_block_size, x.allocator) == (1, "token") and x.kv_capacity_tokens > 0


class _KillAfter(Observer):
    """Kills one server (SIGKILL to its process group, as a crash would) after `n` completions."""

    def __init__(self, label: str, n: int) -> None:
        self.label, self.n, self.done, self.killed_pid = label, n, 0, None

    def request_done(self, target, result) -> None:
        if target.label != self.label:
            return
        self.done += result.status == OK
        if self.done >= self.n and self.killed_pid is None:
            self.killed_pid = target.pid
            os.killpg(target.pid, signal.SIGKILL)


@pytest.fixture(scope="module")
def launched_ab(tiny_model, tmp_path_factory):
    """One `--launch` A/B (block, then token; two server starts), token killed in its first level."""
    logs = tmp_path_factory.mktemp("bench-launch-logs")
    observer = _KillAfter("token", 6)
    plan = BenchPlan(
        wl.WorkloadPlan("short-chat", 240, prompt_override=wl.Range(20, 40),
                        output_override=wl.Range(32, 32)),
        levels_to_run([2, 4], []),
        SweepParams(requests_per_level=60, request_timeout_s=30, sample_interval_s=0.2),
        launch=LaunchPlan(tiny_model, ("block", "token"), ("block", "token"), SERVER_ARGS, log_dir=logs),
        check_answers=True, warmup=4,
    )
    result, work = run_bench(plan, observer)
    return result, work, observer


def test_launch_runs_block_then_token_with_the_same_flags(launched_ab, tmp_path):
    result, work, _ = launched_ab
    block, token = result.runs
    assert (block.label, block.allocator, block.variant) == ("block", "block", "block")
    assert (token.label, token.allocator, token.variant) == ("token", "token", "token")
    # One after the other: the first was stopped before the second started.
    assert block.launch["stopped_at"] <= token.launch["started_at"]
    assert result.config["launch"]["vllm_args"] == list(SERVER_ARGS)
    assert [lv.completed for lv in block.levels] == [60, 60]
    assert [lv.server_requests_finished for lv in block.levels] == [60, 60]
    assert [lv.server_generation_tokens for lv in block.levels] == [60 * 32, 60 * 32]
    assert block.stopped is None
    # Warm-up and --check-answers requests went first and count in no level (the counts above).
    assert result.config["warmup_requests"] == 4 and block.warmup_failed == 0
    for run in (block, token):
        assert Path(run.launch["log"]).exists()
        with pytest.raises(httpx.HTTPError):
            httpx.get(run.url + "/health", timeout=2)  # both stopped at the end
    written = report.write_outputs(result, work, tmp_path / "out")
    page = (tmp_path / "out" / "report.html").read_text()
    assert (tmp_path / "out" / "report.html") in written and "block" in page and "token" in page


def test_check_answers_finds_the_float32_servers_answer_alike(launched_ab, tmp_path):
    """--check-answers: 120 greedy answers from each server before its sweep (the token server was
    killed only later, in its first level); float32, same weights: every answer identical."""
    result, _, _ = launched_ab
    (check,) = result.answer_check
    assert (check["reference"], check["test"], check["num_prompts"]) == ("block", "token", 120)
    assert (check["identical"], check["near_ties"], check["drift"], check["differ"], check["failed"]) \
        == (120, 0, 0, 0, 0)
    assert check["kv_dtypes"] == ["auto", "auto"] and not check["expected_to_differ"]
    assert check["examples"] == []
    assert "answers, token against block: 120/120 greedy answers identical" in " ".join(result.notes)
    assert json.loads(result.to_json())["answer_check"] == result.answer_check


def test_a_server_killed_mid_level_is_reported_not_crashed_on(launched_ab):
    result, _, observer = launched_ab
    token = result.runs[1]
    assert observer.killed_pid is not None
    (level,) = token.levels  # c=4 was not run
    assert (level.kind, level.value) == (CONCURRENCY, 2)
    assert level.completed >= 6 and level.failed > 0
    assert level.completed + level.failed + level.timed_out + level.cancelled == level.num_sent < 60
    assert "error rate" in level.aborted and "server unreachable" in level.aborted
    assert level.server_requests_finished is None  # no after-scrape from a dead server
    assert "server unreachable" in token.stopped
    summary = " ".join(result.verdict["summary"])
    assert "token: meets P95 E2E <= 2s at no tested level; breaks at c=2: stopped early" in summary
    assert "only block meets the SLO" in summary



def test_an_interrupted_bench_writes_the_levels_that_finished(proxima_server, tmp_path):
    """SIGTERM (what Ctrl-C or a job timeout sends) in the middle of the second level: the first
    level's figures are written and shown, the run exits 130. A real CLI process, a real signal."""
    out = tmp_path / "out"
    def finished() -> float:
        return scrape_sync(proxima_server.url).requests_finished_total

    start = finished()
    proc = subprocess.Popen(
        [sys.executable, "-m", "proxima.cli.main", "bench", "--url", proxima_server.url, "-c", "1",
         "--rate", "0.05", "-n", "4", "--prompt-tokens", "10-30", "--max-tokens", "800",
         "--sample-interval", "0",
         "--warmup", "0", "--out", str(out)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    try:
        # On two loaded cores a scrape may not be answered until the streams it queued behind end,
        # so the server is only seen reliably between levels. Level 2 sends four requests at
        # 0.05 req/s (about a minute of arrivals): once level 1's four are counted, a signal a
        # second later lands in level 2 however late that scrape was answered. (A second
        # concurrency level lasted as long as the first, and a late scrape once let it finish.)
        deadline = time.monotonic() + 120
        while finished() < start + 4 and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(1.0)
        proc.send_signal(signal.SIGTERM)
        stdout, stderr = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 130, stderr
    assert "interrupted" in stderr and "written" in stderr
    data = json.loads((out / "results.json").read_text())
    (run,) = data["runs"]
    assert [(lv["value"], lv["completed"]) for lv in run["levels"]] == [(1, 4)]
    assert run["stopped"] == "interrupted after c=1"
    assert data["notes"][0].startswith("Interrupted")
    assert "c=1" in stdout  # the finished level's table is shown too


def test_multi_turn_resends_each_answer_and_the_token_cache_serves_it(proxima_server, tmp_path):
    out = tmp_path / "out"
    result = runner.invoke(app, [
        "bench", "--url", proxima_server.url, "-c", "2", "-n", "2", "--workload", "multi-turn",
        "--prompt-tokens", "10-20", "--max-tokens", "8", "--out", str(out),
    ])
    assert result.exit_code == 0, result.output
    (level,) = json.loads((out / "results.json").read_text())["runs"][0]["levels"]
    # Two conversations of four turns, each turn sent after the previous answer came back.
    assert (level["num_sent"], level["completed"], level["failed"]) == (8, 8, 0)
    assert level["server_requests_finished"] == 8
    # Every later turn resends the system prompt and the conversation so far: most of what the
    # server looks up is served from its token-exact prefix cache.
    assert level["prefix_cache_hit_rate"] > 0.5
    rows = [json.loads(line) for line in (out / "workload.jsonl").read_text().splitlines()]
    assert all(len(r["followups"]) == 3 for r in rows)
