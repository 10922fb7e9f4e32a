"""Prometheus alert rules for Proxima, written from the metrics catalog.

A rule is a conjunction of `Condition`s, each `signal op threshold`. The signal is the
measured series on its own (what a dashboard would plot), kept apart so that the integration
test can prove every signal returns data from a real server, while a threshold usually cannot
be crossed on demand. Conditions are joined with `and on(instance, engine)`: Proxima's series
carry `engine` (plus `instance`/`job` from the scrape), vLLM's add `model_name`, so the two
meet on the scrape target and the engine index.

An alert's labels are its first condition's series labels plus `severity`; annotations use
only `$labels.*` and `$value` (rendered in the promtool tests, see `alert_tests`).
"""

from __future__ import annotations

from dataclasses import dataclass

import yaml

from dashboards import DEFAULT_RUNBOOK_BASE
from dashboards import promql as q
from proxima import runbooks
from proxima.metrics import catalog as c

GROUP = "proxima-kv"
JOIN_ON = ("instance", "engine")
KEEP = ("job", "instance", "engine")

STEP_OP = "step"
if STEP_OP not in c.ALLOCATOR_OPS:
    raise RuntimeError(f"catalog.ALLOCATOR_OPS lost {STEP_OP!r}: the latency rules watch it")
STEP = f'op="{STEP_OP}"'
LATENCY_WINDOW = "5m"
REGRESSION_FLOOR_S = 0.00025
GROWTH_LIMIT_PER_HOUR = 0.05
THRASH_WINDOW = "10m"
# The hit rate fell below this share of its value an hour earlier...
THRASH_HIT_DROP = 0.5
# ...while evictions turn over at least this share of the cache per minute.
THRASH_EVICTED_PER_MIN = 0.25


@dataclass(frozen=True, slots=True)
class Condition:
    signal: str
    op: str
    threshold: str

    @property
    def expr(self) -> str:
        # PromQL binds arithmetic tighter than comparisons, and comparisons tighter than `and`,
        # so no parentheses are needed around the signal or between conditions.
        return f"{self.signal} {self.op} {self.threshold}"


@dataclass(frozen=True, slots=True)
class AlertRule:
    name: str
    conditions: tuple[Condition, ...]
    for_: str
    severity: str
    summary: str
    description: str
    runbook: str

    @property
    def expr(self) -> str:
        joiner = f"\nand on({', '.join(JOIN_ON)})\n"
        return joiner.join(cond.expr for cond in self.conditions)

    @property
    def signals(self) -> tuple[str, ...]:
        return tuple(cond.signal for cond in self.conditions)

    def to_dict(self, runbook_base: str) -> dict:
        return {
            "alert": self.name,
            "expr": self.expr + "\n" if len(self.conditions) > 1 else self.expr,
            "for": self.for_,
            "labels": {"severity": self.severity},
            "annotations": {
                "summary": self.summary,
                "description": self.description,
                **runbook_annotations(self.runbook, runbook_base),
            },
        }


def runbook_url(page: str, base: str = DEFAULT_RUNBOOK_BASE) -> str:
    runbooks.page(page)  # ValueError naming the pages when it is not one shipped
    return f"{base}{page}.md"


def runbook_annotations(page: str, base: str = DEFAULT_RUNBOOK_BASE) -> dict[str, str]:
    """`runbook_url` (repository-relative unless `base` says otherwise) and, for whoever has only
    the pip package, the command that prints the same page from it."""
    return {"runbook_url": runbook_url(page, base), "runbook_command": f"proxima runbook {page}"}


def step_p99(offset: str = "") -> str:
    return q.quantile(0.99, c.ALLOCATOR_LATENCY, LATENCY_WINDOW, KEEP, STEP, offset=offset)


def prefix_hit_rate(offset: str = "") -> str:
    """vLLM's prefix-cache hit rate per engine over THRASH_WINDOW (optionally `offset` ago)."""
    shifted = f" offset {offset}" if offset else ""
    by = ", ".join(KEEP)
    hits, queries = (f"sum by ({by}) (rate({q.sel(m)}[{THRASH_WINDOW}]{shifted}))"
                     for m in (c.Vllm.PREFIX_CACHE_HITS, c.Vllm.PREFIX_CACHE_QUERIES))
    return f"{hits} / {queries}"


def eviction_turnover() -> str:
    """Cached tokens evicted per minute, as a share of the cache."""
    return f"{q.rate(c.PREFIX_EVICTED_TOKENS, THRASH_WINDOW)} * 60 / {q.sel(c.SLOTS_TOTAL)}"


def unexplained_slot_growth() -> str:
    """Growth of (slots used - live tokens) per hour, as a fraction of capacity."""
    used = f"deriv({q.sel(c.SLOTS_USED)}[1h])"
    live = f"deriv({q.sel(c.LIVE_TOKENS)}[1h])"
    return f"({used} - {live}) * 3600 / {q.sel(c.SLOTS_TOTAL)}"


RULES: tuple[AlertRule, ...] = (
    AlertRule(
        "ProximaKVExhaustionImminent",
        (Condition(q.sel(c.TOKEN_USAGE), ">", f"{c.KV_DANGER_USAGE:g}"),
         Condition(q.sel(c.Vllm.WAITING), ">", "0")),
        "2m", "critical",
        "KV cache {{ $value | humanizePercentage }} full on {{ $labels.instance }} with requests "
        "waiting",
        f"Live tokens fill more than {c.KV_DANGER_USAGE:.0%} of the KV cache of engine "
        "{{ $labels.engine }} on {{ $labels.instance }} and requests have been queueing for 2 "
        "minutes: new requests wait "
        "for memory and running ones are next to be preempted. Shed or spread load, or give the "
        "cache more memory (--gpu-memory-utilization, --kv-cache-memory-bytes).",
        "kv-exhaustion",
    ),
    AlertRule(
        "ProximaSustainedPreemptions",
        (Condition(q.rate(c.Vllm.PREEMPTIONS, "5m"), ">", "0"),),
        "5m", "warning",
        "{{ $labels.instance }} preempts {{ $value | humanize }} requests/s",
        "Engine {{ $labels.engine }} on {{ $labels.instance }} has preempted requests in every "
        "5-minute window for 5 minutes: the KV cache cannot hold the running batch, so requests "
        "are evicted and recomputed, wasting compute and inflating latency. Counted with vLLM's "
        "own counter, so this rule covers stock vLLM servers too.",
        "oom-under-load",
    ),
    AlertRule(
        "ProximaSlotLeak",
        (Condition(q.sel(c.SLOTS_USED), ">", "0"),
         Condition(q.sel(c.Vllm.RUNNING), "==", "0"),
         Condition(q.sel(c.Vllm.WAITING), "==", "0")),
        "5m", "warning",
        "{{ $value | humanize }} KV slots held on idle {{ $labels.instance }}",
        "No request has been running or waiting on engine {{ $labels.engine }} of "
        "{{ $labels.instance }} for 5 minutes, yet its allocator reports slots in use: slots "
        "were not returned when their requests finished. The cache shrinks by that much until "
        "the server restarts.",
        "memory-leak",
    ),
    AlertRule(
        "ProximaKVMemoryGrowth",
        (Condition(unexplained_slot_growth(), ">", f"{GROWTH_LIMIT_PER_HOUR:g}"),),
        "30m", "warning",
        "KV slots not held by live tokens grow {{ $value | humanizePercentage }} of capacity per "
        "hour on {{ $labels.instance }}",
        "Over the last hour, slots in use on engine {{ $labels.engine }} of "
        "{{ $labels.instance }} grew faster than the tokens live requests hold (least-squares "
        f"slope of used slots minus that of live tokens) by more than "
        f"{GROWTH_LIMIT_PER_HOUR:.0%} of the cache per hour, for 30 minutes. Load alone does not "
        "do this: more traffic raises live tokens and used slots together, so their difference "
        "stays flat whatever the request rate, which is why this compares the two instead of "
        "watching used slots against request rate. A steady climb is memory that finished "
        f"requests did not give back; at {GROWTH_LIMIT_PER_HOUR:.0%} per hour the cache is gone "
        f"within {1 / GROWTH_LIMIT_PER_HOUR:.0f} hours.",
        "memory-leak",
    ),
    AlertRule(
        "ProximaPrefixCacheThrash",
        (Condition(eviction_turnover(), ">", f"{THRASH_EVICTED_PER_MIN:g}"),
         Condition(prefix_hit_rate(), "<", f"{THRASH_HIT_DROP:g} * {prefix_hit_rate(offset='1h')}")),
        "15m", "warning",
        "Prefix cache thrashing on {{ $labels.instance }}: {{ $value | humanizePercentage }} of "
        "the KV cache evicted per minute",
        "On engine {{ $labels.engine }} of {{ $labels.instance }} cached prefixes are evicted at "
        f"more than {THRASH_EVICTED_PER_MIN:.0%} of the cache per minute while the prefix-cache "
        f"hit rate has fallen below {THRASH_HIT_DROP:.0%} of what it was an hour earlier, for 15 "
        "minutes: entries are pushed out before they are reused (more distinct prompts than the "
        "cache holds, or live requests crowding the cache out), so prompts are recomputed and "
        "time to first token rises.",
        "prefix-cache-thrash",
    ),
    AlertRule(
        "ProximaAllocatorStepLatencyHigh",
        (Condition(step_p99(), ">", f"{c.ALLOCATOR_STEP_P99_LIMIT_S:g}"),),
        "10m", "warning",
        "KV allocator step p99 {{ $value | humanizeDuration }} on {{ $labels.instance }}",
        "The KV allocator's work per scheduler step on engine {{ $labels.engine }} of "
        "{{ $labels.instance }} has had a 99th percentile above "
        f"{c.ALLOCATOR_STEP_P99_LIMIT_S * 1e3:g} ms "
        "for 10 minutes. Every step of the whole batch waits for it, so it adds directly to "
        "inter-token latency.",
        "allocator-latency",
    ),
    AlertRule(
        "ProximaAllocatorStepLatencyRegression",
        (Condition(step_p99(), ">", f"2 * {step_p99(offset='1d')}"),
         Condition(step_p99(), ">", f"{REGRESSION_FLOOR_S:g}")),
        "30m", "info",
        "KV allocator step p99 doubled since yesterday on {{ $labels.instance }}: "
        "{{ $value | humanizeDuration }}",
        "The 99th percentile of the KV allocator's per-step time on engine {{ $labels.engine }} "
        "of {{ $labels.instance }} has been more than twice its value at the same time "
        f"yesterday for 30 minutes, and above {REGRESSION_FLOOR_S * 1e6:g} µs so that jitter in "
        "microsecond timings does not alert. Look at what changed since: a deploy, the cache "
        "size, max-num-seqs, or the traffic's prompt lengths.",
        "allocator-latency",
    ),
)


class _Dumper(yaml.SafeDumper):
    """Block style for multi-line strings, so PromQL and prose stay readable in the file."""


def _str(dumper: yaml.SafeDumper, value: str):
    style = "|" if "\n" in value else None
    return dumper.represent_scalar("tag:yaml.org,2002:str", value, style=style)


_Dumper.add_representer(str, _str)


def dump_yaml(data: dict) -> str:
    return yaml.dump(data, Dumper=_Dumper, sort_keys=False, allow_unicode=True, width=10_000,
                     default_flow_style=False)


def rules_yaml(runbook_base: str = DEFAULT_RUNBOOK_BASE) -> str:
    header = ("# Generated by `python -m dashboards.generate` from proxima/metrics/catalog.py.\n"
              "# Do not edit: change dashboards/alerts.py and regenerate.\n")
    body = {"groups": [{"name": GROUP, "rules": [r.to_dict(runbook_base) for r in RULES]}]}
    return header + dump_yaml(body)
