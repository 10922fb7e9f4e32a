"""Charts of a bench result: inline SVG (always; no dependency) and a PNG when matplotlib exists.

`chart_specs` decides what to plot from a `BenchResult`; `svg_line_chart` and `write_png` only
draw. The SVG needs nothing but the standard library, so the HTML report is self-contained on any
machine; matplotlib is optional.
"""

from __future__ import annotations

import html
import math
from dataclasses import dataclass, field
from pathlib import Path

from proxima.bench.results import CONCURRENCY, RATE, BenchResult
from proxima.files import atomic_output

PALETTE = ("#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#8c564b")


@dataclass(frozen=True, slots=True)
class Series:
    label: str
    points: tuple[tuple[float, float], ...]
    dashed: bool = False


@dataclass(frozen=True, slots=True)
class ChartSpec:
    title: str
    x_label: str
    y_label: str
    series: tuple[Series, ...]
    log_x: bool = False
    hline: tuple[float, str] | None = None  # (y, label), e.g. the SLO
    y_cap: float | None = None  # upper bound of the y axis (it still zooms in below it)
    markers: bool = True
    notes: tuple[str, ...] = field(default=())


def chart_specs(result: BenchResult) -> list[ChartSpec]:
    slo = result.verdict.get("slo_p95_e2e_s", result.config.get("slo_p95_e2e_s"))
    specs: list[ChartSpec] = []
    for kind, x_label in ((CONCURRENCY, "concurrent requests"), (RATE, "offered rate (req/s)")):
        runs = [(r.label, r.levels_of(kind)) for r in result.runs if r.levels_of(kind)]
        if not runs:
            continue
        xs = [lv.value for _, levels in runs for lv in levels]
        log_x = min(xs) > 0 and max(xs) / min(xs) >= 8

        def series(attr, runs=runs):
            return tuple(Series(label, tuple((lv.value, attr(lv)) for lv in levels if attr(lv) is not None))
                         for label, levels in runs)

        what = "concurrency" if kind == CONCURRENCY else "offered rate"
        specs.append(ChartSpec(f"Output throughput vs {what}", x_label, "output tokens/s",
                               series(lambda lv: lv.output_tps), log_x))
        specs.append(ChartSpec(f"Requests per second vs {what}", x_label, "completed req/s",
                               series(lambda lv: lv.rps), log_x))
        specs.append(ChartSpec(f"P95 end-to-end latency vs {what}", x_label, "P95 E2E (s)",
                               series(lambda lv: lv.e2e.p95), log_x,
                               hline=(slo, f"SLO {slo:g}s") if slo else None))
    kv = tuple(
        Series(run.label, tuple(sorted((lv.started_s + s.t, 100.0 * s.kv_usage) for lv in run.levels
                                       for s in lv.timeline if s.ok and s.kv_usage is not None)))
        for run in result.runs
    )
    if any(s.points for s in kv):
        specs.append(ChartSpec("KV cache occupancy over time (vllm:kv_cache_usage_perc)",
                               "seconds since the server's first level", "KV occupancy (%)", kv,
                               y_cap=100.0, markers=False))
    frag = tuple(
        Series(run.label, tuple(sorted((lv.started_s + s.t, 100.0 * s.fragmentation) for lv in run.levels
                                       for s in lv.timeline if s.ok and s.fragmentation is not None)))
        for run in result.runs
    )
    if any(s.points for s in frag):
        specs.append(ChartSpec("KV fragmentation over time (Proxima metrics)",
                               "seconds since the server's first level", "slots allocated but not live (%)",
                               tuple(s for s in frag if s.points), y_cap=100.0, markers=False))
    return specs


def _nice_ticks(low: float, high: float, count: int = 5) -> list[float]:
    if high <= low:
        high = low + 1.0
    raw = (high - low) / count
    magnitude = 10 ** math.floor(math.log10(raw))
    step = next(m * magnitude for m in (1, 2, 2.5, 5, 10) if m * magnitude >= raw)
    first = math.ceil(low / step) * step
    return [first + i * step for i in range(int((high - first) / step + 1e-9) + 1)]


def _fmt(value: float) -> str:
    if value == 0:
        return "0"
    if abs(value) >= 1000:
        return f"{value / 1000:g}k"
    return f"{value:.3g}"


def svg_line_chart(spec: ChartSpec, width: int = 640, height: int = 360) -> str:
    left, right, top, bottom = 64, 150, 36, 48
    plot_w, plot_h = width - left - right, height - top - bottom
    points = [p for s in spec.series for p in s.points]
    esc = html.escape
    head = (f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
            f'viewBox="0 0 {width} {height}" font-family="sans-serif" font-size="12" role="img">'
            f'<title>{esc(spec.title)}</title>'
            f'<text x="{width / 2}" y="20" text-anchor="middle" font-size="14" font-weight="bold">'
            f'{esc(spec.title)}</text>')
    if not points:
        return head + f'<text x="{width / 2}" y="{height / 2}" text-anchor="middle">no data</text></svg>'
    xs = [x for x, _ in points]
    ys = [y for _, y in points] + ([spec.hline[0]] if spec.hline else [])
    fx = (lambda v: math.log2(v)) if spec.log_x else (lambda v: v)
    x_lo, x_hi = fx(min(xs)), fx(max(xs))
    if x_hi == x_lo:
        x_lo, x_hi = x_lo - 1, x_hi + 1
    y_hi = max(ys) * 1.1 or 1.0
    if spec.y_cap is not None:
        y_hi = min(y_hi, spec.y_cap)

    def px(v: float) -> float:
        return left + (fx(v) - x_lo) / (x_hi - x_lo) * plot_w

    def py(v: float) -> float:
        return top + plot_h - min(max(v, 0.0), y_hi) / y_hi * plot_h

    frame = f'<rect x="{left}" y="{top}" width="{plot_w}" height="{plot_h}" fill="none" stroke="#999"/>'
    parts = [head, frame]
    for t in _nice_ticks(0.0, y_hi):
        if t <= y_hi:
            parts.append(f'<line x1="{left}" x2="{left + plot_w}" y1="{py(t):.1f}" y2="{py(t):.1f}" '
                         f'stroke="#e5e5e5"/><text x="{left - 6}" y="{py(t) + 4:.1f}" text-anchor="end">'
                         f'{_fmt(t)}</text>')
    # Sweeps label their levels; time axes get round numbers.
    levels = spec.log_x or (spec.markers and len(set(xs)) <= 8)
    x_ticks = sorted(set(xs)) if levels else [t for t in _nice_ticks(min(xs), max(xs)) if t >= min(xs)]
    for t in x_ticks:
        parts.append(f'<text x="{px(t):.1f}" y="{top + plot_h + 16}" text-anchor="middle">{_fmt(t)}</text>')
    parts.append(f'<text x="{left + plot_w / 2}" y="{height - 8}" text-anchor="middle">{esc(spec.x_label)}'
                 f'{" (log scale)" if spec.log_x else ""}</text>')
    parts.append(f'<text x="14" y="{top + plot_h / 2}" text-anchor="middle" '
                 f'transform="rotate(-90 14 {top + plot_h / 2})">{esc(spec.y_label)}</text>')
    if spec.hline:
        y = py(spec.hline[0])
        parts.append(f'<line x1="{left}" x2="{left + plot_w}" y1="{y:.1f}" y2="{y:.1f}" stroke="#555" '
                     f'stroke-dasharray="6 4"/><text x="{left + plot_w - 4}" y="{y - 4:.1f}" '
                     f'text-anchor="end" fill="#555">{esc(spec.hline[1])}</text>')
    for i, s in enumerate(spec.series):
        color = PALETTE[i % len(PALETTE)]
        coords = " ".join(f"{px(x):.1f},{py(y):.1f}" for x, y in s.points)
        dash = ' stroke-dasharray="4 3"' if s.dashed else ""
        parts.append(f'<polyline points="{coords}" fill="none" stroke="{color}" stroke-width="2"{dash}>'
                     f'<title>{esc(s.label)}</title></polyline>')
        if spec.markers:
            for x, y in s.points:
                parts.append(f'<circle cx="{px(x):.1f}" cy="{py(y):.1f}" r="3.5" fill="{color}">'
                             f'<title>{esc(s.label)}: {_fmt(x)} → {y:.3g}</title></circle>')
        ly = top + 14 + 18 * i
        parts.append(f'<line x1="{left + plot_w + 12}" x2="{left + plot_w + 32}" y1="{ly - 4}" y2="{ly - 4}" '
                     f'stroke="{color}" stroke-width="3"/><text x="{left + plot_w + 38}" y="{ly}">'
                     f'{esc(s.label)}</text>')
    parts.append("</svg>")
    return "".join(parts)


def matplotlib_available() -> bool:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return False
    return True


def write_png(specs: list[ChartSpec], path: Path) -> None:
    """All charts in one PNG grid (call only when `matplotlib_available()`)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cols = 2
    rows = max(1, math.ceil(len(specs) / cols))
    fig, axes = plt.subplots(rows, cols, figsize=(12, 4 * rows), squeeze=False)
    for ax, spec in zip(axes.flat, specs):
        for i, s in enumerate(spec.series):
            if s.points:
                x, y = zip(*s.points)
                ax.plot(x, y, marker="o" if spec.markers else None, label=s.label,
                        color=PALETTE[i % len(PALETTE)], linestyle="--" if s.dashed else "-")
        if spec.hline:
            ax.axhline(spec.hline[0], color="#555", linestyle="--", label=spec.hline[1])
        if spec.log_x:
            ax.set_xscale("log", base=2)
            ticks = sorted({x for s in spec.series for x, _ in s.points})
            ax.set_xticks(ticks, [f"{t:g}" for t in ticks])
        ys = [y for s in spec.series for _, y in s.points] + ([spec.hline[0]] if spec.hline else [])
        top = max(ys, default=1.0) * 1.1 or 1.0
        ax.set_ylim(0, min(top, spec.y_cap) if spec.y_cap is not None else None)
        ax.set_title(spec.title, fontsize=10)
        ax.set_xlabel(spec.x_label)
        ax.set_ylabel(spec.y_label)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    for ax in list(axes.flat)[len(specs):]:
        ax.axis("off")
    fig.tight_layout()
    try:
        with atomic_output(path, "wb") as f:
            fig.savefig(f, format="png", dpi=100)
    finally:
        plt.close(fig)
