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

The probe's requests have the size of the server's own traffic: the mean prompt and output
tokens of the requests it finished before (vLLM's per-request token histograms), when at least
`MIN_OBSERVED` did; otherwise a fixed 64-word prompt and 32 tokens. Requests of the wrong size
load a different cache (100-token requests on a server whose chats hold 2,000 tokens never fill
it), which is how a server whose `oom_risk` fails could be called compute-bound.
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
    pct,
    run_steps,
    table_advice,
)
from proxima.sampling import Sample
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
# Finished requests whose mean size the probe replays; below this, the fixed shape below.
MIN_OBSERVED = 20
FIXED_PROMPT_WORDS, FIXED_OUTPUT_TOKENS = 64, 32
MAX_OUTPUT_TOKENS = 1024  # a phase lasts seconds: longer outputs would only be cut off


@dataclass(frozen=True, slots=True)
class RequestShape:
    prompt_words: int
    output_tokens: int
    source: str  # what the shape was taken from, for the evidence


def request_shape(snapshot, max_model_len: int | None) -> RequestShape:
    """The server's observed mean request (prompt words ~ tokens: the probe's prompts are common
    words, about one token each), or the fixed shape when too few requests finished."""
    prompts, outputs = snapshot.prompt_tokens_per_request, snapshot.generation_tokens_per_request
    finished = min(prompts.count, outputs.count)
    if finished < MIN_OBSERVED or prompts.mean is None or outputs.mean is None:
        return RequestShape(FIXED_PROMPT_WORDS, FIXED_OUTPUT_TOKENS,
                            f"fixed ({finished:.0f} finished requests to copy, fewer than {MIN_OBSERVED})")
    output = max(1, min(round(outputs.mean), MAX_OUTPUT_TOKENS))
    prompt = max(1, round(prompts.mean))
    if max_model_len:  # leave room for the output (and the tokenizer's few extra tokens)
        prompt = max(1, min(prompt, int(0.9 * max_model_len) - output))
    return RequestShape(prompt, output, f"observed: the mean of {finished:.0f} finished requests")


def _throughput(samples: list[Sample]) -> float | None:
    ok = [s.snapshot for s in samples if s.snapshot.ok]
    return rate(ok[-1], ok[0], "generation_tokens_total") if len(ok) >= 2 else None


async def _phase(ctx: ProbeContext, concurrency: int, seconds: float, t0: float, first: int,
                 shape: RequestShape) -> list[Sample]:
    sampler = ctx.sampler(t0=t0)
    async with ctx.load.steady(concurrency, max_tokens=shape.output_tokens, prompt_words=shape.prompt_words,
                               first_index=first):
        await asyncio.sleep(min(1.0, seconds / 4))  # let the batch fill before measuring
        async with sampler.running():
            await asyncio.sleep(seconds)
    return sampler.ok_samples


ADVICE = {
    "memory_bound_with_slots": (
        "give the KV cache more memory (--kv-cache-memory-bytes / --gpu-memory-utilization up)",
        "or lower --max-num-seqs to stop preemption thrash; see proxima runbook kv-exhaustion"),
    "memory_bound": ("serve with `proxima serve` (token slots) and compare with `proxima bench`",
                     "see the `adoption` check for the capacity it would add on this traffic"),
    "saturated": ("scale out (more replicas) rather than pack tighter",
                  "lower --max-num-seqs to cap latency"),
    "front_end_bound": (
        "give the API server process CPU of its own (fewer co-located processes, CPU pinning)",
        "make sure the load generator is not the bottleneck (run it on another machine)"),
    "compute_bound": (
        "scale out or use faster hardware; Proxima's gain is concurrency when memory is the limit",),
}


@dataclass(frozen=True, slots=True)
class Readings:
    throughput_scaling: float | None  # tokens/s at HIGH over tokens/s at LOW
    kv_peak: float
    preempted: float
    running_mean: float  # requests the engine ran, on average, at HIGH
    gpu_util: float | None  # None without NVML
    token_slots: bool  # Proxima's token allocator serves
    evidence: Evidence


async def gather(ctx: ProbeContext) -> Readings:
    first = await scrape(ctx.client, ctx.url)
    if not first.ok:
        raise Unmeasured(Status.ERROR, f"cannot read metrics: {first.error}")
    seconds = max(1.5, ctx.window_s / 2)
    shape = request_shape(first, ctx.max_model_len)
    low = await _phase(ctx, LOW, seconds, 0.0, 20_000, shape)
    high = await _phase(ctx, HIGH, seconds, 0.0, 40_000, shape)
    if len(high) < 2 or len(low) < 2:
        raise Unmeasured(Status.ERROR, "too few metric samples under load")

    tput_low, tput_high = _throughput(low), _throughput(high)
    scaling = tput_high / tput_low if tput_low and tput_high else None
    kv_peak = max(s.snapshot.kv_usage for s in high)
    running_mean = sum(s.snapshot.running for s in high) / len(high)
    preempted = max(0.0, high[-1].snapshot.preemptions_total - low[0].snapshot.preemptions_total)
    util = [u for s in high if (u := s.gpu_utilization_pct) is not None]
    gpu_util = sum(util) / len(util) if util else None
    proxima = high[-1].snapshot.proxima
    evidence: Evidence = {
        "concurrency_low": LOW,
        "concurrency_high": HIGH,
        "request_prompt_words": shape.prompt_words,
        "request_output_tokens": shape.output_tokens,
        "request_shape": shape.source,
        "throughput_low_tokens_per_s": round(tput_low, 1) if tput_low else None,
        "throughput_high_tokens_per_s": round(tput_high, 1) if tput_high else None,
        "throughput_scaling": round(scaling, 2) if scaling else None,
        "kv_usage_peak": round(kv_peak, 4),
        "kv_usage_mean": round(sum(s.snapshot.kv_usage for s in high) / len(high), 4),
        "waiting_fraction_of_samples": round(sum(1 for s in high if s.snapshot.waiting > 0) / len(high), 2),
        "engine_running_mean": round(running_mean, 1),
        "preemptions": preempted,
        "gpu_utilization_pct": round(gpu_util, 1) if gpu_util is not None else "N/A (no NVML)",
        "decided_from": _basis(gpu_util),
        "decision_rule": f"memory-bound: KV > {KV_BOUND:.0%} while compute < {COMPUTE_BOUND_PCT:.0f}%",
    }
    return Readings(scaling, kv_peak, preempted, running_mean, gpu_util,
                    proxima is not None and proxima.allocator == "token", evidence)


def _basis(gpu_util: float | None) -> str:
    if gpu_util is not None:
        return "KV metrics and GPU utilisation (NVML)"
    return "KV metrics and throughput scaling alone (no GPU visible through NVML)"


def judge(r: Readings) -> Verdict:
    memory_bound = r.kv_peak >= KV_BOUND or r.preempted > 0
    scaling = r.throughput_scaling
    if r.gpu_util is not None:
        compute_bound = r.gpu_util >= COMPUTE_BOUND_PCT
    else:
        compute_bound = scaling is not None and scaling < FLAT_SCALING and not memory_bound
    compute_text = f"GPU {r.gpu_util:.0f}% busy" if r.gpu_util is not None else \
        (f"throughput x{scaling:.2f} from {LOW} to {HIGH} concurrent" if scaling else "compute unknown")
    kv_text = f"KV peak {pct(r.kv_peak)}"
    if memory_bound and not compute_bound:
        if r.token_slots:
            return Verdict(Status.WARN, f"memory-bound even with token slots: {kv_text}, {compute_text}",
                           ("memory_bound_with_slots",), RUNBOOK_MEMORY)
        return Verdict(Status.WARN, f"memory-bound: {kv_text}, {compute_text}: Proxima's token slots help "
                                    "here", ("memory_bound",), RUNBOOK_MEMORY)
    if memory_bound and compute_bound:
        return Verdict(Status.WARN, f"memory and compute both saturated ({kv_text}, {compute_text}): extra "
                                    "KV capacity would mostly queue on compute", ("saturated",))
    if r.running_mean < FRONT_END_SHARE * HIGH:
        return Verdict(Status.OK, f"front-end bound: of {HIGH} requests in flight the engine ran "
                                  f"{r.running_mean:.1f} on average ({compute_text}, {kv_text}): the API "
                                  "server process (HTTP, tokenisation) or the client is the limit; more KV "
                                  "slots (Proxima) will not raise throughput", ("front_end_bound",))
    if compute_bound:
        return Verdict(Status.OK, f"compute-bound: {compute_text} with {kv_text}: more KV slots (Proxima) "
                                  "will not raise throughput", ("compute_bound",))
    return Verdict(Status.OK, f"not saturated at {HIGH} concurrent: {compute_text}, {kv_text}; decided from "
                              f"{_basis(r.gpu_util)}")


advise = table_advice(ADVICE)


async def run(ctx: ProbeContext) -> ProbeResult:
    return await run_steps(CHECK, RUNBOOK_COMPUTE, ctx, gather, judge, advise)
