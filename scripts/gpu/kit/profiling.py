"""Where an e2e.py step's time goes (its --profile): host time of chosen functions, GPU kernel time
by kind under torch.profiler, and the host functions cProfile finds busiest.

`HostTimer` observes functions through sys.monitoring (PEP 669, Python 3.12+, as on the GPU
machine): it wraps nothing, so vLLM's scheduler, executor and attention classes stay as vLLM
built them, and only the watched functions' code objects raise events (a few microseconds a call
on top of the call). Nothing here imports torch or vLLM at module level.
"""

from __future__ import annotations

import inspect
import sys
import time
from collections.abc import Callable


class HostTimer:
    """Sums the host wall time of each watched function's calls and counts them (nested and
    recursive calls each timed; an exception ends a call as a return does)."""

    def __init__(self, tool_name: str = "proxima-host-timer") -> None:
        monitoring = getattr(sys, "monitoring", None)
        if monitoring is None:
            raise RuntimeError("HostTimer needs Python 3.12 or later (sys.monitoring); "
                               "run e2e.py --profile there, or leave --profile out")
        self._mon = monitoring
        # Never PROFILER_ID: cProfile claims it (host_profile runs while this timer is open).
        self._tool = next((t for t in (3, 4, monitoring.DEBUGGER_ID, monitoring.COVERAGE_ID)
                           if monitoring.get_tool(t) is None), None)
        if self._tool is None:
            raise RuntimeError("no sys.monitoring tool id is free for the host timer")
        monitoring.use_tool_id(self._tool, tool_name)
        events = monitoring.events
        monitoring.register_callback(self._tool, events.PY_START, self._start)
        monitoring.register_callback(self._tool, events.PY_RETURN, self._end)
        monitoring.register_callback(self._tool, events.PY_UNWIND, self._unwind)
        monitoring.set_events(self._tool, events.PY_UNWIND)  # a global event; filtered below
        self._labels: dict[object, str] = {}
        self._open: dict[object, list[float]] = {}
        self.seconds: dict[str, float] = {}
        self.calls: dict[str, int] = {}

    def watch(self, fn: Callable, label: str) -> None:
        """Time every call of `fn` (a function, or a method taken from its class or instance)."""
        code = inspect.unwrap(getattr(fn, "__func__", fn)).__code__
        self._labels[code] = label
        self._open[code] = []
        events = self._mon.events
        self._mon.set_local_events(self._tool, code, events.PY_START | events.PY_RETURN)

    def _start(self, code, offset) -> None:
        if code in self._labels:
            self._open[code].append(time.perf_counter())

    def _end(self, code, offset, value) -> None:
        started = self._open.get(code)
        if started:
            label = self._labels[code]
            self.seconds[label] = self.seconds.get(label, 0.0) + time.perf_counter() - started.pop()
            self.calls[label] = self.calls.get(label, 0) + 1

    def _unwind(self, code, offset, exc) -> None:
        self._end(code, offset, None)

    def reset(self) -> None:
        self.seconds.clear()
        self.calls.clear()

    def report(self, steps: int) -> dict:
        return {label: {"calls": self.calls[label], "ms_total": 1e3 * sec,
                        "us_per_call": 1e6 * sec / self.calls[label],
                        "ms_per_step": 1e3 * sec / max(steps, 1)}
                for label, sec in self.seconds.items()}

    def close(self) -> None:
        for code in self._labels:
            self._mon.set_local_events(self._tool, code, 0)
        self._mon.set_events(self._tool, 0)
        for event in (self._mon.events.PY_START, self._mon.events.PY_RETURN, self._mon.events.PY_UNWIND):
            self._mon.register_callback(self._tool, event, None)
        self._mon.free_tool_id(self._tool)
        self._labels.clear()


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
