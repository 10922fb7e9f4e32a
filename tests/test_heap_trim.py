"""The worker's idle heap trim (proxima/engine/heap_trim.py): glibc's real malloc_trim, real
fragments, measured in a process of their own so that pytest's heap does not blur the figures."""

from __future__ import annotations

import json
import logging
import subprocess
import sys
import textwrap
import time

import pytest

from proxima.engine import heap_trim

pytestmark = pytest.mark.skipif(heap_trim._glibc_malloc_trim() is None, reason="needs glibc")

# 64 MiB in 16 KiB blocks (below malloc's mmap threshold, so they live in the heap); every 16th is
# kept, so the free memory is fragments under live blocks that the heap's top cannot return.
_FRAGMENTS = textwrap.dedent("""
    import ctypes, json, sys, time
    from proxima.engine.heap_trim import IdleHeapTrimmer, _glibc_malloc_trim
    libc = ctypes.CDLL(None)
    libc.malloc.restype = ctypes.c_void_p
    libc.free.argtypes = [ctypes.c_void_p]
    def rss():
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * 4096
    blocks = [libc.malloc(16384) for _ in range(4096)]
    for b in blocks:
        ctypes.memset(b, 1, 16384)  # touched: resident
    for i, b in enumerate(blocks):
        if i % 16:
            libc.free(b)
    freed = rss()
    trimmer = IdleHeapTrimmer(float(sys.argv[1]), _glibc_malloc_trim())
    trimmer.note_step()
    time.sleep(float(sys.argv[2]))
    print(json.dumps({"freed": freed, "after": rss(), "trims": trimmer.trims}))
""")


def _fragments(idle_s: float, wait_s: float) -> dict:
    out = subprocess.run([sys.executable, "-c", _FRAGMENTS, str(idle_s), str(wait_s)],
                         capture_output=True, text=True, timeout=120, check=True)
    return json.loads(out.stdout)


def test_an_idle_trim_returns_the_fragments_glibc_kept():
    figures = _fragments(idle_s=0.2, wait_s=2.0)
    assert figures["trims"] == 1  # one idle period, one trim, however long it lasts
    # 60 of the 64 MiB were freed; without the trim glibc keeps all of it resident.
    assert figures["freed"] - figures["after"] > 40 * 2**20, figures


def test_no_trim_before_the_engine_has_been_idle_for_the_set_time():
    figures = _fragments(idle_s=600.0, wait_s=0.5)
    assert figures["trims"] == 0
    assert figures["freed"] - figures["after"] < 8 * 2**20, figures  # the fragments are still held


def test_each_idle_period_trims_once():
    calls = []
    trimmer = heap_trim.IdleHeapTrimmer(0.1, calls.append)
    trimmer.note_step()
    deadline = time.monotonic() + 30
    while not calls and time.monotonic() < deadline:
        time.sleep(0.05)
    time.sleep(0.5)  # five more idle periods' worth of waiting: still one trim
    assert calls == [0]
    trimmer.note_step()  # work again, then idle again: a second trim
    while len(calls) < 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert calls == [0, 0]
    assert trimmer.trims == 2


def test_a_failing_trim_is_logged_and_stops_trimming():
    def broken(_pad):
        raise OSError("no")

    # A handler on the module's own logger: once vLLM has configured logging (any earlier test
    # that imports it), its "vllm" loggers no longer propagate to pytest's capture.
    records: list[logging.LogRecord] = []
    handler = logging.Handler(logging.ERROR)
    handler.emit = records.append
    heap_trim.logger.addHandler(handler)
    try:
        trimmer = heap_trim.IdleHeapTrimmer(0.05, broken)
        trimmer.note_step()
        trimmer._thread.join(timeout=30)
    finally:
        heap_trim.logger.removeHandler(handler)
    assert not trimmer._thread.is_alive()
    assert any("malloc_trim failed" in r.getMessage() for r in records)
    trimmer.note_step()  # the step itself never fails
