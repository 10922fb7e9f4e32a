"""Scheduler steps and preemptions reported to sinks, for Proxima's scheduler and for stock vLLM.

Layer: plugin (the one place that hooks vLLM). `report_step` turns one `schedule()` call into the
sinks' `SchedulerStep` event; `ProximaScheduler` calls it after its own telemetry.
`ObservedScheduler` is vLLM's scheduler with nothing changed (its block manager, its prefix
cache, no Proxima telemetry) but the same two reports, so that an engine harness records what a
stock engine did through the same sink protocol as Proxima's, instead of wrapping the
scheduler's methods from outside. It is chosen with `--scheduler-cls` (vLLM's extension point);
`proxima.harness` does that for its `stock` variant.
"""

from __future__ import annotations

import time

from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.sched.scheduler import Scheduler

from proxima.metrics.sink import FailOpenSinks, SchedulerStep

OBSERVED_SCHEDULER_CLS = "proxima.engine.observed.ObservedScheduler"


def report_step(scheduler: Scheduler, sinks: FailOpenSinks, output, seconds: float,
                telemetry_seconds: float = 0.0) -> None:
    """Hand one step to the sinks that take steps (none while serving: then nothing is built)."""
    if not sinks.step_sinks:
        return
    num_running, num_waiting = scheduler.get_request_counts()
    step = SchedulerStep(seconds, telemetry_seconds, num_running, num_waiting,
                         output.num_scheduled_tokens, output.total_num_scheduled_tokens)
    for sink in sinks.step_sinks:
        sink.step_scheduled(step)


class ObservedScheduler(Scheduler):
    """vLLM's scheduler, unchanged, reporting each step and preemption to `kv_sinks`."""

    def __new__(cls, vllm_config, *args, **kwargs):
        # As ProximaScheduler: keep vLLM's own choice of the async variant.
        if cls is ObservedScheduler and vllm_config.scheduler_config.async_scheduling:
            cls = ObservedAsyncScheduler
        return super().__new__(cls)

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.kv_sinks = FailOpenSinks()

    def schedule(self, *args, **kwargs):
        start = time.perf_counter()
        output = super().schedule(*args, **kwargs)
        report_step(self, self.kv_sinks, output, time.perf_counter() - start)
        return output

    def _preempt_request(self, request, timestamp: float) -> None:
        super()._preempt_request(request, timestamp)
        for sink in self.kv_sinks:
            sink.count_preemption()


class ObservedAsyncScheduler(ObservedScheduler, AsyncScheduler):
    """The same, over vLLM's AsyncScheduler (chosen by ObservedScheduler.__new__)."""
