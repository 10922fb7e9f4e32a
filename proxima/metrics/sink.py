"""The interface every KV telemetry sink implements (Prometheus, OpenTelemetry, test recorders).

The scheduler calls each sink at each publish (`publish`, and `observe_latencies` with the
scheduler step times and allocator calls timed since the last publish: every step when
PROXIMA_TELEMETRY_INTERVAL_S is 0, else at most once per interval while busy and always on an
idle step), per preemption and per finished request; sinks never call back into it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from proxima.engine.kv_stats import KVStats
from proxima.metrics.otel_env import RequestKVFacts


class KVTelemetrySink(Protocol):
    def set_static(self, allocator: str, granularity: int, bytes_per_token: int, cache_bytes: int) -> None: ...
    def observe_latencies(self, op: str, seconds: Sequence[float]) -> None: ...
    def count_preemption(self) -> None: ...
    def publish(self, stats: KVStats) -> None: ...
    def request_finished(self, facts: RequestKVFacts) -> None: ...
