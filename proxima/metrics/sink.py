"""The interface every KV telemetry sink implements (Prometheus, OpenTelemetry, the engine
harness's recorder), and the fail-open front through which the scheduler calls them.

The scheduler calls each sink at each publish (`publish`, and `observe_latencies` with the
scheduler step times and allocator calls timed since the last publish: every step when
PROXIMA_TELEMETRY_INTERVAL_S is 0, else at most once per interval while busy and always on an
idle step), per preemption and per finished request; sinks never call back into it. A sink that
also defines `step_scheduled` (`StepSink`: recorders, not exporters) gets every scheduler step
as it returns, after that step's publish; the scheduler builds the step's facts only when such a
sink is attached, so serving pays nothing for the event.

Telemetry fails open: these calls run inside vLLM's engine busy loop, which treats any exception
as fatal and stops serving. `FailOpenSinks` hands the scheduler guarded sinks that catch every
exception, count it (proxima_telemetry_errors_total{sink}) and log it at most once per
`log_interval_s` per sink, so a broken exporter costs its metrics, never the server.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
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


@dataclass(frozen=True, slots=True)
class SchedulerStep:
    """One call of the scheduler's `schedule()`, as it returned.

    `num_scheduled_tokens` is vLLM's own map in the step's output (request id -> tokens scheduled
    this step), not a copy: read it during the call, never keep it."""

    seconds: float  # wall time of vLLM's schedule() itself
    telemetry_seconds: float  # collecting and exporting KV telemetry after it (0: no publish)
    num_running: int  # requests running once the step is scheduled
    num_waiting: int
    num_scheduled_tokens: Mapping[str, int]
    total_num_scheduled_tokens: int


class StepSink(Protocol):
    """The optional per-step event (see the module docstring)."""

    def step_scheduled(self, step: SchedulerStep) -> None: ...


class FailOpenSinks:
    """The scheduler's sinks, each behind a guard; iterate to get the guarded sinks.

    `count_error(sink_name)` records one failure (the Prometheus exporter's counter); it is
    guarded too, since the sink that failed may be the one that counts.
    """

    def __init__(self, count_error: Callable[[str], None] | None = None,
                 log_interval_s: float = DEFAULT_LOG_INTERVAL_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._sinks: list[GuardedSink] = []
        # The sinks that take every step; empty while serving, so the scheduler skips the event.
        self.step_sinks: list[GuardedSink] = []
        # What set_static last said, for a sink added later (a recorder attached to a running engine).
        self.static: tuple[str, int, int, int, str] | None = None
        self._count_error = count_error
        self._log_interval_s = log_interval_s
        self._clock = clock
        self.errors: dict[str, int] = {}  # failures per sink name since start
        self._logged_at: dict[str, float] = {}
        self._unlogged: dict[str, int] = {}

    def add(self, name: str, sink: KVTelemetrySink) -> GuardedSink:
        """Guard and attach `sink`; one added after start-up gets the static facts at once."""
        guarded = GuardedSink(name, sink, self)
        self._sinks.append(guarded)
        if hasattr(sink, "step_scheduled"):
            self.step_sinks.append(guarded)
        if self.static is not None:
            guarded.set_static(*self.static)
        return guarded

    def remove(self, guarded: GuardedSink) -> None:
        """Detach a sink `add` returned (a recorder whose run is over)."""
        self._sinks.remove(guarded)
        if guarded in self.step_sinks:
            self.step_sinks.remove(guarded)

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
    """One sink whose every call fails open (see `FailOpenSinks`)."""

    __slots__ = ("name", "sink", "_owner")

    def __init__(self, name: str, sink: KVTelemetrySink, owner: FailOpenSinks) -> None:
        self.name, self.sink, self._owner = name, sink, owner

    def set_static(self, allocator: str, granularity: int, bytes_per_token: int, cache_bytes: int,
                   kv_figures: str = "exact") -> None:
        self._owner.static = (allocator, granularity, bytes_per_token, cache_bytes, kv_figures)
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

    def step_scheduled(self, step: SchedulerStep) -> None:
        try:
            self.sink.step_scheduled(step)
        except Exception as err:  # noqa: BLE001
            self._owner.failed(self.name, "step_scheduled", err)

    def shutdown(self) -> None:
        shutdown = getattr(self.sink, "shutdown", None)
        if shutdown is None:
            return
        try:
            shutdown()
        except Exception as err:  # noqa: BLE001
            self._owner.failed(self.name, "shutdown", err)
