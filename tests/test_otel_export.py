"""`proxima serve --otlp-metrics-endpoint`: KV metrics and per-request KV spans reach a real
OTLP/HTTP receiver on loopback, in the real protobuf wire format, with the engine's values."""

from __future__ import annotations

import time

import httpx
import pytest

from proxima.metrics import catalog as c
from proxima.metrics.otel import SPAN_NAME
from proxima.server_process import ManagedServer, ServerSpec
from tests.conftest import SERVER_ARGS
from tests.otlp_receiver import OtlpReceiver

pytestmark = pytest.mark.engine


def _attrs(span) -> dict:
    out = {}
    for kv in span.attributes:
        v = kv.value
        out[kv.key] = v.int_value if v.HasField("int_value") else (
            v.bool_value if v.HasField("bool_value") else v.string_value)
    return out


def _wait_for(predicate, timeout=60.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.5)
    return False


def _last_value(points) -> float | None:
    return (points[-1].as_double or points[-1].as_int) if points else None


def test_metrics_and_request_spans_reach_an_otlp_receiver(tiny_model, server_logs):
    with OtlpReceiver() as receiver:
        spec = ServerSpec(
            model=tiny_model, variant="token", log_path=server_logs / "otel.log",
            args=(*SERVER_ARGS, "--otlp-metrics-endpoint", receiver.url),
            env={"OTEL_METRIC_EXPORT_INTERVAL": "1000", "OTEL_BSP_SCHEDULE_DELAY": "200"},
        )
        with ManagedServer(spec) as server:
            usages = []
            for words in (3, 40, 120):
                r = httpx.post(f"{server.url}/v1/completions", timeout=120, json={
                    "model": tiny_model, "prompt": " ".join(["fox"] * words), "max_tokens": 7,
                    "temperature": 0, "ignore_eos": True})
                assert r.status_code == 200, r.text
                usages.append(r.json()["usage"])
            assert _wait_for(lambda: len(receiver.spans(SPAN_NAME)) >= 3), "no request spans received"
            assert _wait_for(lambda: any(p.as_double or p.as_int
                                         for p in receiver.gauge_points(c.SLOTS_TOTAL.name)))
            # An export after the engine's idle publish (the requests may all finish between two
            # exports, and a server stopped at once may not flush): nothing held any more.
            assert _wait_for(lambda: _last_value(receiver.gauge_points(c.SLOTS_USED.name)) == 0)

        names = receiver.metric_names()
        for spec_ in (c.SLOTS_TOTAL, c.SLOTS_USED, c.FRAGMENTATION, c.TOKEN_USAGE, c.ALLOCATOR_INFO,
                      c.ALLOCATOR_LATENCY, c.BYTES_PER_TOKEN):
            assert spec_.name in names, f"{spec_.name} not exported over OTLP"
        # Default figures are whole blocks: the physical slot map is withheld (docs/security.md).
        assert c.OCCUPANCY_MAP.name not in names
        total = receiver.gauge_points(c.SLOTS_TOTAL.name)[-1]
        assert (total.as_double or total.as_int) == 32 << 10
        # The last export after the requests finished: nothing held.
        used = receiver.gauge_points(c.SLOTS_USED.name)[-1]
        assert (used.as_double or used.as_int) == 0

        spans = sorted(receiver.spans(SPAN_NAME), key=lambda s: _attrs(s)["proxima.request.prompt_tokens"])
        assert len(spans) == 3
        for span, usage in zip(spans, sorted(usages, key=lambda u: u["prompt_tokens"])):
            a = _attrs(span)
            assert a["proxima.request.prompt_tokens"] == usage["prompt_tokens"]
            assert a["proxima.request.output_tokens"] == usage["completion_tokens"] == 7
            # The last sampled token is never fed back, so its K/V never needs a slot.
            assert a["proxima.kv.slots_peak"] == usage["prompt_tokens"] + 7 - 1
            assert a["proxima.kv.preempted"] is False
            assert span.end_time_unix_nano > span.start_time_unix_nano
