"""Exposition text → samples by name: the text layer under `proxima.scrape`.

Only the families the tools read are parsed (a prefix test drops the rest first: the parser is
pure Python), and a sample missing what its metric requires (a bucket's `le`, a segment's
`segment`) raises `MalformedMetrics` naming it, which the scrape makes that server's error.
"""

from __future__ import annotations

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
        return float(text)
    except ValueError:
        raise MalformedMetrics(f"{sample.name}: bucket bound {text!r} is not a number") from None


# Only these families are read; the rest (python_gc_*, http_*, a proxy's own series) is dropped by
# a prefix test before the pure-Python parser, which costs ~1-2 s per MiB.
_READ_PREFIXES = ("vllm:", "proxima_", c.Vllm.PROCESS_RESIDENT_MEMORY)


def _lines_read(text: str) -> str:
    kept = [line for line in text.splitlines()
            if line.startswith(_READ_PREFIXES)
            or (line.startswith(("# TYPE ", "# HELP ")) and line[7:].startswith(_READ_PREFIXES))]
    return "\n".join(kept) + "\n"


class Samples:
    """Samples of one exposition, indexed by sample name, filtered by labels."""

    def __init__(self, text: str) -> None:
        self.by_name: dict[str, list] = defaultdict(list)
        for family in text_string_to_metric_families(_lines_read(text)):
            for sample in family.samples:
                self.by_name[sample.name].append(sample)

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
        return (
            tuple(sorted(per_le.items())),
            self.total(name + "_count", engine, **labels) or 0.0,
            self.total(name + "_sum", engine, **labels) or 0.0,
        )


def segment_of(sample) -> int:
    text = _label(sample, "segment")
    try:
        return int(text)
    except ValueError:
        raise MalformedMetrics(f"{sample.name}: segment {text!r} is not an integer") from None
