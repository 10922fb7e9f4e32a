"""Drive one engine through known requests and record, step by step, what its KV telemetry said
(the scheduler's stats and the Prometheus exporter's samples) beside what the engine did.

Executed by tests/test_engine_metrics.py in a subprocess per allocator; `token-prefix` runs the
prefix-cache scenario with vLLM's prefix caching on, on token slots (`token-prefix`) or on stock
32-token blocks (`block-prefix`).
usage: python tests/metrics_scenarios.py MODEL_DIR {token,block,token-prefix,block-prefix} OUT.json
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys

PROMPT_LENS = [5, 17, 33, 64, 100]
KV_SLOTS = 4096


def exporter_samples(scheduler) -> dict:
    from proxima.metrics import catalog as c

    reg, labels = scheduler.kv_exporter.registry, {"engine": "0"}
    out = {spec.name: reg.get_sample_value(spec.sample_name, labels) for spec in (
        c.SLOTS_TOTAL, c.SLOTS_USED, c.SLOTS_FREE, c.LIVE_TOKENS, c.TOKEN_USAGE, c.BLOCK_USAGE,
        c.FRAGMENTATION, c.BLOCK_FRAGMENTATION, c.RUNNING_REQUESTS, c.LARGEST_FREE_RUN, c.PREEMPTIONS,
        c.BYTES_PER_TOKEN, c.CACHE_BYTES, c.SLOTS_CACHED, *c.PREFIX_COUNTERS)}
    out["occupancy_0"] = reg.get_sample_value(c.OCCUPANCY_MAP.name, {"engine": "0", "segment": "0"})
    for op in c.ALLOCATOR_OPS:
        out[f"latency_count_{op}"] = reg.get_sample_value(
            c.ALLOCATOR_LATENCY.name + "_count", {"engine": "0", "op": op})
    return out


def snapshot(scheduler) -> dict:
    return {"stats": dataclasses.asdict(scheduler.last_kv_stats), "prom": exporter_samples(scheduler)}


def main(model: str, variant: str) -> dict:
    from vllm import LLM, SamplingParams, TokensPrompt

    block_size = 1 if variant == "token" else 32
    llm = LLM(model, dtype="float32", max_model_len=1024, enforce_eager=True, seed=0,
              max_num_batched_tokens=2048, max_num_seqs=64, enable_prefix_caching=False,
              block_size=block_size, kv_cache_memory_bytes=KV_SLOTS * 1024,
              scheduler_cls="proxima.engine.scheduler.ProximaScheduler")
    engine = llm.llm_engine
    scheduler = engine.engine_core.engine_core.scheduler
    calls = {"allocate_ok": 0, "preempt": 0, "schedule": 0}
    mgr_allocate, preempt = scheduler.kv_cache_manager.allocate_slots, scheduler._preempt_request
    schedule = scheduler.schedule

    def counted_schedule(*args, **kwargs):
        calls["schedule"] += 1
        return schedule(*args, **kwargs)

    def counted_allocate(*args, **kwargs):
        result = mgr_allocate(*args, **kwargs)
        calls["allocate_ok"] += result is not None
        return result

    def counted_preempt(*args, **kwargs):
        calls["preempt"] += 1
        return preempt(*args, **kwargs)

    scheduler.kv_cache_manager.allocate_slots = counted_allocate
    scheduler._preempt_request = counted_preempt
    scheduler.schedule = counted_schedule
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
    result["calls"] = calls
    return result


SYSTEM_LEN = 40
TAILS = [3, 5, 8, 13]
FLOOD = 30  # prompts of 200 tokens: 6,000 tokens into 4,096 slots


def prefix_scenario(model: str, block_size: int = 1) -> dict:
    """One burst of 4 prompts behind a 40-token system prompt, the same burst again, then a
    flood of unrelated prompts that needs more than the free slots (evictions)."""
    from vllm import LLM, SamplingParams, TokensPrompt

    llm = LLM(model, dtype="float32", max_model_len=1024, enforce_eager=True, seed=0,
              max_num_batched_tokens=2048, max_num_seqs=64, enable_prefix_caching=True,
              block_size=block_size, kv_cache_memory_bytes=KV_SLOTS * 1024,
              scheduler_cls="proxima.engine.scheduler.ProximaScheduler")
    engine = llm.llm_engine
    scheduler = engine.engine_core.engine_core.scheduler
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


if __name__ == "__main__":
    model_dir, variant, out_path = sys.argv[1:4]
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ["PROXIMA_ALLOCATOR"] = variant.removesuffix("-prefix")
    os.environ["PROXIMA_TELEMETRY_INTERVAL_S"] = "0"  # publish every step: snapshots are per step
    os.environ["PROXIMA_KV_FIGURES"] = "exact"  # the figures are checked against the engine, token by token
    if variant.endswith("-prefix"):
        data = prefix_scenario(model_dir, 1 if variant == "token-prefix" else 32)
    else:
        data = main(model_dir, variant)
    with open(out_path + ".tmp", "w") as f:
        json.dump(data, f)
    os.replace(out_path + ".tmp", out_path)
