"""From frames to the figures panels show: rates, windowed quantiles, headroom, alerts.

Layer: pure functions over immutable frames (no I/O, no Textual, no wall clock). Rates come from
two snapshots `Settings.rate_window_s` apart (`scrape.rate`); latency quantiles from histogram
deltas over `Settings.window_s` (`HistogramSnapshot.since`), so they describe the last minute, not
the server's whole life. A server that stops answering keeps its last good figures, marked stale.
KV capacity is `scrape.kv_capacity_tokens`; the all-servers view combines the servers' KV figures
by the catalog's rules, as the scrape combines a server's engines (`KVSnapshot.combine`).
"""

from __future__ import annotations

from bisect import bisect_right
from dataclasses import replace

from proxima import fmt
from proxima.metrics import catalog
from proxima.scrape import (
    HistogramSnapshot,
    KVSnapshot,
    ServerSnapshot,
    kv_capacity_tokens,
    merge_histograms,
    rate,
)
from proxima.tui.model import (
    DANGER_USAGE,
    WARN_USAGE,
    Frame,
    Point,
    ServerView,
    Settings,
    Track,
)

_LEVELS = ("ok", "warn", "danger")


def baseline(i: int, frames: tuple[Frame, ...], times: tuple[float, ...],
             before: float) -> ServerSnapshot | None:
    """Server i's latest good snapshot at or before `before`, other than the newest frame's.

    When the history is shorter than the window, the oldest good snapshot stands in (the window
    is then as long as the history, and views say so); None when there is no earlier good one.
    """
    newest = len(frames) - 1
    k = min(bisect_right(times, before) - 1, newest - 1)
    for j in range(k, -1, -1):
        if frames[j].servers[i].ok:
            return frames[j].servers[i]
    for j in range(max(k + 1, 0), newest):
        if frames[j].servers[i].ok:
            return frames[j].servers[i]
    return None


def _kv_view(snap: ServerSnapshot, window_base: ServerSnapshot | None) -> KVSnapshot | None:
    """The server's KV snapshot, its allocator latency histograms narrowed to the window."""
    kv = snap.proxima
    if kv is None:
        return None
    older = window_base.proxima.allocator_latency if window_base and window_base.proxima else {}
    return replace(kv, allocator_latency={
        op: kv.allocator_latency[op].since(older.get(op))
        for op in catalog.ALLOCATOR_OPS if op in kv.allocator_latency
    })


def _figures(snap: ServerSnapshot, rate_base: ServerSnapshot | None,
             window_base: ServerSnapshot | None) -> ServerView:
    kv = _kv_view(snap, window_base)
    capacity = kv_capacity_tokens(snap)
    if kv is not None:
        used, free = kv.slots_used, kv.slots_free
    elif capacity:
        used = snap.kv_usage * capacity
        free = capacity - used
    else:
        used = free = None
    typical = _typical_request_tokens(snap, kv, used, window_base)
    return ServerView(
        url=snap.url, kind="proxima" if kv is not None else "stock", ok=True,
        taken_at=snap.taken_at, last_ok_at=snap.taken_at, model_name=snap.model_name,
        running=snap.running, waiting=snap.waiting, finished_total=snap.requests_finished_total,
        failed_total=snap.requests_failed_total, kv_usage=snap.kv_usage, block_size=snap.block_size,
        num_gpu_blocks=snap.num_gpu_blocks, capacity_tokens=capacity, used_tokens=used,
        preemption_rate=rate(snap, rate_base, "preemptions_total"),
        prompt_rate=rate(snap, rate_base, "prompt_tokens_total"),
        generation_rate=rate(snap, rate_base, "generation_tokens_total"),
        finished_rate=rate(snap, rate_base, "requests_finished_total"),
        ttft=snap.ttft.since(window_base and window_base.ttft),
        itl=snap.itl.since(window_base and window_base.itl),
        e2e=snap.e2e.since(window_base and window_base.e2e),
        window_s=None if window_base is None else snap.taken_at - window_base.taken_at,
        kv=kv,
        prefix_hit_rate=prefix_hit_rate(snap, window_base),
        kv_cache_dtype=snap.kv_cache_dtype,
        typical_request_tokens=typical,
        headroom_requests=free / typical if free is not None and typical else None,
    )


def prefix_hit_rate(snap: ServerSnapshot, base: ServerSnapshot | None) -> float | None:
    """vLLM's prefix-cache hits over its queries, since `base` (or since start)."""
    queries, hits = snap.prefix_cache_queries_total, snap.prefix_cache_hits_total
    if base is not None and base.ok and base.prefix_cache_queries_total <= queries:
        queries -= base.prefix_cache_queries_total
        hits -= base.prefix_cache_hits_total
    return hits / queries if queries > 0 else None


def _typical_request_tokens(snap: ServerSnapshot, kv: KVSnapshot | None, used: float | None,
                            window_base: ServerSnapshot | None) -> float | None:
    """Mean tokens per running request; with none running, the mean size of recent finished ones."""
    if kv is not None and kv.requests_holding_slots >= 1:
        return kv.live_tokens / kv.requests_holding_slots
    if kv is None and used and snap.running >= 1:
        return used / snap.running  # block-rounded: all a stock server tells
    base = window_base
    if base is not None and snap.requests_finished_total > base.requests_finished_total:
        tokens = (snap.prompt_tokens_total - base.prompt_tokens_total
                  + snap.generation_tokens_total - base.generation_tokens_total)
        return tokens / (snap.requests_finished_total - base.requests_finished_total) or None
    return None


def _judge(view: ServerView) -> ServerView:
    level, alerts = "ok", []

    def flag(lvl: str, text: str) -> None:
        nonlocal level
        level = max(level, lvl, key=_LEVELS.index)
        alerts.append(text)

    if not view.ok:
        flag("danger", f"down: {view.error or 'no answer'}" + (" (last figures shown)" if view.stale else ""))
        return replace(view, level=level, alerts=tuple(alerts))
    usage = view.usage
    if usage is not None and usage >= DANGER_USAGE:
        if view.waiting > 0:
            flag("danger", f"KV cache {fmt.pct(usage, 0)} full with {view.waiting:.0f} waiting")
        else:
            flag("warn", f"KV cache {fmt.pct(usage, 0)} full")
    elif usage is not None and usage >= WARN_USAGE:
        flag("warn", f"KV cache {fmt.pct(usage, 0)} full")
    if view.waiting > 0 and (usage is None or usage < WARN_USAGE):
        # Not a danger: a hint that the queue is bound by something else (max-num-seqs, batch tokens).
        alerts.append(f"{view.waiting:.0f} waiting while the KV cache has room: the limit is elsewhere "
                      "(max-num-seqs or max-num-batched-tokens?)")
    if view.preemption_rate:
        flag("danger" if usage is not None and usage >= DANGER_USAGE else "warn",
             f"preempting {fmt.per_second(view.preemption_rate)}")
    return replace(view, level=level, alerts=tuple(alerts))


def server_view(i: int, frames: tuple[Frame, ...], times: tuple[float, ...], track: Track,
                settings: Settings) -> ServerView:
    snap = frames[-1].servers[i]
    if snap.ok:
        rate_base = baseline(i, frames, times, snap.taken_at - settings.rate_window_s)
        window_base = None if settings.since_start else baseline(
            i, frames, times, snap.taken_at - settings.window_s)
        view = _figures(snap, rate_base, window_base)
    elif track.last_ok is not None:
        # Keep the last good gauges on screen, dimmed; rates and windows need a live server.
        last = _figures(track.last_ok, None, None)
        view = replace(last, ok=False, stale=True, error=snap.error, taken_at=snap.taken_at,
                       ttft=HistogramSnapshot(), itl=HistogramSnapshot(), e2e=HistogramSnapshot(),
                       headroom_requests=None)
    else:
        view = ServerView(url=snap.url, kind="unknown", ok=False, error=snap.error, taken_at=snap.taken_at)
    view = replace(view, scrape_errors=track.scrape_errors, down_since=track.down_since,
                   last_ok_at=track.last_ok.taken_at if track.last_ok else None)
    return _judge(view)


def _sum(values) -> float | None:
    known = [v for v in values if v is not None]
    return sum(known) if known else None


def aggregate_view(views: tuple[ServerView, ...]) -> ServerView:
    """All servers as one: sums of counts and rates, quantiles of the merged histograms."""
    live = [v for v in views if v.ok]
    sized = [v for v in live if v.capacity_tokens]
    windows = [v.window_s for v in live if v.window_s is not None]
    worst = max((v.level for v in views), key=_LEVELS.index, default="ok")
    alerts = tuple(f"{fmt.short_url(v.url)}: {a}" for v in views for a in v.alerts)
    return ServerView(
        url="all servers", kind="aggregate", ok=bool(live),
        error=None if live else "no server answers",
        taken_at=max((v.taken_at for v in views if v.taken_at is not None), default=None),
        scrape_errors=sum(v.scrape_errors for v in views),
        running=sum(v.running for v in live), waiting=sum(v.waiting for v in live),
        finished_total=sum(v.finished_total for v in live),
        failed_total=_sum(v.failed_total for v in live),
        capacity_tokens=sum(v.capacity_tokens for v in sized) if sized else None,
        used_tokens=sum(v.used_tokens or 0.0 for v in sized) if sized else None,
        preemption_rate=_sum(v.preemption_rate for v in live),
        prompt_rate=_sum(v.prompt_rate for v in live),
        generation_rate=_sum(v.generation_rate for v in live),
        finished_rate=_sum(v.finished_rate for v in live),
        ttft=merge_histograms(v.ttft for v in live), itl=merge_histograms(v.itl for v in live),
        e2e=merge_histograms(v.e2e for v in live),
        window_s=max(windows) if windows else None,
        kv=KVSnapshot.combine([v.kv for v in live if v.kv is not None]),
        headroom_requests=_sum(v.headroom_requests for v in live),
        level=worst, alerts=alerts,
    )


def point_of(view: ServerView, t: float) -> Point:
    if not view.ok:
        return Point(t)  # a gap in every sparkline while the server is down
    return Point(t, usage=view.usage, running=view.running, waiting=view.waiting,
                 generation_rate=view.generation_rate, ttft_p95=view.ttft.quantile(0.95),
                 preemption_rate=view.preemption_rate)
