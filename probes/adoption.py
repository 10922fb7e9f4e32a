"""Check `adoption`: how much KV this traffic wastes in blocks, and the capacity token slots add.

Measured where Proxima's telemetry is present and requests are live during the window: the
`proxima_kv_block_fragmentation_ratio` (blocks of 16) or, under the block allocator, the actual
`proxima_kv_fragmentation_ratio`. Otherwise estimated from the server's request-length
histograms: a request holds on average prompt + generation/2 tokens over its life, and its last
block is on average (B-1)/2 slots empty, so block slots / token slots = (L + (B-1)/2) / L. The
doctor sends no load here: the point is the user's own traffic, and the histograms read are the
ones taken before any probe ran, when there are any.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

from proxima.metrics.catalog import REFERENCE_BLOCK_SIZE
from proxima.probes.base import (
    Evidence,
    ProbeContext,
    ProbeResult,
    Status,
    Unmeasured,
    Verdict,
    advice_for,
    pct,
    run_steps,
)
from proxima.scrape import ServerSnapshot, scrape

CHECK = "adoption"
RUNBOOK = "runbooks/no-throughput-gain.md"
MEASURE_S = 5.0


@dataclass(frozen=True, slots=True)
class BlockWaste:
    block_size: int
    live_tokens: float  # time-averaged tokens a request holds
    waste_per_request: float  # empty slots in its last block, on average

    @property
    def fragmentation(self) -> float:
        return self.waste_per_request / (self.live_tokens + self.waste_per_request)

    @property
    def capacity_ratio(self) -> float:
        """Block slots / token slots for the same requests: the concurrency token slots add."""
        return (self.live_tokens + self.waste_per_request) / self.live_tokens


def estimate_block_waste(mean_prompt: float, mean_generation: float, block_size: int) -> BlockWaste:
    # Decode grows a request one token at a time, so over its life it holds prompt + gen/2 on
    # average; where the sequence ends inside its last block is uniform, hence (B-1)/2.
    live = max(1.0, mean_prompt + mean_generation / 2)
    return BlockWaste(block_size, live, (block_size - 1) / 2)


def _history(ctx: ProbeContext, current: ServerSnapshot) -> tuple[ServerSnapshot, str] | None:
    base = ctx.baseline
    if base is not None and base.prompt_tokens_per_request.count:
        return base, f"{base.prompt_tokens_per_request.count:.0f} request(s) finished before the doctor ran"
    if current.prompt_tokens_per_request.count:
        return current, (f"{current.prompt_tokens_per_request.count:.0f} finished request(s), the doctor's "
                         "own test traffic included (no earlier traffic): rerun under real traffic")
    return None


@dataclass(frozen=True, slots=True)
class Readings:
    allocator: str | None  # None: stock vLLM
    block_size: int  # the blocks compared with
    fragmentation: float  # of blocks of `block_size` on this traffic, measured or estimated
    ratio: float | None  # block slots / token slots: the capacity token slots add (None: unbounded)
    basis: str
    hit_rate: float | None  # prefix cache, prompt tokens served from it
    beyond_blocks_share: float | None  # of those hits, the share whole blocks would miss (token slots)
    evidence: Evidence


async def gather(ctx: ProbeContext) -> Readings:
    snapshot = await scrape(ctx.client, ctx.url)
    if not snapshot.ok:
        raise Unmeasured(Status.ERROR, f"cannot read metrics: {snapshot.error}")
    kv = snapshot.proxima
    evidence: Evidence = {"allocator": kv.allocator if kv else "stock vLLM blocks"}

    measured: float | None = None  # fragmentation measured on live requests
    if kv is not None:
        sampler = ctx.sampler()
        async with sampler.running():
            await asyncio.sleep(min(MEASURE_S, ctx.window_s))
        live = [s.snapshot.proxima for s in sampler.ok_samples
                if s.snapshot.proxima is not None and s.snapshot.proxima.live_tokens > 0]
        evidence["live_samples"] = len(live)
        if live:
            if kv.allocator == "block":
                measured = sum(p.fragmentation for p in live) / len(live)
                evidence["measured_fragmentation"] = round(measured, 4)
            else:
                measured = sum(p.block_fragmentation for p in live) / len(live)
                evidence[f"measured_block{REFERENCE_BLOCK_SIZE}_fragmentation"] = round(measured, 4)

    block_size = REFERENCE_BLOCK_SIZE if kv is not None and kv.allocator == "token" else \
        (kv.granularity if kv is not None else snapshot.block_size) or REFERENCE_BLOCK_SIZE
    evidence["block_size_compared"] = block_size
    history = _history(ctx, snapshot)
    estimate = None
    if history is not None:
        traffic, source = history
        mean_prompt = traffic.prompt_tokens_per_request.mean or 0.0
        mean_gen = traffic.generation_tokens_per_request.mean or 0.0
        estimate = estimate_block_waste(mean_prompt, mean_gen, block_size)
        evidence.update({
            "traffic_source": source,
            "mean_prompt_tokens": round(mean_prompt, 1),
            "mean_generation_tokens": round(mean_gen, 1),
            "mean_live_tokens": round(estimate.live_tokens, 1),
            "expected_waste_per_request": estimate.waste_per_request,
            "estimated_fragmentation": round(estimate.fragmentation, 4),
        })
    if measured is None and estimate is None:
        raise Unmeasured(Status.SKIP, "no finished requests and no live ones: nothing to measure yet; "
                                      "run the doctor under real traffic", evidence)
    fragmentation = measured if measured is not None else estimate.fragmentation  # type: ignore[union-attr]
    ratio = 1 / (1 - fragmentation) if fragmentation < 1 else None
    evidence["basis"] = "measured on live requests" if measured is not None else "estimated from histograms"
    evidence["capacity_ratio_token_vs_block"] = round(ratio, 3) if ratio else None

    base = ctx.baseline or snapshot
    hit_rate = (base.prefix_cache_hits_total / base.prefix_cache_queries_total
                if base.prefix_cache_queries_total else None)
    evidence["prefix_cache_hit_rate"] = round(hit_rate, 4) if hit_rate is not None else "N/A (no queries)"
    share = None
    if kv is not None and kv.allocator == "token":
        share = kv.beyond_blocks_share
        evidence["prefix_hit_tokens_beyond_blocks_share"] = round(share, 4) if share is not None else "N/A"
    return Readings(kv.allocator if kv else None, block_size, fragmentation, ratio, str(evidence["basis"]),
                    hit_rate, share, evidence)


def _worth_it(r: Readings) -> bool:
    return r.ratio is None or r.ratio >= 1.05


def judge(r: Readings) -> Verdict:
    ratio_text = f"x{r.ratio:.2f}" if r.ratio else "unbounded"
    hits = f"prefix cache serves {pct(r.hit_rate)} of prompt tokens" if r.hit_rate is not None else None
    if r.allocator == "token":
        extra = ""
        if hits:
            extra = f"; {hits}"
            if r.beyond_blocks_share is not None:
                extra += (f", {pct(r.beyond_blocks_share)} of them beyond what {REFERENCE_BLOCK_SIZE}-token "
                          "blocks would share")
        return Verdict(Status.OK, f"Proxima token slots in use: blocks of {r.block_size} would waste "
                                  f"{pct(r.fragmentation)} of KV on this traffic; token slots hold "
                                  f"{ratio_text} the requests{extra}")
    if _worth_it(r):
        verdict = f"Proxima's token slots would hold {ratio_text} the requests in the same memory"
    else:
        verdict = f"little to gain (token slots would hold {ratio_text} the requests)"
    if r.hit_rate:
        # Token slots keep the prefix cache and share the partial block at the end of each hit too:
        # on average (B-1)/2 more tokens per hit than whole blocks of B.
        verdict += (f"; {hits} and token slots keep it, sharing ~{(r.block_size - 1) / 2:.1f} more tokens "
                    "per hit (the partial last block)")
    return Verdict(Status.OK, f"blocks of {r.block_size} waste {pct(r.fragmentation)} of KV on this traffic "
                              f"({r.basis}); {verdict}", ("worth_trying",) if _worth_it(r) else ())


def advise(r: Readings, verdict: Verdict) -> tuple[str, ...]:
    return advice_for(verdict.findings, {
        "worth_trying": ("try it: `proxima serve MODEL ...` with the same flags, then `proxima bench`",),
    })


async def run(ctx: ProbeContext) -> ProbeResult:
    return await run_steps(CHECK, RUNBOOK, ctx, gather, judge, advise)
