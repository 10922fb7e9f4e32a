"""Background sampling during a level: the server's metrics, the GPU, and the client's own load.

`MetricsSampler` reads `/metrics` on a timer and turns it into a snapshot with
`proxima.scrape.parse_metrics` (in a worker thread, on its own connection, so samples are not
queued behind the load and parsing does not stall the client's event loop), and, for a server on
this host, reads the GPUs through `proxima.gpu`. `LoopLagProbe` measures how late the event loop
wakes a sleeping task: when the client is saturated, its timestamps are late too, and this says so.

Sampling is not free for the server: vLLM renders `/metrics` on the same event loop that streams
tokens (tens of milliseconds per scrape on a busy CPU host), so `interval_s` trades resolution of
the peaks for a small slowdown that both servers of an A/B pay alike; 0 turns it off.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from dataclasses import dataclass
from typing import Self

import httpx

from proxima.gpu import read_gpus
from proxima.scrape import ServerSnapshot, scrape_sync


@dataclass(frozen=True, slots=True)
class Sample:
    """One reading during a level (`t` in seconds since the level started)."""

    t: float
    ok: bool
    running: float | None = None
    waiting: float | None = None
    kv_usage: float | None = None
    token_usage: float | None = None  # Proxima servers only
    fragmentation: float | None = None  # Proxima servers only
    preemptions_total: float | None = None
    gpu_memory_bytes: int | None = None  # local servers with NVML only


def sample_of(snapshot: ServerSnapshot, t: float, gpu_bytes: int | None) -> Sample:
    if not snapshot.ok:
        return Sample(t, False, gpu_memory_bytes=gpu_bytes)
    kv = snapshot.proxima
    return Sample(
        t, True, snapshot.running, snapshot.waiting, snapshot.kv_usage,
        kv.token_usage if kv else None, kv.fragmentation if kv else None,
        snapshot.preemptions_total, gpu_bytes,
    )


def gpu_memory_bytes() -> int | None:
    """Memory used on all GPUs of this host (None without NVML: shown as N/A)."""
    readings = [g.memory_used_bytes for g in read_gpus() if g.memory_used_bytes is not None]
    return sum(readings) if readings else None


class MetricsSampler:
    """Samples a server every `interval_s` (0: never) while a level runs."""

    def __init__(self, url: str, interval_s: float, local: bool) -> None:
        self.url = url
        self.interval_s = interval_s
        self.local = local
        self.samples: list[Sample] = []
        self._task: asyncio.Task | None = None
        self._t0 = 0.0
        self._http: httpx.Client | None = None

    async def __aenter__(self) -> Self:
        self._t0 = time.perf_counter()
        if self.interval_s > 0:
            self._http = httpx.Client(timeout=max(1.0, self.interval_s * 4))
            self._task = asyncio.create_task(self._run())
        return self

    async def __aexit__(self, *exc) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        if self._http is not None:
            self._http.close()

    def _read(self, t: float) -> Sample:
        """One sample, in a worker thread: fetching and parsing an exposition takes milliseconds of
        CPU, which on the event loop would delay the token timestamps being measured. One client
        for the level: a new one per scrape would pay for TLS set-up every time."""
        snapshot = scrape_sync(self.url, timeout=self._http.timeout.read or 5.0, client=self._http)
        return sample_of(snapshot, t, gpu_memory_bytes() if self.local else None)

    async def _run(self) -> None:
        while True:
            t = time.perf_counter() - self._t0
            self.samples.append(await asyncio.to_thread(self._read, t))
            await asyncio.sleep(max(0.0, self.interval_s - (time.perf_counter() - self._t0 - t)))


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
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

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
