"""Capacity at a fixed KV budget: stock vLLM (block 32, block 128) against Proxima's token slots.

A short-chat burst (prompts of 50-200 tokens, outputs of 20-100, all submitted at once) runs on
each engine at the same KV budget in bytes. Every scheduler step is recorded: live tokens,
allocated slots, running requests, and the time the step's scheduling (allocation included)
took. Each engine runs in its own process (vLLM's plugin registry is per process); stock
allocation runs under Proxima's observing scheduler (PROXIMA_ALLOCATOR=block), which leaves
vLLM's block manager untouched and only reads it.

usage: python scripts/bench_capacity.py [--model DIR] [--requests 400] [--kv-tokens 8192] [--json OUT]
       [--kv-cache-dtype auto|fp8]   (fp8: every engine stores e4m3 K/V in the same budget of bytes)
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

VARIANTS = {"stock-b32": ("block", 32), "stock-b128": ("block", 128), "proxima": ("token", 1)}


def workload(n: int, seed: int) -> list[tuple[list[int], int]]:
    rng = random.Random(seed)
    return [([rng.randrange(3, 400) for _ in range(rng.randint(50, 200))], rng.randint(20, 100))
            for _ in range(n)]


def run_engine(model: str, allocator: str, block_size: int, requests: int, kv_tokens: int, seed: int,
               kv_cache_dtype: str = "auto") -> dict:
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ["PROXIMA_ALLOCATOR"] = allocator
    # Every figure below is per scheduler step: publish the KV telemetry on every step.
    os.environ["PROXIMA_TELEMETRY_INTERVAL_S"] = "0"
    import numpy as np
    from vllm import LLM, SamplingParams, TokensPrompt

    llm = LLM(model, dtype="float32", max_model_len=1024, enforce_eager=True, seed=seed,
              block_size=block_size, kv_cache_memory_bytes=kv_tokens * 1024,
              max_num_seqs=512, max_num_batched_tokens=2048, enable_prefix_caching=False,
              scheduler_cls="proxima.engine.scheduler.ProximaScheduler", kv_cache_dtype=kv_cache_dtype)
    engine = llm.llm_engine
    scheduler = engine.engine_core.engine_core.scheduler
    steps: list[tuple[int, int, int, float]] = []
    schedule, preemptions, alloc_time = scheduler.schedule, [0], [0.0]

    def timed_schedule(*args, **kwargs):
        start = time.perf_counter()
        out = schedule(*args, **kwargs)
        elapsed = time.perf_counter() - start
        s = scheduler.last_kv_stats
        steps.append((s.live_tokens, s.slots_used, len(scheduler.running), elapsed))
        return out

    preempt = scheduler._preempt_request

    def counted_preempt(*args, **kwargs):
        preemptions[0] += 1
        return preempt(*args, **kwargs)

    scheduler.schedule, scheduler._preempt_request = timed_schedule, counted_preempt
    alloc_per_step: list[float] = []
    if allocator == "token":  # pure allocator time: the slot manager times each call
        exporter = scheduler.kv_exporter
        observe = exporter.observe_latencies

        def observe_latencies(op, seconds):
            if op != "step":
                alloc_time[0] += sum(seconds)
            observe(op, seconds)

        exporter.observe_latencies = observe_latencies
    for i, (prompt, out_len) in enumerate(workload(requests, seed)):
        engine.add_request(f"r{i}", TokensPrompt(prompt_token_ids=prompt),
                           SamplingParams(temperature=0, max_tokens=out_len, ignore_eos=True))
    start, output_tokens = time.perf_counter(), 0
    while engine.has_unfinished_requests():
        before = alloc_time[0]
        for o in engine.step():
            if o.finished:
                output_tokens += len(o.outputs[0].token_ids)
        if allocator == "token":
            alloc_per_step.append(alloc_time[0] - before)
    wall = time.perf_counter() - start
    arr = np.array(steps, dtype=np.float64)
    busy = arr[arr[:, 1] > 0]
    step_times = arr[:, 3]
    result = {
        "allocator": allocator, "block_size": block_size, "requests": requests,
        "kv_cache_dtype": kv_cache_dtype,
        "slots_total": scheduler.last_kv_stats.slots_total,
        "slot_efficiency_mean": float(np.mean(busy[:, 0] / busy[:, 1])),
        "running_peak": int(arr[:, 2].max()), "running_mean": float(busy[:, 2].mean()),
        "preemptions": preemptions[0], "output_tokens": output_tokens,
        "output_tokens_per_s": output_tokens / wall, "wall_s": wall, "steps": len(arr),
        "schedule_ms_p50": float(np.percentile(step_times, 50) * 1e3),
        "schedule_ms_p99": float(np.percentile(step_times, 99) * 1e3),
    }
    if alloc_per_step:
        a = np.array(alloc_per_step) * 1e6
        result["allocator_us_per_step_p50"] = float(np.percentile(a, 50))
        result["allocator_us_per_step_p99"] = float(np.percentile(a, 99))
    return result


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="model dir (default: build the tiny model)")
    p.add_argument("--requests", type=int, default=400)
    p.add_argument("--kv-tokens", type=int, default=8192, help="KV budget in tokens of the tiny model")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", type=Path, default=None)
    p.add_argument("--kv-cache-dtype", default="auto", help="vLLM's --kv-cache-dtype for every engine")
    p.add_argument("--child", nargs=2, metavar=("VARIANT", "OUT"), help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        allocator, block = VARIANTS[args.child[0]]
        res = run_engine(args.model, allocator, block, args.requests, args.kv_tokens, args.seed,
                         args.kv_cache_dtype)
        Path(args.child[1]).write_text(json.dumps(res))
        return
    model = args.model
    if model is None:
        from proxima.tiny_model import build_tiny_model

        model = str(build_tiny_model(Path(tempfile.mkdtemp()) / "tiny"))
    results = {}
    for name in VARIANTS:
        with tempfile.NamedTemporaryFile(suffix=".json") as out:
            env = {k: v for k, v in os.environ.items() if not k.startswith("PROXIMA_")}
            subprocess.run([sys.executable, __file__, "--model", model, "--requests", str(args.requests),
                            "--kv-tokens", str(args.kv_tokens), "--seed", str(args.seed),
                            "--kv-cache-dtype", args.kv_cache_dtype,
                            "--child", name, out.name], check=True, env=env,
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            results[name] = json.loads(Path(out.name).read_text())
    cols = ["slots_total", "slot_efficiency_mean", "running_peak", "running_mean", "preemptions",
            "output_tokens_per_s", "schedule_ms_p50", "schedule_ms_p99"]
    print(f"{'engine':<12}" + "".join(f"{c:>22}" for c in cols))
    for name, r in results.items():
        print(f"{name:<12}" + "".join(f"{r[c]:>22.3f}" if isinstance(r[c], float) else f"{r[c]:>22}" for c in cols))
    px = results["proxima"]
    if "allocator_us_per_step_p50" in px:
        print(f"proxima allocator time per step: p50 {px['allocator_us_per_step_p50']:.1f} us, "
              f"p99 {px['allocator_us_per_step_p99']:.1f} us")
    for base in ("stock-b32", "stock-b128"):
        b = results[base]
        print(f"mean running proxima/{base}: {px['running_mean'] / b['running_mean']:.2f}x "
              f"(fragmentation bound: {1 / b['slot_efficiency_mean']:.2f}x)")
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
