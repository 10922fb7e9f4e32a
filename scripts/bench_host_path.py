"""Host cost of Proxima's per-step hot paths, per call, on this machine's CPU.

What a serving step pays on the host, measured without a GPU (median of --repeats runs of
--calls calls each):
- allocator: `SlotAllocator.allocate(1)` alone and with `RequestSlotTable.append` (one decode
  token of one running request);
- latency export: one `Histogram.observe` per allocator call, against one `BatchObserver.observe`
  per step for a step's worth of values (what the scheduler does);
- attention launch path: the shape/dtype checks both attention implementations run per layer
  per step, and the tile choice, on Llama-3-8B-like shapes (47 requests, 245 query tokens).

`--checks-from FILE` / `--allocator-from FILE` also time another copy of the module that defined
the checks / the allocator, for a before-and-after on one machine, e.g.
  git show deef7d4:proxima/engine/attention/reference.py > /tmp/ref_before.py
  git show deef7d4:proxima/engine/slot_allocator.py > /tmp/alloc_before.py

usage: python scripts/bench_host_path.py [--calls N] [--repeats N] [--requests N]
                                         [--checks-from FILE] [--allocator-from FILE]
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import time

import numpy as np
import torch
from prometheus_client import CollectorRegistry, Histogram

from proxima.engine.attention.checks import check_attention_args, check_write_kv_args
from proxima.engine.attention.planning import choose_tiles
from proxima.engine.slot_allocator import SlotAllocator
from proxima.engine.slot_table import RequestSlotTable
from proxima.metrics import catalog as c
from proxima.metrics.prometheus import BatchObserver


def per_call_us(fn, calls: int, repeats: int) -> float:
    runs = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn(calls)
        runs.append((time.perf_counter() - start) / calls * 1e6)
    return statistics.median(runs)


def _load(path: str):
    spec = importlib.util.spec_from_file_location("baseline", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def attention_args():
    tokens, hq, hkv, d, requests = 245, 32, 8, 128, 47
    query = torch.zeros(tokens, hq, d, dtype=torch.bfloat16)
    rows = torch.zeros(8192, hkv, 2 * d, dtype=torch.bfloat16)
    k_cache, v_cache = rows[..., :d], rows[..., d:]
    table = torch.zeros(512, 2048, dtype=torch.int32)
    qsl = torch.arange(requests + 1, dtype=torch.int32)
    seq_lens = torch.ones(requests, dtype=torch.int32)
    key = torch.zeros(tokens, hkv, d, dtype=torch.bfloat16)
    slot_mapping = torch.zeros(tokens, dtype=torch.int64)
    attention = (query, k_cache, v_cache, table, qsl, seq_lens, torch.zeros_like(query), tokens)
    write = (key, key.clone(), k_cache, v_cache, slot_mapping)
    return attention, write


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--calls", type=int, default=20000)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--requests", type=int, default=64, help="running requests per decode step")
    p.add_argument("--checks-from", help="another module defining check_attention_args / check_write_kv_args")
    p.add_argument("--allocator-from", help="another module defining SlotAllocator")
    args = p.parse_args()
    allocator, table = SlotAllocator(1 << 24), RequestSlotTable()  # never runs out over all repeats
    ids = [f"r{i}" for i in range(args.requests)]

    def allocate_only(n: int) -> None:
        for _ in range(n):
            allocator.allocate(1)

    def allocate_and_append(n: int) -> None:
        for i in range(n):
            table.append(ids[i % len(ids)], allocator.allocate(1))

    histogram = Histogram("h_seconds", "h", ["op"], registry=CollectorRegistry(),
                          buckets=c.ALLOCATOR_LATENCY.buckets).labels(op="allocate")
    batch = BatchObserver(histogram)
    values = list(np.random.default_rng(0).uniform(1e-6, 2e-5, args.requests))

    def observe_each(n: int) -> None:
        for i in range(n):
            histogram.observe(values[i % len(values)])

    def observe_per_step(n: int) -> None:
        for _ in range(n // len(values)):
            batch.observe(values)

    attention, write = attention_args()
    timed = {"allocate(1)": allocate_only, "allocate(1) + table append": allocate_and_append,
             "latency export, observe per call": observe_each,
             "latency export, one batch a step": observe_per_step}
    if args.allocator_from:
        other = _load(args.allocator_from).SlotAllocator(1 << 24)
        timed["allocate(1) [--allocator-from]"] = lambda n: [other.allocate(1) for _ in range(n)]
    modules = [("", check_attention_args, check_write_kv_args)]
    if args.checks_from:
        baseline = _load(args.checks_from)
        modules.append((" [--checks-from]", baseline.check_attention_args, baseline.check_write_kv_args))
    for tag, check_attention, check_write in modules:
        timed[f"attention argument checks{tag}"] = \
            lambda n, f=check_attention: [f(*attention) for _ in range(n)]
        timed[f"KV write argument checks{tag}"] = lambda n, f=check_write: [f(*write) for _ in range(n)]
    timed["tile choice (cached)"] = lambda n: [choose_tiles(4, 128, 2, 200) for _ in range(n)]
    print(f"per call, median of {args.repeats} x {args.calls} calls ({args.requests} requests per step):")
    for name, fn in timed.items():
        print(f"  {name:<44} {per_call_us(fn, args.calls, args.repeats):6.2f} us")


if __name__ == "__main__":
    main()
