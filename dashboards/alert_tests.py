"""promtool unit tests for the alert rules: for every alert, series that fire it and series that
must not, generated from the catalog like the rules themselves.

Each scenario holds several scrape targets at once (one that fires, others that each miss one
condition) and is evaluated twice: inside the rule's `for` window (nothing fires yet) and after
it (exactly the expected targets fire). promtool compares annotations exactly, so every firing
target states how its `$value` renders (`value_text`); a wrong number fails the test.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from prometheus_client.utils import floatToGoString

from dashboards import alerts as a
from proxima.metrics import catalog as c

JOB = "vllm"
ENGINE = "0"
MODEL = "tiny"
RULES_FILE = "proxima-alerts.yml"


def labels(instance: str, *, vllm: bool = False, **extra: str) -> dict[str, str]:
    found = {"engine": ENGINE, "instance": instance, "job": JOB, **extra}
    if vllm:
        found["model_name"] = MODEL
    return found


def series(metric: c.MetricSpec | str, instance: str, values: str, *, suffix: str = "",
           **extra: str) -> dict:
    """An input series; a `catalog.Vllm` name (a str) gets vLLM's `model_name` label too."""
    is_vllm = isinstance(metric, str)
    if is_vllm:
        name = metric + suffix
    else:
        name = metric.name + suffix if suffix else metric.sample_name
    lbls = labels(instance, vllm=is_vllm, **extra)
    inner = ", ".join(f'{k}="{v}"' for k, v in lbls.items())
    return {"series": f"{name}{{{inner}}}", "values": values}


def step_histogram(instance: str, phases: tuple[tuple[float, int, int], ...],
                   op: str = a.STEP_OP) -> list[dict]:
    """Bucket series for observations that land in one bucket per phase.

    `phases`: (bucket upper bound, observations per interval, number of intervals). A sample
    is written at t=0 (all zero) and one per interval after it.
    """
    bounds = [*c.ALLOCATOR_LATENCY.buckets, float("inf")]
    for bound, _, _ in phases:
        if bound not in bounds:
            raise ValueError(f"{bound} is not a bucket bound of {c.ALLOCATOR_LATENCY.name}")
    found = []
    for le in bounds:
        total, parts = 0, ["0"]
        for bound, per_interval, intervals in phases:
            step = per_interval if le >= bound else 0
            parts.append(f"{total + step}+{step}x{intervals - 1}")
            total += step * intervals
        found.append(series(c.ALLOCATOR_LATENCY, instance, " ".join(parts), suffix="_bucket",
                            le=floatToGoString(le), op=op))
    return found


def thrash_series(instance: str, hits_after: int, evicted_per_min: int) -> list[dict]:
    """An hour at a 90% prefix-cache hit rate without evictions, then 40 minutes at
    `hits_after` hits per 1,000 queried tokens a minute, evicting `evicted_per_min` tokens."""
    hits = f"0+900x60 {54000 + hits_after}+{hits_after}x39"
    evicted = f"0x60 {evicted_per_min}+{evicted_per_min}x39"
    return [series(c.Vllm.PREFIX_CACHE_QUERIES, instance, "0+1000x100"),
            series(c.Vllm.PREFIX_CACHE_HITS, instance, hits),
            series(c.PREFIX_EVICTED_TOKENS, instance, evicted),
            series(c.SLOTS_TOTAL, instance, "10000x100")]


@dataclass(frozen=True, slots=True)
class Firing:
    instance: str
    value_text: str
    vllm_labels: bool = False  # the alert keeps vLLM's model_name label


@dataclass(frozen=True, slots=True)
class Scenario:
    alert: str
    title: str
    input_series: list[dict]
    pending_at: str  # conditions hold, but not yet for the rule's `for`
    fires_at: str
    firing: tuple[Firing, ...]
    interval: str = "1m"
    also_silent: tuple[str, ...] = field(default=())  # other alerts that must not fire then


def _render(template: str, lbls: dict[str, str], value_text: str) -> str:
    text = re.sub(r"\{\{ \$labels\.(\w+) \}\}", lambda m: lbls[m.group(1)], template)
    return re.sub(r"\{\{ \$value(?: \| \w+)? \}\}", value_text, text)


def _expected(rule: a.AlertRule, firing: Firing, runbook_base: str) -> dict:
    lbls = labels(firing.instance, vllm=firing.vllm_labels)
    return {
        "exp_labels": {**lbls, "severity": rule.severity},
        "exp_annotations": {
            "summary": _render(rule.summary, lbls, firing.value_text),
            "description": _render(rule.description, lbls, firing.value_text),
            **a.runbook_annotations(rule.runbook, runbook_base),
        },
    }


def scenarios() -> tuple[Scenario, ...]:
    day = 24 * 60
    return (
        Scenario(
            "ProximaKVExhaustionImminent",
            "full cache with a queue fires; full without queue, or queue without full cache, not",
            [series(c.TOKEN_USAGE, "hot:8000", "0.97x10"),
             series(c.Vllm.WAITING, "hot:8000", "3x10"),
             series(c.TOKEN_USAGE, "full-no-queue:8000", "0.97x10"),
             series(c.Vllm.WAITING, "full-no-queue:8000", "0x10"),
             series(c.TOKEN_USAGE, "queue-not-full:8000", "0.9x10"),
             series(c.Vllm.WAITING, "queue-not-full:8000", "3x10")],
            "1m", "5m", (Firing("hot:8000", "97%"),),
        ),
        Scenario(
            "ProximaSustainedPreemptions",
            "a preemption every second fires; a counter that stopped moving does not",
            [series(c.Vllm.PREEMPTIONS, "storm:8000", "0+60x20"),
             series(c.Vllm.PREEMPTIONS, "calm:8000", "5x20")],
            "3m", "12m", (Firing("storm:8000", "1", vllm_labels=True),),
        ),
        Scenario(
            "ProximaSlotLeak",
            "slots held with nothing running or waiting fires; busy or empty servers do not",
            [series(c.SLOTS_USED, "leaky:8000", "512x15"),
             series(c.Vllm.RUNNING, "leaky:8000", "0x15"),
             series(c.Vllm.WAITING, "leaky:8000", "0x15"),
             series(c.SLOTS_USED, "busy:8000", "512x15"),
             series(c.Vllm.RUNNING, "busy:8000", "2x15"),
             series(c.Vllm.WAITING, "busy:8000", "0x15"),
             series(c.SLOTS_USED, "clean:8000", "0x15"),
             series(c.Vllm.RUNNING, "clean:8000", "0x15"),
             series(c.Vllm.WAITING, "clean:8000", "0x15")],
            "3m", "10m", (Firing("leaky:8000", "512"),),
        ),
        Scenario(
            "ProximaKVMemoryGrowth",
            "used slots outgrowing live tokens fires; growth that live tokens explain (load) not",
            [series(c.SLOTS_USED, "leaking:8000", "1000+64x120"),
             series(c.LIVE_TOKENS, "leaking:8000", "1000x120"),
             series(c.SLOTS_TOTAL, "leaking:8000", "32768x120"),
             series(c.SLOTS_USED, "loaded:8000", "1000+64x120"),
             series(c.LIVE_TOKENS, "loaded:8000", "1000+64x120"),
             series(c.SLOTS_TOTAL, "loaded:8000", "32768x120")],
            # 64 slots/min = 3840/h = 11.72% of 32768 slots per hour.
            "20m", "90m", (Firing("leaking:8000", "11.72%"),),
        ),
        Scenario(
            "ProximaPrefixCacheThrash",
            "hit rate collapsing while evictions turn the cache over fires; either alone does not",
            [*thrash_series("thrash:8000", hits_after=200, evicted_per_min=3000),
             *thrash_series("steady:8000", hits_after=900, evicted_per_min=3000),
             *thrash_series("cold:8000", hits_after=200, evicted_per_min=0)],
            # From minute 61 the hit rate is 20% (90% an hour before) and 3,000 of 10,000
            # slots are evicted a minute; both conditions hold from minute 69.
            "75m", "90m", (Firing("thrash:8000", "30%"),),
        ),
        Scenario(
            "ProximaAllocatorStepLatencyHigh",
            "slow steps fire; steps just under the limit or fast do not, even when another op is slow",
            [*step_histogram("slow:8000", ((0.005, 600, 20),)),
             *step_histogram("near:8000", ((0.0025, 600, 20),)),
             *step_histogram("fast:8000", ((1e-5, 600, 20),)),
             *step_histogram("fast:8000", ((0.005, 600, 20),), op="allocate")],
            # Slow steps all in (2.5 ms, 5 ms]: p99 = 2.5 ms + 2.5 ms x 0.99. Near ones in
            # (1 ms, 2.5 ms]: p99 2.485 ms, just under the limit (a catalog bucket bound).
            "5m", "15m", (Firing("slow:8000", "4.975ms"),),
        ),
        Scenario(
            "ProximaAllocatorStepLatencyRegression",
            "p99 doubling since yesterday fires; unchanged or sub-floor latency does not",
            # One sample every 2 minutes (a 5m rate window still holds two or more) keeps a
            # day and a half of 51 bucket series quick for promtool.
            [*step_histogram("regressed:8000", ((1e-4, 120, day // 2), (5e-4, 120, 45))),
             *step_histogram("steady:8000", ((5e-4, 120, day // 2), (5e-4, 120, 45))),
             *step_histogram("tiny:8000", ((5e-6, 120, day // 2), (5e-5, 120, 45)))],
            # Yesterday p99 = 99.5 us, today 497.5 us (> 2x and > the 250 us floor); "tiny"
            # doubles too but stays under the floor.
            f"{day + 10}m", f"{day + 90}m", (Firing("regressed:8000", "497.5us"),),
            interval="2m", also_silent=("ProximaAllocatorStepLatencyHigh",),
        ),
    )


def tests_yaml(runbook_base: str = a.DEFAULT_RUNBOOK_BASE) -> str:
    rules = {rule.name: rule for rule in a.RULES}
    missing = set(rules) - {s.alert for s in scenarios()}
    if missing:
        raise RuntimeError(f"alerts without a promtool scenario: {', '.join(sorted(missing))}")
    tests = []
    for sc in scenarios():
        rule = rules[sc.alert]
        checks = [
            {"eval_time": sc.pending_at, "alertname": sc.alert, "exp_alerts": []},
            {"eval_time": sc.fires_at, "alertname": sc.alert,
             "exp_alerts": [_expected(rule, f, runbook_base) for f in sc.firing]},
            *({"eval_time": sc.fires_at, "alertname": other, "exp_alerts": []}
              for other in sc.also_silent),
        ]
        tests.append({"name": f"{sc.alert}: {sc.title}", "interval": sc.interval,
                      "input_series": sc.input_series, "alert_rule_test": checks})
    header = ("# Generated by `python -m dashboards.generate`; run with\n"
              "#   promtool test rules dashboards/prometheus/proxima-alerts.test.yml\n")
    body = {"rule_files": [RULES_FILE], "evaluation_interval": "1m", "tests": tests}
    return header + a.dump_yaml(body)
