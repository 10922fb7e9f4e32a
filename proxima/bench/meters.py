"""The client's own load during a level: how late its event loop wakes, how busy its CPU is.

When the client is saturated its timestamps are late too, and these say so (the notes under a
bench's results). The server's side of a level is sampled by `proxima.sampling.Sampler`.
"""

from __future__ import annotations

import asyncio
import time
from typing import Self


class LoopLagProbe:
    """Lateness of a `sleep(interval)` on this event loop, in seconds, sampled while a level runs."""

    def __init__(self, interval_s: float = 0.05) -> None:
        self.interval_s = interval_s
        self.lags: list[float] = []
        self._task: asyncio.Task | None = None

    async def __aenter__(self) -> Self:
        self._task = asyncio.create_task(self._run())
        return self

    async def __aexit__(self, *exc) -> None:
        if self._task is not None:
            self._task.cancel()
            # gather, not `await` under suppress(CancelledError): that would also swallow a cancel
            # of the caller that lands meanwhile (Ctrl-C).
            await asyncio.gather(self._task, return_exceptions=True)

    async def _run(self) -> None:
        while True:
            before = time.perf_counter()
            await asyncio.sleep(self.interval_s)
            self.lags.append(max(0.0, time.perf_counter() - before - self.interval_s))


class CpuMeter:
    """This process's CPU time over wall time (1.0 = one core busy), for the client's own load."""

    def __init__(self) -> None:
        self._cpu0 = time.process_time()
        self._wall0 = time.perf_counter()

    def fraction(self) -> float:
        wall = time.perf_counter() - self._wall0
        return (time.process_time() - self._cpu0) / wall if wall > 0 else 0.0
