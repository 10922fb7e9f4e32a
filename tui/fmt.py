"""Number formatting shared by the Textual panels and the `--once` plain text.

One convention for the whole dashboard: `N/A` means the figure cannot be known here (no GPU
readable, a stock server without Proxima's metrics); `–` means it is known to be empty right now
(no requests finished inside the window, no rate yet after a single scrape).
"""

from __future__ import annotations

import math
import time

NA = "N/A"
NONE_YET = "–"


def _bad(x: float | None) -> bool:
    return x is None or (isinstance(x, float) and math.isnan(x))


def count(x: float | None) -> str:
    return NONE_YET if _bad(x) else f"{x:,.0f}"


def pct(fraction: float | None, digits: int = 1) -> str:
    return NONE_YET if _bad(fraction) else f"{fraction * 100:.{digits}f}%"


def per_second(x: float | None, unit: str = "") -> str:
    """`12.3/s`, or with unit=" tok": `12.3 tok/s`."""
    if _bad(x):
        return NONE_YET
    return f"{x:,.0f}{unit}/s" if x >= 100 else f"{x:.1f}{unit}/s"


def seconds(x: float | None) -> str:
    """Latencies from microseconds (allocator) to seconds (E2E) in three significant figures."""
    if _bad(x):
        return NONE_YET
    if x < 1e-3:
        return f"{x * 1e6:.0f}µs"
    if x < 1.0:
        return f"{x * 1e3:.0f}ms" if x >= 0.1 else f"{x * 1e3:.1f}ms"
    return f"{x:.2f}s"


def gib(x: float | None) -> str:
    return NA if _bad(x) else f"{x / 2**30:.1f} GiB"


def clock(t: float | None) -> str:
    """Wall-clock time of a frame; never the current time, so replays show the recording's clock."""
    return NONE_YET if t is None else time.strftime("%H:%M:%S", time.localtime(t))


def duration(s: float | None) -> str:
    if _bad(s):
        return NONE_YET
    if s < 90:
        return f"{s:.0f}s" if s >= 10 else f"{s:.1f}s"
    if s < 5400:
        return f"{s / 60:.0f}min"
    return f"{s / 3600:.1f}h"


def short_url(url: str) -> str:
    """`http://127.0.0.1:8000` → `127.0.0.1:8000`: the scheme adds nothing on a status line."""
    return url.split("://", 1)[-1].rstrip("/")
