"""Views → Rich text lines: the one drawing code behind both the Textual panels and `--once`.

Layer: rendering only. Functions take immutable views (never snapshots, never I/O) and a width,
and return `rich.text.Text` lines; the panels show them styled, `plain.py` prints their `.plain`,
so the terminal UI and the plain-text snapshot can never disagree on a figure.
"""

from __future__ import annotations

from functools import lru_cache

from rich.style import Style
from rich.text import Text

from proxima import fmt
from proxima.metrics import catalog
from proxima.scrape import KVSnapshot
from proxima.tui.model import DANGER_USAGE, WARN_USAGE, Point, ServerView

RAMP = " ▁▂▃▄▅▆▇█"
LEVEL_STYLE = {"ok": "green", "warn": "yellow", "danger": "bold red"}
DIM = "bright_black"
CACHED = "blue"  # prefix-cache entries no request references: the map, the bar and the help agree


@lru_cache(maxsize=64)
def style(spec: str) -> Style:
    """Parsed once: per-cell strings would be re-parsed on every render (most of a frame's cost)."""
    return Style.parse(spec)


def append_runs(text: Text, cells) -> Text:
    """Append (glyph, Style) cells, one span per run of equal style: maps and sparklines have
    hundreds of cells but few colour changes, and every span costs at render time."""
    run: list[str] = []
    run_style: Style | None = None
    for glyph, cell_style in cells:
        if cell_style is not run_style and run:
            text.append("".join(run), run_style)
            run = []
        run_style = cell_style
        run.append(glyph)
    if run:
        text.append("".join(run), run_style)
    return text


def usage_style(fraction: float | None) -> str:
    if fraction is None:
        return DIM
    return "red" if fraction >= DANGER_USAGE else "yellow" if fraction >= WARN_USAGE else "green"


def resample(values: tuple[float, ...] | list[float], width: int) -> list[float]:
    """Area-weighted resampling of equal segments onto `width` columns (down or up)."""
    n = len(values)
    if n == 0 or width <= 0:
        return []
    out = []
    for col in range(width):
        lo, hi = col * n / width, (col + 1) * n / width
        total, k = 0.0, int(lo)
        while k < n and k < hi:
            total += values[k] * (min(hi, k + 1) - max(lo, k))
            k += 1
        out.append(total / (hi - lo))
    return out


def occupancy_map(occupancy: tuple[float, ...], width: int, rows: int = 2,
                  cached: tuple[float, ...] = ()) -> list[Text]:
    """Each column a bar (rows × 8 levels): the share of its slots used by requests from the
    bottom, coloured by how full, and the share cached stacked above it in CACHED, a cell wholly
    cached drawn ▒ as in the bar below the map, so cached reads as cached even without colour.
    `cached` empty (a server that does not publish it): used only."""
    used_cols = resample(occupancy, width)
    cached_cols = resample(cached, width) if len(cached) == len(occupancy) else [0.0] * len(used_cols)
    empty = style(f"{DIM} on grey15")
    levels = rows * 8

    def cell(u: float, k: float, row: int) -> tuple[str, Style]:
        used = round(max(0.0, min(1.0, u)) * levels) - row * 8
        top = round(max(0.0, min(1.0, u + k)) * levels) - row * 8
        if top <= 0 and row == 0:
            return "·", empty  # an empty stretch, visible even without colour
        if top <= used or used >= 8 or top <= 0:  # no cached slots in this cell
            return RAMP[max(0, min(8, top))], style(f"{usage_style(u)} on grey15")
        if used <= 0:  # cached only
            return ("▒" if top >= 8 else RAMP[top]), style(f"{CACHED} on grey15")
        return RAMP[used], style(f"{usage_style(u)} on {CACHED}")  # used, with cached above it

    return [append_runs(Text(), (cell(u, k, row) for u, k in zip(used_cols, cached_cols)))
            for row in range(rows - 1, -1, -1)]


def bar(parts: list[tuple[float, str, str]], width: int) -> Text:
    """A proportional bar from (fraction, glyph, style) parts; the rest is free space."""
    text, used = Text(), 0
    for fraction, glyph, style in parts:
        n = min(width - used, round(max(0.0, fraction) * width))
        text.append(glyph * n, style=style)
        used += n
    text.append("░" * (width - used), style=DIM)
    return text


def _row(label: str, *parts: tuple[str, str] | str) -> Text:
    line = Text(f"{label:<12}", style="bold")
    for part in parts:
        line.append(*(part if isinstance(part, tuple) else (part,)))
    return line


def kv_lines(view: ServerView, width: int) -> list[Text]:
    width = max(width, 20)
    if view.kind == "unknown":
        return [Text(f"no data: {view.error or 'not scraped yet'}", style="red")]
    if view.kv is None:
        return _stock_kv_lines(view, width)
    kv = view.kv
    if not kv.slots_total:
        return [Text("Proxima metrics present, but the engine has not reported its first step yet "
                     "(send a request).", style=DIM)]
    lines = occupancy_map(kv.occupancy, width, cached=kv.occupancy_cached) if kv.occupancy else []
    if not kv.exact_figures:
        lines.append(Text(f"prefix-cache figures in whole {catalog.REFERENCE_BLOCK_SIZE}-token blocks, as "
                          "a block cache discloses them: no slot map or free run (a single-tenant server "
                          "shows them with --proxima-exact-kv-figures)", style=DIM))
    used, cached = kv.slot_usage, kv.slots_cached / kv.slots_total
    free = max(0.0, kv.slots_free - kv.slots_cached) / kv.slots_total  # cached slots are free too
    legend = f" used {fmt.pct(used)} · cached {fmt.pct(cached)} · free {fmt.pct(free)}"
    bar_width = max(10, width - len(legend))
    lines.append(bar([(used, "█", usage_style(used)), (cached, "▒", CACHED)], bar_width) + Text(legend))
    lines += [
        _row("slots", (f"{fmt.count(kv.slots_used)} / {fmt.count(kv.slots_total)}", usage_style(used)),
             f" used ({fmt.pct(used)}) · {fmt.count(kv.slots_cached)} cached · "
             f"{fmt.count(max(0.0, kv.slots_free - kv.slots_cached))} free" + _dtype_note(view)),
        _row("tokens", f"{fmt.count(kv.live_tokens)} live ({fmt.pct(kv.token_usage)}) · "
             f"{catalog.REFERENCE_BLOCK_SIZE}-token blocks would use {fmt.pct(kv.block_usage)}"),
        _row("fragment.", f"{fmt.pct(kv.fragmentation)} of used slots idle · "
             f"{catalog.REFERENCE_BLOCK_SIZE}-token blocks would idle {fmt.pct(kv.block_fragmentation)}"),
        *([_row("free run", f"largest {fmt.count(kv.largest_free_run)} contiguous slots "
                f"({fmt.pct(kv.largest_free_run / kv.slots_total)} of capacity)")]
          if kv.exact_figures else []),
        _row("headroom", *_headroom(view)),
        _row("allocator", *_allocator_latency(kv)),
    ]
    if view.prefix_hit_rate is not None or kv.prefix_hit_tokens_total:
        lines.append(_row("prefix", _prefix_summary(view, kv)))
    if any(h.count for h in kv.allocator_latency.values()):
        lines.append(_row("", (f"p50/p99 per call, {window_label(view)} (step = one scheduler step)", DIM)))
    return lines


def _headroom(view: ServerView) -> list[tuple[str, str] | str]:
    if view.headroom_requests is None or view.typical_request_tokens is None:
        return [(fmt.NONE_YET, DIM),
                (" (no request size known yet: none running or finished in the window)", DIM)]
    style = "red" if view.headroom_requests < 1 else "yellow" if view.headroom_requests < 4 else "green"
    return [(f"~{view.headroom_requests:,.0f}", style),
            f" more requests of {view.typical_request_tokens:,.0f} tokens (mean running size)"]


def _allocator_latency(kv: KVSnapshot) -> list[tuple[str, str] | str]:
    if not any(h.count for h in kv.allocator_latency.values()):
        return [("no allocator calls in the window", DIM)]
    return [" · ".join(f"{op} {fmt.seconds(h.quantile(0.5))}/{fmt.seconds(h.quantile(0.99))}"
                       for op, h in kv.allocator_latency.items() if h.count)]


def _stock_kv_lines(view: ServerView, width: int) -> list[Text]:
    usage = view.kv_usage
    legend = f" vLLM kv usage {fmt.pct(usage)}"
    lines = [bar([(usage, "█", usage_style(usage))], max(10, width - len(legend))) + Text(legend)]
    lines.append(Text("stock vLLM exposes only vllm:kv_cache_usage_perc (block level): no slot map, no "
                      "fragmentation, no allocator timings. Serve with `proxima serve` to see inside.",
                      style=DIM))
    if view.capacity_tokens:
        lines.append(_row("blocks", f"~{fmt.count(view.used_tokens)} / {fmt.count(view.capacity_tokens)} "
                          f"token positions ({fmt.count(view.num_gpu_blocks)} blocks × {view.block_size})"))
    lines.append(_row("headroom", *_headroom(view)))
    if view.prefix_hit_rate is not None:
        lines.append(_row("prefix", f"hit rate {fmt.pct(view.prefix_hit_rate)} (whole blocks only)"))
    return lines


def _dtype_note(view: ServerView) -> str:
    """The KV dtype when it is not the model's own (fp8 halves bytes per token)."""
    dtype = view.kv_cache_dtype
    if dtype in (None, "auto") or view.kv is None:
        return ""
    return f" · KV {dtype}, {fmt.count(view.kv.bytes_per_token)} B/token"


def _prefix_summary(view: ServerView, kv) -> str:
    """Prefix cache: hit rate, what token-exact sharing added, what was evicted."""
    parts = [f"hit rate {fmt.pct(view.prefix_hit_rate)}" if view.prefix_hit_rate is not None
             else f"hit rate {fmt.NA}"]
    share = kv.beyond_blocks_share
    if share is not None:
        parts.append(f"{fmt.pct(share)} of hits beyond {catalog.REFERENCE_BLOCK_SIZE}-token blocks")
    elif not kv.exact_figures:
        parts.append(f"hits counted in whole {catalog.REFERENCE_BLOCK_SIZE}-token blocks")
    parts.append(f"{fmt.count(kv.prefix_evicted_tokens_total)} evicted")
    return " · ".join(parts)


def window_label(view: ServerView) -> str:
    if view.stale:
        return f"figures as last seen at {fmt.clock(view.last_ok_at)}"
    return "since server start" if view.window_s is None else f"last {fmt.duration(view.window_s)}"


def serving_lines(view: ServerView) -> list[Text]:
    waiting_style = "yellow" if view.waiting else ""
    lines = [
        _row("running", f"{fmt.count(view.running):<8}", ("waiting ", "bold"),
             (fmt.count(view.waiting), waiting_style)),
        _row("finished", f"{fmt.count(view.finished_total):<8}", ("failed  ", "bold"),
             fmt.NA if view.failed_total is None else fmt.count(view.failed_total)),
        _row("preempt", (fmt.per_second(view.preemption_rate), "yellow" if view.preemption_rate else "")),
        _row("prompt", fmt.per_second(view.prompt_rate, " tok")),
        _row("generation", fmt.per_second(view.generation_rate, " tok")),
        Text(f"{'':<12}{'p50':>9}{'p95':>9}", style="bold"),
    ]
    for name, hist in (("TTFT", view.ttft), ("ITL", view.itl), ("E2E", view.e2e)):
        lines.append(_row(name, f"{fmt.seconds(hist.quantile(0.5)):>9}{fmt.seconds(hist.quantile(0.95)):>9}"))
    lines.append(Text(f"{window_label(view)} · {fmt.count(view.e2e.count)} req finished", style=DIM))
    lines.append(_row("scrape err", (str(view.scrape_errors), "red" if view.scrape_errors else "")))
    return lines


def gpu_lines(gpus, width: int) -> list[Text]:
    if gpus is None:
        return [Text(f"{fmt.NA}: no watched server is on this host (GPU readings are local only)", style=DIM)]
    if not gpus:
        return [Text(f"{fmt.NA}: no GPU readable through NVML on this host", style=DIM)]
    lines = []
    for g in gpus:
        frac = g.memory_fraction
        mem = (f" {fmt.gib(g.memory_used_bytes)} / {fmt.gib(g.memory_total_bytes)}"
               if frac is not None else f" {fmt.NA}")
        util = fmt.NA if g.utilization_pct is None else f"{g.utilization_pct:.0f}%"
        power = fmt.NA if g.power_watts is None else f"{g.power_watts:.0f} W"
        head = Text(f"GPU{g.index} {g.name[:18]:<18} ", style="bold")
        tail = f"{mem}  util {util:>4}  power {power}"
        bar_width = max(8, width - len(head) - len(tail))
        lines.append(head + bar([(frac or 0.0, "█", usage_style(frac))], bar_width) + Text(tail))
    return lines


def spark(points: tuple[Point, ...], attr: str, width: int, span_s: float, now: float,
          hi: float | None = None, rows: int = 1) -> list[Text]:
    """One row of eighth-blocks on a time axis ending at `now`; the max of each column's samples.

    A fixed time axis (not one column per sample) keeps the picture steady when the refresh rate
    changes, and ratios keep a fixed 0..1 scale so a flat 20% never looks like a full cache.
    """
    if width <= 0:
        return [Text() for _ in range(rows)]
    # Sample-and-hold: a column between two samples shows the earlier one (refresh ticks and
    # columns rarely line up); only a point without a value (server down) leaves a gap.
    cols: list[float | None] = [None] * width
    start = now - span_s
    held: float | None = None
    last_col = -1
    for p in points:
        if p.t < start:
            held = getattr(p, attr)
            continue
        c = min(width - 1, int((p.t - start) / span_s * width))
        for k in range(last_col + 1, c):
            cols[k] = held
        v = getattr(p, attr)
        if c != last_col or cols[c] is None:
            cols[c] = v
        elif v is not None:
            cols[c] = max(cols[c], v)
        held, last_col = v, c
    top = hi if hi is not None else max((v for v in cols if v is not None), default=0.0)
    # Heights in eighths of a row; the least visible mark for a sample (even a zero) so that
    # "zero" and "no sample" (a gap, e.g. while a server is down) look different.
    heights = [0 if v is None else (max(1, round(rows * 8 * min(1.0, v / top))) if top > 0 else 1)
               for v in cols]
    styles = [style(usage_style(v) if hi == 1.0 else "cyan") for v in cols]
    return [append_runs(Text(), ((RAMP[max(0, min(8, h - (rows - 1 - r) * 8))], st)
                                 for h, st in zip(heights, styles)))
            for r in range(rows)]


SPARK_ROWS = (
    ("KV usage", "usage", 1.0, fmt.pct),
    ("running", "running", None, fmt.count),
    ("waiting", "waiting", None, fmt.count),
    ("gen tok/s", "generation_rate", None, fmt.per_second),
    ("TTFT p95", "ttft_p95", None, fmt.seconds),
    ("preempt/s", "preemption_rate", None, fmt.per_second),
)


def history_span(points: tuple[Point, ...], history_s: float) -> float:
    """At least a minute; then as long as the history, up to its bound."""
    if not points:
        return 60.0
    return min(history_s, max(60.0, points[-1].t - points[0].t))


def history_lines(points: tuple[Point, ...], width: int, history_s: float, height: int = 6) -> list[Text]:
    """One sparkline per figure, each as many rows tall as `height` allows (1 to 3)."""
    if not points:
        return [Text("no samples yet", style=DIM)]
    span, now, last = history_span(points, history_s), points[-1].t, points[-1]
    rows = max(1, min(3, height // len(SPARK_ROWS)))
    spaced = height - rows * len(SPARK_ROWS) >= len(SPARK_ROWS) - 1
    lines = []
    for label, attr, hi, show in SPARK_ROWS:
        if spaced and lines:
            lines.append(Text())
        value = getattr(last, attr)
        shown = show(value) if value is not None else fmt.NONE_YET
        for r, strip in enumerate(spark(points, attr, max(1, width - 23), span, now, hi, rows)):
            bottom = r == rows - 1
            line = Text(f"{label if bottom else '':<11}", style="bold")
            line.append_text(strip)
            line.append(f" {shown if bottom else '':>10}")
            lines.append(line)
    return lines


_TABLE = ((" server", 22, "<"), ("engine", 11, "<"), ("state", 6, "<"), ("run", 5, ">"), ("wait", 5, ">"),
          ("KV use", 7, ">"), ("frag", 6, ">"), ("headroom", 9, ">"), ("gen/s", 8, ">"),
          ("TTFT p95", 9, ">"), ("preempt", 8, ">"), ("err", 5, ">"))


def _cells(view: ServerView, label: str) -> list[tuple[str, str]]:
    state = ("up", "green") if view.ok else (("stale", "red") if view.stale else ("DOWN", "bold red"))
    allocator = view.kv.allocator if view.kv else "?"
    kind = {"proxima": f"{allocator} slots", "stock": "stock vLLM"}.get(view.kind, fmt.NONE_YET)
    if view.kind == "aggregate":
        kind, state = "", (f"{view.level}", LEVEL_STYLE[view.level])
    usage = view.usage
    return [
        (label, "bold"), (kind, ""), state, (fmt.count(view.running), ""),
        (fmt.count(view.waiting), "yellow" if view.waiting else ""),
        (fmt.pct(usage), usage_style(usage)),
        (fmt.pct(view.kv.fragmentation) if view.kv else fmt.NA, ""),
        (fmt.NONE_YET if view.headroom_requests is None else f"~{view.headroom_requests:,.0f}", ""),
        (fmt.per_second(view.generation_rate), ""), (fmt.seconds(view.ttft.quantile(0.95)), ""),
        (fmt.per_second(view.preemption_rate), "yellow" if view.preemption_rate else ""),
        (str(view.scrape_errors), "red" if view.scrape_errors else ""),
    ]


def _table_row(cells: list[tuple[str, str]]) -> Text:
    line = Text()
    for (text, style), (_, width, align) in zip(cells, _TABLE):
        cell = text[:width] if align == "<" else text[-width:]
        line.append(f"{cell:{align}{width}} ", style=style)
    return line


def servers_lines(views: tuple[ServerView, ...], aggregate: ServerView, width: int) -> list[Text]:
    """The aggregate view: one row per server, a total row, then each server's occupancy strip."""
    lines = [Text("".join(f"{name:{align}{w}} " for name, w, align in _TABLE), style="bold underline")]
    for n, view in enumerate(views, start=1):
        lines.append(_table_row(_cells(view, f"{n} {fmt.short_url(view.url)}")))
    lines.append(_table_row(_cells(aggregate, " all servers")))
    quantiles = " · ".join(f"{name} {fmt.seconds(h.quantile(0.5))}/{fmt.seconds(h.quantile(0.95))}"
                           for name, h in (("TTFT", aggregate.ttft), ("ITL", aggregate.itl),
                                           ("E2E", aggregate.e2e)))
    lines.append(Text(f" p50/p95 {quantiles} ({window_label(aggregate)}) · prompt "
                      f"{fmt.per_second(aggregate.prompt_rate, ' tok')} · finished "
                      f"{fmt.count(aggregate.finished_total)}", style=DIM))
    lines.append(Text())
    strip = max(10, width - 24)
    for n, view in enumerate(views, start=1):
        head = Text(f"{n} {fmt.short_url(view.url)[:20]:<20}  ", style="bold")
        if view.kv is not None and view.kv.occupancy and view.kv.slots_total:
            strip_map = occupancy_map(view.kv.occupancy, strip, rows=1, cached=view.kv.occupancy_cached)
            lines.append(head + strip_map[0])
        elif view.kind == "stock":
            lines.append(head + bar([(view.kv_usage, "█", usage_style(view.kv_usage))], strip))
        else:
            lines.append(head + Text("no KV picture (down or not reached yet)", style=DIM))
    return lines


def server_title(view: ServerView) -> Text:
    """`127.0.0.1:8000 · Proxima token slots · model /m` and, when down, since when."""
    title = Text(fmt.short_url(view.url), style="bold")
    if view.kind == "proxima" and view.kv is not None:
        title.append(f" · Proxima {view.kv.allocator} allocator (granularity {view.kv.granularity})")
    elif view.kind == "stock":
        title.append(f" · stock vLLM (block size {view.block_size or '?'})")
    if view.model_name:
        title.append(f" · model {view.model_name}", style=DIM)
    if not view.ok:
        since = f" since {fmt.clock(view.down_since)}" if view.down_since else ""
        title.append(f" · DOWN{since} (retrying)", style="bold red")
    return title
