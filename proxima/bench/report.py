"""Rendering of bench results: the terminal table and progress bar, and the files in `--out`.

Reads `BenchResult` only. Output files: results.json (everything, timelines included),
results.csv (one row per server and level), workload.jsonl (the exact requests, reloadable
with `--workload`), report.html (self-contained: tables and inline SVG charts) and report.png
when matplotlib is installed. Each file is written through a temporary name.
"""

from __future__ import annotations

import html
from functools import partial
from pathlib import Path

from rich import box
from rich.console import Group
from rich.markup import escape
from rich.panel import Panel
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table
from rich.text import Text

from proxima import fmt
from proxima.bench import charts
from proxima.bench.results import CONCURRENCY, RATE, BenchResult, LevelResult, to_csv
from proxima.bench.sweep import Observer, Target
from proxima.bench.workload import Workload, write_jsonl
from proxima.files import write_atomic
from proxima.streaming import OK, RequestResult

# Bench's missing figures are readings not taken here (no NVML, sampling off, a stock server's
# fragmentation): `fmt.NA`, in the one formatter.
NA = fmt.NA
_ms = partial(fmt.ms, missing=NA)
_pct = partial(fmt.pct, digits=0, missing=NA)
_num = partial(fmt.number, missing=NA)
_gib = partial(fmt.gib, missing=NA, unit=False)


def _e2e(q: str):
    return lambda lv: _num(getattr(lv.e2e, q), "{:.2f}")


def _pm(figure: str, cell, scale: float = 1.0, digits: int = 0):
    """The cell, then ± the half-width of its 95% interval when the level ran more than once."""
    def render(lv: LevelResult) -> str:
        found = lv.intervals.get(figure)
        return cell(lv) + (f" ±{found.half_width * scale:.{digits}f}" if found is not None else "")
    return render


SPEED, MEMORY, BOTH = "speed", "memory", "both"
# (header, cell, terminal table): one definition for the terminal and the HTML tables. The
# terminal keeps the columns an A/B is judged by, in two tables that each fit 120 columns (SPEED:
# throughput and latency; MEMORY: what the servers held, and the client); the HTML has every
# percentile (None: the HTML only).
COLUMNS = (
    ("server", lambda lv: lv.server, BOTH),
    ("level", lambda lv: lv.label, BOTH),
    ("ok/fail/tmo", lambda lv: f"{lv.completed}/{lv.failed}/{lv.timed_out}", SPEED),
    ("req/s", _pm("rps", lambda lv: f"{lv.rps:.2f}", digits=2), SPEED),
    ("out tok/s", _pm("output_tps", lambda lv: f"{lv.output_tps:.0f}"), SPEED),
    ("total tok/s", lambda lv: f"{lv.total_tps:.0f}", None),
    ("TTFT p50 ms", lambda lv: _ms(lv.ttft.p50), None),
    ("TTFT p95 ms", _pm("ttft_p95_s", lambda lv: _ms(lv.ttft.p95), scale=1e3), SPEED),
    ("TTFT p99 ms", lambda lv: _ms(lv.ttft.p99), None),
    ("ITL p50 ms", lambda lv: _ms(lv.itl.p50), SPEED),
    ("ITL p95 ms", lambda lv: _ms(lv.itl.p95), None),
    ("ITL p99 ms", lambda lv: _ms(lv.itl.p99), None),
    ("TPOT p50 ms", lambda lv: _ms(lv.tpot.p50), SPEED),
    ("TPOT p95 ms", lambda lv: _ms(lv.tpot.p95), None),
    ("TPOT p99 ms", lambda lv: _ms(lv.tpot.p99), None),
    ("E2E p50 s", _e2e("p50"), SPEED),
    ("E2E p95 s", _pm("e2e_p95_s", _e2e("p95"), digits=2), SPEED),
    ("E2E p99 s", _e2e("p99"), SPEED),
    ("peak running", lambda lv: _num(lv.peak_running), MEMORY),
    ("preempt", lambda lv: _num(lv.preemptions), MEMORY),
    ("prefix hits", lambda lv: _pct(lv.prefix_cache_hit_rate), MEMORY),
    ("peak KV", lambda lv: _pct(lv.peak_kv_usage), MEMORY),
    ("peak frag", lambda lv: _pct(lv.peak_fragmentation), MEMORY),
    ("peak GPU GiB", lambda lv: _gib(lv.peak_gpu_memory_bytes), MEMORY),
    ("client CPU", lambda lv: _pct(lv.client_cpu), MEMORY),
    ("client lag p99 ms", lambda lv: _ms(lv.client_loop_lag_p99_s), None),
    ("note", lambda lv: lv.aborted or "", MEMORY),
)
TEXT_COLUMNS = ("server", "level", "note")


def _levels(result: BenchResult, kind: str) -> list[LevelResult]:
    # Interleave servers per level so that A and B sit next to each other.
    rows = [lv for run in result.runs for lv in run.levels_of(kind)]
    order = {run.label: i for i, run in enumerate(result.runs)}
    return sorted(rows, key=lambda lv: (lv.value, order[lv.server]))


def terminal_tables(result: BenchResult) -> list[Table]:
    """Per sweep kind, a throughput-and-latency table and a memory-and-client one; levels that
    break the SLO in red in both."""
    tables = []
    for kind, title in ((CONCURRENCY, "Concurrency sweep"), (RATE, "Poisson rate sweep")):
        rows = _levels(result, kind)
        if not rows:
            continue
        for group, part in ((SPEED, "throughput and latency"), (MEMORY, "memory and client")):
            table = Table(title=f"{title}: {part}", box=box.SIMPLE_HEAD, padding=(0, 1), header_style="bold")
            shown = [(h, cell) for h, cell, where in COLUMNS if where in (group, BOTH)]
            for header, _ in shown:
                # Two-word headers on two lines: the numbers, not the titles, set the widths.
                table.add_column(header.replace(" ", "\n", 1) if header not in TEXT_COLUMNS else header,
                                 justify="left" if header in TEXT_COLUMNS else "right",
                                 no_wrap=header not in TEXT_COLUMNS)
            for lv in rows:
                failing = lv.slo_failure(result.verdict["slo_p95_e2e_s"], result.verdict["max_error_rate"])
                # Text, not markup: a label or a server's error message may contain "[...]".
                table.add_row(*(Text(str(cell(lv))) for _, cell in shown), style="red" if failing else None)
            tables.append(table)
    return tables


def _server_line(run) -> Text:
    grain = f", {run.kv_block_size}-token granularity" if run.kv_block_size else ""
    capacity = f", KV {run.kv_capacity_tokens:.0f} tokens" if run.kv_capacity_tokens else ""
    return Text(f"{run.label}: {run.url}, allocator {run.allocator or '?'}{grain}{capacity}", style="dim")


def verdict_panel(result: BenchResult) -> Panel:
    # Text objects throughout: labels, URLs and servers' error strings are data, never markup.
    lines = [_server_line(run) for run in result.runs]
    lines += [Text(str(line)) for line in result.verdict.get("summary", [])]
    lines += [Text(f"{run.label}: {run.stopped}", style="yellow") for run in result.runs if run.stopped]
    lines += [Text(f"note: {n}", style="yellow") for n in result.notes]
    return Panel(Group(*lines) if lines else "no levels ran", title="Verdict", expand=False)


class ProgressObserver(Observer):
    """A rich progress bar per level (requests done of requests planned, or elapsed time)."""

    def __init__(self, progress: Progress) -> None:
        self.progress = progress
        self.task = None
        self.done = self.errors = 0

    @staticmethod
    def make(console) -> Progress:
        return Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                        TextColumn("{task.fields[errors]}"), TimeElapsedColumn(), console=console,
                        transient=False)

    def level_started(self, target: Target, kind: str, value: float, total: int | None) -> None:
        label = f"c={value:g}" if kind == CONCURRENCY else f"{value:g} req/s"
        self.done = self.errors = 0
        self.task = self.progress.add_task(f"{escape(target.label):>10} {label:>12}", total=total, errors="")

    def request_done(self, target: Target, result: RequestResult) -> None:
        self.done += 1
        self.errors += result.status != OK
        self.progress.update(self.task, completed=self.done,
                             errors=f"[red]{self.errors} failed[/]" if self.errors else "")

    def event(self, text: str) -> None:
        self.progress.console.print(escape(text), highlight=False)

    def level_finished(self, target: Target, level: LevelResult) -> None:
        p95 = _num(level.e2e.p95, "{:.2f}")
        # The reason may quote a server's error message: data, escaped, never markup.
        note = f"[red]stopped: {escape(level.aborted)}[/]" if level.aborted else f"p95 {p95}s"
        self.progress.update(self.task, errors=note, total=self.done or 1, completed=self.done)


_CSS = (
    "body{font-family:sans-serif;margin:2em;max-width:1400px}"
    "table{border-collapse:collapse;font-size:13px}"
    "td,th{border:1px solid #ccc;padding:3px 6px;text-align:right}"
    "td:first-child,td:nth-child(2),td:last-child{text-align:left}tr.bad td{background:#fde8e8}"
    ".charts svg{margin:6px;border:1px solid #eee}code{background:#f4f4f4;padding:1px 4px}"
)


def html_report(result: BenchResult, png_name: str | None) -> str:
    esc = html.escape
    specs = charts.chart_specs(result)
    out = [
        ("<!doctype html><html><head><meta charset='utf-8'><title>proxima bench report</title>"
         f"<style>{_CSS}</style></head><body>"),
        "<h1>proxima bench</h1>",
        f"<p>{esc(result.created_at)} — <code>{esc(result.command)}</code></p>",
        "<h2>Verdict</h2><ul>",
        *(f"<li>{esc(line)}</li>" for line in result.verdict.get("summary", [])),
        *(f"<li>{esc(run.label)}: {esc(run.stopped)}</li>" for run in result.runs if run.stopped),
        "</ul>",
    ]
    if result.notes:
        out += ["<h3>Notes</h3><ul>", *(f"<li>{esc(n)}</li>" for n in result.notes), "</ul>"]
    out.append("<h2>Servers</h2><table><tr><th>label</th><th>url</th><th>model</th><th>allocator</th>"
               "<th>granularity (tokens)</th><th>KV capacity (tokens)</th><th>launched</th></tr>")
    for run in result.runs:
        launched = f"{run.variant} (log {run.launch.get('log')})" if run.launch else "no (given URL)"
        cells = (run.label, run.url, run.model, str(run.allocator), _num(run.kv_block_size),
                 _num(run.kv_capacity_tokens), launched)
        out.append("<tr>" + "".join(f"<td>{esc(str(c))}</td>" for c in cells) + "</tr>")
    out.append("</table>")
    w = result.workload
    out.append(f"<h2>Workload</h2><p>{esc(str(w['name']))}, seed {w['seed']}, {w['num_requests']} requests; "
               f"prompt tokens {w['prompt_tokens_min']}–{w['prompt_tokens_max']} "
               f"({esc(w['token_counting'])}); max_tokens {w['max_tokens_min']}–{w['max_tokens_max']}. "
               f"{esc(' '.join(w['notes']))} Saved as <code>workload.jsonl</code>.</p>")
    for kind, title in ((CONCURRENCY, "Concurrency sweep"), (RATE, "Poisson rate sweep")):
        rows = _levels(result, kind)
        if not rows:
            continue
        out.append(f"<h2>{title}</h2><table><tr>{''.join(f'<th>{esc(h)}</th>' for h, _, _ in COLUMNS)}</tr>")
        for lv in rows:
            bad = lv.slo_failure(result.verdict["slo_p95_e2e_s"], result.verdict["max_error_rate"])
            out.append(f"<tr{' class=bad' if bad else ''}>"
                       f"{''.join(f'<td>{esc(str(cell(lv)))}</td>' for _, cell, _ in COLUMNS)}</tr>")
        out.append("</table>")
    out.append("<h2>Charts</h2><div class='charts'>")
    out += [charts.svg_line_chart(spec) for spec in specs]
    out.append("</div>")
    if png_name:
        out.append(f"<p>Static copy: <a href='{esc(png_name)}'>{esc(png_name)}</a></p>")
    out.append("<p>All figures: <a href='results.json'>results.json</a>, "
               "<a href='results.csv'>results.csv</a>.</p></body></html>")
    return "\n".join(out)


def write_outputs(result: BenchResult, workload: Workload, out_dir: Path) -> list[Path]:
    """Render everything first, then write: a rendering fault leaves no partial set of files."""
    make_png = charts.matplotlib_available()
    if not make_png:
        result.notes.append("matplotlib is not installed: report.html has SVG charts, no report.png")
    texts = {
        "results.json": result.to_json(),
        "results.csv": to_csv(result),
        "report.html": html_report(result, "report.png" if make_png else None),
    }
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = []
    # results.json first: if the disk fills up later, the measurement itself is already safe.
    for name, text in texts.items():
        write_atomic(out_dir / name, text)
        paths.append(out_dir / name)
    write_jsonl(workload, out_dir / "workload.jsonl")
    paths.append(out_dir / "workload.jsonl")
    if make_png:
        charts.write_png(charts.chart_specs(result), out_dir / "report.png")
        paths.append(out_dir / "report.png")
    return paths
