"""Where an e2e.py step's time goes (its --profile): host time of wrapped methods, GPU kernel time
by kind under torch.profiler, and the host functions cProfile finds busiest."""

from __future__ import annotations

import time


class HostTimer:
    """Wraps methods (in place) to sum their host wall time and count their calls."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}
        self.calls: dict[str, int] = {}

    def wrap(self, owner, attr: str, label: str) -> None:
        inner = getattr(owner, attr)

        def timed(*a, **k):
            start = time.perf_counter()
            try:
                return inner(*a, **k)
            finally:
                self.seconds[label] = self.seconds.get(label, 0.0) + time.perf_counter() - start
                self.calls[label] = self.calls.get(label, 0) + 1

        setattr(owner, attr, timed)

    def reset(self) -> None:
        self.seconds.clear()
        self.calls.clear()

    def report(self, steps: int) -> dict:
        return {label: {"calls": self.calls[label], "ms_total": 1e3 * sec,
                        "us_per_call": 1e6 * sec / self.calls[label],
                        "ms_per_step": 1e3 * sec / max(steps, 1)}
                for label, sec in self.seconds.items()}


def attention_impl(backend: str):
    if backend == "CUSTOM":
        from proxima.engine.attention.backend import ProximaSlotAttentionImpl

        return ProximaSlotAttentionImpl
    if backend == "FLASH_ATTN":
        from vllm.v1.attention.backends.flash_attn import FlashAttentionImpl

        return FlashAttentionImpl
    from vllm.v1.attention.backends.triton_attn import TritonAttentionImpl

    return TritonAttentionImpl


KERNEL_KINDS = (("attention", ("attention", "attn", "flash", "fmha", "merge_splits")),
                ("kv write", ("reshape_and_cache", "write_kv")),
                ("gemm", ("gemm", "cutlass", "nvjet", "sm90_xmma", "matmul")))


def kernel_profile(run) -> dict:
    """GPU kernel time of one call of ``run`` by kind, from torch.profiler (CUDA activity only)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        start = time.perf_counter()
        run()
        wall = time.perf_counter() - start
    kinds: dict[str, float] = {}
    top = []
    for e in prof.key_averages():
        us = e.self_device_time_total
        if us <= 0:
            continue
        lname = e.key.lower()
        kind = next((k for k, words in KERNEL_KINDS if any(w in lname for w in words)), "other")
        kinds[kind] = kinds.get(kind, 0.0) + us / 1e3
        top.append((us / 1e3, e.count, e.key[:90]))
    top.sort(reverse=True)
    return {"wall_ms": wall * 1e3, "gpu_ms_by_kind": kinds, "gpu_ms_total": sum(kinds.values()),
            "top_kernels": top[:15]}


def host_profile(run, top: int = 45) -> str:
    """The host functions one call of ``run`` spent most time in (cProfile, self time)."""
    import cProfile
    import io
    import pstats

    prof = cProfile.Profile()
    prof.enable()
    run()
    prof.disable()
    text = io.StringIO()
    pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(top)
    return text.getvalue()
