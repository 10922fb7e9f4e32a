"""The one number formatter: every figure `top`, `doctor`, `bench` and `demo` print goes through it.

One convention everywhere:
  `N/A`  the figure cannot be known here: no GPU readable, a stock server without Proxima's
         metrics, a reading that was not taken (`bench --sample-interval 0`)
  `–`    the figure is known to be empty right now: no request finished inside the window, no
         rate yet after a single scrape
Only the caller knows which one a missing value (None, NaN) is, so each function takes it as
`missing`; the default is `–`, the dashboard's usual case, and `bench` and the doctor's probes,
whose missing figures are readings not taken, pass `missing=NA`.
"""

from __future__ import annotations

import math
import time

NA = "N/A"
NONE_YET = "–"


def _bad(x: float | None) -> bool:
    return x is None or (isinstance(x, float) and math.isnan(x))


def count(x: float | None, missing: str = NONE_YET) -> str:
    """`12,345`."""
    return missing if _bad(x) else f"{x:,.0f}"


def number(x: float | None, spec: str = "{:.0f}", missing: str = NONE_YET) -> str:
    """`x` in `spec` (a str.format spec), for table cells whose header carries the unit."""
    return missing if _bad(x) else spec.format(x)


def pct(fraction: float | None, digits: int = 1, missing: str = NONE_YET) -> str:
    """`42.0%` from 0.42."""
    return missing if _bad(fraction) else f"{fraction * 100:.{digits}f}%"


def per_second(x: float | None, unit: str = "", missing: str = NONE_YET) -> str:
    """`12.3/s`, or with unit=" tok": `12.3 tok/s`."""
    if _bad(x):
        return missing
    return f"{x:,.0f}{unit}/s" if x >= 100 else f"{x:.1f}{unit}/s"


def seconds(x: float | None, missing: str = NONE_YET) -> str:
    """Latencies from microseconds (allocator) to seconds (E2E) in three significant figures."""
    if _bad(x):
        return missing
    if x < 1e-3:
        return f"{x * 1e6:.0f}µs"
    if x < 1.0:
        return f"{x * 1e3:.0f}ms" if x >= 0.1 else f"{x * 1e3:.1f}ms"
    return f"{x:.2f}s"


def ms(x: float | None, missing: str = NONE_YET) -> str:
    """Seconds as a number of milliseconds (`12`, `3.4`), for columns headed "ms"."""
    if _bad(x):
        return missing
    return f"{x * 1e3:.0f}" if x >= 0.1 else f"{x * 1e3:.1f}"


def gib(x: float | None, missing: str = NA, unit: bool = True) -> str:
    """`1.5 GiB` (or `1.5` for columns headed "GiB"); missing: GPU memory no one could read."""
    if _bad(x):
        return missing
    return f"{x / 2**30:.1f} GiB" if unit else f"{x / 2**30:.1f}"


def size(n: float | None, missing: str = NA) -> str:
    """Bytes in the largest binary unit under 1024: `512 B`, `1.5 MiB`."""
    if _bad(n):
        return missing
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


def clock(t: float | None, missing: str = NONE_YET) -> str:
    """Wall-clock time of a frame; never the current time, so replays show the recording's clock."""
    return missing if t is None else time.strftime("%H:%M:%S", time.localtime(t))


def duration(s: float | None, missing: str = NONE_YET) -> str:
    if _bad(s):
        return missing
    if s < 90:
        return f"{s:.0f}s" if s >= 10 else f"{s:.1f}s"
    if s < 5400:
        return f"{s / 60:.0f}min"
    return f"{s / 3600:.1f}h"


def short_url(url: str) -> str:
    """`http://127.0.0.1:8000` → `127.0.0.1:8000`: the scheme adds nothing on a status line."""
    return url.split("://", 1)[-1].rstrip("/")
