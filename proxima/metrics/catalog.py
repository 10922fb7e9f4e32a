"""The one catalog of Proxima's metrics, and the stock vLLM metrics Proxima's tools read.

Every exporter, dashboard, alert rule, probe and TUI panel takes names from here: a name is
written once. Conventions (prometheus_client practice): `proxima_` prefix, base units in the
name (`_seconds`, `_bytes`), `_total` only on counters, bounded labels (never a request or slot
id). Gauges carry a `multiprocess_mode` because the engine process writes them through
prometheus_client's multiprocess mode and vLLM's API server serves them on its `/metrics`.

Beside each name the entry says, once, the whole path of its figure (the way nvitop keeps a
metric's name beside how to read it):
  stat      the `KVStats` attribute the engine publishes each step (both exporters read it);
            None for a figure set at start-up (`set_static`) or counted per event
  figure    the `KVSnapshot` attribute the tools read it as (`proxima.scrape`)
  read      how a scrape reads one engine's figure (`Read`)
  combine   how several engines' (or servers') figures become one (`Combine`), with `of`
            naming the figures a computed or weighted one is made from
Adding a gauge is one entry here plus its `KVStats` attribute, where the engine computes it;
the exporters, the scrape layer and the combination need nothing more
(tests/test_catalog_one_path.py adds one and follows it through all of them).
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum


class Kind(str, Enum):
    GAUGE = "gauge"
    COUNTER = "counter"
    HISTOGRAM = "histogram"


class Read(str, Enum):
    """How a tool reads one engine's figure from a scrape."""

    VALUE = "value"  # the engine's samples added up (over `sink`, say); the largest if written as a max
    # Not read: computed from the engine's own counts by its `combine` rule, so that a ratio always
    # agrees with the counts shown beside it (a scrape can land between two gauge writes).
    COMPUTED = "computed"
    SEGMENTS = "segments"  # one sample per `segment` label, in segment order
    HISTOGRAMS = "histograms"  # one histogram per `op` label
    LABELS = "labels"  # an info metric: its labels are the figures (allocator; block_size: granularity)


class Combine(str, Enum):
    """How several engines' (or servers') figures become one. A ratio is never added up: two
    engines at 60% are at 60%, not 120%; it is recomputed from the engines' summed counts."""

    SUM = "sum"  # counts and counters
    MAX = "max"  # the largest engine's (a longest free run, bytes per token)
    # of[0] / of[1], each summed over the engines (0 when of[1] is 0). A term "a*b" is an
    # engine's a times its b: block usage x slots = the slots its blocks would take.
    RATIO = "ratio"
    WASTE = "waste"  # (of[0] - of[1]) / of[0], summed likewise: the share of of[0] not live, >= 0
    # Each engine's values weighted by its of[0] (equal weights when all are 0): segment i of
    # several occupancy maps; maps of unequal length combine to none.
    WEIGHTED = "weighted"
    HISTOGRAMS = "histograms"  # bucket counts added (histograms with the same bounds)
    LABELS = "labels"  # the allocators named together ("block/token"), the finest granularity


@dataclass(frozen=True, slots=True)
class MetricSpec:
    name: str
    kind: Kind
    help: str
    unit: str = ""
    labels: tuple[str, ...] = ("engine",)
    buckets: tuple[float, ...] = ()
    # How the API server combines values written by several live processes.
    multiprocess_mode: str = "livesum"
    figure: str = ""
    stat: str | None = None
    read: Read = Read.VALUE
    combine: Combine = Combine.SUM
    of: tuple[str, ...] = ()

    @property
    def sample_name(self) -> str:
        """The name a scrape shows (prometheus_client appends `_total` to counters)."""
        return self.name + "_total" if self.kind is Kind.COUNTER else self.name


# Number of segments the occupancy map is downsampled to: enough for a dashboard strip and a
# terminal row, small enough to stay a bounded label set.
OCCUPANCY_SEGMENTS = 64
# Block size against which token-granular usage is compared: vLLM's default on GPU.
REFERENCE_BLOCK_SIZE = 16
# Usage at which the KV cache counts as nearly full: `proxima top` turns it red, the exhaustion
# alert fires on it (with requests waiting) and the doctor's ramp calls a queue behind it
# "queueing for a full KV cache". One value, so all three tell the same story.
KV_DANGER_USAGE = 0.95
# Usage at which `proxima top` turns the KV cache yellow: warn early, before anything queues.
KV_WARN_USAGE = 0.85

# Figures that count single slots of what other requests cached: a client who reads them could
# recover a cached prompt token by token, so only a single-tenant server publishes them.
_EXACT_ONLY = "Published only with --proxima-exact-kv-figures (docs/security.md)."

_LATENCY_BUCKETS = (
    1e-6, 2.5e-6, 5e-6, 1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2, 0.1,
)

ALLOCATOR_INFO = MetricSpec(
    "proxima_allocator_info",
    Kind.GAUGE,
    "Constant 1, labelled with the KV allocator in use (token = Proxima slots, block = stock vLLM), "
    "the allocation granularity in tokens, and kv_figures: block when the figures that depend on "
    f"other requests' cached tokens are disclosed in whole {REFERENCE_BLOCK_SIZE}-token blocks "
    "(the default), exact when token-exact (--proxima-exact-kv-figures).",
    labels=("engine", "allocator", "block_size", "kv_figures"),
    figure="allocator", read=Read.LABELS, combine=Combine.LABELS,
)
SLOTS_TOTAL = MetricSpec(
    "proxima_kv_slots", Kind.GAUGE, "KV cache capacity in token slots.", unit="slots",
    figure="slots_total", stat="slots_total",
)
SLOTS_USED = MetricSpec(
    "proxima_kv_slots_used",
    Kind.GAUGE,
    "Token slots used: live requests reference them, each counted once however many requests share "
    "it through the prefix cache (for the block allocator: blocks in use x block size).",
    unit="slots",
    figure="slots_used", stat="slots_used",
)
SLOTS_FREE = MetricSpec(
    "proxima_kv_slots_free", Kind.GAUGE,
    "Token slots any request may take (total - used): empty ones and the cached ones of "
    "proxima_kv_slots_cached, which an allocation evicts on demand.",
    unit="slots",
    figure="slots_free", stat="slots_free",
)
SLOTS_CACHED = MetricSpec(
    "proxima_kv_slots_cached",
    Kind.GAUGE,
    "Token slots cached: no request references them, they still hold reusable prefix-cache entries "
    "(evicted on demand, least recently used first), and proxima_kv_slots_free counts them; "
    f"counted in whole {REFERENCE_BLOCK_SIZE}-token blocks unless --proxima-exact-kv-figures.",
    unit="slots",
    figure="slots_cached", stat="slots_cached",
)
LIVE_TOKENS = MetricSpec(
    "proxima_kv_live_tokens",
    Kind.GAUGE,
    "Tokens whose KV live requests hold (computed or scheduled to be computed this step); a slot "
    "shared by several requests through the prefix cache counts once.",
    unit="tokens",
    figure="live_tokens", stat="live_tokens",
)
TOKEN_USAGE = MetricSpec(
    "proxima_kv_token_usage_ratio",
    Kind.GAUGE,
    "Live tokens / KV capacity: the memory requests actually need.",
    figure="token_usage", stat="token_usage",
    read=Read.COMPUTED, combine=Combine.RATIO, of=("live_tokens", "slots_total"),
)
BLOCK_USAGE = MetricSpec(
    "proxima_kv_block_usage_ratio",
    Kind.GAUGE,
    f"KV usage that block-granular allocation at {REFERENCE_BLOCK_SIZE} tokens per block would report "
    "for the same live requests (what vllm:kv_cache_usage_perc counts).",
    figure="block_usage", stat="block_usage",
    combine=Combine.RATIO, of=("block_usage*slots_total", "slots_total"),
)
FRAGMENTATION = MetricSpec(
    "proxima_kv_fragmentation_ratio",
    Kind.GAUGE,
    "Allocated-but-unused slots / allocated slots, for the allocator in use.",
    figure="fragmentation", stat="fragmentation",
    read=Read.COMPUTED, combine=Combine.WASTE, of=("slots_used", "live_tokens"),
)
BLOCK_FRAGMENTATION = MetricSpec(
    "proxima_kv_block_fragmentation_ratio",
    Kind.GAUGE,
    f"Fragmentation that block-granular allocation at {REFERENCE_BLOCK_SIZE} tokens per block would "
    "have for the same live requests.",
    # Read as exported; combined from the slots those blocks would take (block usage x capacity),
    # a count the engine does not export on its own.
    figure="block_fragmentation", stat="block_fragmentation",
    combine=Combine.WASTE, of=("block_usage*slots_total", "live_tokens"),
)
OCCUPANCY_MAP = MetricSpec(
    "proxima_kv_occupancy_ratio",
    Kind.GAUGE,
    f"Fraction of slots used by requests in each of {OCCUPANCY_SEGMENTS} equal segments of the KV "
    f"cache (a downsampled occupancy map; cached slots are not counted). {_EXACT_ONLY}",
    labels=("engine", "segment"),
    figure="occupancy", stat="occupancy", read=Read.SEGMENTS, combine=Combine.WEIGHTED,
    of=("slots_total",),
)
OCCUPANCY_CACHED_MAP = MetricSpec(
    "proxima_kv_occupancy_cached_ratio",
    Kind.GAUGE,
    f"Fraction of slots cached (prefix entries no request references) in each of the "
    f"{OCCUPANCY_SEGMENTS} segments of proxima_kv_occupancy_ratio. {_EXACT_ONLY}",
    labels=("engine", "segment"),
    figure="occupancy_cached", stat="occupancy_cached", read=Read.SEGMENTS, combine=Combine.WEIGHTED,
    of=("slots_total",),
)
LARGEST_FREE_RUN = MetricSpec(
    "proxima_kv_largest_free_run_slots",
    Kind.GAUGE,
    f"Longest run of contiguous empty slots: neither used by requests nor cached. {_EXACT_ONLY}",
    unit="slots",
    multiprocess_mode="max",
    figure="largest_free_run", stat="largest_free_run", combine=Combine.MAX,
)
BYTES_PER_TOKEN = MetricSpec(
    "proxima_kv_bytes_per_token",
    Kind.GAUGE,
    "KV cache bytes one token occupies across all layers.",
    unit="bytes",
    multiprocess_mode="max",
    figure="bytes_per_token", combine=Combine.MAX,
)
CACHE_BYTES = MetricSpec(
    "proxima_kv_cache_bytes", Kind.GAUGE, "KV cache size.", unit="bytes", multiprocess_mode="max",
    figure="cache_bytes",
)
REQUESTS_HOLDING_SLOTS = MetricSpec(
    "proxima_kv_requests_holding_slots",
    Kind.GAUGE,
    "Requests that hold KV slots (running, or preempted before release).",
    figure="requests_holding_slots", stat="requests_holding_slots",
)
PREEMPTIONS = MetricSpec(
    "proxima_kv_preemptions",
    Kind.COUNTER,
    "Requests preempted because the KV cache had no room for their next tokens.",
    figure="preemptions_total",
)
ALLOCATOR_LATENCY = MetricSpec(
    "proxima_allocator_latency_seconds",
    Kind.HISTOGRAM,
    "Time the KV allocator spends per operation (allocate, free) and per scheduler step (step).",
    unit="seconds",
    labels=("engine", "op"),
    buckets=_LATENCY_BUCKETS,
    figure="allocator_latency", read=Read.HISTOGRAMS, combine=Combine.HISTOGRAMS,
)
ALLOCATOR_OPS = ("allocate", "free", "step")
# Scheduler-step p99 (ALLOCATOR_LATENCY, op="step") above which the step is a stall users feel:
# the alert fires on it and `proxima doctor`'s allocator check warns on it, one value so that
# both tell the same story. On the H200 the step (vLLM's scheduling, the allocator inside) takes
# 0.45-0.61 ms, at parity with stock vLLM (docs/benchmarks.md), so this is four times that at
# the tail. It is a bucket bound, so a p99 read from the buckets crosses it exactly rather than
# by interpolating inside a bucket.
ALLOCATOR_STEP_P99_LIMIT_S = 0.0025
PREFIX_HIT_TOKENS = MetricSpec(
    "proxima_prefix_cache_hit_tokens",
    Kind.COUNTER,
    "Prompt tokens admitted from Proxima's token-exact prefix cache instead of computed "
    "(vllm:prefix_cache_hits_total counts every lookup, including admissions retried later); "
    f"each hit counted in whole {REFERENCE_BLOCK_SIZE}-token blocks unless --proxima-exact-kv-figures.",
    unit="tokens",
    figure="prefix_hit_tokens_total", stat="prefix.hit_tokens",
)
PREFIX_HIT_BEYOND_BLOCKS = MetricSpec(
    "proxima_prefix_cache_hit_tokens_beyond_blocks",
    Kind.COUNTER,
    f"Of those, tokens a prefix cache of {REFERENCE_BLOCK_SIZE}-token blocks would have missed "
    f"(the partial block at the end of each hit). {_EXACT_ONLY}",
    unit="tokens",
    figure="prefix_hit_tokens_beyond_blocks_total", stat="prefix.hit_tokens_beyond_blocks",
)
PREFIX_EVICTED_TOKENS = MetricSpec(
    "proxima_prefix_cache_evicted_tokens",
    Kind.COUNTER,
    "Cached tokens evicted to make room for new ones (least recently used first).",
    unit="tokens",
    figure="prefix_evicted_tokens_total", stat="prefix.evicted_tokens",
)
PREFIX_COUNTERS = (PREFIX_HIT_TOKENS, PREFIX_HIT_BEYOND_BLOCKS, PREFIX_EVICTED_TOKENS)
TELEMETRY_ERRORS = MetricSpec(
    "proxima_telemetry_errors",
    Kind.COUNTER,
    "Exceptions raised by a KV telemetry sink (prometheus, otlp) and caught so that serving goes on; "
    "the sink's figures are stale or missing while this rises.",
    labels=("engine", "sink"),
    figure="telemetry_errors_total",
)
# The sinks' names, as the scheduler registers them (the label values of TELEMETRY_ERRORS).
TELEMETRY_SINKS = ("prometheus", "otlp", "collect")  # collect: reading the KV state itself

ENGINE_METRICS: tuple[MetricSpec, ...] = (
    ALLOCATOR_INFO,
    SLOTS_TOTAL,
    SLOTS_USED,
    SLOTS_FREE,
    SLOTS_CACHED,
    LIVE_TOKENS,
    TOKEN_USAGE,
    BLOCK_USAGE,
    FRAGMENTATION,
    BLOCK_FRAGMENTATION,
    OCCUPANCY_MAP,
    OCCUPANCY_CACHED_MAP,
    LARGEST_FREE_RUN,
    BYTES_PER_TOKEN,
    CACHE_BYTES,
    REQUESTS_HOLDING_SLOTS,
    PREEMPTIONS,
    ALLOCATOR_LATENCY,
    *PREFIX_COUNTERS,
    TELEMETRY_ERRORS,
)


class Vllm:
    """Stock vLLM 0.26 metric names that Proxima's tools read (samples as scraped)."""

    RUNNING = "vllm:num_requests_running"
    WAITING = "vllm:num_requests_waiting"
    KV_USAGE = "vllm:kv_cache_usage_perc"
    PREEMPTIONS = "vllm:num_preemptions_total"
    PROMPT_TOKENS = "vllm:prompt_tokens_total"
    GENERATION_TOKENS = "vllm:generation_tokens_total"
    REQUEST_SUCCESS = "vllm:request_success_total"
    TTFT = "vllm:time_to_first_token_seconds"
    ITL = "vllm:inter_token_latency_seconds"
    E2E = "vllm:e2e_request_latency_seconds"
    QUEUE_TIME = "vllm:request_queue_time_seconds"
    CACHE_CONFIG_INFO = "vllm:cache_config_info"
    PREFIX_CACHE_QUERIES = "vllm:prefix_cache_queries_total"
    PREFIX_CACHE_HITS = "vllm:prefix_cache_hits_total"
    REQUEST_PROMPT_TOKENS = "vllm:request_prompt_tokens"
    REQUEST_GENERATION_TOKENS = "vllm:request_generation_tokens"
    PROCESS_RESIDENT_MEMORY = "process_resident_memory_bytes"


# The engine's metrics by how they are fed. Functions, not constants: they read ENGINE_METRICS
# when called, so an entry added to it (a test's, say) is exported and read like the others.

def published() -> tuple[MetricSpec, ...]:
    """Figures the engine publishes each step, read from `KVStats` by their `stat`."""
    return tuple(spec for spec in ENGINE_METRICS if spec.stat is not None)


def kv_figures() -> tuple[MetricSpec, ...]:
    """Figures a scrape reads into a `KVSnapshot` (every engine metric has one)."""
    return tuple(spec for spec in ENGINE_METRICS if spec.figure)
