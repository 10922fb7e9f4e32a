"""The one collector of server samples: a server's `/metrics` as `proxima.scrape` snapshots and,
for a server on this host (`proxima.hosts`), this host's GPUs and the server's process memory.

Layer: I/O, below `top`, `doctor`, `bench` and `demo`, which only compute over what comes back:
  `read_servers`  one look at several servers at once (`top`'s tick);
  `Sampler`       one server read on a timer while a block runs (the doctor's phases, bench's
                  levels, the demo's burst), every reading an immutable `Sample`;
  `wait_idle`     polls until a server holds no request.
Nothing here raises for a server that is down, slow or unreadable: its reading is a snapshot
with `ok=False` and the reason (watching must never crash the tool, nor the load it measures).

Sampling is not free for the server: vLLM renders `/metrics` on the same event loop that streams
tokens (tens of milliseconds per scrape on a busy CPU host). A sampler therefore waits
`interval_s` after each reading before the next, so a server slow to answer is not also scraped
back to back; `interval_s` 0 turns a sampler off.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass

import httpx

from proxima.fetch import client_limits
from proxima.gpu import GpuSnapshot, memory_used_bytes, read_gpus
from proxima.hosts import is_this_host, process_tree_rss
from proxima.scrape import ServerSnapshot, scrape, scrape_sync

# The scrape layer's own default: long enough for a busy server's /metrics, short enough that a
# hung one does not stall the caller. The doctor gives its samples more (its probes' context).
SCRAPE_TIMEOUT_S = 5.0

GpuReader = Callable[[], tuple[GpuSnapshot, ...]]


@dataclass(frozen=True, slots=True)
class Sample:
    """One reading of one server, `t` seconds after its sampler's start (when the reading began)."""

    t: float
    snapshot: ServerSnapshot
    gpus: tuple[GpuSnapshot, ...] | None = None  # this host's GPUs; None: not read (server elsewhere)
    rss_bytes: int | None = None  # the server's process tree, when its process is known

    @property
    def idle(self) -> bool:
        return self.snapshot.ok and self.snapshot.running == 0 and self.snapshot.waiting == 0

    @property
    def gpu_memory_bytes(self) -> int | None:
        return memory_used_bytes(self.gpus or ())

    @property
    def gpu_utilization_pct(self) -> float | None:
        util = [g.utilization_pct for g in self.gpus or () if g.utilization_pct is not None]
        return sum(util) / len(util) if util else None


async def read_servers(client: httpx.AsyncClient, urls: Sequence[str], timeout_s: float,
                       gpu_reader: GpuReader | None = read_gpus,
                       ) -> tuple[tuple[ServerSnapshot, ...], tuple[GpuSnapshot, ...] | None]:
    """Every server at once (one slow server costs one budget, not one each), then the GPUs
    through `gpu_reader` (None: not read)."""
    taken_at = time.time()
    found = await asyncio.gather(*(scrape(client, u, timeout_s) for u in urls), return_exceptions=True)
    # scrape never raises; should it ever, that server is down, and the others still show.
    snapshots = tuple(s if isinstance(s, ServerSnapshot) else
                      ServerSnapshot(url=u, taken_at=taken_at, ok=False, error=f"{type(s).__name__}: {s}")
                      for u, s in zip(urls, found))
    # NVML calls block; a thread keeps the event loop (and a UI on it) responsive meanwhile.
    gpus = await asyncio.to_thread(gpu_reader) if gpu_reader is not None else None
    return snapshots, gpus


class Sampler:
    """Reads one server every `interval_s` while `running()`; `t0` lets samplers share a time axis.

    `here` (default: `is_this_host(url)`) reads this host's GPUs with each sample, and `pid` the
    memory of that process and its children. `off_loop` fetches and parses each reading in a
    worker thread on a connection of its own: parsing an exposition takes milliseconds of CPU,
    which on the caller's event loop would delay the token timestamps a load generator on it is
    measuring.
    """

    def __init__(self, url: str, interval_s: float, *, client: httpx.AsyncClient | None = None,
                 timeout_s: float = SCRAPE_TIMEOUT_S, here: bool | None = None, pid: int | None = None,
                 t0: float | None = None, off_loop: bool = False, gpu_reader: GpuReader = read_gpus,
                 headers: dict[str, str] | None = None) -> None:
        self.url = url
        self.interval_s = interval_s
        self.timeout_s = timeout_s
        self.here = is_this_host(url) if here is None else here
        self.pid = pid
        self.t0 = time.monotonic() if t0 is None else t0
        self.off_loop = off_loop
        self.samples: list[Sample] = []
        self._client = client
        self._gpu_reader = gpu_reader
        self._headers = headers  # for the clients it makes itself (a given client has its own)
        self._blocking: httpx.Client | None = None

    @property
    def ok_samples(self) -> list[Sample]:
        return [s for s in self.samples if s.snapshot.ok]

    def _local(self) -> tuple[tuple[GpuSnapshot, ...] | None, int | None]:
        if not self.here:
            return None, None
        return self._gpu_reader(), process_tree_rss(self.pid)

    def _read_blocking(self, t: float) -> Sample:
        snapshot = scrape_sync(self.url, timeout=self.timeout_s, client=self._blocking)
        return Sample(t, snapshot, *self._local())

    async def read(self) -> Sample:
        """One reading now (also outside `running()`)."""
        t = time.monotonic() - self.t0
        if self.off_loop:
            return await asyncio.to_thread(self._read_blocking, t)
        if self._client is None:
            async with httpx.AsyncClient(headers=self._headers, limits=client_limits()) as client:
                snapshot = await scrape(client, self.url, self.timeout_s)
        else:
            snapshot = await scrape(self._client, self.url, self.timeout_s)
        gpus, rss = await asyncio.to_thread(self._local) if self.here else (None, None)
        return Sample(t, snapshot, gpus, rss)

    async def _loop(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            self.samples.append(await self.read())
            # asyncio.timeout, not asyncio.wait_for: on Python 3.11 wait_for drops a cancel that
            # lands as `stop` is set, and this loop's cancel must never be lost.
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(self.interval_s):
                    await stop.wait()

    @contextlib.asynccontextmanager
    async def running(self, final: bool = True) -> AsyncIterator[Sampler]:
        """Sample until the block exits. The reading in flight then is finished rather than
        cancelled (its scrape budget bounds the wait): under load one scrape can outlast a short
        phase, which must still have its reading. With `final` (the default) one more is taken, so
        that a phase has both of its ends; without it (bench: a level's peaks are in by then) none."""
        if self.interval_s <= 0:
            yield self
            return
        async with contextlib.AsyncExitStack() as stack:
            if self.off_loop:
                self._blocking = stack.enter_context(httpx.Client(headers=self._headers,
                                                                  limits=client_limits()))
                stack.callback(setattr, self, "_blocking", None)
            elif self._client is None:  # one connection for the whole run, not one per reading
                self._client = await stack.enter_async_context(httpx.AsyncClient(headers=self._headers,
                                                                                      limits=client_limits()))
                stack.callback(setattr, self, "_client", None)
            stop = asyncio.Event()
            task = asyncio.ensure_future(self._loop(stop))
            try:
                yield self
            except BaseException:
                await _stop(task, stop)
                raise
            stop.set()
            await task
            if final:
                self.samples.append(await self.read())


async def _stop(task: asyncio.Future, stop: asyncio.Event) -> None:
    """End a sampling loop now and wait for it. `stop` is set as well as the task cancelled, so
    that even a cancel lost below (a library's await that swallows it) ends the loop after the
    reading in flight, which its scrape budget bounds, rather than never."""
    stop.set()
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)


async def wait_idle(client: httpx.AsyncClient, url: str, timeout_s: float,
                    poll_s: float = 0.25) -> ServerSnapshot | None:
    """Wait until the server reports no running and no waiting request; that snapshot, or None
    at the deadline (a reading that fails is polled past, like a busy one)."""
    deadline = time.monotonic() + timeout_s
    while True:
        snap = await scrape(client, url)
        if snap.ok and snap.running == 0 and snap.waiting == 0:
            return snap
        if time.monotonic() >= deadline:
            return None
        await asyncio.sleep(poll_s)
