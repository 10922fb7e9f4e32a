"""`--repeat N`: a level run N times, its headline figures as a mean with a 95% confidence
interval, and two servers called tied where their intervals overlap.

The level reported for N runs (`combine`) is the first run's record with: counts and durations
summed over the runs; req/s, output and total tok/s, and each latency percentile the mean over
the runs; `intervals` holding the Student's t interval of the four figures an A/B is judged by
(`FIGURES`). Timeline and peaks stay the first run's. A run stopped early ends the repetitions and
the level is reported as stopped. One run has no interval (None): nothing is called tied then.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable
from dataclasses import dataclass, replace

from proxima.bench.results import LevelResult, Stats
from proxima.probes.trend import t_quantile

CONFIDENCE = 0.95


@dataclass(frozen=True, slots=True)
class Interval:
    mean: float
    low: float
    high: float
    n: int

    @property
    def half_width(self) -> float:
        return (self.high - self.low) / 2

    def overlaps(self, other: Interval) -> bool:
        return self.low <= other.high and other.low <= self.high


def interval(values: list[float], confidence: float = CONFIDENCE) -> Interval | None:
    """Mean and Student's t interval of `values` (None for fewer than two)."""
    if len(values) < 2:
        return None
    mean = statistics.fmean(values)
    n = len(values)
    half = t_quantile(confidence, n - 1) * statistics.stdev(values) / math.sqrt(n)
    return Interval(mean, mean - half, mean + half, n)


# name in results.json: (reading, higher is better, name in the verdict)
FIGURES: dict[str, tuple[Callable[[LevelResult], float | None], bool, str]] = {
    "rps": (lambda lv: lv.rps, True, "req/s"),
    "output_tps": (lambda lv: lv.output_tps, True, "output tok/s"),
    "ttft_p95_s": (lambda lv: lv.ttft.p95, False, "TTFT P95"),
    "e2e_p95_s": (lambda lv: lv.e2e.p95, False, "E2E P95"),
}


def _mean(values: list[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return statistics.fmean(present) if present else None


def _mean_stats(runs: list[Stats]) -> Stats:
    return Stats(sum(s.n for s in runs), _mean([s.mean for s in runs]), _mean([s.p50 for s in runs]),
                 _mean([s.p95 for s in runs]), _mean([s.p99 for s in runs]))


def combine(runs: list[LevelResult]) -> LevelResult:
    """One level's record for its runs (see the module's docstring); one run is returned as it is."""
    if len(runs) == 1:
        return runs[0]
    first = runs[0]
    level = replace(first, timeline=list(first.timeline), errors=dict(first.errors))
    for name in ("num_sent", "completed", "failed", "timed_out", "cancelled", "prompt_tokens",
                 "output_tokens", "duration_s"):
        setattr(level, name, sum(getattr(r, name) for r in runs))
    for name in ("rps", "output_tps", "total_tps", "client_cpu"):
        setattr(level, name, statistics.fmean(getattr(r, name) for r in runs))
    for name in ("ttft", "itl", "tpot", "e2e"):
        setattr(level, name, _mean_stats([getattr(r, name) for r in runs]))
    level.peak_in_flight = max(r.peak_in_flight for r in runs)
    level.aborted = next((r.aborted for r in runs if r.aborted), None)
    level.num_runs = len(runs)
    level.intervals = {}
    for name, (read, _, _) in FIGURES.items():
        values = [read(r) for r in runs]
        if all(v is not None for v in values):
            found = interval(values)
            if found is not None:
                level.intervals[name] = found
    return level


def compare(a: LevelResult, b: LevelResult, figure: str) -> str | None:
    """`tied`, `a` or `b` (which is better) for one figure, None without both intervals."""
    ia, ib = a.intervals.get(figure), b.intervals.get(figure)
    if ia is None or ib is None:
        return None
    if ia.overlaps(ib):
        return "tied"
    higher_is_better = FIGURES[figure][1]
    return "b" if (ib.mean > ia.mean) == higher_is_better else "a"


def compare_runs(a_levels: list[LevelResult], b_levels: list[LevelResult], a_name: str,
                 b_name: str) -> tuple[list[dict], list[str]]:
    """Per level both servers ran N > 1 times, per figure: tied (intervals overlap) or who is
    better; as records for results.json and as one summary line per figure."""
    b_at = {lv.value: lv for lv in b_levels}
    records: list[dict] = []
    for a in a_levels:
        b = b_at.get(a.value)
        if b is None:
            continue
        for figure in FIGURES:
            outcome = compare(a, b, figure)
            if outcome is not None:
                winner = {"a": a_name, "b": b_name}.get(outcome, "tied")
                records.append({"level": a.label, "figure": figure, "result": winner,
                                "a": a.intervals[figure], "b": b.intervals[figure]})
    lines = []
    for figure, (_, _, name) in FIGURES.items():
        rows = [r for r in records if r["figure"] == figure]
        if not rows:
            continue
        groups: dict[str, list[str]] = {}
        for r in rows:
            groups.setdefault(r["result"], []).append(r["level"])
        said = "; ".join(f"{'tied' if who == 'tied' else who + ' better'} at {', '.join(levels)}"
                         for who, levels in groups.items())
        lines.append(f"{name} ({CONFIDENCE:.0%} intervals over {rows[0]['a'].n} runs): {said}")
    return records, lines
