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


def t_quantile(confidence: float, df: int) -> float:
    """Two-sided Student t quantile (the half-width of a `confidence` interval, in standard
    errors) with `df` degrees of freedom: the one place the project takes them from (scipy)."""
    from scipy import stats  # imported when a trend or a repeated bench needs it

    return float(stats.t.ppf((1 + confidence) / 2, df))


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
    half = t_quantile(0.95, n - 2) * stderr
    return Trend(slope, stderr, n, slope - half, slope + half)
