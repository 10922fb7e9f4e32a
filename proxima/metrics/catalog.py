"""The one catalog of Proxima's metrics, and the stock vLLM metrics Proxima's tools read.

Every exporter, dashboard, alert rule, probe and TUI panel takes names from here: a name is
written once. Conventions (prometheus_client practice): `proxima_` prefix, base units in the
name (`_seconds`, `_bytes`), `_total` only on counters, bounded labels (never a request or slot
id). Gauges carry a `multiprocess_mode` because the engine process writes them through
prometheus_client's multiprocess mode and vLLM's API server serves them on its `/metrics`.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum


class Kind(str, Enum):
    GAUGE = "gauge"
    COUNTER = "counter"
    HISTOGRAM = "histogram"


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

    @property
    def sample_name(self) -> str:
        """The name a scrape shows (prometheus_client appends `_total` to counters)."""
        return self.name + "_total" if self.kind is Kind.COUNTER else self.name


# Number of segments the occupancy map is downsampled to: enough for a dashboard strip and a
# terminal row, small enough to stay a bounded label set.
OCCUPANCY_SEGMENTS = 64
# Block size against which token-granular usage is compared: vLLM's default on GPU.
REFERENCE_BLOCK_SIZE = 16
# Token usage at which the KV cache counts as nearly full: `proxima top` turns it red and the
# exhaustion alert fires on it (with requests waiting). One value, so both tell the same story.
KV_DANGER_USAGE = 0.95

_LATENCY_BUCKETS = (
    1e-6, 2.5e-6, 5e-6, 1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2, 0.1,
)

ALLOCATOR_INFO = MetricSpec(
    "proxima_allocator_info",
    Kind.GAUGE,
    "Constant 1, labelled with the KV allocator in use (token = Proxima slots, block = stock vLLM) "
    "and the allocation granularity in tokens.",
    labels=("engine", "allocator", "block_size"),
)
SLOTS_TOTAL = MetricSpec(
    "proxima_kv_slots", Kind.GAUGE, "KV cache capacity in token slots.", unit="slots"
)
SLOTS_USED = MetricSpec(
    "proxima_kv_slots_used",
    Kind.GAUGE,
    "Token slots live requests reference, each counted once however many requests share it "
    "through the prefix cache (for the block allocator: blocks in use x block size).",
    unit="slots",
)
SLOTS_FREE = MetricSpec(
    "proxima_kv_slots_free", Kind.GAUGE,
    "Token slots any request may take: unused ones and cached ones no request references.",
    unit="slots"
)
SLOTS_CACHED = MetricSpec(
    "proxima_kv_slots_cached",
    Kind.GAUGE,
    "Free token slots that still hold reusable prefix-cache entries (evicted on demand, least "
    "recently used first).",
    unit="slots",
)
LIVE_TOKENS = MetricSpec(
    "proxima_kv_live_tokens",
    Kind.GAUGE,
    "Tokens whose KV live requests hold (computed or scheduled to be computed this step); a slot "
    "shared by several requests through the prefix cache counts once.",
    unit="tokens",
)
TOKEN_USAGE = MetricSpec(
    "proxima_kv_token_usage_ratio",
    Kind.GAUGE,
    "Live tokens / KV capacity: the memory requests actually need.",
)
BLOCK_USAGE = MetricSpec(
    "proxima_kv_block_usage_ratio",
    Kind.GAUGE,
    f"KV usage that block-granular allocation at {REFERENCE_BLOCK_SIZE} tokens per block would report "
    "for the same live requests (what vllm:kv_cache_usage_perc counts).",
)
FRAGMENTATION = MetricSpec(
    "proxima_kv_fragmentation_ratio",
    Kind.GAUGE,
    "Allocated-but-unused slots / allocated slots, for the allocator in use.",
)
BLOCK_FRAGMENTATION = MetricSpec(
    "proxima_kv_block_fragmentation_ratio",
    Kind.GAUGE,
    f"Fragmentation that block-granular allocation at {REFERENCE_BLOCK_SIZE} tokens per block would "
    "have for the same live requests.",
)
OCCUPANCY_MAP = MetricSpec(
    "proxima_kv_occupancy_ratio",
    Kind.GAUGE,
    f"Fraction of slots in use in each of {OCCUPANCY_SEGMENTS} equal segments of the KV cache "
    "(a downsampled occupancy map).",
    labels=("engine", "segment"),
)
LARGEST_FREE_RUN = MetricSpec(
    "proxima_kv_largest_free_run_slots",
    Kind.GAUGE,
    "Longest run of contiguous free slots.",
    unit="slots",
    multiprocess_mode="max",
)
BYTES_PER_TOKEN = MetricSpec(
    "proxima_kv_bytes_per_token",
    Kind.GAUGE,
    "KV cache bytes one token occupies across all layers.",
    unit="bytes",
    multiprocess_mode="max",
)
CACHE_BYTES = MetricSpec(
    "proxima_kv_cache_bytes", Kind.GAUGE, "KV cache size.", unit="bytes", multiprocess_mode="max"
)
RUNNING_REQUESTS = MetricSpec(
    "proxima_kv_requests_holding_slots",
    Kind.GAUGE,
    "Requests that hold KV slots (running, or preempted before release).",
)
PREEMPTIONS = MetricSpec(
    "proxima_kv_preemptions",
    Kind.COUNTER,
    "Requests preempted because the KV cache had no room for their next tokens.",
)
ALLOCATOR_LATENCY = MetricSpec(
    "proxima_allocator_latency_seconds",
    Kind.HISTOGRAM,
    "Time the KV allocator spends per operation (allocate, free) and per scheduler step (step).",
    unit="seconds",
    labels=("engine", "op"),
    buckets=_LATENCY_BUCKETS,
)
ALLOCATOR_OPS = ("allocate", "free", "step")
PREFIX_HIT_TOKENS = MetricSpec(
    "proxima_prefix_cache_hit_tokens",
    Kind.COUNTER,
    "Prompt tokens admitted from Proxima's token-exact prefix cache instead of computed "
    "(vllm:prefix_cache_hits_total counts every lookup, including admissions retried later).",
    unit="tokens",
)
PREFIX_HIT_BEYOND_BLOCKS = MetricSpec(
    "proxima_prefix_cache_hit_tokens_beyond_blocks",
    Kind.COUNTER,
    f"Of those, tokens a prefix cache of {REFERENCE_BLOCK_SIZE}-token blocks would have missed "
    "(the partial block at the end of each hit).",
    unit="tokens",
)
PREFIX_EVICTED_TOKENS = MetricSpec(
    "proxima_prefix_cache_evicted_tokens",
    Kind.COUNTER,
    "Cached tokens evicted to make room for new ones (least recently used first).",
    unit="tokens",
)
PREFIX_COUNTERS = (PREFIX_HIT_TOKENS, PREFIX_HIT_BEYOND_BLOCKS, PREFIX_EVICTED_TOKENS)
TELEMETRY_ERRORS = MetricSpec(
    "proxima_telemetry_errors",
    Kind.COUNTER,
    "Exceptions raised by a KV telemetry sink (prometheus, otlp) and caught so that serving goes on; "
    "the sink's figures are stale or missing while this rises.",
    labels=("engine", "sink"),
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
    LARGEST_FREE_RUN,
    BYTES_PER_TOKEN,
    CACHE_BYTES,
    RUNNING_REQUESTS,
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


def by_name() -> dict[str, MetricSpec]:
    return {spec.name: spec for spec in ENGINE_METRICS}
