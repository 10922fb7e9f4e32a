"""Bench's load from several worker processes: the schedule split without changing it, and every
request of a level sent once and merged back into the level's records (against the fast
stand-in, `tests/fast_standin.py`, over real HTTP)."""

from __future__ import annotations

import asyncio
import itertools

import pytest

from proxima.bench import workload as wl
from proxima.bench.drive import arrival_offsets
from proxima.bench.results import CONCURRENCY, RATE
from proxima.bench.runner import client_notes
from proxima.bench.sweep import Observer, SweepParams, Target, run_sweep
from proxima.bench.workers import STREAMS_PER_WORKER, available_cores, client_workers, plan_workers, split
from proxima.streaming import OK
from tests.fast_standin import FastStandIn


def _work(n: int) -> wl.Workload:
    return wl.generate(wl.WorkloadPlan("short-chat", n, 5, output_override=wl.Range(4, 12)),
                       wl.WordCosts.approximate())


def _plan(num_workers: int, kind: str, value: float, n: int = 50, offset: int = 7, count: int | None = 30,
          duration_s: float | None = None):
    return plan_workers(num_workers, kind, value, _work(n).requests, offset, count, duration_s, seed=3,
                        url="http://x", model="m", request_timeout_s=5.0, api_key=None)


def test_split_and_default_worker_count():
    assert split(10, 3) == [4, 3, 3] and split(2, 2) == [1, 1] and sum(split(257, 5)) == 257
    cores = available_cores()
    assert client_workers(None, CONCURRENCY, STREAMS_PER_WORKER) == 1
    assert client_workers(None, CONCURRENCY, 256) == min(max(1, cores // 2), 11)
    assert client_workers(None, CONCURRENCY, 10_000) == max(1, cores // 2)  # half the cores at most
    assert client_workers(4, CONCURRENCY, 2) == 2  # never more than a closed loop's streams
    assert client_workers(3, RATE, 0.5) == 3 and client_workers(1, CONCURRENCY, 256) == 1


def test_closed_loop_shares_split_the_concurrency():
    specs = _plan(3, CONCURRENCY, 8)
    assert [s.concurrency for s in specs] == [3, 3, 2]
    assert all(s.offset == 7 and s.count == 30 and not s.arrivals for s in specs)


@pytest.mark.parametrize(("count", "duration_s"), [(30, None), (None, 0.5), (30, 0.2)])
def test_open_loop_arrivals_are_the_one_process_schedule_dealt_out(count, duration_s):
    rate = 40.0
    specs = _plan(3, RATE, rate, count=count, duration_s=duration_s)
    merged = sorted(a for s in specs for a in s.arrivals)
    times = arrival_offsets(3, rate)
    if duration_s is not None:
        times = itertools.takewhile(lambda at: at < duration_s, times)
    expected = [(at, (7 + k) % 50) for k, at in enumerate(itertools.islice(times, count))]
    assert merged == expected
    assert max(len(s.arrivals) for s in specs) - min(len(s.arrivals) for s in specs) <= 1


class _Recorder(Observer):
    def __init__(self) -> None:
        self.results = []

    def request_done(self, target, result) -> None:
        self.results.append(result)


@pytest.mark.parametrize(("kind", "value"), [(CONCURRENCY, 8.0), (RATE, 400.0)])
def test_workers_send_each_request_once_and_merge_every_record(kind, value):
    n = 60
    work = _work(n)
    params = SweepParams(requests_per_level=n, slo_p95_s=30.0, request_timeout_s=20.0, sample_interval_s=0,
                         client_workers=3)
    recorder = _Recorder()
    with FastStandIn(itl_s=0.001) as server:
        target = Target("standin", server.url, "standin", local=True)
        (level,), stopped = asyncio.run(run_sweep(target, work, [(kind, value)], params, recorder))
        prompts = server.prompts
    assert stopped is None and level.aborted is None
    assert level.client_workers == 3 and len(level.client_cpu_by_process) == 4
    assert level.num_sent == level.completed == n and level.failed == level.cancelled == 0
    assert sorted(r.index for r in recorder.results) == list(range(n))
    assert all(r.status == OK and r.output_tokens == work.requests[r.index].max_tokens
               for r in recorder.results)
    assert level.output_tokens == sum(r.max_tokens for r in work.requests)
    assert prompts == {r.prompt: 1 for r in work.requests}  # the server saw each request once
    assert level.peak_in_flight >= 2 and level.rps > 0


def test_a_busy_client_is_named_the_limit_with_the_fix():
    from proxima.bench.results import BenchResult, LevelResult, ServerRun

    level = LevelResult("a", CONCURRENCY, 256, client_workers=1, client_cpu=0.95,
                        client_cpu_by_process=[0.95])
    fine = LevelResult("a", CONCURRENCY, 8, client_workers=1, client_cpu=0.2, client_cpu_by_process=[0.2])
    result = BenchResult("now", "cmd", {}, {}, [ServerRun("a", "http://a", levels=[fine, level])])
    (note,) = client_notes(result)
    assert "the client was the limit at c=256 " in note and "c=8" not in note
    assert ("raise --client-workers" in note) == (available_cores() > 1)


def test_late_wakeups_of_idle_workers_are_named_a_shared_host_not_a_busy_client():
    from proxima.bench.results import BenchResult, LevelResult, ServerRun

    level = LevelResult("a", CONCURRENCY, 512, client_workers=2, client_cpu=0.22,
                        client_cpu_by_process=[0.05, 0.22, 0.2], client_loop_lag_p99_s=0.022)
    result = BenchResult("now", "cmd", {}, {}, [ServerRun("a", "http://a", levels=[level])])
    (note,) = client_notes(result)
    assert "waited for a CPU at c=512" in note and "lag p99 22 ms" in note and "busiest at 22%" in note
    assert "the client was the limit" not in note


def test_an_avalanche_seen_by_the_parent_stops_every_worker_and_loses_nothing():
    from proxima.server_process import free_port

    n = 5000
    params = SweepParams(requests_per_level=n, max_error_rate=0.1, min_samples=10, request_timeout_s=5.0,
                         sample_interval_s=0, client_workers=2)
    recorder = _Recorder()
    target = Target("gone", f"http://127.0.0.1:{free_port()}", "m")  # every request refused
    (level,), stopped = asyncio.run(run_sweep(target, _work(50), [(CONCURRENCY, 8.0)], params, recorder))
    assert level.aborted and "error rate" in level.aborted and "connection refused" in level.aborted
    assert 10 <= level.num_sent < n
    assert level.num_sent == level.completed + level.failed + level.timed_out + level.cancelled
    assert len(recorder.results) == level.failed  # every finished request reported once


def test_records_of_a_worker_that_died_are_failed_with_the_reason_not_lost():
    from proxima.bench.sweep import _LevelState
    from proxima.bench.workers import FINISHED, STARTED, _Merge
    from proxima.streaming import FAILED, RequestResult

    async def scenario():
        state = _LevelState(SweepParams(min_samples=100), total=10)
        recorder = _Recorder()
        merge = _Merge(state, recorder, None)
        done = RequestResult(3, OK, 1.0, ttft=0.1, e2e=0.2, output_tokens=4)
        merge.take(0, [(STARTED, 0, (3, 1.0)), (STARTED, 1, (4, 1.1)), (FINISHED, 0, done)])
        merge.take(1, [(STARTED, 0, (5, 1.2))])
        assert len(state.in_flight) == 2 and state.peak_in_flight == 2
        merge.lost(0, "client worker 0 exited (code -9)")
        assert [(r.index, r.status) for r in state.results] == [(3, OK), (4, FAILED), (5, "cancelled")]
        assert state.results[1].error == "client worker 0 exited (code -9)" and len(state.in_flight) == 1
        assert state.results[0].output_tokens == 4 and [r.index for r in recorder.results] == [3, 4]

    asyncio.run(scenario())
