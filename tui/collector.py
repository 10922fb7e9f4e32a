"""Collection for `top`: one tick reads every server and, for servers on this host, the GPUs,
into an immutable `Frame`.

Layer: I/O only, no rendering (nvitop's split between its `api/` and `tui/`). The reading itself
is `proxima.sampling.read_servers`, the tools' one collector; this module owns the dashboard's
HTTP client and the Frame. The app calls `Collector.collect()` from a Textual worker on a timer
and folds the frame into its `DashboardState` when the worker's message arrives; `--once` and
the benchmark call it directly. Nothing here raises for a server that is down (its snapshot has
`ok=False`) or a missing GPU (`read_gpus` returns `()`): a dashboard shows failures, it does not
die of them.

GPU readings are taken only when a watched server is on this host (`proxima.hosts`): NVML sees
this machine's GPUs, which say nothing about a remote server.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Sequence

import httpx

from proxima.fetch import auth_headers, client_limits
from proxima.gpu import GpuSnapshot, read_gpus
from proxima.hosts import is_this_host
from proxima.sampling import SCRAPE_TIMEOUT_S, read_servers
from proxima.tui.model import Frame


def scrape_timeout(interval_s: float) -> float:
    """Long enough for a busy server's /metrics, short enough that a hung one cannot stall ticks."""
    return min(SCRAPE_TIMEOUT_S, max(2.0, 2.0 * interval_s))


class Collector:
    """Scrapes a fixed list of servers; one shared HTTP client keeps connections alive."""

    def __init__(self, urls: Sequence[str], gpu_reader: Callable[[], tuple[GpuSnapshot, ...]] = read_gpus,
                 clock: Callable[[], float] = time.time, api_key: str | None = None) -> None:
        self.urls = tuple(urls)
        self._headers = auth_headers(api_key)
        self.read_gpus_here = any(is_this_host(u) for u in self.urls)
        self._gpu_reader = gpu_reader
        self._clock = clock
        self._client: httpx.AsyncClient | None = None

    async def collect(self, timeout: float = SCRAPE_TIMEOUT_S) -> Frame:
        if self._client is None:
            self._client = httpx.AsyncClient(headers=self._headers, limits=client_limits())
        taken_at = self._clock()
        snapshots, gpus = await read_servers(self._client, self.urls, timeout,
                                             self._gpu_reader if self.read_gpus_here else None)
        return Frame(taken_at, snapshots, gpus)

    async def aclose(self) -> None:
        if self._client is not None:
            await self._client.aclose()
            self._client = None


async def look_once(collector: Collector, interval_s: float, settings, on_frame=None):
    """Two scrapes `interval_s` apart folded into a state (`--once`): one look, but with rates.

    Latency quantiles in such a state should come from `Settings(since_start=True)`: a window of
    half a second says nothing.
    """
    from proxima.tui.state import DashboardState

    state = DashboardState.empty(collector.urls, settings)
    try:
        for k in range(2):
            if k:
                await asyncio.sleep(interval_s)
            frame = await collector.collect(scrape_timeout(interval_s))
            if on_frame is not None:
                on_frame(frame)
            state = state.advance(frame)
    finally:
        await collector.aclose()
    return state
