"""Samples over time (server snapshot, server process memory, GPUs) and the trend through them.

Layer: probes. A `Sampler` is one collector on a timer, like `top`'s: every reading is an
immutable `Sample`; probes compute over the list once sampling has stopped.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass

from proxima.probes.base import ProbeContext
from proxima.probes.process import process_tree_rss

from proxima.gpu import GpuSnapshot, read_gpus
from proxima.scrape import ServerSnapshot, scrape


@dataclass(frozen=True, slots=True)
class Sample:
    t: float  # seconds since the sampler started
    snapshot: ServerSnapshot
    rss_bytes: int | None
    gpus: tuple[GpuSnapshot, ...]

    @property
    def idle(self) -> bool:
        return self.snapshot.ok and self.snapshot.running == 0 and self.snapshot.waiting == 0

    @property
    def gpu_memory_bytes(self) -> int | None:
        used = [g.memory_used_bytes for g in self.gpus if g.memory_used_bytes is not None]
        return sum(used) if used else None

    @property
    def gpu_utilization_pct(self) -> float | None:
        util = [g.utilization_pct for g in self.gpus if g.utilization_pct is not None]
        return sum(util) / len(util) if util else None


# The scrape layer's default total budget (5 s) suits `top`'s refreshes; the doctor samples a
# server it is loading itself, whose /metrics can take seconds to answer on shared CPU cores,
# and a phase with too few readings is an error, so its samples get more time.
SAMPLE_TIMEOUT_S = 20.0


async def take_sample(ctx: ProbeContext, t0: float) -> Sample:
    snapshot = await scrape(ctx.client, ctx.url, timeout=SAMPLE_TIMEOUT_S)
    return Sample(time.monotonic() - t0, snapshot, process_tree_rss(ctx.server_pid), read_gpus())


class Sampler:
    """Samples every `interval_s` while `running()`; `t0` lets several samplers share a time axis."""

    def __init__(self, ctx: ProbeContext, interval_s: float | None = None, t0: float | None = None) -> None:
        self.ctx = ctx
        self.interval_s = interval_s or ctx.sample_interval_s
        self.t0 = time.monotonic() if t0 is None else t0
        self.samples: list[Sample] = []

    async def _loop(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            self.samples.append(await take_sample(self.ctx, self.t0))
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(stop.wait(), self.interval_s)

    @contextlib.asynccontextmanager
    async def running(self) -> AsyncIterator[Sampler]:
        """Sample until the block exits, then once more: at least two samples, whatever the timing.

        A scrape in flight when the block exits is finished rather than cancelled, because under
        load one scrape can take longer than a short phase and a phase needs both of its ends.
        """
        stop = asyncio.Event()
        task = asyncio.ensure_future(self._loop(stop))
        try:
            yield self
        except BaseException:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            raise
        stop.set()
        await task
        self.samples.append(await take_sample(self.ctx, self.t0))

    @property
    def ok_samples(self) -> list[Sample]:
        return [s for s in self.samples if s.snapshot.ok]


async def wait_idle(ctx: ProbeContext, timeout_s: float) -> ServerSnapshot | None:
    """Wait until the server reports no running and no waiting request; the idle snapshot, or None."""
    deadline = time.monotonic() + timeout_s
    while True:
        snap = await scrape(ctx.client, ctx.url)
        if snap.ok and snap.running == 0 and snap.waiting == 0:
            return snap
        if time.monotonic() >= deadline:
            return None
        await asyncio.sleep(0.25)


@dataclass(frozen=True, slots=True)
class Trend:
    """Least-squares line y = a + slope * t, with the slope's standard error and 95% interval."""

    slope: float
    stderr: float
    n: int
    ci95_low: float
    ci95_high: float

    @property
    def significant_rise(self) -> bool:
        return self.ci95_low > 0


# Two-sided 95% Student t quantiles for small samples (df = n - 2); 1.96 beyond.
_T95 = {1: 12.71, 2: 4.30, 3: 3.18, 4: 2.78, 5: 2.57, 6: 2.45, 7: 2.36, 8: 2.31, 9: 2.26, 10: 2.23,
        12: 2.18, 15: 2.13, 20: 2.09, 25: 2.06, 30: 2.04}


def _t95(df: int) -> float:
    if df > 30:
        return 1.96
    return _T95[max(k for k in _T95 if k <= df)]


def linear_trend(ts: Sequence[float], ys: Sequence[float]) -> Trend | None:
    """Slope of ys against ts (units of y per unit of t); None with fewer than 3 points."""
    n = len(ts)
    if n < 3 or n != len(ys):
        return None
    mt, my = sum(ts) / n, sum(ys) / n
    sxx = sum((t - mt) ** 2 for t in ts)
    if sxx == 0:
        return None
    slope = sum((t - mt) * (y - my) for t, y in zip(ts, ys)) / sxx
    intercept = my - slope * mt
    residual = sum((y - intercept - slope * t) ** 2 for t, y in zip(ts, ys))
    stderr = math.sqrt(residual / (n - 2) / sxx)
    half = _t95(n - 2) * stderr
    return Trend(slope, stderr, n, slope - half, slope + half)
