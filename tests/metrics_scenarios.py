"""Drive one engine through known requests and record, step by step, what its KV telemetry said
(the scheduler's stats and the Prometheus exporter's samples) beside what the engine did.

Run by tests/test_engine_metrics.py through the engine harness, in the session's engine
processes, once per allocator (`token`, `block`: 32-token blocks under Proxima's observing
scheduler); `prefix_scenario` runs with vLLM's prefix caching on, on token slots or on blocks.
The KV telemetry publishes on every step (PROXIMA_TELEMETRY_INTERVAL_S=0): snapshots are per step.
"""

from __future__ import annotations

import dataclasses

from proxima.harness import TINY_CPU_ARGS, EngineSpec, open_engine, vllm_flags

PROMPT_LENS = [5, 17, 33, 64, 100]
KV_SLOTS = 4096


def engine_spec(model: str, allocator: str, prefix_caching: bool) -> EngineSpec:
    flags = vllm_flags(seed=0, max_num_batched_tokens=2048, max_num_seqs=64,
                       kv_cache_memory_bytes=KV_SLOTS * 1024, enable_prefix_caching=prefix_caching,
                       block_size=1 if allocator == "token" else 32)
    return EngineSpec(model, allocator, TINY_CPU_ARGS + flags, env={
        "PROXIMA_TELEMETRY_INTERVAL_S": "0",  # publish every step: snapshots are per step
        "PROXIMA_KV_FIGURES": "exact",  # the figures are checked against the engine, token by token
    })


def exporter_samples(scheduler) -> dict:
    from proxima.metrics import catalog as c

    reg, labels = scheduler.kv_exporter.registry, {"engine": "0"}
    out = {spec.name: reg.get_sample_value(spec.sample_name, labels) for spec in (
        c.SLOTS_TOTAL, c.SLOTS_USED, c.SLOTS_FREE, c.LIVE_TOKENS, c.TOKEN_USAGE, c.BLOCK_USAGE,
        c.FRAGMENTATION, c.BLOCK_FRAGMENTATION, c.REQUESTS_HOLDING_SLOTS, c.LARGEST_FREE_RUN, c.PREEMPTIONS,
        c.BYTES_PER_TOKEN, c.CACHE_BYTES, c.SLOTS_CACHED, *c.PREFIX_COUNTERS)}
    out["occupancy_0"] = reg.get_sample_value(c.OCCUPANCY_MAP.name, {"engine": "0", "segment": "0"})
    for op in c.ALLOCATOR_OPS:
        out[f"latency_count_{op}"] = reg.get_sample_value(
            c.ALLOCATOR_LATENCY.name + "_count", {"engine": "0", "op": op})
    return out


def snapshot(scheduler) -> dict:
    stats = dataclasses.asdict(scheduler.last_kv_stats)
    stats["occupancy"] = list(stats["occupancy"])  # as the tests read it (they once read JSON)
    return {"stats": stats, "prom": exporter_samples(scheduler)}


def main(model: str, variant: str) -> dict:
    with open_engine(engine_spec(model, variant, prefix_caching=False)) as harnessed:
        return known_requests(harnessed, variant)


def known_requests(harnessed, variant: str) -> dict:
    from vllm import SamplingParams, TokensPrompt

    block_size = 1 if variant == "token" else 32
    engine, scheduler, recorder = harnessed.llm.llm_engine, harnessed.scheduler, harnessed.recorder
    allocated = [0]
    if variant == "token":  # successful allocations, counted apart from the slot manager's own timing
        allocate = scheduler.kv_cache_manager.allocate_slots

        def counted_allocate(*args, **kwargs):
            result = allocate(*args, **kwargs)
            allocated[0] += result is not None
            return result

        scheduler.kv_cache_manager.allocate_slots = counted_allocate
    greedy = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    for i, n in enumerate(PROMPT_LENS):
        engine.add_request(f"m{i}", TokensPrompt(prompt_token_ids=list(range(10, 10 + n))), greedy)
    result = {"variant": variant, "block_size": block_size, "prompt_lens": PROMPT_LENS}
    engine.step()
    result["after_prefill"] = snapshot(scheduler)
    engine.step()
    result["after_one_decode"] = snapshot(scheduler)
    while engine.has_unfinished_requests():
        engine.step()
    scheduler.schedule()  # an idle step, as the server's busy loop makes: publishes the empty state
    result["idle"] = snapshot(scheduler)

    # Oversubscribe: 40 requests of 200 + 60 tokens need 10,400 slots of 4,096. With a publish
    # interval longer than the run, the gauges must stay as the idle step left them while busy,
    # and the closing idle step must bring them, and every latency timed meanwhile, up to date.
    scheduler.telemetry_interval_s = 3600.0
    long = SamplingParams(temperature=0, max_tokens=60, ignore_eos=True)
    for i in range(40):
        ids = [(i * 7 + j) % 400 + 3 for j in range(200)]
        engine.add_request(f"p{i}", TokensPrompt(prompt_token_ids=ids), long)
    for _ in range(3):
        engine.step()
    result["during_pressure"] = {"running": len(scheduler.running), "prom": exporter_samples(scheduler)}
    while engine.has_unfinished_requests():
        engine.step()
    scheduler.schedule()
    result["after_pressure"] = snapshot(scheduler)
    result["calls"] = {"allocate_ok": allocated[0], "preempt": recorder.preemptions,
                       "schedule": len(recorder.steps)}
    return result


SYSTEM_LEN = 40
TAILS = [3, 5, 8, 13]
FLOOD = 30  # prompts of 200 tokens: 6,000 tokens into 4,096 slots


def prefix_scenario(model: str, allocator: str) -> dict:
    """One burst of 4 prompts behind a 40-token system prompt, the same burst again, then a
    flood of unrelated prompts that needs more than the free slots (evictions)."""
    with open_engine(engine_spec(model, allocator, prefix_caching=True)) as harnessed:
        return shared_prefixes(harnessed)


def shared_prefixes(harnessed) -> dict:
    from vllm import SamplingParams, TokensPrompt

    engine, scheduler = harnessed.llm.llm_engine, harnessed.scheduler
    system = list(range(100, 100 + SYSTEM_LEN))
    prompts = [system + list(range(300 + 20 * i, 300 + 20 * i + n)) for i, n in enumerate(TAILS)]
    greedy = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    result: dict = {"system_len": SYSTEM_LEN, "tails": TAILS, "flood": FLOOD}
    for burst in ("first", "second"):
        for i, p in enumerate(prompts):
            engine.add_request(f"{burst}{i}", TokensPrompt(prompt_token_ids=p), greedy)
        engine.step()
        result[f"{burst}_prefill"] = snapshot(scheduler)
        while engine.has_unfinished_requests():
            engine.step()
        scheduler.schedule()
        result[f"{burst}_idle"] = snapshot(scheduler)
    flood = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    for i in range(FLOOD):
        engine.add_request(f"flood{i}", TokensPrompt(prompt_token_ids=[7 + i] * 200), flood)
    while engine.has_unfinished_requests():
        engine.step()
    scheduler.schedule()
    result["flood_idle"] = snapshot(scheduler)
    return result
