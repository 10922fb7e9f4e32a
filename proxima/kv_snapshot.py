"""Proxima's KV figures as a scrape reads them: one engine's, and several engines' combined.

Layer: part of the scrape/snapshot layer (`proxima.scrape` re-exports `KVSnapshot`). Nothing here
names a figure: each catalog entry says which `KVSnapshot` field it fills (`figure`), how one
engine's value is read (`read`) and how several engines' values combine (`combine`, `of`), and
the two functions below follow those rules for every entry. `KVSnapshot.combine` is the one place
that combines KV figures, for the engines of one server and for the servers of `proxima top`'s
all-servers view alike.

A catalog figure that has no field of its own here yet (one just added, read by no tool by name)
is read and combined the same way and kept in `other`; `figure(name)` reads either.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from proxima.exposition import Samples, segment_of
from proxima.histograms import HistogramSnapshot, merge_histograms
from proxima.metrics import catalog as c
from proxima.metrics.kv_stats import ratio, waste


@dataclass(frozen=True, slots=True)
class KVSnapshot:
    """Proxima's engine metrics (present only when the server runs Proxima's scheduler).

    Fields are recorded and replayed by name (`proxima top --record`): rename none."""

    allocator: str
    granularity: int
    slots_total: float
    slots_used: float
    slots_free: float
    slots_cached: float
    live_tokens: float
    token_usage: float
    block_usage: float
    fragmentation: float
    block_fragmentation: float
    occupancy: tuple[float, ...]
    largest_free_run: float
    bytes_per_token: float
    cache_bytes: float
    requests_holding_slots: float
    preemptions_total: float
    allocator_latency: dict[str, HistogramSnapshot] = field(default_factory=dict)
    engines: tuple[str, ...] = ()  # engine labels of the schedulers that export these metrics
    prefix_hit_tokens_total: float = 0.0
    prefix_hit_tokens_beyond_blocks_total: float = 0.0
    prefix_evicted_tokens_total: float = 0.0
    # Exceptions a telemetry sink raised and the engine caught (its figures may be stale meanwhile).
    telemetry_errors_total: float = 0.0
    # Cached slots per segment of `occupancy` (empty from servers that do not publish it).
    occupancy_cached: tuple[float, ...] = ()
    # "block": figures that depend on other requests' cached tokens come in whole blocks, and the
    # occupancy map, largest free run and hits beyond blocks are not published; "exact": all are.
    kv_figures: str = "exact"
    # Catalog figures without a field above, by figure name.
    other: dict[str, float] = field(default_factory=dict)

    @property
    def slot_usage(self) -> float:
        return self.slots_used / self.slots_total if self.slots_total else 0.0

    @property
    def exact_figures(self) -> bool:
        return self.kv_figures == "exact"

    @property
    def beyond_blocks_share(self) -> float | None:
        """Share of prefix-cache hit tokens a block cache of the reference size would miss (None
        where the server discloses figures in whole blocks)."""
        if not self.prefix_hit_tokens_total or not self.exact_figures:
            return None
        return self.prefix_hit_tokens_beyond_blocks_total / self.prefix_hit_tokens_total

    def figure(self, name: str) -> Any:
        """A catalog figure by name, whether it has a field or lives in `other` (absent: 0)."""
        return getattr(self, name) if name in _FIELDS else self.other.get(name, 0.0)

    @classmethod
    def combine(cls, kvs: Sequence[KVSnapshot]) -> KVSnapshot | None:
        """Several engines' (or servers') snapshots as one, each figure by its catalog rule:
        counts and histograms summed, ratios recomputed from the summed counts, maxima kept as
        maxima, occupancy maps weighted by slots. One snapshot comes back as it is."""
        if not kvs:
            return None
        if len(kvs) == 1:
            return kvs[0]
        values: dict[str, Any] = {"engines": tuple(sorted({e for k in kvs for e in k.engines}))}
        for spec in c.kv_figures():
            values.update(_combined(spec, kvs))
        return _build(values)


_FIELDS = frozenset(f.name for f in dataclasses.fields(KVSnapshot))


def _build(values: dict[str, Any]) -> KVSnapshot:
    named = {k: v for k, v in values.items() if k in _FIELDS}
    return KVSnapshot(**named, other={k: v for k, v in values.items() if k not in _FIELDS})


# -- one engine ---------------------------------------------------------------------------------

def read_engines(s: Samples, engine: str | None = None) -> KVSnapshot | None:
    """Every engine in the exposition (or only `engine`), each read alone and then combined:
    a ratio summed over engines would read 1.2 for two engines at 60%. None on stock vLLM."""
    info = [lab for lab in s.labels_of(c.ALLOCATOR_INFO.name)
            if engine is None or lab.get("engine") == engine]
    if not info:
        return None
    rows: dict[str | None, dict[str, str]] = {}
    for lab in info:
        rows.setdefault(lab.get("engine"), lab)
    ordered = sorted(rows.items(), key=lambda row: row[0] or "")
    return KVSnapshot.combine([read_engine(s, e, lab) for e, lab in ordered])


def read_engine(s: Samples, engine: str | None, info: dict[str, str]) -> KVSnapshot:
    """One engine's figures (`engine` None: an exposition without engine labels); `info` is its
    allocator-info labels."""
    def mine(sample) -> bool:
        return engine is None or sample.labels.get("engine") == engine

    values: dict[str, Any] = {"engines": (engine,) if engine is not None else ()}
    computed = []
    for spec in c.kv_figures():
        read = spec.read
        if read is c.Read.LABELS:
            values[spec.figure] = info.get("allocator", "?")
            values["granularity"] = int(info.get("block_size", "1") or 1)
            # Servers from before the label published exact figures.
            values["kv_figures"] = info.get("kv_figures", "exact")
        elif read is c.Read.SEGMENTS:
            segments = {segment_of(x): x.value for x in s.by_name.get(spec.name, ()) if mine(x)}
            values[spec.figure] = tuple(v for _, v in sorted(segments.items()))
        elif read is c.Read.HISTOGRAMS:  # one per `op`: the allocator-latency histogram's label
            values[spec.figure] = {op: HistogramSnapshot(*s.histogram(spec.name, engine, op=op))
                                   for op in c.ALLOCATOR_OPS}
        elif read is c.Read.COMPUTED:
            computed.append(spec)
        elif spec.multiprocess_mode == "max":  # written as a max by several processes: read as one
            values[spec.figure] = max((x.value for x in s.by_name.get(spec.sample_name, ()) if mine(x)),
                                      default=0.0)
        else:
            values[spec.figure] = s.total(spec.sample_name, engine) or 0.0
    for spec in computed:  # from the counts just read: the same rule as for several engines
        values[spec.figure] = _computed(spec, [values.get])
    return _build(values)


# -- several engines ----------------------------------------------------------------------------

def _combined(spec: c.MetricSpec, kvs: Sequence[KVSnapshot]) -> dict[str, Any]:
    rule, name = spec.combine, spec.figure
    if rule is c.Combine.LABELS:
        return {name: "/".join(sorted({k.figure(name) for k in kvs})),
                "granularity": min(k.granularity for k in kvs),
                "kv_figures": "/".join(sorted({k.kv_figures for k in kvs}))}
    if rule in (c.Combine.RATIO, c.Combine.WASTE):
        return {name: _computed(spec, [k.figure for k in kvs])}
    parts = [k.figure(name) for k in kvs]
    if rule is c.Combine.SUM:
        return {name: sum(parts)}
    if rule is c.Combine.MAX:
        return {name: max(parts)}
    if rule is c.Combine.HISTOGRAMS:
        keys = list(dict.fromkeys(key for part in parts for key in part))
        return {name: {key: merge_histograms(part[key] for part in parts if key in part) for key in keys}}
    if rule is c.Combine.WEIGHTED:
        weights = [_term(spec.of[0], k.figure) for k in kvs]
        if sum(weights) == 0:
            weights = [1.0] * len(kvs)
        if spec.read is not c.Read.SEGMENTS:
            return {name: sum(w * v for w, v in zip(weights, parts)) / sum(weights)}
        lengths = {len(part) for part in parts}
        if len(lengths) != 1:  # segments of caches cut differently do not line up
            return {name: ()}
        return {name: tuple(sum(w * part[i] for w, part in zip(weights, parts)) / sum(weights)
                            for i in range(lengths.pop()))}
    raise ValueError(f"{spec.name}: no combination rule {rule!r}")


def _term(term: str, figure) -> float:
    """One engine's value of a `Combine` operand: a figure, or a product "a*b" of figures."""
    return math.prod(figure(name) or 0.0 for name in term.split("*"))


def _computed(spec: c.MetricSpec, engines: list) -> float:
    """A RATIO or WASTE figure over engines given as figure look-ups (name -> value)."""
    a, b = (sum(_term(term, figure) for figure in engines) for term in spec.of)
    return ratio(a, b) if spec.combine is c.Combine.RATIO else waste(a, b)
