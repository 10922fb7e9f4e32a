"""Check `bottleneck`: under load, is the server memory-bound (Proxima helps) or compute-bound?

Two phases of steady load (LOW then HIGH concurrent requests, half the window each), sampled:
KV usage, waiting queue, preemptions, generation throughput and, where NVML sees a GPU, its
utilisation. The decision rule is the one operators use: KV memory > 90% full while compute is
< 70% busy means memory-bound, and packing KV tighter (Proxima) adds concurrency; compute busy
with KV headroom left means more KV cannot add throughput. Without NVML (CPU serving) compute is
inferred from throughput scaling: if 4x the concurrency barely raises tokens/s while KV has room,
the engine is compute- (or CPU-scheduling-) bound. And if the engine sees only a small part of
the requests the probe keeps in flight, the front end (HTTP, tokenisation in the API server
process, or the client) is the limit: the engine idles between waves. The verdict says which
evidence it used.
"""

from __future__ import annotations

import asyncio

from proxima.probes.base import ProbeContext, ProbeResult, Status, pct
from proxima.probes.sampling import Sample, Sampler

from proxima.scrape import rate, scrape

CHECK = "bottleneck"
RUNBOOK_COMPUTE = "runbooks/no-throughput-gain.md"
RUNBOOK_MEMORY = "runbooks/kv-exhaustion.md"
LOW, HIGH = 8, 32
KV_BOUND = 0.90
COMPUTE_BOUND_PCT = 70.0
# Throughput rising less than this from LOW to HIGH concurrency counts as flat.
FLAT_SCALING = 1.3
# If the engine runs fewer than this share of the requests in flight, the front end is the limit.
FRONT_END_SHARE = 0.25


def _throughput(samples: list[Sample]) -> float | None:
    ok = [s.snapshot for s in samples if s.snapshot.ok]
    return rate(ok[-1], ok[0], "generation_tokens_total") if len(ok) >= 2 else None


async def _phase(ctx: ProbeContext, concurrency: int, seconds: float, t0: float, first: int) -> list[Sample]:
    sampler = Sampler(ctx, t0=t0)
    async with ctx.load.steady(concurrency, max_tokens=32, prompt_words=64, first_index=first):
        await asyncio.sleep(min(1.0, seconds / 4))  # let the batch fill before measuring
        async with sampler.running():
            await asyncio.sleep(seconds)
    return sampler.ok_samples


async def run(ctx: ProbeContext) -> ProbeResult:
    first = await scrape(ctx.client, ctx.url)
    if not first.ok:
        return ProbeResult(CHECK, Status.ERROR, f"cannot read metrics: {first.error}", runbook=RUNBOOK_COMPUTE)
    seconds = max(1.5, ctx.window_s / 2)
    low = await _phase(ctx, LOW, seconds, 0.0, 20_000)
    high = await _phase(ctx, HIGH, seconds, 0.0, 40_000)
    if len(high) < 2 or len(low) < 2:
        return ProbeResult(CHECK, Status.ERROR, "too few metric samples under load", runbook=RUNBOOK_COMPUTE)

    tput_low, tput_high = _throughput(low), _throughput(high)
    scaling = tput_high / tput_low if tput_low and tput_high else None
    kv_peak = max(s.snapshot.kv_usage for s in high)
    kv_mean = sum(s.snapshot.kv_usage for s in high) / len(high)
    waiting_fraction = sum(1 for s in high if s.snapshot.waiting > 0) / len(high)
    running_mean = sum(s.snapshot.running for s in high) / len(high)
    preempted = max(0.0, high[-1].snapshot.preemptions_total - low[0].snapshot.preemptions_total)
    util = [u for s in high if (u := s.gpu_utilization_pct) is not None]
    gpu_util = sum(util) / len(util) if util else None
    proxima = high[-1].snapshot.proxima
    token_slots = proxima is not None and proxima.allocator == "token"

    memory_bound = kv_peak >= KV_BOUND or preempted > 0
    if gpu_util is not None:
        compute_bound = gpu_util >= COMPUTE_BOUND_PCT
        basis = "KV metrics and GPU utilisation (NVML)"
    else:
        compute_bound = scaling is not None and scaling < FLAT_SCALING and not memory_bound
        basis = "KV metrics and throughput scaling alone (no GPU visible through NVML)"
    evidence: dict = {
        "concurrency_low": LOW,
        "concurrency_high": HIGH,
        "throughput_low_tokens_per_s": round(tput_low, 1) if tput_low else None,
        "throughput_high_tokens_per_s": round(tput_high, 1) if tput_high else None,
        "throughput_scaling": round(scaling, 2) if scaling else None,
        "kv_usage_peak": round(kv_peak, 4),
        "kv_usage_mean": round(kv_mean, 4),
        "waiting_fraction_of_samples": round(waiting_fraction, 2),
        "engine_running_mean": round(running_mean, 1),
        "preemptions": preempted,
        "gpu_utilization_pct": round(gpu_util, 1) if gpu_util is not None else "N/A (no NVML)",
        "decided_from": basis,
        "decision_rule": f"memory-bound: KV > {KV_BOUND:.0%} while compute < {COMPUTE_BOUND_PCT:.0f}%",
    }
    compute_text = f"GPU {gpu_util:.0f}% busy" if gpu_util is not None else \
        (f"throughput x{scaling:.2f} from {LOW} to {HIGH} concurrent" if scaling else "compute unknown")
    kv_text = f"KV peak {pct(kv_peak)}"
    if memory_bound and not compute_bound:
        if token_slots:
            return ProbeResult(
                CHECK, Status.WARN, f"memory-bound even with token slots: {kv_text}, {compute_text}",
                evidence, RUNBOOK_MEMORY,
                ("give the KV cache more memory (--kv-cache-memory-bytes / --gpu-memory-utilization up)",
                 "or lower --max-num-seqs to stop preemption thrash; see runbooks/kv-exhaustion.md"),
            )
        return ProbeResult(
            CHECK, Status.WARN, f"memory-bound: {kv_text}, {compute_text}: Proxima's token slots help here",
            evidence, RUNBOOK_MEMORY,
            ("serve with `proxima serve` (token slots) and compare with `proxima bench`",
             "see the `adoption` check for the capacity it would add on this traffic"),
        )
    if memory_bound and compute_bound:
        return ProbeResult(
            CHECK, Status.WARN,
            f"memory and compute both saturated ({kv_text}, {compute_text}): extra KV capacity would mostly "
            "queue on compute", evidence, RUNBOOK_COMPUTE,
            ("scale out (more replicas) rather than pack tighter", "lower --max-num-seqs to cap latency"),
        )
    if running_mean < FRONT_END_SHARE * HIGH:
        return ProbeResult(
            CHECK, Status.OK,
            f"front-end bound: of {HIGH} requests in flight the engine ran {running_mean:.1f} on average "
            f"({compute_text}, {kv_text}): the API server process (HTTP, tokenisation) or the client is the "
            "limit; more KV slots (Proxima) will not raise throughput", evidence, RUNBOOK_COMPUTE,
            ("give the API server process CPU of its own (fewer co-located processes, CPU pinning)",
             "make sure the load generator is not the bottleneck (run it on another machine)"),
        )
    if compute_bound:
        return ProbeResult(
            CHECK, Status.OK,
            f"compute-bound: {compute_text} with {kv_text}: more KV slots (Proxima) will not raise "
            "throughput", evidence, RUNBOOK_COMPUTE,
            ("scale out or use faster hardware; Proxima's gain is concurrency when memory is the limit",),
        )
    return ProbeResult(
        CHECK, Status.OK,
        f"not saturated at {HIGH} concurrent: {compute_text}, {kv_text}; decided from {basis}",
        evidence, RUNBOOK_COMPUTE,
    )
