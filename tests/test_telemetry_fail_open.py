"""Telemetry fails open: a sink that raises costs its own figures, never the engine.

vLLM's engine busy loop treats an exception from the scheduler as fatal, and the scheduler calls
the sinks inline; so every sink call must be caught, counted (proxima_telemetry_errors_total) and
logged at most once per interval.
"""

from __future__ import annotations

import logging
import textwrap

import httpx
import pytest
from prometheus_client import CollectorRegistry

from proxima.metrics import catalog as c
from proxima.metrics.kv_stats import KVStats
from proxima.metrics.prometheus import PrometheusKVExporter
from proxima.metrics.sink import FailOpenSinks
from proxima.metrics.sink import logger as sink_logger
from proxima.scrape import parse_metrics
from proxima.server_process import ManagedServer, ServerSpec
from tests.conftest import SERVER_ARGS

STATS = KVStats(allocator="token", granularity=1, slots_total=64, slots_used=10, slots_cached=0,
                live_tokens=10, requests_holding_slots=1, reference_block=16, reference_block_slots=16,
                occupancy=(0.5,), largest_free_run=54)


class RaisingSink:
    def set_static(self, *args) -> None:
        raise RuntimeError("broken exporter")

    observe_latencies = count_preemption = publish = request_finished = set_static


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _errors(registry: CollectorRegistry, sink: str) -> float | None:
    return registry.get_sample_value(c.TELEMETRY_ERRORS.sample_name, {"engine": "0", "sink": sink})


def test_a_raising_sink_is_caught_counted_and_the_next_sink_still_runs():
    registry = CollectorRegistry()
    prom = PrometheusKVExporter(registry)
    clock = Clock()
    sinks = FailOpenSinks(prom.count_telemetry_error, log_interval_s=60.0, clock=clock)
    sinks.add("otlp", RaisingSink())
    sinks.add("prometheus", prom)
    assert _errors(registry, "otlp") == 0.0  # present from the start, so rate() has a first point
    # The sink logs under "vllm.", which vLLM's logging setup (run by any earlier test that
    # imported vLLM) stops from propagating to the root logger: listen on the logger itself.
    records: list[logging.LogRecord] = []
    handler = logging.Handler(logging.ERROR)
    handler.emit = records.append
    sink_logger.addHandler(handler)
    try:
        for _ in range(50):
            for sink in sinks:
                sink.observe_latencies("step", [1e-4])
                sink.publish(STATS)
                sink.count_preemption()
        clock.now = 61.0
        for sink in sinks:
            sink.publish(STATS)
    finally:
        sink_logger.removeHandler(handler)
    assert _errors(registry, "otlp") == 151.0
    assert _errors(registry, "prometheus") == 0.0
    assert sinks.errors == {"otlp": 151}
    # The sink after the broken one saw every call.
    assert registry.get_sample_value(c.SLOTS_USED.name, {"engine": "0"}) == 10.0
    assert registry.get_sample_value(c.PREEMPTIONS.sample_name, {"engine": "0"}) == 50.0
    lines = [r.getMessage() for r in records if "telemetry sink otlp failed" in r.getMessage()]
    assert len(lines) == 2, lines  # once at the first failure, once after the interval
    assert "149 more failures" in lines[1]  # 151 = the two logged + 149 between them
    assert records[0].exc_info is not None and not records[-1].exc_info


def test_a_failing_error_counter_does_not_raise_either():
    def count(_name: str) -> None:
        raise OSError("metrics directory gone")

    sinks = FailOpenSinks(count)
    guarded = sinks.add("prometheus", RaisingSink())
    guarded.publish(STATS)
    guarded.shutdown()  # no shutdown method: nothing to do
    assert sinks.errors == {"prometheus": 1}


# In every process of the server (PYTHONPATH), the Prometheus exporter's publish raises: the
# fault a full disk or a broken metrics directory causes, injected where it is caught.
_SITECUSTOMIZE = textwrap.dedent("""
    from proxima.metrics import prometheus

    def publish(self, stats):
        raise RuntimeError("injected: the metrics directory is not writable")

    prometheus.PrometheusKVExporter.publish = publish
""")


@pytest.mark.engine
def test_server_keeps_answering_when_a_sink_raises_and_counts_it(tiny_model, server_logs, tmp_path):
    (tmp_path / "sitecustomize.py").write_text(_SITECUSTOMIZE)
    log = server_logs / "raising-sink.log"
    spec = ServerSpec(model=tiny_model, variant="token", log_path=log, args=SERVER_ARGS,
                      env={"PYTHONPATH": str(tmp_path)})
    with ManagedServer(spec) as server:
        counts = []
        for _ in range(2):
            for words in (3, 30):
                r = httpx.post(f"{server.url}/v1/completions", timeout=120, json={
                    "model": tiny_model, "prompt": " ".join(["fox"] * words), "max_tokens": 6})
                assert r.status_code == 200, r.text
            snap = parse_metrics(httpx.get(f"{server.url}/metrics", timeout=10).text)
            assert snap.proxima is not None
            counts.append(snap.proxima.telemetry_errors_total)
        assert httpx.get(f"{server.url}/health", timeout=10).status_code == 200
    assert 0 < counts[0] < counts[1], counts
    text = log.read_text(errors="replace")
    assert text.count("telemetry sink prometheus failed in publish") == 1


def test_a_sink_that_takes_steps_gets_them_and_a_late_one_the_static_facts():
    from proxima.metrics.sink import SchedulerStep

    sinks = FailOpenSinks()
    sinks.add("prometheus", RaisingSink()).set_static("token", 1, 1024, 4096)  # raises: counted
    steps = []

    class Recorder:  # what proxima.harness attaches to a running engine
        static = None

        def set_static(self, *facts) -> None:
            self.static = facts

        def step_scheduled(self, step) -> None:
            steps.append(step)
            raise RuntimeError("injected")

    late = Recorder()
    guarded = sinks.add("harness", late)
    assert late.static == ("token", 1, 1024, 4096, "exact")
    assert [s.name for s in sinks.step_sinks] == ["harness"]  # exporters take no step event
    step = SchedulerStep(0.001, 0.0, 2, 0, {"a": 1, "b": 1}, 2)
    for sink in sinks.step_sinks:
        sink.step_scheduled(step)  # must not raise
    assert steps == [step] and sinks.errors == {"prometheus": 1, "harness": 1}
    sinks.remove(guarded)
    assert sinks.step_sinks == [] and len(sinks) == 1


def test_a_failing_kv_state_collection_is_caught_and_counted_as_collect():
    from proxima.engine.kv_manager import OpTimings
    from proxima.engine.scheduler import ProximaScheduler

    class Stand:  # the scheduler's publish path alone: a real scheduler needs a whole engine
        kv_sinks = FailOpenSinks()
        _timings = OpTimings()
        last_kv_stats = None

        def _collect_stats(self):
            raise RuntimeError("injected: a request vanished mid-read")

    stand = Stand()
    ProximaScheduler.publish_kv_telemetry(stand)  # must not raise
    assert stand.kv_sinks.errors == {"collect": 1} and stand.last_kv_stats is None
