"""Check `oom_risk`: can the KV cache hold the concurrency the server admits?

Three readings, then a verdict that names the setting to change and the direction:
  1. static: KV capacity (tokens) against the typical request (observed mean prompt + generation
     from the server's own histograms, or `--typical-tokens`) and `--max-num-seqs` when given;
  2. history: preemptions the server made before the doctor arrived; GPU memory headroom outside
     the KV cache (NVML; skipped with a reason where there is no GPU);
  3. a short ramp of concurrent requests (1, 2, 4 ... 64 in flight, each level held a moment, small
     max_tokens, bounded in time) to find where preemptions, errors or queueing for a full KV
     cache start.
In vLLM "out of KV memory" is a preemption (recompute, latency collapse), not a crash; a real
CUDA OOM comes from memory outside the KV cache, hence the GPU headroom reading.
"""

from __future__ import annotations

import asyncio
import math
import time
from dataclasses import dataclass

from proxima.gpu import read_gpus
from proxima.metrics import catalog
from proxima.probes.base import (
    Evidence,
    ProbeContext,
    ProbeResult,
    Status,
    Unmeasured,
    Verdict,
    fmt_bytes,
    pct,
    run_steps,
)
from proxima.scrape import ServerSnapshot, kv_capacity_tokens, scrape

CHECK = "oom_risk"
RUNBOOK = "runbooks/oom-under-load.md"
RAMP_LEVELS = (1, 2, 4, 8, 16, 32, 64)
RAMP_MAX_TOKENS = 32
RAMP_PROMPT_WORDS = 32
# Less free GPU memory than this, outside the KV cache, and an activation spike can OOM.
MIN_GPU_HEADROOM = 0.05
# Usage at which the KV cache counts as full: the exhaustion alert's and `proxima top`'s threshold.
KV_FULL = catalog.KV_DANGER_USAGE


@dataclass(frozen=True, slots=True)
class RampStep:
    concurrency: int
    num_ok: int
    num_errors: int
    preemptions: float
    peak_running: float
    peak_waiting: float
    peak_kv_usage: float
    mean_request_tokens: float | None
    first_error: str | None

    @property
    def queued_for_kv(self) -> bool:
        return self.peak_waiting > 0 and self.peak_kv_usage >= KV_FULL

    @property
    def pressured(self) -> bool:
        return self.preemptions > 0 or self.num_errors > 0 or self.queued_for_kv

    @property
    def pressure(self) -> str:
        if self.preemptions:
            return "preemptions"
        if self.num_errors:
            return "errors"
        return "queueing for a full KV cache" if self.queued_for_kv else "none"

    def describe(self) -> str:
        parts = [f"{self.concurrency}:"]
        if self.preemptions:
            parts.append(f"{self.preemptions:.0f} preempted")
        if self.num_errors:
            parts.append(f"{self.num_errors} errors")
        if self.queued_for_kv:
            parts.append(f"{self.peak_waiting:.0f} waiting")
        if not self.pressured:
            parts.append("ok")
        parts.append(f"(KV {pct(self.peak_kv_usage)})")
        return " ".join(parts)


def kv_bytes_per_token(snapshot: ServerSnapshot) -> float | None:
    if snapshot.proxima is not None and snapshot.proxima.bytes_per_token:
        return snapshot.proxima.bytes_per_token
    size = snapshot.config_float("kv_cache_memory_bytes")
    tokens = snapshot.config_float("kv_cache_size_tokens")
    return size / tokens if size and tokens else None


def observed_request(history: ServerSnapshot) -> tuple[float, float] | None:
    """Mean (prompt, generation) tokens of the requests the server had finished, if any."""
    prompt, gen = history.prompt_tokens_per_request.mean, history.generation_tokens_per_request.mean
    if prompt is None or gen is None:
        return None
    return prompt, gen


def preemptions(snapshot: ServerSnapshot) -> float:
    proxima = snapshot.proxima.preemptions_total if snapshot.proxima is not None else 0.0
    return max(snapshot.preemptions_total, proxima)


async def ramp(ctx: ProbeContext, prompt_words: int, max_tokens: int, budget_s: float) -> list[RampStep]:
    """Hold each concurrency level for a moment (a steady load, so samples see its steady state)."""
    steps: list[RampStep] = []
    hold_s = max(2.0, min(6.0, ctx.window_s / 2))
    deadline = time.monotonic() + budget_s
    for n, level in enumerate(RAMP_LEVELS):
        remaining = deadline - time.monotonic()
        if remaining < hold_s:
            break
        before = await scrape(ctx.client, ctx.url)
        sampler = ctx.sampler(interval_s=0.2)
        async with ctx.load.steady(level, max_tokens, prompt_words, first_index=100_000 * (n + 1)) as stats:
            # Sample only inside the level: a scrape under load can take longer than the level.
            await asyncio.sleep(hold_s / 3)
            async with sampler.running():
                await asyncio.sleep(hold_s * 2 / 3)
        after = await scrape(ctx.client, ctx.url)
        samples = [s.snapshot for s in sampler.ok_samples]
        steps.append(RampStep(
            concurrency=level,
            num_ok=stats.num_ok,
            num_errors=stats.num_errors,
            preemptions=max(0.0, preemptions(after) - preemptions(before)) if before.ok and after.ok else 0.0,
            peak_running=max((s.running for s in samples), default=0.0),
            peak_waiting=max((s.waiting for s in samples), default=0.0),
            peak_kv_usage=max((s.kv_usage for s in samples), default=0.0),
            mean_request_tokens=stats.mean_request_tokens,
            first_error=stats.last_error,
        ))
        if steps[-1].pressured:
            break
    return steps


@dataclass(frozen=True, slots=True)
class Readings:
    snapshot: ServerSnapshot  # after the ramp: the Proxima gauges exist once a step has run
    capacity: int | None  # KV tokens
    per_token: float | None  # KV bytes per token
    typical: float | None  # tokens of a typical request
    fits: float | None  # typical requests the KV cache holds
    max_num_seqs: int | None  # stated, or vLLM's default here
    max_num_seqs_assumed: bool
    steps: list[RampStep]
    pressured: RampStep | None  # the first ramp level under pressure
    preemptions_before: float | None
    headroom: float | None  # GPU memory free outside the KV cache (None: no GPU here)
    max_model_len: int | None
    evidence: Evidence


def _ramp_shape(ctx: ProbeContext, observed: tuple[float, float] | None) -> tuple[int, int]:
    """(prompt words, max tokens) of the ramp's requests: the typical request, within bounds."""
    opts = ctx.options
    if opts.typical_tokens:
        gen = min(RAMP_MAX_TOKENS, max(4, opts.typical_tokens // 2))
        return max(8, min(1024, opts.typical_tokens - gen)), gen
    if observed:
        # Floors keep the ramp meaningful when the history is a handful of "hello" requests.
        return int(max(16, min(1024, observed[0]))), int(max(16, min(RAMP_MAX_TOKENS, observed[1])))
    return RAMP_PROMPT_WORDS, RAMP_MAX_TOKENS


async def gather(ctx: ProbeContext) -> Readings:
    snapshot = await scrape(ctx.client, ctx.url)
    if not snapshot.ok:
        raise Unmeasured(Status.ERROR, f"cannot read metrics: {snapshot.error}")
    history = ctx.baseline or snapshot  # before the doctor's own traffic, where there is one

    observed = observed_request(history)
    opts = ctx.options
    gpus = read_gpus() if ctx.server_here else ()  # this host's GPUs say nothing of a remote server
    assumed = None if opts.max_num_seqs else assumed_max_num_seqs(ctx.server_here, gpus)
    max_num_seqs = opts.max_num_seqs or assumed
    prompt_words, gen = _ramp_shape(ctx, observed)
    steps = await ramp(ctx, prompt_words, gen, budget_s=max(20.0, min(60.0, 4 * ctx.window_s)))
    snapshot = await scrape(ctx.client, ctx.url)  # the Proxima gauges exist once a step has run
    capacity = kv_capacity_tokens(snapshot)
    per_token = kv_bytes_per_token(snapshot)
    ramp_tokens = next((s.mean_request_tokens for s in steps if s.mean_request_tokens), None)

    if opts.typical_tokens:
        typical, source = float(opts.typical_tokens), "--typical-tokens"
    elif observed:
        typical = observed[0] + observed[1]
        source = (f"mean of the {history.prompt_tokens_per_request.count:.0f} request(s) the server "
                  "finished before the doctor")
    elif ramp_tokens:
        typical, source = ramp_tokens, "the doctor's ramp requests (no earlier traffic to learn from)"
    else:
        typical, source = None, "unknown"

    evidence: Evidence = {
        "kv_capacity_tokens": capacity,
        "kv_bytes_per_token": per_token,
        "kv_cache_dtype": snapshot.kv_cache_dtype or "N/A",
        "kv_cache_bytes": capacity * per_token if capacity and per_token else None,
        "max_model_len": ctx.max_model_len,
        "typical_request_tokens": round(typical, 1) if typical else None,
        "typical_request_source": source,
        "max_num_seqs": _describe_max_num_seqs(opts.max_num_seqs, assumed),
        "preemptions_before_doctor": preemptions(ctx.baseline) if ctx.baseline else None,
    }
    fits = capacity / typical if capacity and typical else None
    evidence["typical_requests_kv_holds"] = math.floor(fits) if fits is not None else None
    if capacity and ctx.max_model_len:
        evidence["max_len_requests_kv_holds"] = round(capacity / ctx.max_model_len, 2)
    evidence["ramp"] = ", ".join(s.describe() for s in steps) or "not run (no time left)"
    pressured = next((s for s in steps if s.pressured), None)
    evidence["first_pressure_concurrency"] = pressured.concurrency if pressured else None
    evidence["ramp_peak_kv_usage"] = max((s.peak_kv_usage for s in steps), default=None)
    evidence["ramp_peak_running"] = max((s.peak_running for s in steps), default=None)
    evidence["ramp_peak_waiting"] = max((s.peak_waiting for s in steps), default=None)
    if pressured and pressured.first_error:
        evidence["first_error"] = pressured.first_error

    headroom = None
    if gpus:
        fractions = [1 - g.memory_fraction for g in gpus if g.memory_fraction is not None]
        headroom = min(fractions) if fractions else None
        evidence["gpu_memory_headroom"] = headroom
        evidence["gpu_memory_free_bytes"] = min(
            (g.memory_total_bytes - g.memory_used_bytes for g in gpus
             if g.memory_total_bytes is not None and g.memory_used_bytes is not None), default=None)
    elif ctx.server_here:
        evidence["gpu_memory_headroom"] = "N/A: no GPU visible through NVML; GPU headroom part skipped"
    else:
        evidence["gpu_memory_headroom"] = "N/A: the server is not on this machine; GPU headroom part skipped"
    return Readings(snapshot, capacity, per_token, typical, fits, max_num_seqs, bool(assumed), steps,
                    pressured, evidence["preemptions_before_doctor"], headroom, ctx.max_model_len, evidence)


def judge(r: Readings) -> Verdict:
    fails: list[str] = []
    warns: list[str] = []
    if r.pressured is not None:
        fails.append(f"{r.pressured.pressure} start at {r.pressured.concurrency} concurrent requests of "
                     f"~{r.typical or 0:.0f} tokens (KV peak seen {pct(r.pressured.peak_kv_usage)})")
    if r.fits is not None and r.max_num_seqs and r.fits < r.max_num_seqs:
        short = (f"the KV cache holds {math.floor(r.fits)} typical requests but --max-num-seqs admits "
                 f"{r.max_num_seqs}")
        # A limit the operator stated is a fact; vLLM's default is only what this server probably uses.
        if r.max_num_seqs_assumed:
            warns.append(short + " (vLLM's default here; pass --max-num-seqs to judge)")
        else:
            fails.append(short)
    if r.preemptions_before:
        warns.append(f"the server preempted {r.preemptions_before:.0f} requests before the doctor ran")
    if r.headroom is not None and r.headroom < MIN_GPU_HEADROOM:
        warns.append(f"only {pct(r.headroom)} GPU memory free outside the KV cache (activation spikes can "
                     "OOM)")
    if fails:
        return Verdict(Status.FAIL, "; ".join(fails + warns), ("at_risk",))
    if warns:
        return Verdict(Status.WARN, "; ".join(warns), ("at_risk",))
    top = r.steps[-1].concurrency if r.steps else 0
    if not r.fits:
        return Verdict(Status.OK, f"no preemptions up to {top} concurrent")
    return Verdict(Status.OK, f"KV holds ~{math.floor(r.fits)} typical ({r.typical:.0f}-token) requests; no "
                              f"preemptions up to {top} concurrent (KV peak "
                              f"{pct(r.evidence['ramp_peak_kv_usage'])})")


def advise(r: Readings, verdict: Verdict) -> tuple[str, ...]:
    if "at_risk" not in verdict.findings:
        return ()
    return _advice(r.capacity, r.typical, r.per_token, r.max_num_seqs, r.pressured, r.max_model_len,
                   r.snapshot, r.headroom, _uses_token_slots(r.snapshot))


async def run(ctx: ProbeContext) -> ProbeResult:
    return await run_steps(CHECK, RUNBOOK, ctx, gather, judge, advise)


def assumed_max_num_seqs(server_is_local: bool, gpus: tuple) -> int | None:
    """vLLM 0.26's default --max-num-seqs for the API server on this machine's platform.

    Only for a server on this machine (a remote one may run on other hardware): 128 on CPU,
    1024 on GPUs of 70 GiB or more other than A100, 256 on other GPUs (vllm/engine/arg_utils.py).
    """
    if not server_is_local:
        return None
    if not gpus:
        return 128
    big = all((g.memory_total_bytes or 0) >= 70 * (1 << 30) and "a100" not in g.name.lower() for g in gpus)
    return 1024 if big else 256


def _describe_max_num_seqs(given: int | None, assumed: int | None) -> int | str:
    if given:
        return given
    if assumed:
        return f"{assumed} (assumed: vLLM's default on this platform; pass --max-num-seqs)"
    return "unknown (not in /metrics; pass --max-num-seqs)"


def _advice(capacity: int | None, typical: float | None, per_token: float | None, max_num_seqs: int | None,
            pressured: RampStep | None, max_model_len: int | None, snapshot: ServerSnapshot,
            headroom: float | None, token_slots: bool) -> tuple[str, ...]:
    advice: list[str] = []
    if capacity and typical:
        safe = max(1, math.floor(capacity / typical))
        now = f" (now {max_num_seqs})" if max_num_seqs else ""
        advice.append(f"--max-num-seqs down to {safe}{now}: {safe} x {typical:.0f} tokens fit {capacity} KV "
                      "slots")
        target = max_num_seqs or (2 * pressured.concurrency if pressured else None)
        if target and per_token:
            need = target * typical * per_token
            kv_now = snapshot.config_float("kv_cache_memory_bytes")
            now_text = f" (now {fmt_bytes(kv_now)})" if kv_now else ""
            util = snapshot.cache_config.get("gpu_memory_utilization")
            advice.append(f"or --kv-cache-memory-bytes up to {int(need)} ({fmt_bytes(need)}){now_text} for "
                          f"{target} concurrent requests, or --gpu-memory-utilization up"
                          + (f" from {util}" if util else ""))
    if capacity and max_model_len and capacity / max_model_len < 4:
        advice.append(f"--max-model-len down (now {max_model_len}): one request may take "
                      f"{100 * max_model_len / capacity:.0f}% of the KV cache")
    if headroom is not None and headroom < MIN_GPU_HEADROOM:
        advice.append("--gpu-memory-utilization down a little, or --max-num-batched-tokens down: the OOM "
                      "risk is outside the KV cache")
    if not token_slots:
        advice.append("Proxima's token slots add capacity when requests are short and varied (see "
                      "`adoption`)")
    return tuple(advice)


def _uses_token_slots(snapshot: ServerSnapshot) -> bool:
    return snapshot.proxima is not None and snapshot.proxima.allocator == "token"
