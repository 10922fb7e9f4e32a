"""The interface every KV telemetry sink implements (Prometheus, OpenTelemetry, test recorders),
and the fail-open front through which the scheduler calls them.

The scheduler calls each sink at each publish (`publish`, and `observe_latencies` with the
scheduler step times and allocator calls timed since the last publish: every step when
PROXIMA_TELEMETRY_INTERVAL_S is 0, else at most once per interval while busy and always on an
idle step), per preemption and per finished request; sinks never call back into it.

Telemetry fails open: these calls run inside vLLM's engine busy loop, which treats any exception
as fatal and stops serving. `FailOpenSinks` hands the scheduler guarded sinks that catch every
exception, count it (proxima_telemetry_errors_total{sink}) and log it at most once per
`log_interval_s` per sink, so a broken exporter costs its metrics, never the server.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Protocol

from proxima.metrics.kv_stats import KVStats
from proxima.metrics.otel_env import RequestKVFacts

# Under "vllm." so the line lands in the server log with vLLM's own handlers and format.
logger = logging.getLogger(f"vllm.{__name__}")

# A sink failing every step would otherwise write a traceback per step (hundreds a second).
DEFAULT_LOG_INTERVAL_S = 60.0


class KVTelemetrySink(Protocol):
    def set_static(self, allocator: str, granularity: int, bytes_per_token: int,
                   cache_bytes: int, kv_figures: str = "exact") -> None: ...
    def observe_latencies(self, op: str, seconds: Sequence[float]) -> None: ...
    def count_preemption(self) -> None: ...
    def publish(self, stats: KVStats) -> None: ...
    def request_finished(self, facts: RequestKVFacts) -> None: ...


class FailOpenSinks:
    """The scheduler's sinks, each behind a guard; iterate to get the guarded sinks.

    `count_error(sink_name)` records one failure (the Prometheus exporter's counter); it is
    guarded too, since the sink that failed may be the one that counts.
    """

    def __init__(self, count_error: Callable[[str], None] | None = None,
                 log_interval_s: float = DEFAULT_LOG_INTERVAL_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._sinks: list[GuardedSink] = []
        self._count_error = count_error
        self._log_interval_s = log_interval_s
        self._clock = clock
        self.errors: dict[str, int] = {}  # failures per sink name since start
        self._logged_at: dict[str, float] = {}
        self._unlogged: dict[str, int] = {}

    def add(self, name: str, sink: KVTelemetrySink) -> GuardedSink:
        guarded = GuardedSink(name, sink, self)
        self._sinks.append(guarded)
        return guarded

    def append(self, sink: KVTelemetrySink) -> GuardedSink:
        """`add` under the sink's class name (scripts that extend the scheduler's sinks, e.g.
        scripts/gpu/e2e.py's recorder, were written against a list)."""
        return self.add(type(sink).__name__, sink)

    def __iter__(self) -> Iterator[GuardedSink]:
        return iter(self._sinks)

    def __len__(self) -> int:
        return len(self._sinks)

    def failed(self, name: str, call: str, err: BaseException) -> None:
        """Count and (rate-limited) log one failure; never raises."""
        self.errors[name] = self.errors.get(name, 0) + 1
        if self._count_error is not None:
            try:
                self._count_error(name)
            except Exception:  # noqa: BLE001 (the counter's own failure is in the log line below)
                pass
        now = self._clock()
        last = self._logged_at.get(name)
        if last is not None and now - last < self._log_interval_s:
            self._unlogged[name] = self._unlogged.get(name, 0) + 1
            return
        self._logged_at[name] = now
        suppressed = self._unlogged.pop(name, 0)
        logger.error(
            "Proxima: telemetry sink %s failed in %s (%s: %s); serving continues without it%s",
            name, call, type(err).__name__, err,
            f" ({suppressed} more failures since the last report)" if suppressed else "",
            exc_info=last is None,  # the first failure's traceback, once, for the bug report
        )


class GuardedSink:
    """One sink whose every call fails open (see `FailOpenSinks`). No __slots__: a measuring
    script may wrap a guarded sink's methods on the instance (scripts/bench_telemetry_overhead.py)."""

    def __init__(self, name: str, sink: KVTelemetrySink, owner: FailOpenSinks) -> None:
        self.name, self.sink, self._owner = name, sink, owner

    def set_static(self, allocator: str, granularity: int, bytes_per_token: int, cache_bytes: int,
                   kv_figures: str = "exact") -> None:
        try:
            self.sink.set_static(allocator, granularity, bytes_per_token, cache_bytes, kv_figures)
        except Exception as err:  # noqa: BLE001 (fail open: see the module docstring)
            self._owner.failed(self.name, "set_static", err)

    def observe_latencies(self, op: str, seconds: Sequence[float]) -> None:
        try:
            self.sink.observe_latencies(op, seconds)
        except Exception as err:  # noqa: BLE001
            self._owner.failed(self.name, "observe_latencies", err)

    def count_preemption(self) -> None:
        try:
            self.sink.count_preemption()
        except Exception as err:  # noqa: BLE001
            self._owner.failed(self.name, "count_preemption", err)

    def publish(self, stats: KVStats) -> None:
        try:
            self.sink.publish(stats)
        except Exception as err:  # noqa: BLE001
            self._owner.failed(self.name, "publish", err)

    def request_finished(self, facts: RequestKVFacts) -> None:
        try:
            self.sink.request_finished(facts)
        except Exception as err:  # noqa: BLE001
            self._owner.failed(self.name, "request_finished", err)

    def shutdown(self) -> None:
        shutdown = getattr(self.sink, "shutdown", None)
        if shutdown is None:
            return
        try:
            shutdown()
        except Exception as err:  # noqa: BLE001
            self._owner.failed(self.name, "shutdown", err)
