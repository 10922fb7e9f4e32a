"""The KV memory dashboard: occupancy, token vs block usage, fragmentation, allocator, headroom.

This is the view stock vLLM cannot give: it reports KV use only in whole blocks
(vLLM's `kv_cache_usage_perc`). Proxima's engine exports what requests actually hold, what
block-granular allocation would hold for the same requests, and how the allocator behaves.
"""

from __future__ import annotations

from dashboards import panels as p
from dashboards import promql as q
from proxima.metrics import catalog as c

UID = "proxima-kv-memory"
INSTANCE, MODEL = q.INSTANCE_MATCH, q.MODEL_MATCH
BY_INSTANCE = ("instance",)
LEGEND = "{{instance}} e{{engine}}"

_INTRO = f"""\
**KV memory as Proxima sees it.** Stock vLLM reports KV use only in whole blocks
(`{c.Vllm.KV_USAGE}`); Proxima exports the tokens requests actually hold, what
{c.REFERENCE_BLOCK_SIZE}-token blocks would hold for the same requests, fragmentation, a
{c.OCCUPANCY_SEGMENTS}-segment occupancy map and allocator latency. Panels marked
*needs Proxima* stay empty for an instance that runs stock vLLM."""


def _padded_segments(expr: str) -> str:
    """Zero-pad single-digit segment labels so the rows sort 00..63, not 0, 1, 10, 11, ..."""
    return f'label_replace({expr}, "segment", "0$1", "segment", "^([0-9])$")'


def headroom(board: p.Board) -> None:
    board.row("Headroom")
    board.add(
        p.stat_panel("Token usage", c.TOKEN_USAGE.help,
                     [p.Target(q.sel(c.TOKEN_USAGE, INSTANCE), LEGEND)], "percentunit"),
        p.stat_panel("Free slots", c.SLOTS_FREE.help,
                     [p.Target(q.sel(c.SLOTS_FREE, INSTANCE), LEGEND)], "short"),
        p.stat_panel("Largest free run", c.LARGEST_FREE_RUN.help + " The longest prompt that "
                     "fits without scattering its slots.",
                     [p.Target(q.sel(c.LARGEST_FREE_RUN, INSTANCE), LEGEND)], "short"),
        p.stat_panel("Capacity (slots)", c.SLOTS_TOTAL.help,
                     [p.Target(q.sel(c.SLOTS_TOTAL, INSTANCE), LEGEND)], "short"),
        p.stat_panel("KV cache size", c.CACHE_BYTES.help,
                     [p.Target(q.sel(c.CACHE_BYTES, INSTANCE), LEGEND)], "bytes"),
        p.stat_panel("Allocator", c.ALLOCATOR_INFO.help,
                     [p.Target(q.sel(c.ALLOCATOR_INFO, INSTANCE),
                               "{{allocator}}, {{block_size}}-token granularity")], "none",
                     name_only=True),
        # vLLM's own info gauge, so it reads the same for stock vLLM: fp8 halves the bytes of a
        # token, and with them what "KV cache size" holds.
        p.stat_panel("KV cache dtype", "vLLM's --kv-cache-dtype as the server runs it (auto: the "
                     "model's dtype; fp8: e4m3, one byte per value, twice the tokens per byte).",
                     [p.Target(q.sel(c.Vllm.CACHE_CONFIG_INFO, INSTANCE), "{{cache_dtype}}")], "none",
                     name_only=True),
    )


def occupancy(board: p.Board) -> None:
    board.row("Occupancy map")
    board.add(
        p.occupancy_panel(
            "KV occupancy map ($instance)",
            c.OCCUPANCY_MAP.help + " One row per segment (00 = start of the cache); red = full. "
            "Scattered partly-filled segments with little free run mean fragmentation.",
            [p.Target(_padded_segments(q.sel(c.OCCUPANCY_MAP, INSTANCE)),
                      "{{segment}}")],
            rows=c.OCCUPANCY_SEGMENTS,
        ).repeat("instance").repeat_direction("v"),
    )


def usage(board: p.Board) -> None:
    board.row("Usage and fragmentation")
    board.add(
        p.timeseries_panel(
            "Token vs block usage",
            "What requests hold (tokens) against what block-granular allocation would report for "
            f"the same requests, and what vLLM itself reports ({c.Vllm.KV_USAGE}).",
            [p.Target(q.sel(c.TOKEN_USAGE, INSTANCE), LEGEND + " tokens (Proxima)"),
             p.Target(q.sel(c.BLOCK_USAGE, INSTANCE),
                      LEGEND + f" {c.REFERENCE_BLOCK_SIZE}-token blocks"),
             p.Target(q.sel(c.Vllm.KV_USAGE, INSTANCE, MODEL), LEGEND + " vLLM reported")],
            "percentunit", min_val=0, max_val=1),
        p.timeseries_panel(
            "Fragmentation: Proxima vs block-granular",
            f"{c.FRAGMENTATION.help} Against: {c.BLOCK_FRAGMENTATION.help}",
            [p.Target(q.sel(c.FRAGMENTATION, INSTANCE), LEGEND + " allocator in use"),
             p.Target(q.sel(c.BLOCK_FRAGMENTATION, INSTANCE),
                      LEGEND + f" {c.REFERENCE_BLOCK_SIZE}-token blocks")],
            "percentunit", min_val=0, max_val=1),
        p.timeseries_panel(
            "Slots",
            "Used, free and prefix-cached slots, and the live tokens requests hold. Used minus "
            "live tokens is memory allocated but not (yet) holding KV.",
            [p.Target(q.sel(c.SLOTS_USED, INSTANCE), LEGEND + " used"),
             p.Target(q.sel(c.SLOTS_FREE, INSTANCE), LEGEND + " free"),
             p.Target(q.sel(c.SLOTS_CACHED, INSTANCE), LEGEND + " cached"),
             p.Target(q.sel(c.LIVE_TOKENS, INSTANCE), LEGEND + " live tokens")],
            "short", min_val=0),
        p.timeseries_panel(
            "Requests holding slots vs running",
            f"{c.REQUESTS_HOLDING_SLOTS.help} Held slots with no running or waiting request for minutes "
            "is a slot leak.",
            [p.Target(q.sel(c.REQUESTS_HOLDING_SLOTS, INSTANCE), LEGEND + " holding slots"),
             p.Target(q.sel(c.Vllm.RUNNING, INSTANCE, MODEL), LEGEND + " running (vLLM)"),
             p.Target(q.sel(c.Vllm.WAITING, INSTANCE, MODEL), LEGEND + " waiting (vLLM)")],
            "short", min_val=0),
    )


def hit_rate(window: str, *matchers: str) -> str:
    """vLLM's prefix-cache hit rate (hit tokens / looked-up tokens) over `window`, per instance."""
    return (f"{q.sum_rate(c.Vllm.PREFIX_CACHE_HITS, window, BY_INSTANCE, *matchers)} / "
            f"{q.sum_rate(c.Vllm.PREFIX_CACHE_QUERIES, window, BY_INSTANCE, *matchers)}")


def prefix_cache(board: p.Board) -> None:
    board.row("Prefix cache")
    board.add(
        p.timeseries_panel(
            "Prefix-cache hit rate",
            "Prompt tokens served from the prefix cache over the tokens looked up "
            f"({c.Vllm.PREFIX_CACHE_HITS} / {c.Vllm.PREFIX_CACHE_QUERIES}: vLLM's own counters, "
            "so stock servers show here too). Under Proxima they count token-exact hits.",
            [p.Target(hit_rate(p.RATE_INTERVAL, INSTANCE, MODEL), "{{instance}}")],
            "percentunit", width=8, min_val=0, max_val=1),
        p.timeseries_panel(
            "Cached slots and evictions",
            f"{c.SLOTS_CACHED.help} Against the rate at which cached tokens are evicted "
            f"({c.PREFIX_EVICTED_TOKENS.help}). Evictions climbing while the hit rate falls is a "
            "cache that thrashes: runbooks/prefix-cache-thrash.md.",
            [p.Target(q.sel(c.SLOTS_CACHED, INSTANCE), LEGEND + " cached slots"),
             p.Target(q.sum_rate(c.PREFIX_EVICTED_TOKENS, p.RATE_INTERVAL, BY_INSTANCE, INSTANCE),
                      "{{instance}} evicted tokens/s")],
            "short", width=8, min_val=0),
        p.timeseries_panel(
            f"Hits beyond {c.REFERENCE_BLOCK_SIZE}-token blocks",
            f"{c.PREFIX_HIT_BEYOND_BLOCKS.help} As a share of all hit tokens "
            f"({c.PREFIX_HIT_TOKENS.name}): what token-exact sharing adds over a block cache.",
            [p.Target(f"{q.sum_rate(c.PREFIX_HIT_BEYOND_BLOCKS, p.RATE_INTERVAL, BY_INSTANCE, INSTANCE)}"
                      f" / {q.sum_rate(c.PREFIX_HIT_TOKENS, p.RATE_INTERVAL, BY_INSTANCE, INSTANCE)}",
                      "{{instance}}")],
            "percentunit", width=8, min_val=0, max_val=1),
    )


def allocator(board: p.Board) -> None:
    board.row("Allocator and preemptions")
    by_op = ("instance", "op")
    board.add(
        p.timeseries_panel(
            "Allocator latency p50 / p99 per op",
            c.ALLOCATOR_LATENCY.help,
            [p.Target(q.quantile(0.5, c.ALLOCATOR_LATENCY, p.RATE_INTERVAL, by_op, INSTANCE),
                      "{{instance}} {{op}} p50"),
             p.Target(q.quantile(0.99, c.ALLOCATOR_LATENCY, p.RATE_INTERVAL, by_op, INSTANCE),
                      "{{instance}} {{op}} p99")],
            "s", width=8),
        p.timeseries_panel(
            "Allocator operations / s",
            "Allocations, frees and scheduler steps per second.",
            [p.Target(f"sum by (instance, op) "
                      f"({q.rate(c.ALLOCATOR_LATENCY, p.RATE_INTERVAL, INSTANCE, suffix='_count')})",
                      "{{instance}} {{op}}")],
            "ops", width=8, min_val=0),
        p.timeseries_panel(
            "Preemptions / s",
            f"{c.PREEMPTIONS.help} Counted by Proxima and by vLLM ({c.Vllm.PREEMPTIONS}); "
            "sustained preemptions mean the KV cache is too small for the load.",
            [p.Target(q.sum_rate(c.PREEMPTIONS, p.RATE_INTERVAL, BY_INSTANCE, INSTANCE),
                      "{{instance}} Proxima"),
             p.Target(q.sum_rate(c.Vllm.PREEMPTIONS, p.RATE_INTERVAL, BY_INSTANCE, INSTANCE, MODEL),
                      "{{instance}} vLLM")],
            "reqps", width=8, min_val=0),
    )


def build() -> p.Board:
    board = (p.Board(UID, "Proxima / KV memory",
                     "Token-granular KV cache: occupancy, usage, fragmentation, allocator.")
             .variable(p.query_variable("model_name", "Model", q.MODEL_VALUES, multi=True))
             .variable(p.query_variable("instance", "Instance", q.INSTANCE_VALUES, multi=True)))
    board.add(p.text_panel("About this dashboard", _INTRO, height=4))
    headroom(board)
    occupancy(board)
    usage(board)
    prefix_cache(board)
    allocator(board)
    return board
