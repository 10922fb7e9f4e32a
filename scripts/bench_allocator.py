"""Host cost of the slot allocator's hot path, per call: what a decode step pays per running request.

Times (median of --repeats runs, each --calls calls):
- `SlotAllocator.allocate(1)` alone, and with `RequestSlotTable.append` (one decode token);
- exporting one allocator latency to Prometheus: one `Histogram.observe` per call, against
  `observe_many` once per step for a step's worth of values (what the scheduler does now).

usage: python scripts/bench_allocator.py [--calls 20000] [--repeats 5] [--requests 64]
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
from prometheus_client import CollectorRegistry

from proxima.engine.slot_allocator import SlotAllocator
from proxima.engine.slot_table import RequestSlotTable
from proxima.metrics.prometheus import PrometheusKVExporter


def per_call_us(fn, calls: int, repeats: int) -> float:
    runs = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn(calls)
        runs.append((time.perf_counter() - start) / calls * 1e6)
    return statistics.median(runs)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--calls", type=int, default=20000)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--requests", type=int, default=64, help="running requests per decode step")
    args = p.parse_args()
    slots = 1 << 24  # never runs out over all repeats
    allocator, table = SlotAllocator(slots), RequestSlotTable()
    ids = [f"r{i}" for i in range(args.requests)]

    def allocate_only(n: int) -> None:
        for _ in range(n):
            allocator.allocate(1)

    def allocate_and_append(n: int) -> None:
        for i in range(n):
            table.append(ids[i % len(ids)], allocator.allocate(1))

    exporter = PrometheusKVExporter(CollectorRegistry())
    values = list(np.random.default_rng(0).uniform(1e-6, 2e-5, args.requests))

    def observe_each(n: int) -> None:
        for i in range(n):
            exporter._latency["allocate"].observe(values[i % len(values)])

    def observe_per_step(n: int) -> None:
        for _ in range(n // len(values)):
            exporter.observe_latencies("allocate", values)

    print(f"per call, median of {args.repeats} x {args.calls} calls ({args.requests} requests per step):")
    print(f"  allocate(1)                       {per_call_us(allocate_only, args.calls, args.repeats):6.2f} us")
    print(f"  allocate(1) + table append        {per_call_us(allocate_and_append, args.calls, args.repeats):6.2f} us")
    print(f"  latency export, observe per call  {per_call_us(observe_each, args.calls, args.repeats):6.2f} us")
    print(f"  latency export, one batch a step  {per_call_us(observe_per_step, args.calls, args.repeats):6.2f} us")


if __name__ == "__main__":
    main()
