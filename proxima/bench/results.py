"""Results of a bench run: per-level figures, per-server runs, the verdict, and their files.

Plain dataclasses (the layer below the terminal table and the HTML report, which only read
them). Latencies are in seconds; `None` means "not measured here" and renders as N/A. Files are
written through a temporary name and renamed, so a reader never sees half a file.
"""

from __future__ import annotations

import csv
import io
import json
import math
from dataclasses import asdict, dataclass, field

from proxima.sampling import Sample

CONCURRENCY, RATE = "concurrency", "rate"


def percentile(values: list[float], q: float, presorted: bool = False) -> float | None:
    """Linear interpolation between closest ranks (numpy's default), q in [0, 100]."""
    if not values:
        return None
    ordered = values if presorted else sorted(values)
    pos = (len(ordered) - 1) * q / 100.0
    low = math.floor(pos)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (pos - low)


@dataclass(frozen=True, slots=True)
class Stats:
    n: int = 0
    mean: float | None = None
    p50: float | None = None
    p95: float | None = None
    p99: float | None = None

    @classmethod
    def of(cls, values: list[float]) -> Stats:
        if not values:
            return cls()
        return cls(len(values), sum(values) / len(values), percentile(values, 50), percentile(values, 95),
                   percentile(values, 99))


@dataclass(frozen=True, slots=True)
class TimelinePoint:
    """One sample of the server during a level, as results.json keeps it (`t` in seconds since
    the level started)."""

    t: float
    ok: bool
    running: float | None = None
    waiting: float | None = None
    kv_usage: float | None = None
    token_usage: float | None = None  # Proxima servers only
    fragmentation: float | None = None  # Proxima servers only
    preemptions_total: float | None = None
    gpu_memory_bytes: int | None = None  # local servers with NVML only

    @classmethod
    def of(cls, sample: Sample) -> TimelinePoint:
        snapshot, gpu_bytes = sample.snapshot, sample.gpu_memory_bytes
        if not snapshot.ok:
            return cls(sample.t, False, gpu_memory_bytes=gpu_bytes)
        kv = snapshot.proxima
        return cls(
            sample.t, True, snapshot.running, snapshot.waiting, snapshot.kv_usage,
            kv.token_usage if kv else None, kv.fragmentation if kv else None,
            snapshot.preemptions_total, gpu_bytes,
        )


@dataclass(slots=True)
class LevelResult:
    server: str
    kind: str  # CONCURRENCY or RATE
    value: float  # concurrent requests, or offered requests per second
    num_sent: int = 0
    completed: int = 0
    failed: int = 0
    timed_out: int = 0
    cancelled: int = 0  # in flight when the level was stopped early
    duration_s: float = 0.0
    prompt_tokens: int = 0
    output_tokens: int = 0
    rps: float = 0.0
    output_tps: float = 0.0
    total_tps: float = 0.0
    ttft: Stats = field(default_factory=Stats)
    itl: Stats = field(default_factory=Stats)
    tpot: Stats = field(default_factory=Stats)
    e2e: Stats = field(default_factory=Stats)
    peak_in_flight: int = 0
    peak_running: float | None = None
    peak_waiting: float | None = None
    preemptions: float | None = None
    # Prompt tokens the server served from its prefix cache / tokens it looked up, this level.
    prefix_cache_hit_rate: float | None = None
    peak_kv_usage: float | None = None
    peak_token_usage: float | None = None
    peak_fragmentation: float | None = None
    peak_gpu_memory_bytes: int | None = None
    client_cpu: float = 0.0  # the busiest client process's CPU time / wall time (1.0 = one core)
    client_workers: int = 1  # processes that sent the load (1: bench's own event loop)
    # bench's own process first (sampler, watchdog; with one worker, the load too), then each worker
    client_cpu_by_process: list[float] = field(default_factory=list)
    client_loop_lag_p99_s: float | None = None
    client_overhead_us_per_token: float | None = None
    server_requests_finished: float | None = None  # deltas of the server's own counters
    server_prompt_tokens: float | None = None
    server_generation_tokens: float | None = None
    started_s: float = 0.0  # when the level began, seconds after this server's sweep began
    aborted: str | None = None  # why the level was stopped early (avalanche, server gone)
    num_runs: int = 1  # `--repeat`: the runs combined here (`proxima.bench.repeats.combine`)
    intervals: dict = field(default_factory=dict)  # figure -> repeats.Interval, with num_runs > 1
    errors: dict[str, int] = field(default_factory=dict)
    timeline: list[TimelinePoint] = field(default_factory=list)

    @property
    def finished(self) -> int:
        return self.completed + self.failed + self.timed_out

    @property
    def error_rate(self) -> float:
        return (self.failed + self.timed_out) / self.finished if self.finished else 0.0

    @property
    def label(self) -> str:
        return f"c={self.value:g}" if self.kind == CONCURRENCY else f"{self.value:g} req/s"

    def slo_failure(self, slo_p95_s: float, max_error_rate: float) -> str | None:
        """Why this level does not meet the SLO, or None if it does."""
        if self.aborted:
            return f"stopped early: {self.aborted}"
        if self.error_rate > max_error_rate:
            return f"error rate {self.error_rate:.0%} > {max_error_rate:.0%}"
        if self.e2e.p95 is None:
            return "no request completed"
        if self.e2e.p95 > slo_p95_s:
            return f"P95 E2E {self.e2e.p95:.2f}s > SLO {slo_p95_s:g}s"
        return None


@dataclass(slots=True)
class ServerRun:
    label: str
    url: str
    model: str = ""
    variant: str | None = None  # token / block / stock when launched by bench
    allocator: str | None = None  # as the server reports it: token, block, or stock (no Proxima metrics)
    local: bool = False
    kv_block_size: int | None = None  # allocation granularity in tokens (1 for Proxima's slots)
    kv_capacity_tokens: float | None = None
    levels: list[LevelResult] = field(default_factory=list)
    stopped: str | None = None  # why higher levels were not run
    launch: dict | None = None  # started_at / stopped_at / log, when bench launched it
    metrics_error: str | None = None  # why its /metrics could not be used, when it could not
    kv_cache_dtype: str | None = None  # vLLM's --kv-cache-dtype as the server reports it
    warmup_failed: int = 0  # warm-up requests that failed (none measured)
    warmup_prompt_tokens: int = 0  # what the warm-up cost the server in prompt tokens (its usage)

    def levels_of(self, kind: str) -> list[LevelResult]:
        return sorted((lv for lv in self.levels if lv.kind == kind), key=lambda lv: lv.value)


@dataclass(frozen=True, slots=True)
class Knee:
    """Where one server stands against the SLO in one sweep."""

    server: str
    kind: str
    best_value: float | None  # highest level before the first one that breaks the SLO
    best_rps: float | None
    best_output_tps: float | None
    breaks_at: float | None
    break_reason: str | None
    max_tested: float | None


def knee_of(run: ServerRun, kind: str, slo_p95_s: float, max_error_rate: float) -> Knee | None:
    levels = run.levels_of(kind)
    if not levels:
        return None
    best: LevelResult | None = None
    for level in levels:
        reason = level.slo_failure(slo_p95_s, max_error_rate)
        if reason is not None:
            return Knee(run.label, kind, best and best.value, best and best.rps, best and best.output_tps,
                        level.value, reason, levels[-1].value)
        best = level
    return Knee(run.label, kind, best.value, best.rps, best.output_tps, None, None, levels[-1].value)


def _ratio(b: float | None, a: float | None) -> float | None:
    return b / a if a and b is not None else None


def verdict(runs: list[ServerRun], slo_p95_s: float, max_error_rate: float) -> dict:
    """Per sweep kind: each server's knee, and B relative to A when there are two servers."""
    out: dict = {"slo_p95_e2e_s": slo_p95_s, "max_error_rate": max_error_rate, "sweeps": {}, "summary": []}
    for kind in (CONCURRENCY, RATE):
        knees = [k for k in (knee_of(r, kind, slo_p95_s, max_error_rate) for r in runs) if k is not None]
        if not knees:
            continue
        entry: dict = {"knees": [asdict(k) for k in knees]}
        unit = "concurrency" if kind == CONCURRENCY else "offered rate"
        for k in knees:
            out["summary"].append(_knee_line(k, slo_p95_s))
        if len(runs) == 2:
            from proxima.bench.repeats import compare_runs  # repeats builds on this module

            entry["comparisons"], lines = compare_runs(runs[0].levels_of(kind), runs[1].levels_of(kind),
                                                       runs[0].label, runs[1].label)
            out["summary"].extend(lines)
        if len(knees) == 2:
            a, b = knees
            entry["ratio_value"] = _ratio(b.best_value, a.best_value)
            entry["ratio_rps"] = _ratio(b.best_rps, a.best_rps)
            if entry["ratio_value"] is not None:
                out["summary"].append(
                    f"{b.server} / {a.server}: {entry['ratio_value']:.2f}x sustainable {unit}, "
                    f"{entry['ratio_rps']:.2f}x RPS at P95 E2E <= {slo_p95_s:g}s"
                )
            elif a.best_value is None and b.best_value is not None:
                out["summary"].append(f"only {b.server} meets the SLO at any tested {unit}")
            elif b.best_value is None and a.best_value is not None:
                out["summary"].append(f"only {a.server} meets the SLO at any tested {unit}")
        out["sweeps"][kind] = entry
    return out


def _knee_line(k: Knee, slo_p95_s: float) -> str:
    name = "c=" if k.kind == CONCURRENCY else "rate "
    if k.best_value is None:
        held = f"{k.server}: meets P95 E2E <= {slo_p95_s:g}s at no tested level"
    else:
        held = (f"{k.server}: sustains {name}{k.best_value:g} ({k.best_rps:.2f} req/s, "
                f"{k.best_output_tps:.0f} output tok/s) within P95 E2E <= {slo_p95_s:g}s")
    if k.breaks_at is None:
        return f"{held}; did not break up to {name}{k.max_tested:g} (raise the sweep to find the knee)"
    return f"{held}; breaks at {name}{k.breaks_at:g}: {k.break_reason}"


@dataclass(slots=True)
class BenchResult:
    created_at: str
    command: str
    config: dict
    workload: dict
    runs: list[ServerRun]
    verdict: dict = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    answer_check: list[dict] = field(default_factory=list)  # --check-answers: each server against the first

    def to_json(self) -> str:
        data = asdict(self)
        for run_data, run in zip(data["runs"], self.runs):
            for level_data, level in zip(run_data["levels"], run.levels):
                level_data["error_rate"] = level.error_rate
        return json.dumps(data, indent=2)


CSV_COLUMNS = (
    "server", "kind", "value", "num_sent", "completed", "failed", "timed_out", "cancelled", "error_rate",
    "duration_s", "rps", "output_tps", "total_tps", "prompt_tokens", "output_tokens",
    "ttft_p50_s", "ttft_p95_s", "ttft_p99_s", "itl_p50_s", "itl_p95_s", "itl_p99_s",
    "tpot_p50_s", "tpot_p95_s", "tpot_p99_s", "e2e_p50_s", "e2e_p95_s", "e2e_p99_s",
    "peak_in_flight", "peak_running", "peak_waiting", "preemptions", "prefix_cache_hit_rate",
    "peak_kv_usage", "peak_token_usage",
    "peak_fragmentation", "peak_gpu_memory_bytes", "client_workers", "client_cpu", "client_loop_lag_p99_s",
    "client_overhead_us_per_token", "server_requests_finished", "server_prompt_tokens",
    "server_generation_tokens", "num_runs", "aborted",
)


def to_csv(result: BenchResult) -> str:
    buffer = io.StringIO()
    writer = csv.DictWriter(buffer, fieldnames=CSV_COLUMNS, extrasaction="ignore")
    writer.writeheader()
    for run in result.runs:
        for lv in run.levels:
            row = {k: getattr(lv, k) for k in CSV_COLUMNS if hasattr(lv, k)}
            for name in ("ttft", "itl", "tpot", "e2e"):
                stats: Stats = getattr(lv, name)
                for q in ("p50", "p95", "p99"):
                    row[f"{name}_{q}_s"] = getattr(stats, q)
            row["error_rate"] = lv.error_rate
            writer.writerow({k: "" if v is None else v for k, v in row.items()})
    return buffer.getvalue()


