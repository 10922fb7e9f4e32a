"""Exposition text → samples by name: the text layer under `proxima.scrape`.

Only the families the tools read are parsed (a prefix test drops the rest first: the parser is
pure Python). What is parsed is checked before any tool sees it, and a fault raises
`MalformedMetrics` naming the series, which the scrape makes that server's error:
  - every value finite, not negative and below `MAX_VALUE` (every figure the tools read is a
    count, a size, a duration or a ratio);
  - every family declared once and every series (name and labels) present once: a page that
    repeats a family (two servers' pages concatenated, say) would otherwise be summed twice;
  - a sample has what its metric requires (a bucket's `le`, a segment's `segment`), and a
    histogram's cumulative buckets never decrease.
"""

from __future__ import annotations

import math
from collections import defaultdict

from prometheus_client.parser import text_string_to_metric_families

from proxima.metrics import catalog as c


class MalformedMetrics(ValueError):
    """The exposition parses as text, but a sample lacks what its metric requires (a bucket's
    `le`, a segment's `segment`): the server's error, never the dashboard's."""


def _label(sample, key: str) -> str:
    value = sample.labels.get(key)
    if value is None:
        raise MalformedMetrics(f"{sample.name} sample without a {key!r} label")
    return value


def bound_of(sample) -> float:
    text = _label(sample, "le")
    try:
        bound = float(text)
    except ValueError:
        bound = math.nan
    if math.isnan(bound):
        raise MalformedMetrics(f"{sample.name}: bucket bound {text!r} is not a number")
    return bound


# Larger than any count, size or duration a server can report (2^60): a wrong answer, not a big server.
MAX_VALUE = float(1 << 60)


# Only these families are read; the rest (python_gc_*, http_*, a proxy's own series) is dropped by
# a prefix test before the pure-Python parser, which costs ~1-2 s per MiB.
_READ_PREFIXES = ("vllm:", "proxima_", c.Vllm.PROCESS_RESIDENT_MEMORY)


def _lines_read(text: str) -> str:
    kept = [line for line in text.splitlines()
            if line.startswith(_READ_PREFIXES)
            or (line.startswith(("# TYPE ", "# HELP ")) and line[7:].startswith(_READ_PREFIXES))]
    return "\n".join(kept) + "\n"


def _declared_twice(text: str) -> str | None:
    seen: set[str] = set()
    for line in text.splitlines():
        if line.startswith("# TYPE "):
            name = line[7:].split(" ", 1)[0]
            if name in seen:
                return name
            seen.add(name)
    return None


def _check_value(sample) -> None:
    value = sample.value
    if not math.isfinite(value):
        raise MalformedMetrics(f"{_series(sample)} is {value} (not a finite number)")
    if value < 0:
        raise MalformedMetrics(f"{_series(sample)} is negative ({value:g})")
    if value > MAX_VALUE:
        raise MalformedMetrics(f"{_series(sample)} is implausibly large ({value:g})")


def _series(sample) -> str:
    labels = ",".join(f'{k}="{v}"' for k, v in sorted(sample.labels.items()))
    return f"{sample.name}{{{labels}}}" if labels else sample.name


class Samples:
    """Samples of one exposition, indexed by sample name, filtered by labels (checked as the
    module docstring says; `MalformedMetrics` otherwise)."""

    def __init__(self, text: str) -> None:
        self.by_name: dict[str, list] = defaultdict(list)
        read = _lines_read(text)
        twice = _declared_twice(read)
        if twice is not None:
            raise MalformedMetrics(f"the family {twice} is declared twice (one page per server expected)")
        seen: set[tuple] = set()
        for family in text_string_to_metric_families(read):
            for sample in family.samples:
                key = (sample.name, tuple(sorted(sample.labels.items())))
                if key in seen:
                    raise MalformedMetrics(f"the series {_series(sample)} appears twice")
                seen.add(key)
                _check_value(sample)
                self.by_name[sample.name].append(sample)

    @property
    def has_vllm(self) -> bool:
        """Whether any vLLM series is present (an empty page, a proxy's error page or another
        program's metrics have none)."""
        return any(name.startswith("vllm:") for name in self.by_name)

    def total(self, name: str, engine: str | None = None, **labels: str) -> float | None:
        found = [
            s.value for s in self.by_name.get(name, ())
            if (engine is None or s.labels.get("engine") == engine)
            and all(s.labels.get(k) == v for k, v in labels.items())
        ]
        return float(sum(found)) if found else None

    def labels_of(self, name: str) -> list[dict[str, str]]:
        return [s.labels for s in self.by_name.get(name, ())]

    def histogram(self, name: str, engine: str | None = None,
                  **labels: str) -> tuple[tuple[tuple[float, float], ...], float, float]:
        """(cumulative (le, count) buckets, count, sum), summed over the matching series."""
        per_le: dict[float, float] = defaultdict(float)
        for s in self.by_name.get(name + "_bucket", ()):
            if (engine is None or s.labels.get("engine") == engine) and all(
                s.labels.get(k) == v for k, v in labels.items()
            ):
                per_le[bound_of(s)] += s.value
        buckets = tuple(sorted(per_le.items()))
        if any(n < prev for (_, prev), (_, n) in zip(buckets, buckets[1:])):
            raise MalformedMetrics(f"{name}: bucket counts decrease with the bound (not cumulative)")
        return (
            buckets,
            self.total(name + "_count", engine, **labels) or 0.0,
            self.total(name + "_sum", engine, **labels) or 0.0,
        )


def segment_of(sample) -> int:
    text = _label(sample, "segment")
    try:
        return int(text)
    except ValueError:
        raise MalformedMetrics(f"{sample.name}: segment {text!r} is not an integer") from None
