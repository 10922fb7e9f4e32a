"""The trend through a probe's samples: a least-squares line with its standard error.

Layer: probes (arithmetic only). The samples themselves come from `proxima.sampling.Sampler`,
through `ProbeContext.sampler`; probes compute over the list once sampling has stopped.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Trend:
    """Least-squares line y = a + slope * t, with the slope's standard error and 95% interval."""

    slope: float
    stderr: float
    n: int
    ci95_low: float
    ci95_high: float

    @property
    def significant_rise(self) -> bool:
        return self.ci95_low > 0


# Two-sided 95% Student t quantiles for small samples (df = n - 2); 1.96 beyond.
_T95 = {1: 12.71, 2: 4.30, 3: 3.18, 4: 2.78, 5: 2.57, 6: 2.45, 7: 2.36, 8: 2.31, 9: 2.26, 10: 2.23,
        12: 2.18, 15: 2.13, 20: 2.09, 25: 2.06, 30: 2.04}


def _t95(df: int) -> float:
    if df > 30:
        return 1.96
    return _T95[max(k for k in _T95 if k <= df)]


def linear_trend(ts: Sequence[float], ys: Sequence[float]) -> Trend | None:
    """Slope of ys against ts (units of y per unit of t); None with fewer than 3 points."""
    n = len(ts)
    if n < 3 or n != len(ys):
        return None
    mt, my = sum(ts) / n, sum(ys) / n
    sxx = sum((t - mt) ** 2 for t in ts)
    if sxx == 0:
        return None
    slope = sum((t - mt) * (y - my) for t, y in zip(ts, ys)) / sxx
    intercept = my - slope * mt
    residual = sum((y - intercept - slope * t) ** 2 for t, y in zip(ts, ys))
    stderr = math.sqrt(residual / (n - 2) / sxx)
    half = _t95(n - 2) * stderr
    return Trend(slope, stderr, n, slope - half, slope + half)
