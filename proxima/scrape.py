"""The one scrape/snapshot layer: a server's `/metrics` (stock vLLM or Proxima) as typed snapshots.

`top`, `doctor` and `bench` consume `ServerSnapshot`s and never parse exposition text
themselves. A snapshot is immutable and taken at one instant; rates and windowed quantiles come
from two snapshots (`rate`, `HistogramSnapshot.since`). Scraping never raises: a server that is
down, too slow, too large or unparsable yields a snapshot with `ok=False` and the error, so a
dashboard can show it and retry.

Counts are summed over vLLM's `engine` label (data parallel engines) and ratios recomputed from
the sums (`combine_kv`), except where a per-engine view is asked for with `engine=`. Text → samples
is `proxima.exposition`; bounded HTTP reads are `proxima.fetch`.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import httpx

from proxima.exposition import Samples, segment_of
from proxima.fetch import MAX_METRICS_BYTES, BodyTooLarge, get_text, get_text_sync
from proxima.metrics import catalog as c

DEFAULT_URL = "http://127.0.0.1:8000"
_CONFIG_NOISE = {"engine", "None", ""}
# vllm:cache_config_info labels of features Proxima's users do not tune (hybrid models, bookkeeping).
_CONFIG_HIDDEN_PREFIXES = ("_", "mamba_", "user_specified_")


@dataclass(frozen=True, slots=True)
class HistogramSnapshot:
    """Cumulative bucket counts (upper bound, count), as Prometheus exposes them."""

    buckets: tuple[tuple[float, float], ...] = ()
    count: float = 0.0
    sum: float = 0.0

    def since(self, older: HistogramSnapshot | None) -> HistogramSnapshot:
        """Observations made between `older` and this snapshot (a server restart resets to self)."""
        if older is None or older.count > self.count or len(older.buckets) != len(self.buckets):
            return self
        return HistogramSnapshot(
            tuple((le, n - o) for (le, n), (_, o) in zip(self.buckets, older.buckets)),
            self.count - older.count,
            self.sum - older.sum,
        )

    @property
    def mean(self) -> float | None:
        return self.sum / self.count if self.count else None

    def quantile(self, q: float) -> float | None:
        """Linear interpolation inside the bucket, as PromQL's histogram_quantile does."""
        if not self.count or not self.buckets:
            return None
        rank = q * self.count
        prev_le, prev_n = 0.0, 0.0
        for le, n in self.buckets:
            if n >= rank:
                if math.isinf(le):
                    return prev_le
                width = n - prev_n
                return prev_le + (le - prev_le) * ((rank - prev_n) / width if width else 0.0)
            prev_le, prev_n = le, n
        return prev_le


@dataclass(frozen=True, slots=True)
class KVSnapshot:
    """Proxima's engine metrics (present only when the server runs Proxima's scheduler)."""

    allocator: str
    granularity: int
    slots_total: float
    slots_used: float
    slots_free: float
    slots_cached: float
    live_tokens: float
    token_usage: float
    block_usage: float
    fragmentation: float
    block_fragmentation: float
    occupancy: tuple[float, ...]
    largest_free_run: float
    bytes_per_token: float
    cache_bytes: float
    requests_holding_slots: float
    preemptions_total: float
    allocator_latency: dict[str, HistogramSnapshot] = field(default_factory=dict)
    engines: tuple[str, ...] = ()  # engine labels of the schedulers that export these metrics
    prefix_hit_tokens_total: float = 0.0
    prefix_hit_tokens_beyond_blocks_total: float = 0.0
    prefix_evicted_tokens_total: float = 0.0
    # Exceptions a telemetry sink raised and the engine caught (its figures may be stale meanwhile).
    telemetry_errors_total: float = 0.0

    @property
    def slot_usage(self) -> float:
        return self.slots_used / self.slots_total if self.slots_total else 0.0

    @property
    def beyond_blocks_share(self) -> float | None:
        """Share of prefix-cache hit tokens a block cache of the reference size would miss."""
        if not self.prefix_hit_tokens_total:
            return None
        return self.prefix_hit_tokens_beyond_blocks_total / self.prefix_hit_tokens_total


@dataclass(frozen=True, slots=True)
class ServerSnapshot:
    url: str
    taken_at: float
    ok: bool
    error: str | None = None
    model_name: str | None = None
    engines: tuple[str, ...] = ()
    running: float = 0.0
    waiting: float = 0.0
    kv_usage: float = 0.0
    preemptions_total: float = 0.0
    prompt_tokens_total: float = 0.0
    generation_tokens_total: float = 0.0
    requests_finished_total: float = 0.0
    # Requests that ended with finished_reason="error" (None where the server does not label them).
    requests_failed_total: float | None = None
    block_size: int | None = None
    num_gpu_blocks: int | None = None
    ttft: HistogramSnapshot = HistogramSnapshot()
    itl: HistogramSnapshot = HistogramSnapshot()
    e2e: HistogramSnapshot = HistogramSnapshot()
    queue_time: HistogramSnapshot = HistogramSnapshot()
    # Token counts per finished request: what a typical request of this server's traffic holds.
    prompt_tokens_per_request: HistogramSnapshot = HistogramSnapshot()
    generation_tokens_per_request: HistogramSnapshot = HistogramSnapshot()
    prefix_cache_queries_total: float = 0.0
    prefix_cache_hits_total: float = 0.0
    # The API server's own RSS (absent under PROMETHEUS_MULTIPROC_DIR, i.e. under `proxima serve`).
    process_rss_bytes: float | None = None
    # Labels of vllm:cache_config_info (block_size, kv_cache_size_tokens, ...), bookkeeping left out.
    cache_config: dict[str, str] = field(default_factory=dict)
    proxima: KVSnapshot | None = None

    @property
    def is_proxima(self) -> bool:
        return self.proxima is not None

    @property
    def kv_cache_dtype(self) -> str | None:
        """vLLM's --kv-cache-dtype as the server runs it ("auto": the model's dtype)."""
        return self.cache_config.get("cache_dtype")

    def config_int(self, key: str) -> int | None:
        return _as_int(self.cache_config.get(key))

    def config_float(self, key: str) -> float | None:
        return _as_float(self.cache_config.get(key))


def rate(newer: ServerSnapshot, older: ServerSnapshot | None, attr: str) -> float | None:
    """Per-second increase of a counter field between two snapshots (None if undefined)."""
    if older is None or not (newer.ok and older.ok):
        return None
    dt = newer.taken_at - older.taken_at
    delta = getattr(newer, attr) - getattr(older, attr)
    if dt <= 0 or delta < 0:
        return None
    return delta / dt


def _histogram(s: Samples, name: str, engine: str | None = None, **labels: str) -> HistogramSnapshot:
    return HistogramSnapshot(*s.histogram(name, engine, **labels))


def parse_metrics(text: str, url: str = DEFAULT_URL, taken_at: float | None = None,
                  engine: str | None = None) -> ServerSnapshot:
    """Turn one `/metrics` exposition into a snapshot (summed over engines unless `engine`)."""
    s = Samples(text)
    v = c.Vllm
    info = s.labels_of(v.CACHE_CONFIG_INFO)
    models = [lab.get("model_name") for lab in s.labels_of(v.RUNNING) if lab.get("model_name")]
    engines = sorted({lab.get("engine", "") for lab in s.labels_of(v.RUNNING)} - {""})

    def num(name: str) -> float:
        return s.total(name, engine) or 0.0

    info = [lab for lab in info if engine is None or lab.get("engine") == engine]
    config = _cache_config(info)
    blocks = {lab.get("engine"): _as_int(lab.get("num_gpu_blocks")) for lab in info}
    kv_usage = {x.labels.get("engine"): x.value for x in s.by_name.get(v.KV_USAGE, ())
                if engine is None or x.labels.get("engine") == engine}
    return ServerSnapshot(
        url=url,
        taken_at=time.time() if taken_at is None else taken_at,
        ok=True,
        model_name=models[0] if models else None,
        engines=tuple(engines),
        running=num(v.RUNNING),
        waiting=num(v.WAITING),
        kv_usage=_weighted(kv_usage, blocks),
        preemptions_total=num(v.PREEMPTIONS),
        prompt_tokens_total=num(v.PROMPT_TOKENS),
        generation_tokens_total=num(v.GENERATION_TOKENS),
        requests_finished_total=num(v.REQUEST_SUCCESS),
        requests_failed_total=s.total(v.REQUEST_SUCCESS, engine, finished_reason="error"),
        block_size=_as_int(config.get("block_size")),
        # Capacity of the whole server: every data-parallel engine has its own blocks.
        num_gpu_blocks=None if None in blocks.values() or not blocks else sum(blocks.values()),
        ttft=_histogram(s, v.TTFT, engine),
        itl=_histogram(s, v.ITL, engine),
        e2e=_histogram(s, v.E2E, engine),
        queue_time=_histogram(s, v.QUEUE_TIME, engine),
        prompt_tokens_per_request=_histogram(s, v.REQUEST_PROMPT_TOKENS, engine),
        generation_tokens_per_request=_histogram(s, v.REQUEST_GENERATION_TOKENS, engine),
        prefix_cache_queries_total=num(v.PREFIX_CACHE_QUERIES),
        prefix_cache_hits_total=num(v.PREFIX_CACHE_HITS),
        process_rss_bytes=s.total(v.PROCESS_RESIDENT_MEMORY),
        cache_config=config,
        proxima=_parse_proxima(s, engine),
    )


def _parse_proxima(s: Samples, engine: str | None) -> KVSnapshot | None:
    info = [lab for lab in s.labels_of(c.ALLOCATOR_INFO.name)
            if engine is None or lab.get("engine") == engine]
    if not info:
        return None
    # Each engine on its own, then one combination rule (combine_kv): a ratio summed over engines
    # would read 1.2 for two engines at 60%.
    rows: dict[str | None, dict[str, str]] = {}
    for lab in info:
        rows.setdefault(lab.get("engine"), lab)
    return combine_kv([_parse_engine(s, e, lab) for e, lab in sorted(rows.items(), key=lambda r: r[0] or "")])


def _parse_engine(s: Samples, engine: str | None, info: dict[str, str]) -> KVSnapshot:
    """One engine's Proxima metrics (`engine` None: an exposition without engine labels)."""
    def num(spec: c.MetricSpec) -> float:
        return s.total(spec.sample_name, engine) or 0.0

    def mine(sample) -> bool:
        return engine is None or sample.labels.get("engine") == engine

    segments: dict[int, float] = {}
    for sample in s.by_name.get(c.OCCUPANCY_MAP.name, ()):
        if mine(sample):
            segments[segment_of(sample)] = sample.value
    used, total, live = num(c.SLOTS_USED), num(c.SLOTS_TOTAL), num(c.LIVE_TOKENS)
    return KVSnapshot(
        allocator=info.get("allocator", "?"),
        granularity=int(info.get("block_size", "1") or 1),
        slots_total=total,
        slots_used=used,
        slots_free=num(c.SLOTS_FREE),
        slots_cached=num(c.SLOTS_CACHED),
        live_tokens=live,
        token_usage=live / total if total else 0.0,
        block_usage=num(c.BLOCK_USAGE),
        fragmentation=_waste(used, live),
        block_fragmentation=num(c.BLOCK_FRAGMENTATION),
        occupancy=tuple(v for _, v in sorted(segments.items())),
        largest_free_run=max((x.value for x in s.by_name.get(c.LARGEST_FREE_RUN.name, ()) if mine(x)),
                             default=0.0),
        bytes_per_token=max((x.value for x in s.by_name.get(c.BYTES_PER_TOKEN.name, ()) if mine(x)),
                            default=0.0),
        cache_bytes=num(c.CACHE_BYTES),
        requests_holding_slots=num(c.RUNNING_REQUESTS),
        preemptions_total=num(c.PREEMPTIONS),
        allocator_latency={
            op: _histogram(s, c.ALLOCATOR_LATENCY.name, engine, op=op) for op in c.ALLOCATOR_OPS
        },
        engines=(engine,) if engine is not None else (),
        telemetry_errors_total=num(c.TELEMETRY_ERRORS),
        prefix_hit_tokens_total=num(c.PREFIX_HIT_TOKENS),
        prefix_hit_tokens_beyond_blocks_total=num(c.PREFIX_HIT_BEYOND_BLOCKS),
        prefix_evicted_tokens_total=num(c.PREFIX_EVICTED_TOKENS),
    )


def _waste(allocated: float, live: float) -> float:
    return max(0.0, (allocated - live) / allocated) if allocated > 0 else 0.0


def merge_histograms(hists: Iterable[HistogramSnapshot]) -> HistogramSnapshot:
    """Sum histograms with the same bucket bounds (engines, or servers in the aggregate view)."""
    total: HistogramSnapshot | None = None
    for h in hists:
        if not h.count:
            continue
        if total is None:
            total = h
        elif [le for le, _ in h.buckets] == [le for le, _ in total.buckets]:
            total = HistogramSnapshot(tuple((le, a + b) for (le, a), (_, b) in zip(total.buckets, h.buckets)),
                                      total.count + h.count, total.sum + h.sum)
    return total or HistogramSnapshot()


def combine_kv(kvs: Sequence[KVSnapshot]) -> KVSnapshot | None:
    """Several engines' (or servers') KV snapshots as one: counts and histograms summed, every
    ratio recomputed from the summed counts (usage, fragmentation) or weighted by slots
    (occupancy), maxima kept as maxima. The one place that combines KV figures."""
    if not kvs:
        return None
    if len(kvs) == 1:
        return kvs[0]
    total, used = sum(k.slots_total for k in kvs), sum(k.slots_used for k in kvs)
    live = sum(k.live_tokens for k in kvs)
    # Slots 16-token blocks would hold: each engine's ratio times its own capacity.
    block_slots = sum(k.block_usage * k.slots_total for k in kvs)
    weights = [k.slots_total for k in kvs] if total else [1.0] * len(kvs)
    lengths = {len(k.occupancy) for k in kvs}
    occupancy: tuple[float, ...] = ()
    if len(lengths) == 1:  # segments are fractions of each engine's own cache: weight by its size
        occupancy = tuple(sum(w * k.occupancy[i] for w, k in zip(weights, kvs)) / sum(weights)
                          for i in range(lengths.pop()))
    return KVSnapshot(
        allocator="/".join(sorted({k.allocator for k in kvs})),
        granularity=min(k.granularity for k in kvs),
        slots_total=total,
        slots_used=used,
        slots_free=sum(k.slots_free for k in kvs),
        slots_cached=sum(k.slots_cached for k in kvs),
        live_tokens=live,
        token_usage=live / total if total else 0.0,
        block_usage=block_slots / total if total else 0.0,
        fragmentation=_waste(used, live),
        block_fragmentation=_waste(block_slots, live),
        occupancy=occupancy,
        largest_free_run=max(k.largest_free_run for k in kvs),
        bytes_per_token=max(k.bytes_per_token for k in kvs),
        cache_bytes=sum(k.cache_bytes for k in kvs),
        requests_holding_slots=sum(k.requests_holding_slots for k in kvs),
        preemptions_total=sum(k.preemptions_total for k in kvs),
        allocator_latency={
            op: merge_histograms(k.allocator_latency[op] for k in kvs if op in k.allocator_latency)
            for op in c.ALLOCATOR_OPS if any(op in k.allocator_latency for k in kvs)
        },
        engines=tuple(sorted({e for k in kvs for e in k.engines})),
        telemetry_errors_total=sum(k.telemetry_errors_total for k in kvs),
        prefix_hit_tokens_total=sum(k.prefix_hit_tokens_total for k in kvs),
        prefix_hit_tokens_beyond_blocks_total=sum(k.prefix_hit_tokens_beyond_blocks_total for k in kvs),
        prefix_evicted_tokens_total=sum(k.prefix_evicted_tokens_total for k in kvs),
    )


def _weighted(ratios: dict[str | None, float], weights: dict[str | None, int | None]) -> float:
    """Engines' ratios combined as the ratio of the summed counts (weights: each engine's capacity)."""
    if not ratios:
        return 0.0
    w = {e: float(weights.get(e) or 0) for e in ratios}
    if not all(w.values()):  # a capacity unknown: each engine counts once
        w = dict.fromkeys(ratios, 1.0)
    return sum(ratios[e] * w[e] for e in ratios) / sum(w.values())


def _cache_config(rows: list[dict[str, str]]) -> dict[str, str]:
    """vllm:cache_config_info's labels (every engine has the same), unset and bookkeeping ones left out."""
    return {k: value for k, value in (rows[0] if rows else {}).items()
            if k not in _CONFIG_NOISE and not k.startswith(_CONFIG_HIDDEN_PREFIXES)
            and value not in _CONFIG_NOISE}


def _as_float(value: str | None) -> float | None:
    try:
        return float(value) if value is not None else None
    except ValueError:
        return None


def _as_int(value: str | None) -> int | None:
    number = _as_float(value)
    return int(number) if number is not None and math.isfinite(number) else None


def parse_or_error(text: str, url: str, taken_at: float, engine: str | None = None) -> ServerSnapshot:
    """`parse_metrics`, with any failure to parse made this server's error and nothing else."""
    try:
        return parse_metrics(text, url, taken_at, engine)
    except Exception as err:  # noqa: BLE001 (any parser bug or odd exposition: one server's problem)
        return ServerSnapshot(url=url, taken_at=taken_at, ok=False,
                              error=f"unreadable /metrics: {type(err).__name__}: {err}")


async def scrape(client: httpx.AsyncClient, url: str, timeout: float = 5.0,
                 engine: str | None = None, max_bytes: int = MAX_METRICS_BYTES) -> ServerSnapshot:
    """Fetch and parse `url`/metrics within `timeout` s in all and `max_bytes`. Never raises."""
    taken_at = time.time()
    try:
        text = await get_text(client, url.rstrip("/") + "/metrics", timeout, max_bytes)
    except (httpx.HTTPError, httpx.InvalidURL, ValueError) as err:
        return ServerSnapshot(url=url, taken_at=taken_at, ok=False, error=describe_http_error(err))
    # Parsing is pure Python and takes seconds for a huge exposition: off the caller's event loop
    # (the TUI's), so one server's /metrics never freezes the others.
    return await asyncio.to_thread(parse_or_error, text, url, taken_at, engine)


def scrape_sync(url: str, timeout: float = 5.0, engine: str | None = None,
                client: httpx.Client | None = None, max_bytes: int = MAX_METRICS_BYTES) -> ServerSnapshot:
    """Blocking scrape. Pass a `client` to reuse one connection (and TLS set-up) across scrapes."""
    taken_at = time.time()
    try:
        text = get_text_sync(client, url.rstrip("/") + "/metrics", timeout, max_bytes)
    except (httpx.HTTPError, httpx.InvalidURL, ValueError) as err:
        return ServerSnapshot(url=url, taken_at=taken_at, ok=False, error=describe_http_error(err))
    return parse_or_error(text, url, taken_at, engine)


def describe_http_error(err: Exception) -> str:
    """One line for an HTTP failure, as the tools show it."""
    if isinstance(err, httpx.ConnectError):
        return "connection refused (is the server running?)"
    if isinstance(err, httpx.TimeoutException):
        return "timed out"
    if isinstance(err, httpx.HTTPStatusError):
        return f"HTTP {err.response.status_code}"
    if isinstance(err, BodyTooLarge):
        return str(err)
    return f"{type(err).__name__}: {err}"
