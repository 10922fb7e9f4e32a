"""One bench run from start to verdict: servers (given or launched), workload, sweeps, results.

The CLI builds a checked `BenchPlan` (`proxima.bench.plan`) and renders what comes back;
everything between lives here. Order of work: the workload file is validated before any server
is touched; given servers are checked reachable before any load is sent; the workload is built
(and its prompts counted by the first server's tokenizer) once and sent unchanged to every
server; servers are measured one after the other.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
from collections.abc import Iterator
from dataclasses import dataclass, replace
from urllib.parse import urlsplit

from proxima.bench import workload as wl
from proxima.bench.client import READ_TIMEOUT_S, count_prompt_tokens, fetch_model, fetch_word_costs
from proxima.bench.plan import BenchPlan
from proxima.bench.results import BenchResult, ServerRun, verdict
from proxima.bench.servers import launched
from proxima.bench.sweep import Observer, SweepParams, Target, run_interleaved, run_sweep
from proxima.bench.workers import available_cores
from proxima.fetch import auth_headers
from proxima.hosts import is_this_host
from proxima.load import Completion, LoadDriver, make_prompt, new_http_client
from proxima.scrape import ServerSnapshot, kv_capacity_tokens, scrape_sync

WARMUP_CONCURRENCY = 8
WARMUP_MAX_TOKENS = 32
WARMUP_PROMPT_BASE = 900_000  # far from any workload's prompt indices


@dataclass(slots=True)
class _Served:
    label: str | None
    url: str
    variant: str | None = None
    launch_info: dict | None = None
    pid: int | None = None


def _scrape(url: str, params: SweepParams) -> ServerSnapshot:
    return scrape_sync(url, params.scrape_timeout_s, headers=auth_headers(params.api_key))


def _read_timeout(params: SweepParams) -> float:
    """A read of /v1/models or /tokenize in all: at most the request deadline."""
    return min(READ_TIMEOUT_S, params.request_timeout_s)


def auto_label(url: str, params: SweepParams) -> str:
    """`stock` for plain vLLM, else Proxima's allocator (`token` / `block`), from the server's metrics."""
    snap = _scrape(url, params)
    if not snap.ok:
        return urlsplit(url).netloc or url
    return snap.proxima.allocator if snap.proxima else "stock"


def unique_labels(labels: list[str], urls: list[str]) -> list[str]:
    if len(set(labels)) == len(labels):
        return labels
    return [f"{lab}@{urlsplit(u).port or u}" for lab, u in zip(labels, urls)]


def check_reachable(urls: list[str], params: SweepParams) -> None:
    """Raise ServerUnreachable for the first given server that does not answer."""
    async def check() -> None:
        async with new_http_client(_read_timeout(params), params.api_key) as http:
            for url in urls:
                await fetch_model(http, url, _read_timeout(params))

    asyncio.run(check())


def prepare_workload(plan: BenchPlan, url: str, model: str) -> wl.Workload:
    """Build (or load) the workload, counting prompt tokens with this server's tokenizer if it can."""
    timeout = _read_timeout(plan.params)

    async def build() -> wl.Workload:
        async with new_http_client(timeout, plan.params.api_key) as http:
            if plan.workload.is_file:
                work = wl.from_file(plan.workload, plan.default_max_tokens)
            else:
                costs = await fetch_word_costs(http, url, model, timeout)
                word_costs, max_len = costs if costs else (wl.WordCosts.approximate(), None)
                work = wl.generate(plan.workload, word_costs, max_len)
            counts = await count_prompt_tokens(http, url, model, [r.prompt for r in work.requests],
                                               timeout=timeout)
            if counts is not None:
                work.requests = [replace(r, prompt_tokens=n)
                                 for r, n in zip(work.requests, counts)]
                work.token_counting = wl.SERVER_TOKENIZER
            return work

    return asyncio.run(build())


def _server_groups(plan: BenchPlan, observer: Observer) -> Iterator[list[_Served]]:
    """Servers that are up at the same time, group by group."""
    if plan.launch is None:
        yield [_Served(label, url) for url, label in zip(plan.urls, plan.labels)]
        return
    for group in launched(plan.launch, observer.event):
        yield [_Served(s.label, s.url, s.variant, s.info, s.pid) for s in group]


def _run_for(served: _Served, model: str, label: str, params: SweepParams) -> tuple[Target, ServerRun]:
    local = served.launch_info is not None or is_this_host(served.url)
    target = Target(label, served.url, model, local=local, pid=served.pid)
    run = ServerRun(label, served.url, model, served.variant, local=local, launch=served.launch_info)
    _describe_kv(run, params)
    return target, run


def _describe_kv(run: ServerRun, params: SweepParams) -> None:
    """Allocator, granularity and capacity as the server reports them (capacity gauges are
    published from the engine's first step on, so this is read again after the sweep)."""
    snap = _scrape(run.url, params)
    run.metrics_error = snap.error
    if not snap.ok:
        return
    kv = snap.proxima
    run.allocator = kv.allocator if kv else "stock"
    run.kv_cache_dtype = snap.kv_cache_dtype
    run.kv_block_size = kv.granularity if kv else snap.block_size
    run.kv_capacity_tokens = kv_capacity_tokens(snap) or run.kv_capacity_tokens


def _measure_group(plan: BenchPlan, group: list[_Served], observer: Observer, runs: list[ServerRun],
                   work_box: list[wl.Workload], answers: dict[str, list]) -> None:
    """Sweep the servers of one group (up at the same time); the workload is built on first use.
    With --check-answers each server first answers the fixed greedy prompts (into `answers`)."""
    models = [asyncio.run(_model(s.url, plan.params)) for s in group]
    if not work_box:
        work_box.append(prepare_workload(plan, group[0].url, models[0]))
    work = work_box[0]
    labels = unique_labels([s.label or auto_label(s.url, plan.params) for s in group], [s.url for s in group])
    pairs = [_run_for(s, m, lab, plan.params) for s, m, lab in zip(group, models, labels)]
    targets = [t for t, _ in pairs]
    # The runs are the caller's from here on, and levels land in them as they finish: an
    # interrupted bench still reports what it measured.
    runs.extend(run for _, run in pairs)
    if plan.check_answers:
        from proxima.bench.answers import answer_prompts, collect

        for target, run in pairs:
            observer.event(f"{run.label}: answering {len(answer_prompts())} fixed prompts (--check-answers)")
            first = next(iter(answers.values()), None)  # the first server's, when answered before
            answers[run.label] = asyncio.run(collect(target.url, target.model, plan.params.request_timeout_s,
                                                     plan.params.api_key, first))
    for target, run in pairs:
        if plan.warmup:
            observer.event(f"{run.label}: {plan.warmup} warm-up requests (not measured)")
            done = asyncio.run(_warm_up(target, work, plan.warmup, plan.params))
            run.warmup_failed = sum(not c.ok for c in done)
            run.warmup_prompt_tokens = sum(c.prompt_tokens for c in done)
    if plan.interleave and len(pairs) > 1:
        outcomes = asyncio.run(run_interleaved(targets, work, plan.levels, plan.params, observer,
                                               [run.levels for _, run in pairs]))
    else:
        outcomes = [asyncio.run(run_sweep(t, work, plan.levels, plan.params, observer, run.levels))
                    for t, (_, run) in zip(targets, pairs)]
    for (_, run), (_, stopped) in zip(pairs, outcomes):
        run.stopped = stopped
        if not run.kv_capacity_tokens:
            _describe_kv(run, plan.params)


def run_bench(plan: BenchPlan, observer: Observer) -> tuple[BenchResult, wl.Workload]:
    """Measure every server; raises WorkloadError, ServerUnreachable or LaunchError on user-facing faults."""
    if plan.workload.is_file:
        wl.load_jsonl(plan.workload.source, plan.default_max_tokens)  # fail before touching a server
    else:
        wl.check_source(plan.workload.source)
    if plan.urls:
        check_reachable(plan.urls, plan.params)
    runs: list[ServerRun] = []
    work_box: list[wl.Workload] = []
    answers: dict[str, list] = {}
    try:
        # Launched servers stop even on errors.
        with contextlib.closing(_server_groups(plan, observer)) as groups:
            for group in groups:
                _measure_group(plan, group, observer, runs, work_box, answers)
    except KeyboardInterrupt:
        measured = [run for run in runs if run.levels]
        if not measured or not work_box:
            raise
        for run in measured:
            if len(run.levels) < len(plan.levels):
                interrupted = f"interrupted after {run.levels[-1].label}"
                run.stopped = "; ".join(filter(None, [run.stopped, interrupted]))
        result = _result(plan, measured, work_box[0], answers)
        result.notes.insert(0, "Interrupted: only the levels that finished before the interrupt are "
                               "reported.")
        raise BenchInterrupted(result, work_box[0]) from None
    work = work_box[0] if work_box else None
    assert work is not None
    return _result(plan, runs, work, answers), work


class BenchInterrupted(KeyboardInterrupt):
    """Ctrl-C or SIGTERM after at least one level finished: carries the result of those levels."""

    def __init__(self, result: BenchResult, work: wl.Workload) -> None:
        super().__init__("bench interrupted")
        self.result, self.work = result, work


def _result(plan: BenchPlan, runs: list[ServerRun], work: wl.Workload,
            answers: dict[str, list] | None = None) -> BenchResult:
    p = plan.params
    result = BenchResult(
        created_at=dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        command=plan.command,
        config=_config(plan),
        workload=work.describe(),
        runs=runs,
        verdict=verdict(runs, p.slo_p95_s, p.max_error_rate),
    )
    result.notes.extend(f"{run.label}: {run.warmup_failed} of {plan.warmup} warm-up requests failed (not "
                        "counted in any level; the first level may still have met a cold server)"
                        for run in runs if run.warmup_failed)
    result.notes.extend(_answer_notes(result, runs, answers or {}))
    result.notes.extend(client_notes(result))
    result.notes.extend(f"{run.label}: {run.url}/metrics could not be used ({run.metrics_error}); no KV or "
                        "server-side figures for it" for run in runs if run.metrics_error)
    return result


async def _warm_up(target: Target, work: wl.Workload, count: int, params: SweepParams) -> list[Completion]:
    """`count` requests with the prompt length of the workload's first (in words) and at most
    `WARMUP_MAX_TOKENS` out (what is cold is the first prefill and decode steps, not a long answer),
    prompts of their own (so nothing measured later finds them cached)."""
    first = work.requests[0]
    max_tokens = min(first.max_tokens, WARMUP_MAX_TOKENS)
    requests = [(make_prompt(WARMUP_PROMPT_BASE + i, len(first.prompt.split())), max_tokens)
                for i in range(count)]
    async with new_http_client(params.request_timeout_s, params.api_key) as http:
        return await LoadDriver(http, target.url, target.model).each_once(
            requests, min(count, WARMUP_CONCURRENCY), timeout=params.request_timeout_s)


def _answer_notes(result: BenchResult, runs: list[ServerRun], answers: dict[str, list]) -> list[str]:
    """--check-answers: every server's answers against the first server's, into the result."""
    from dataclasses import asdict

    from proxima.bench.answers import compare

    answered = [run for run in runs if run.label in answers]
    if len(answered) < 2:
        return ["--check-answers: one server, nothing to compare its answers with"] if answered else []
    ref = answered[0]
    checks = [compare(ref.label, answers[ref.label], run.label, answers[run.label],
                      (ref.kv_cache_dtype, run.kv_cache_dtype)) for run in answered[1:]]
    # Lists, not tuples: the record reads the same before and after a JSON round trip.
    result.answer_check = [asdict(c) | {"kv_dtypes": list(c.kv_dtypes), "examples": list(c.examples),
                                        "forced": [list(f) for f in c.forced],
                                        "expected_to_differ": c.expected_to_differ} for c in checks]
    return [c.describe() for c in checks]


async def _model(url: str, params: SweepParams) -> str:
    async with new_http_client(_read_timeout(params), params.api_key) as http:
        return await fetch_model(http, url, _read_timeout(params))


def _config(plan: BenchPlan) -> dict:
    p = plan.params
    config = {
        "levels": [{"kind": k, "value": v} for k, v in plan.levels],
        "requests_per_level": p.requests_per_level, "duration_s": p.duration_s,
        "slo_p95_e2e_s": p.slo_p95_s, "max_error_rate": p.max_error_rate,
        "avalanche_factor": p.avalanche_factor, "min_samples": p.min_samples,
        "request_timeout_s": p.request_timeout_s, "sample_interval_s": p.sample_interval_s, "seed": p.seed,
        "endpoint": "/v1/completions (stream, include_usage, ignore_eos, temperature 0)",
        "interleave": plan.interleave, "client_workers": p.client_workers or "auto",
        "repeat": p.repeat, "check_answers": plan.check_answers, "warmup_requests": plan.warmup,
    }
    if plan.launch is not None:
        launch = plan.launch
        config["launch"] = {"model": launch.model, "variants": list(launch.variants),
                            "vllm_args": list(launch.vllm_args), "side_by_side": launch.side_by_side}
    return config


# A client process above this share of one core, or waking this late, may be what limits the
# figures; so may all of them together above this share of the machine's cores.
CLIENT_CPU_WARN = 0.8
CLIENT_LAG_WARN_S = 0.02


def client_limited(level) -> bool:
    total = sum(level.client_cpu_by_process)
    return (level.client_cpu > CLIENT_CPU_WARN or (level.client_loop_lag_p99_s or 0) > CLIENT_LAG_WARN_S
            or total > CLIENT_CPU_WARN * available_cores())


def client_notes(result: BenchResult) -> list[str]:
    notes = []
    cores = available_cores()
    for run in result.runs:
        busy = [lv for lv in run.levels if client_limited(lv)]
        if not busy:
            continue
        worst = max(busy, key=lambda lv: lv.client_cpu)
        lag_ms = 1e3 * (worst.client_loop_lag_p99_s or 0)
        levels = ", ".join(lv.label for lv in busy)
        if all(lv.client_cpu <= CLIENT_CPU_WARN and sum(lv.client_cpu_by_process) <= CLIENT_CPU_WARN * cores
               for lv in busy):
            # Late wake-ups with idle workers: they waited for a core, taken by the server or others.
            notes.append(
                f"{run.label}: the client's processes waited for a CPU at {levels} (event-loop lag p99 "
                f"{lag_ms:.0f} ms with {worst.client_workers} worker(s), the busiest at "
                f"{worst.client_cpu:.0%} of a core): this host's {cores} cores are shared with the server "
                f"or other work, so latency there includes that wait (fewer --client-workers, or the "
                f"client on another machine)"
            )
            continue
        fix = ("raise --client-workers" if worst.client_workers < cores else
               f"all {cores} cores here already send load: run the client on another machine")
        notes.append(
            f"{run.label}: the client was the limit at {levels} "
            f"({worst.client_workers} worker(s), the busiest at {worst.client_cpu:.0%} of a core, "
            f"event-loop lag p99 {lag_ms:.0f} ms); figures there measure the client or CPU shared "
            f"with the server, not the server alone ({fix})"
        )
    return notes
