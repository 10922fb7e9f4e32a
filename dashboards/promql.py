"""PromQL written from catalog specs: selectors, rates and histogram quantiles.

Every metric name comes from `proxima.metrics.catalog` (a `MetricSpec` or a `catalog.Vllm`
constant); nothing in `dashboards/` spells one. Proxima's own series carry only the `engine`
label (plus `instance`/`job` from the scrape); vLLM's also carry `model_name`, which is why
`model_name` filters apply to `vllm:*` selectors only.
"""

from __future__ import annotations

from proxima.metrics import catalog as c

Metric = c.MetricSpec | str

HISTOGRAM_PARTS = ("_bucket", "_count", "_sum")


def _series_names(spec: c.MetricSpec) -> set[str]:
    names = {spec.name, spec.sample_name}
    if spec.kind is c.Kind.HISTOGRAM:
        names |= {spec.name + part for part in HISTOGRAM_PARTS}
    return names


# Every series name Proxima exports: base names, counters' `_total`, histograms' parts.
PROXIMA_NAMES: frozenset[str] = frozenset(
    name for spec in c.ENGINE_METRICS for name in _series_names(spec)
)


def sample_name(metric: Metric) -> str:
    """The series name a scrape shows for a gauge/counter (counters end in `_total`)."""
    return metric.sample_name if isinstance(metric, c.MetricSpec) else metric


def needs_proxima(expr: str) -> bool:
    """True when the expression reads a `proxima_*` series (so it is empty on stock vLLM)."""
    return any(mentions(expr, name) for name in PROXIMA_NAMES)


def mentions(expr: str, name: str) -> bool:
    """`name` occurs in `expr` as a whole metric name (not inside a longer one)."""
    start = expr.find(name)
    while start != -1:
        end = start + len(name)
        before = expr[start - 1] if start else " "
        after = expr[end] if end < len(expr) else " "
        if not (before.isalnum() or before in "_:") and not (after.isalnum() or after in "_:"):
            return True
        start = expr.find(name, end)
    return False


def sel(metric: Metric, *matchers: str, suffix: str = "") -> str:
    """`name{m1, m2}`; `suffix` picks a histogram part (`_bucket`, `_sum`, `_count`)."""
    if suffix:
        name = (metric.name if isinstance(metric, c.MetricSpec) else metric) + suffix
    else:
        name = sample_name(metric)
    inner = ", ".join(m for m in matchers if m)
    return f"{name}{{{inner}}}" if inner else name


def rate(metric: Metric, window: str, *matchers: str, suffix: str = "") -> str:
    return f"rate({sel(metric, *matchers, suffix=suffix)}[{window}])"


def sum_rate(metric: Metric, window: str, by: tuple[str, ...], *matchers: str) -> str:
    return f"sum by ({', '.join(by)}) ({rate(metric, window, *matchers)})"


def quantile(q: float, histogram: Metric, window: str, by: tuple[str, ...], *matchers: str,
             offset: str = "") -> str:
    """histogram_quantile over the per-`le` rate of a histogram's buckets, kept by `by`."""
    bucket = sel(histogram, *matchers, suffix="_bucket")
    shifted = f" offset {offset}" if offset else ""
    by_le = ", ".join((*by, "le"))
    return f"histogram_quantile({q:g}, sum by ({by_le}) (rate({bucket}[{window}]{shifted})))"


# The template variables the boards filter on ($model_name, $instance): their matchers, and the
# label_values queries that list their choices (the instances of the chosen models).
MODEL_MATCH = 'model_name=~"$model_name"'
INSTANCE_MATCH = 'instance=~"$instance"'
MODEL_VALUES = f"label_values({c.Vllm.RUNNING}, model_name)"
INSTANCE_VALUES = f"label_values({sel(c.Vllm.RUNNING, MODEL_MATCH)}, instance)"
