"""The one scrape/snapshot layer: a server's `/metrics` (stock vLLM or Proxima) as typed snapshots.

`top`, `doctor` and `bench` consume `ServerSnapshot`s and never parse exposition text
themselves. A snapshot is immutable and taken at one instant; rates and windowed quantiles come
from two snapshots (`rate`, `HistogramSnapshot.since`). Scraping never raises: a server that is
down, too slow, too large or unparsable yields a snapshot with `ok=False` and the error, so a
dashboard can show it and retry.

Counts are summed over vLLM's `engine` label (data parallel engines) and ratios recomputed from
the sums, except where a per-engine view is asked for with `engine=`; Proxima's own figures are
read and combined by their catalog rules (`proxima.kv_snapshot`, `KVSnapshot.combine`). Text →
samples is `proxima.exposition`; bounded HTTP reads are `proxima.fetch`; histograms are
`proxima.histograms`. How big the KV cache is, whatever the server: `kv_capacity_tokens`.
"""

from __future__ import annotations

import asyncio
import math
import time
from dataclasses import dataclass, field

import httpx

from proxima.exposition import MalformedMetrics, Samples
from proxima.fetch import MAX_METRICS_BYTES, client_limits, describe_http_error, get_text, get_text_sync
from proxima.histograms import HistogramSnapshot, merge_histograms
from proxima.kv_snapshot import KVSnapshot, read_engines
from proxima.metrics import catalog as c

# The snapshot types and helpers the tools import from here, the one scrape layer.
__all__ = ["DEFAULT_URL", "HistogramSnapshot", "KVSnapshot", "ServerSnapshot", "describe_http_error",
           "kv_capacity_tokens", "merge_histograms", "parse_metrics", "parse_or_error", "rate",
           "scrape", "scrape_sync"]

DEFAULT_URL = "http://127.0.0.1:8000"
_CONFIG_NOISE = {"engine", "None", ""}
# vllm:cache_config_info labels of features Proxima's users do not tune (hybrid models, bookkeeping).
_CONFIG_HIDDEN_PREFIXES = ("_", "mamba_", "user_specified_")


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


def kv_capacity_tokens(snap: ServerSnapshot) -> int | None:
    """The KV cache's size in tokens, whatever the server runs (None: it does not say).

    Proxima's own count of slots when its engine has reported one; else vLLM's blocks x block
    size (summed over data-parallel engines, like `num_gpu_blocks`); else vLLM's
    `kv_cache_size_tokens` (one engine's). The one definition `top`, `doctor` and `bench` use.
    """
    if snap.proxima is not None and snap.proxima.slots_total:
        return int(snap.proxima.slots_total)
    if snap.num_gpu_blocks and snap.block_size:
        return snap.num_gpu_blocks * snap.block_size
    return snap.config_int("kv_cache_size_tokens") or None


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
    """Turn one `/metrics` exposition into a snapshot (summed over engines unless `engine`).

    Raises `MalformedMetrics` for a page that is not a vLLM server's (no `vllm:` series: an empty
    or binary body, a proxy's error page) or whose figures cannot be true (`_check_plausible`)."""
    s = Samples(text)
    if not s.has_vllm:
        raise MalformedMetrics("no vLLM metrics in the answer (an empty page, or not a vLLM server's "
                               "/metrics)")
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
    snapshot = ServerSnapshot(
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
        proxima=read_engines(s, engine),
    )
    _check_plausible(snapshot, kv_usage)
    return snapshot


# Slack for ratios and comparisons of figures written as floats.
_EPS = 1e-6


def _check_plausible(snap: ServerSnapshot, kv_usage: dict[str | None, float]) -> None:
    """Figures that cannot all be true at once (each is finite and >= 0 already, `Samples`)."""
    for engine, usage in kv_usage.items():
        if usage > 1 + _EPS:
            where = f' (engine "{engine}")' if engine else ""
            raise MalformedMetrics(f"{c.Vllm.KV_USAGE} is {usage:g}{where}, above 1 (a share of the "
                                   "KV cache)")
    for name in ("block_size", "num_gpu_blocks"):
        value = getattr(snap, name)
        if value is not None and value <= 0:
            raise MalformedMetrics(f"{c.Vllm.CACHE_CONFIG_INFO}: {name} {value} is not a positive size")
    kv = snap.proxima
    if kv is None:
        return
    if kv.granularity < 1:
        raise MalformedMetrics(f"{c.ALLOCATOR_INFO.name}: block_size {kv.granularity} is not a positive size")
    total = kv.slots_total
    # Each against the capacity alone (static), never against each other: a scrape can land between
    # two gauge writes, so used + free may briefly differ from the total.
    for spec in (c.SLOTS_USED, c.SLOTS_FREE, c.SLOTS_CACHED, c.LIVE_TOKENS, c.LARGEST_FREE_RUN):
        value = kv.figure(spec.figure)
        if value > total + _EPS:
            raise MalformedMetrics(f"{spec.name} is {value:g}, more than the {total:g} slots of "
                                   f"{c.SLOTS_TOTAL.name}")
    # Shares of something that exists (block usage is not one: what blocks *would* need can exceed
    # the capacity that token slots fit).
    ratios = {c.OCCUPANCY_MAP.name: max(kv.occupancy, default=0.0),
              c.OCCUPANCY_CACHED_MAP.name: max(kv.occupancy_cached, default=0.0)}
    ratios |= {spec.name: kv.figure(spec.figure)
               for spec in (c.TOKEN_USAGE, c.FRAGMENTATION, c.BLOCK_FRAGMENTATION)}
    for name, value in ratios.items():
        if value > 1 + _EPS:
            raise MalformedMetrics(f"{name} is {value:g}, above 1 (a share)")


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
    except MalformedMetrics as err:
        error = f"unreadable /metrics: {err}"
    except Exception as err:  # noqa: BLE001 (any parser bug or odd exposition: one server's problem)
        error = f"unreadable /metrics: {type(err).__name__}: {err}"
    # One line, and a bounded one: the message may quote the server's own text.
    error = " ".join(error.split())
    return ServerSnapshot(url=url, taken_at=taken_at, ok=False,
                          error=error if len(error) <= 300 else error[:297] + "...")


async def scrape(client: httpx.AsyncClient, url: str, timeout: float = 5.0,
                 engine: str | None = None, max_bytes: int = MAX_METRICS_BYTES) -> ServerSnapshot:
    """Fetch and parse `url`/metrics within `timeout` s in all and `max_bytes`. Never raises."""
    taken_at = time.time()
    try:
        text = await get_text(client, url.rstrip("/") + "/metrics", timeout, max_bytes)
    except (httpx.HTTPError, httpx.InvalidURL, ValueError) as err:
        return ServerSnapshot(url=url, taken_at=taken_at, ok=False, error=_metrics_error(err))
    # Parsing is pure Python and takes seconds for a huge exposition: off the caller's event loop
    # (the TUI's), so one server's /metrics never freezes the others.
    return await asyncio.to_thread(parse_or_error, text, url, taken_at, engine)


def scrape_sync(url: str, timeout: float = 5.0, engine: str | None = None,
                client: httpx.Client | None = None, max_bytes: int = MAX_METRICS_BYTES,
                headers: dict[str, str] | None = None) -> ServerSnapshot:
    """Blocking scrape. Pass a `client` to reuse one connection (and TLS set-up) across scrapes;
    `headers` (an API key's) go with a scrape that makes its own."""
    if client is None and headers:
        with httpx.Client(headers=headers, limits=client_limits()) as own:
            return scrape_sync(url, timeout, engine, own, max_bytes)
    taken_at = time.time()
    try:
        text = get_text_sync(client, url.rstrip("/") + "/metrics", timeout, max_bytes)
    except (httpx.HTTPError, httpx.InvalidURL, ValueError) as err:
        return ServerSnapshot(url=url, taken_at=taken_at, ok=False, error=_metrics_error(err))
    return parse_or_error(text, url, taken_at, engine)


def _metrics_error(err: Exception) -> str:
    """A failed /metrics read in one line; "connection refused" and "timed out" stay as they are
    (the dashboard's commonest states), the rest says it was /metrics that failed."""
    text = describe_http_error(err)
    if isinstance(err, (httpx.ConnectError, httpx.TimeoutException)):
        return text
    return f"/metrics: {text}"
