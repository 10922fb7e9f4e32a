"""Check `allocator` (Proxima only): slot accounting adds up, and the allocator is cheap per step.

Reads `proxima_kv_slots*` and `proxima_allocator_latency_seconds` from snapshots. The timing
is read over a short burst of requests the probe sends (histogram differences), so it reflects
the server now, not its start-up. The `step` latency is Proxima's whole scheduler step (vLLM's
scheduling with the slot allocator inside); it is judged against the inter-token latency,
because it is overhead on every decode step: what matters is its share of the step, not its
absolute value. (On a tiny model the share looks large because the model's own step is tiny; the
threshold allows for that.)
"""

from __future__ import annotations

from dataclasses import dataclass

from proxima.load import make_prompt
from proxima.metrics import catalog
from proxima.probes.base import (
    Evidence,
    ProbeContext,
    ProbeResult,
    Status,
    Unmeasured,
    Verdict,
    run_steps,
    table_advice,
)
from proxima.scrape import KVSnapshot, scrape

CHECK = "allocator"
RUNBOOK = "runbooks/allocator-latency.md"
# Above this share of the mean inter-token latency the scheduler step is a cost worth acting on.
MAX_STEP_SHARE = 0.10
# Absolute ceiling for the step p99 even when tokens are slow: the alert's, from the catalog.
MAX_STEP_P99_S = catalog.ALLOCATOR_STEP_P99_LIMIT_S
BURST_REQUESTS = 16
ADVICE = {
    "accounting": ("restart the server with PROXIMA_CHECK_INVARIANTS=1 to find the first bad free",
                   "roll back to stock allocation meanwhile (proxima runbook rollback-to-stock)"),
    "slow": ("compare with --proxima-allocator block on the same traffic (proxima bench)",
             "on very short requests the per-token bookkeeping is overhead: see the runbook's fixes"),
}


@dataclass(frozen=True, slots=True)
class Readings:
    kv: KVSnapshot  # after the burst
    step_p99_s: float | None
    step_share: float | None  # of the mean inter-token latency
    evidence: Evidence


async def gather(ctx: ProbeContext) -> Readings:
    before = await scrape(ctx.client, ctx.url)
    if not before.ok:
        raise Unmeasured(Status.ERROR, f"cannot read metrics: {before.error}")
    if before.proxima is None:
        raise Unmeasured(Status.SKIP, "Proxima not loaded (no proxima_allocator_info): allocator metrics "
                                      "exist only under `proxima serve`")
    # Time the allocator now, on a short burst, rather than over the server's life: start-up
    # steps (warm-up, compilation) and old incidents would otherwise dominate the p99.
    prompts = [make_prompt(900 + i, 24) for i in range(BURST_REQUESTS)]
    await ctx.load.burst(prompts, max_tokens=16, timeout=60.0)
    after = await scrape(ctx.client, ctx.url)
    kv = after.proxima
    if not after.ok or kv is None or not kv.slots_total:
        raise Unmeasured(Status.ERROR, "Proxima metrics carry no slot counts after traffic")
    old = before.proxima.allocator_latency
    step, alloc, free = (kv.allocator_latency[op].since(old.get(op)) if op in kv.allocator_latency else None
                         for op in ("step", "allocate", "free"))
    step_mean = step.mean if step else None
    step_p99 = step.quantile(0.99) if step else None
    itl_mean = after.itl.since(before.itl).mean
    share = step_mean / itl_mean if step_mean is not None and itl_mean else None
    evidence = {
        "allocator": kv.allocator,
        "slots_total": int(kv.slots_total),
        "slots_used": int(kv.slots_used),
        "slots_free": int(kv.slots_free),
        "slots_cached": int(kv.slots_cached),
        "burst_requests": BURST_REQUESTS,
        "steps_timed": int(step.count) if step else 0,
        "step_mean_s": step_mean,
        "step_p99_s": step_p99,
        "allocate_p99_s": alloc.quantile(0.99) if alloc else None,
        "free_p99_s": free.quantile(0.99) if free else None,
        "itl_mean_s": itl_mean,
        "step_share_of_itl": share,
    }
    return Readings(kv, step_p99, share, evidence)


def judge(r: Readings) -> Verdict:
    kv, share, step_p99 = r.kv, r.step_share, r.step_p99_s
    if abs(kv.slots_used + kv.slots_free - kv.slots_total) > 0.5:
        return Verdict(Status.FAIL, f"slot accounting broken: used {kv.slots_used:.0f} + free "
                                    f"{kv.slots_free:.0f} != total {kv.slots_total:.0f}",
                       ("accounting",), runbook="runbooks/memory-leak.md")
    if (share is not None and share > MAX_STEP_SHARE) or (step_p99 is not None and step_p99 > MAX_STEP_P99_S):
        share_text = f"{100 * share:.1f}% of the inter-token latency" if share is not None else "no ITL yet"
        return Verdict(Status.WARN, f"scheduler step (allocator included) p99 {1e3 * (step_p99 or 0):.2f} "
                                    f"ms, mean {share_text}", ("slow",))
    share_text = f"{100 * share:.2f}% of a decode step" if share is not None else "no decode steps timed yet"
    return Verdict(Status.OK, f"{kv.allocator} allocator: accounting consistent; scheduler step p99 "
                              f"{1e6 * (step_p99 or 0):.0f} us ({share_text})")


advise = table_advice(ADVICE)


async def run(ctx: ProbeContext) -> ProbeResult:
    return await run_steps(CHECK, RUNBOOK, ctx, gather, judge, advise)
