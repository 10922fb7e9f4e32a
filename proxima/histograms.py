"""Histograms as a scrape shows them: cumulative bucket counts, their deltas and quantiles.

Layer: part of the scrape/snapshot layer (`proxima.scrape` re-exports it). Pure data: a
`HistogramSnapshot` is immutable; windows come from two of them (`since`), several engines' or
servers' from `merge_histograms`.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class HistogramSnapshot:
    """Cumulative bucket counts (upper bound, count), as Prometheus exposes them."""

    buckets: tuple[tuple[float, float], ...] = ()
    count: float = 0.0
    sum: float = 0.0

    def since(self, older: HistogramSnapshot | None) -> HistogramSnapshot:
        """Observations made between `older` and this snapshot (a server restart resets to self)."""
        if older is None or older.count > self.count or len(older.buckets) != len(self.buckets):
            return self
        return HistogramSnapshot(
            tuple((le, n - o) for (le, n), (_, o) in zip(self.buckets, older.buckets)),
            self.count - older.count,
            self.sum - older.sum,
        )

    @property
    def mean(self) -> float | None:
        return self.sum / self.count if self.count else None

    def quantile(self, q: float) -> float | None:
        """Linear interpolation inside the bucket, as PromQL's histogram_quantile does."""
        if not self.count or not self.buckets:
            return None
        rank = q * self.count
        prev_le, prev_n = 0.0, 0.0
        for le, n in self.buckets:
            if n >= rank:
                if math.isinf(le):
                    return prev_le
                width = n - prev_n
                return prev_le + (le - prev_le) * ((rank - prev_n) / width if width else 0.0)
            prev_le, prev_n = le, n
        return prev_le


def merge_histograms(hists: Iterable[HistogramSnapshot]) -> HistogramSnapshot:
    """Sum histograms with the same bucket bounds (engines, or servers in the aggregate view)."""
    total: HistogramSnapshot | None = None
    for h in hists:
        if not h.count:
            continue
        if total is None:
            total = h
        elif [le for le, _ in h.buckets] == [le for le, _ in total.buckets]:
            total = HistogramSnapshot(tuple((le, a + b) for (le, a), (_, b) in zip(total.buckets, h.buckets)),
                                      total.count + h.count, total.sum + h.sum)
    return total or HistogramSnapshot()
