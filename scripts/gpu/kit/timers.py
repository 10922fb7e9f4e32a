"""How the GPU benchmarks time a call: GPU time eager, replayed from a CUDA graph, and host time.

All medians of `triton.testing.do_bench` (GPU time), except `host_us` (wall time of the host
enqueueing calls while the GPU trails behind).
"""

from __future__ import annotations

import time

import torch
import triton.testing


def gpu_us(fn) -> float:
    return triton.testing.do_bench(fn, warmup=25, rep=200, return_mode="median") * 1e3


def graph_us(fn, warmup: int = 25, rep: int = 200) -> float:
    """GPU time of ``fn`` replayed from a CUDA graph (how vLLM runs decode steps), median us.

    One eager call first compiles and warms up outside the capture, as vLLM does before it
    captures a size."""
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return triton.testing.do_bench(graph.replay, warmup=warmup, rep=rep, return_mode="median") * 1e3


def replay_us(fn) -> float:
    """`graph_us` with short timings: a sweep replays hundreds of launch shapes."""
    return graph_us(fn, warmup=10, rep=40)


def host_us(fn, n: int = 200) -> float:
    """Host time to enqueue ``fn`` once: the GPU is left to trail behind the loop."""
    fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(n):
        fn()
    elapsed = time.perf_counter() - start
    torch.cuda.synchronize()
    return elapsed / n * 1e6


def copy_bandwidth() -> float:
    """Device-to-device copy rate (bytes/s): the ceiling a KV read is measured against."""
    src = torch.empty(2 << 30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    ms = triton.testing.do_bench(lambda: dst.copy_(src), warmup=50, rep=300, return_mode="median")
    return 2 * src.numel() / (ms * 1e-3)
