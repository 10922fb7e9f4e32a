"""The dashboard's immutable data types: what is collected (`Frame`) and what panels draw (views).

Layer: pure data, no I/O, no Textual. `Frame` is one collection tick (each server's
`ServerSnapshot`, the GPU readings, the time): the unit that is recorded and replayed.
`ServerView` and `Point` are derived from frames by `views.py` (a view's `kv` is the server's own
`KVSnapshot`, its allocator latencies narrowed to the window; the aggregate's, the servers'
combined by `KVSnapshot.combine`); `state.py` folds frames into a
`DashboardState`. All are frozen: a panel can never see a half-updated picture.
"""

from __future__ import annotations

from dataclasses import dataclass

from proxima.gpu import GpuSnapshot
from proxima.metrics import catalog
from proxima.scrape import HistogramSnapshot, KVSnapshot, ServerSnapshot

# Occupancy thresholds for colour (the catalog's): warn early, danger where the exhaustion alert
# fires and the doctor calls a queue "queueing for a full KV cache".
WARN_USAGE = catalog.KV_WARN_USAGE
DANGER_USAGE = catalog.KV_DANGER_USAGE


@dataclass(frozen=True, slots=True)
class Settings:
    # Latency quantiles (TTFT/ITL/E2E, allocator) come from histogram deltas over this window.
    window_s: float = 60.0
    # Counters become per-second rates over this window: long enough to smooth 2 Hz jitter.
    rate_window_s: float = 5.0
    history_s: float = 300.0
    # Bound on frames whatever the refresh rate (10 Hz for the whole history span).
    max_frames: int = 3000
    # `--once`: quantiles over the server's whole life (one look has no window to speak of).
    since_start: bool = False


@dataclass(frozen=True, slots=True)
class Frame:
    """One collection tick; the unit that is recorded and replayed."""

    taken_at: float
    servers: tuple[ServerSnapshot, ...]
    # None: not read, because no server is on this host; () read, but NVML saw no GPU.
    gpus: tuple[GpuSnapshot, ...] | None = None


@dataclass(frozen=True, slots=True)
class ServerView:
    """Everything a panel shows about one server, derived once per frame."""

    url: str
    kind: str  # "proxima", "stock", "unknown" (never answered) or "aggregate"
    ok: bool
    error: str | None = None
    # Figures are the last successful scrape's: the server is down now and being retried.
    stale: bool = False
    taken_at: float | None = None
    last_ok_at: float | None = None
    down_since: float | None = None
    scrape_errors: int = 0
    model_name: str | None = None
    running: float = 0.0
    waiting: float = 0.0
    finished_total: float = 0.0
    # Requests that ended in error or abort, where the scrape layer exposes them (else None).
    failed_total: float | None = None
    kv_usage: float = 0.0
    block_size: int | None = None
    num_gpu_blocks: int | None = None
    capacity_tokens: float | None = None
    used_tokens: float | None = None
    preemption_rate: float | None = None
    prompt_rate: float | None = None
    generation_rate: float | None = None
    finished_rate: float | None = None
    ttft: HistogramSnapshot = HistogramSnapshot()
    itl: HistogramSnapshot = HistogramSnapshot()
    e2e: HistogramSnapshot = HistogramSnapshot()
    # Span the latency histograms cover; None means since the server started.
    window_s: float | None = None
    kv: KVSnapshot | None = None
    # Prompt tokens served from the prefix cache / looked up, over the window (None: no lookups).
    prefix_hit_rate: float | None = None
    kv_cache_dtype: str | None = None  # vLLM's --kv-cache-dtype ("auto": the model's dtype)
    typical_request_tokens: float | None = None
    headroom_requests: float | None = None
    level: str = "ok"  # "ok", "warn" or "danger"
    alerts: tuple[str, ...] = ()

    @property
    def usage(self) -> float | None:
        """The occupancy the thresholds judge: the allocator's own when Proxima, else vLLM's."""
        if self.used_tokens is None or not self.capacity_tokens:
            return self.kv_usage if self.kind == "stock" else None
        return self.used_tokens / self.capacity_tokens


@dataclass(frozen=True, slots=True)
class Point:
    """One sparkline sample per frame."""

    t: float
    usage: float | None = None
    running: float | None = None
    waiting: float | None = None
    generation_rate: float | None = None
    ttft_p95: float | None = None
    preemption_rate: float | None = None


@dataclass(frozen=True, slots=True)
class Track:
    """What a server's history says beyond the current frame: errors and its last good scrape."""

    scrape_errors: int = 0
    last_ok: ServerSnapshot | None = None
    down_since: float | None = None

    def after(self, snap: ServerSnapshot) -> Track:
        if snap.ok:
            return Track(self.scrape_errors, snap, None)
        return Track(self.scrape_errors + 1, self.last_ok,
                     self.down_since if self.down_since is not None else snap.taken_at)
