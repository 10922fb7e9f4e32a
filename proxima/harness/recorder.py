"""What an engine reported while it ran, kept step by step for scripts and tests.

Layer: tools. `EngineRecorder` is a KV telemetry sink (proxima/metrics/sink.py) that the harness
attaches to an in-process engine's scheduler: it takes the per-step event (`step_scheduled`), the
preemptions and, on Proxima's schedulers, the published KV figures and allocator timings. It
never calls back into the engine. Its cost per step is one small record (the step event is built
only because it listens; a serving engine builds none).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from proxima.metrics.kv_stats import KVStats
from proxima.metrics.otel_env import RequestKVFacts
from proxima.metrics.sink import SchedulerStep


@dataclass(frozen=True, slots=True)
class StaticFacts:
    allocator: str
    granularity: int
    bytes_per_token: int
    cache_bytes: int
    kv_figures: str = "exact"


@dataclass(frozen=True, slots=True)
class StepRecord:
    """One scheduler step: its timings and counts, and what the engine published in it."""

    seconds: float  # vLLM's schedule() itself
    telemetry_seconds: float  # collecting and exporting KV telemetry after it
    num_running: int
    num_waiting: int
    num_scheduled_tokens: int  # every token the step computes (prefill, recompute, decode)
    preemptions: int  # during this step
    allocator_seconds: float  # allocate and free calls timed since the previous step (token slots)
    kv: KVStats | None  # the KV figures published in this step; None when it published none
    started: float = 0.0  # time.perf_counter() at the step's event: the next one's, less this, is its period


class EngineRecorder:
    """A sink keeping every step, preemption and KV publication (`reset` starts a new run).

    `listeners` are called with each raw `SchedulerStep` (its request map is live only during the
    call). A listener's or the recorder's own error is kept and raised by `check`, never lost in
    the fail-open guard's log."""

    def __init__(self) -> None:
        self.static: StaticFacts | None = None
        self.listeners: list[Callable[[SchedulerStep], None]] = []
        self.failure: BaseException | None = None
        self.reset()

    def reset(self) -> None:
        self.steps: list[StepRecord] = []
        self.preemptions = 0
        self.last_kv: KVStats | None = None
        self._kv: KVStats | None = None
        self._step_preemptions = 0
        self._allocator_seconds = 0.0

    def check(self) -> None:
        """Raise what went wrong inside the engine's calls, if anything did."""
        failure, self.failure = self.failure, None
        if failure is not None:
            raise RuntimeError(f"the engine recorder failed during the run: {failure!r}") from failure

    # -- the sink protocol --------------------------------------------------------------------

    def set_static(self, allocator: str, granularity: int, bytes_per_token: int, cache_bytes: int,
                   kv_figures: str = "exact") -> None:
        self.static = StaticFacts(allocator, granularity, bytes_per_token, cache_bytes, kv_figures)

    def observe_latencies(self, op: str, seconds: Sequence[float]) -> None:
        if op != "step":  # step times come with the step event itself
            self._allocator_seconds += sum(seconds)

    def count_preemption(self) -> None:
        self.preemptions += 1
        self._step_preemptions += 1

    def publish(self, stats: KVStats) -> None:
        self.last_kv = self._kv = stats

    def request_finished(self, facts: RequestKVFacts) -> None:
        pass  # sent only with OTLP export on; the caller has the request outputs

    def step_scheduled(self, step: SchedulerStep) -> None:
        try:
            self.steps.append(StepRecord(
                step.seconds, step.telemetry_seconds, step.num_running, step.num_waiting,
                step.total_num_scheduled_tokens, self._step_preemptions, self._allocator_seconds,
                self._kv, time.perf_counter()))
            self._kv, self._step_preemptions, self._allocator_seconds = None, 0, 0.0
            for listener in self.listeners:
                listener(step)
        except Exception as err:  # noqa: BLE001 (kept for check(): the guard would only log it)
            if self.failure is None:
                self.failure = err

    # -- summaries ----------------------------------------------------------------------------

    def running_mean(self) -> float:
        """Mean running requests over the steps that ran any (0 without such a step)."""
        busy = [s.num_running for s in self.steps if s.num_running]
        return statistics.fmean(busy) if busy else 0.0

    def running_mean_while_waiting(self) -> tuple[float, int]:
        """Mean running requests over the steps that left requests waiting, and how many there
        were: what the engine holds while demand exceeds it (a burst's ramp and drain, when no
        request waits, left out). A step budget or ``max_num_seqs`` can make requests wait too."""
        full = [s.num_running for s in self.steps if s.num_waiting and s.num_running]
        return (statistics.fmean(full) if full else 0.0), len(full)

    def step_periods(self, ended: float) -> list[float]:
        """Each step's seconds from its event to the next step's (the last one's: to `ended`, a
        time.perf_counter() reading when the run returned): the engine loop's time for that step,
        host and device, as a run without any profiler sees it."""
        starts = [s.started for s in self.steps]
        return [after - before for before, after in zip(starts, [*starts[1:], ended])]

    def running_peak(self) -> int:
        return max((s.num_running for s in self.steps), default=0)

    def slot_efficiency(self) -> float:
        """Mean over the published steps that held slots of live tokens / slots in use."""
        ratios = [s.kv.live_tokens / s.kv.slots_used for s in self.steps if s.kv and s.kv.slots_used]
        return statistics.fmean(ratios) if ratios else 0.0
