"""Check `leak`: KV held while nothing runs, and the server's memory trend.

Half the window under a steady load the probe drives, then (once the server has drained) half the
window idle. The decisive reading is exact, not statistical: KV slots (Proxima) or KV usage
(stock) still held in a sample where the server reports no running and no waiting request belong
to no one, i.e. they leaked. Memory (the server's process tree on this machine, GPU memory via
NVML) gets a least-squares trend with its standard error; a trend is judged only over a window
long enough to rise above warm-up and allocator noise.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

from proxima.probes.base import (
    Evidence,
    ProbeContext,
    ProbeResult,
    Status,
    Unmeasured,
    Verdict,
    fmt_bytes,
    run_steps,
    table_advice,
)
from proxima.probes.trend import Trend, linear_trend
from proxima.sampling import Sample, wait_idle
from proxima.scrape import ServerSnapshot, scrape

CHECK = "leak"
RUNBOOK = "runbooks/memory-leak.md"
LOAD_CONCURRENCY = 4
# Shorter windows are dominated by warm-up allocations: the trend is reported, not judged.
TREND_MIN_WINDOW_S = 60.0
# A rise slower than this (1 MiB per minute, 60 MiB per hour) is not worth an operator's night.
TREND_MIN_SLOPE_BYTES_PER_S = (1 << 20) / 60
DRAIN_TIMEOUT_S = 30.0


def held(snapshot: ServerSnapshot) -> float:
    """KV held by requests: slots (Proxima) or the usage fraction (stock vLLM)."""
    return snapshot.proxima.slots_used if snapshot.proxima is not None else snapshot.kv_usage


def _trend(samples: list[Sample], reading: str) -> Trend | None:
    points = [(s.t, getattr(s, reading)) for s in samples if getattr(s, reading) is not None]
    return linear_trend([t for t, _ in points], [float(y) for _, y in points])


def _trend_evidence(prefix: str, trend: Trend | None, evidence: dict) -> None:
    if trend is None:
        evidence[f"{prefix}_trend"] = "N/A (fewer than 3 readings)"
        return
    per_min = 60 / (1 << 20)
    evidence[f"{prefix}_trend_mib_per_min"] = round(trend.slope * per_min, 3)
    evidence[f"{prefix}_trend_stderr_mib_per_min"] = round(trend.stderr * per_min, 3)
    evidence[f"{prefix}_trend_ci95_mib_per_min"] = (
        f"[{trend.ci95_low * per_min:.3f}, {trend.ci95_high * per_min:.3f}] over {trend.n} samples")


ADVICE = {
    "leak": (("check that PROXIMA_FAULT_LEAK_SLOTS and PROXIMA_ENABLE_TEST_FAULTS are not set in the "
              "server's environment (a test-only fault that leaks on purpose)"),
             ("restart the server to reclaim the slots; until the fix, roll back to stock allocation "
              "(proxima runbook rollback-to-stock)"),
             ("reproduce with PROXIMA_CHECK_INVARIANTS=1 and attach the server log and this output to "
              "the bug")),
    "rising": ("run `proxima doctor --checks leak --window 600` in a quiet hour to confirm",
               "compare with --proxima-allocator block: if it rises there too, the leak is not in the slots"),
}


@dataclass(frozen=True, slots=True)
class Readings:
    window_s: float
    unit: str  # "slots" (Proxima) or "KV usage" (stock)
    requests_completed: int
    idle_samples: int  # samples with nothing running or waiting
    leaked: float | None  # the least KV held in an idle sample (None: never idle)
    rss: Trend | None
    gpu_memory: Trend | None
    evidence: Evidence


async def gather(ctx: ProbeContext) -> Readings:
    half = max(1.0, ctx.window_s / 2)
    first = await scrape(ctx.client, ctx.url)
    if not first.ok:
        raise Unmeasured(Status.ERROR, f"cannot read metrics: {first.error}")
    load_sampler = ctx.sampler()
    load = ctx.load.steady(LOAD_CONCURRENCY, max_tokens=16, prompt_words=24)
    async with load_sampler.running(), load as stats:
        await asyncio.sleep(half)
    drained = await wait_idle(ctx.client, ctx.url, DRAIN_TIMEOUT_S)
    idle_sampler = ctx.sampler(t0=load_sampler.t0)
    async with idle_sampler.running():
        await asyncio.sleep(half)

    load_samples, idle_samples = load_sampler.ok_samples, idle_sampler.ok_samples
    quiet = [s for s in idle_samples if s.idle]
    evidence: Evidence = {
        "window_s": ctx.window_s,
        "load_concurrency": LOAD_CONCURRENCY,
        "requests_completed": stats.num_ok,
        "request_errors": stats.num_errors,
        "drained": drained is not None,
        "idle_samples": len(quiet),
        "peak_held_under_load": max((held(s.snapshot) for s in load_samples), default=None),
    }
    leaked: float | None = None
    if quiet:
        leaked = min(held(s.snapshot) for s in quiet)
        last = quiet[-1].snapshot
        if last.proxima is not None:
            evidence["slots_in_use_idle"] = leaked
            evidence["slots_total"] = last.proxima.slots_total
            evidence["requests_holding_slots_idle"] = last.proxima.requests_holding_slots
        else:
            evidence["kv_usage_idle"] = leaked
            if last.num_gpu_blocks:
                evidence["blocks_in_use_idle"] = round(leaked * last.num_gpu_blocks)
        evidence["running_idle"] = last.running
        evidence["waiting_idle"] = last.waiting
        if first.running == 0 and first.waiting == 0 and stats.num_ok and last.proxima is not None:
            evidence["leaked_slots_per_request"] = round((leaked - held(first)) / stats.num_ok, 2)

    all_samples = load_samples + idle_samples
    rss = _trend(all_samples, "rss_bytes")
    gpu = _trend(all_samples, "gpu_memory_bytes")
    rss_now = next((s.rss_bytes for s in reversed(all_samples) if s.rss_bytes is not None), None)
    evidence["server_rss"] = fmt_bytes(rss_now) if rss_now is not None else \
        "N/A: server process not on this machine (or not visible)"
    _trend_evidence("rss", rss, evidence)
    if any(s.gpus for s in all_samples):
        _trend_evidence("gpu_memory", gpu, evidence)
    else:
        evidence["gpu_memory_trend"] = "N/A: no GPU visible through NVML"
    unit = "slots" if first.proxima is not None else "KV usage"
    return Readings(ctx.window_s, unit, stats.num_ok, len(quiet), leaked, rss, gpu, evidence)


def judge(r: Readings) -> Verdict:
    judged = r.window_s >= TREND_MIN_WINDOW_S
    extra: Evidence = {}
    if not judged:
        extra["trend_verdict"] = f"not judged: window {r.window_s:.0f} s < {TREND_MIN_WINDOW_S:.0f} s"
    rising = [name for name, t in (("server memory", r.rss), ("GPU memory", r.gpu_memory))
              if judged and t is not None and t.significant_rise and t.slope > TREND_MIN_SLOPE_BYTES_PER_S]
    if r.leaked:
        amount = f"{r.leaked:.0f} slots" if r.unit == "slots" else f"KV usage {100 * r.leaked:.1f}%"
        per = r.evidence.get("leaked_slots_per_request")
        return Verdict(Status.FAIL, f"{amount} held with no request running or waiting"
                       + (f" (~{per} leaked per finished request)" if per else ""), ("leak",), evidence=extra)
    if rising:
        return Verdict(Status.WARN, f"{' and '.join(rising)} rising steadily over {r.window_s:.0f} s",
                       ("rising",), evidence=extra)
    if not r.idle_samples:
        return Verdict(Status.SKIP, "the server never went idle during the window (other traffic?): no idle "
                                    "reading", evidence=extra)
    return Verdict(Status.OK, f"no {r.unit} held while idle after {r.requests_completed} requests; memory "
                              "trend " + ("flat" if judged else "reported, not judged (short window)"),
                   evidence=extra)


advise = table_advice(ADVICE)


async def run(ctx: ProbeContext) -> ProbeResult:
    return await run_steps(CHECK, RUNBOOK, ctx, gather, judge, advise)
