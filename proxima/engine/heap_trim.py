"""Give the worker's freed heap back to the system when the engine goes idle.

Why: over a soak, vLLM's CPU worker (stock and Proxima alike) grows about 100 MiB in 30 minutes,
and most of it is memory the program already freed that glibc keeps in its arenas as fragments
between bursts (docs/benchmarks.md, "Soak: what grows in the worker"). Capping the number of
arenas does not help. `malloc_trim(0)` returns every whole free page inside the heap, not only
the top; it walks and locks each arena, so it runs once per idle period: a thread calls it when
no step has been planned for `idle_s` seconds.

`note_step()` is the whole cost on the hot path (one clock read and two attribute writes); the
thread starts on the first call in each process. Where there is no glibc (musl, macOS) nothing
starts. `PROXIMA_IDLE_TRIM_S` sets the idle time (settings.py; 0 turns it off).
"""

from __future__ import annotations

import ctypes
import logging
import os
import threading
import time

from proxima.engine.settings import ProximaConfigError, idle_trim_from_env

logger = logging.getLogger(f"vllm.{__name__}")


def _glibc_malloc_trim():
    try:  # the process's own symbols: libc is loaded, and no subprocess runs to find it
        return ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError):  # not glibc: no malloc_trim to call
        return None


class IdleHeapTrimmer:
    """Calls `trim()` once each time the steps noted stop for `idle_s` seconds."""

    def __init__(self, idle_s: float, trim) -> None:
        self.idle_s = idle_s
        self._trim = trim
        self._last_step = time.monotonic()
        self._trimmed = True  # nothing to give back before the first step
        self.trims = 0
        self._thread: threading.Thread | None = None
        self._pid = None

    def note_step(self) -> None:
        self._last_step = time.monotonic()
        self._trimmed = False
        if self._pid != os.getpid():  # first step here, or a forked child whose thread did not follow
            self._start()

    def _start(self) -> None:
        self._pid = os.getpid()
        self._thread = threading.Thread(target=self._run, name="proxima-idle-trim", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while True:
            wait = self._last_step + self.idle_s - time.monotonic()
            if wait > 0:
                time.sleep(wait)
                continue
            if not self._trimmed:
                self._trimmed = True
                try:
                    self._trim(0)
                except Exception:  # never let housekeeping take the worker down
                    logger.exception("Proxima: malloc_trim failed; idle heap trimming is off")
                    return
                self.trims += 1
            time.sleep(self.idle_s)


_trimmer: IdleHeapTrimmer | None = None
_resolved = False


def note_step() -> None:
    """Called once per planned step in the worker (the attention metadata builder)."""
    global _trimmer, _resolved
    if not _resolved:
        _resolved = True
        try:
            idle_s = idle_trim_from_env()
        except ProximaConfigError as err:  # `proxima serve` refuses it before start; vLLM alone may not
            logger.error("Proxima: idle heap trimming off: %s", err)
            idle_s = 0.0
        trim = _glibc_malloc_trim() if idle_s > 0 else None
        _trimmer = IdleHeapTrimmer(idle_s, trim) if trim is not None else None
    if _trimmer is not None:
        _trimmer.note_step()
