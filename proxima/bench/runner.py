"""One bench run from start to verdict: servers (given or launched), workload, sweeps, results.

The CLI builds a `BenchPlan` and renders what comes back; everything between lives here.
Order of work: the workload file is validated before any server is touched; given servers are
checked reachable before any load is sent; the workload is built (and its prompts counted by
the first server's tokenizer) once and sent unchanged to every server; servers are measured one
after the other.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import socket
from collections.abc import Iterator
from dataclasses import dataclass, field
from urllib.parse import urlsplit

from proxima.bench import workload as wl
from proxima.bench.client import count_prompt_tokens, fetch_model, fetch_word_costs, new_http_client
from proxima.bench.launch import LaunchPlan, launched
from proxima.bench.results import BenchResult, ServerRun, verdict
from proxima.bench.sweep import Observer, SweepParams, Target, run_sweep
from proxima.scrape import scrape_sync

LOCAL_HOSTS = {"127.0.0.1", "localhost", "::1", "0.0.0.0", ""}


@dataclass(slots=True)
class BenchPlan:
    workload: wl.WorkloadPlan
    levels: list[tuple[str, float]]
    params: SweepParams
    urls: list[str] = field(default_factory=list)  # given servers ...
    labels: list[str | None] = field(default_factory=list)
    launch: LaunchPlan | None = None  # ... or servers to launch
    default_max_tokens: int = wl.DEFAULT_MAX_TOKENS
    command: str = ""


@dataclass(slots=True)
class _Served:
    label: str | None
    url: str
    variant: str | None = None
    launch_info: dict | None = None


def is_local(url: str) -> bool:
    host = urlsplit(url).hostname or ""
    return host in LOCAL_HOSTS or host in {socket.gethostname(), socket.getfqdn()}


def auto_label(url: str) -> str:
    """`stock` for plain vLLM, else Proxima's allocator (`token` / `block`), from the server's metrics."""
    snap = scrape_sync(url)
    if not snap.ok:
        return urlsplit(url).netloc or url
    return snap.proxima.allocator if snap.proxima else "stock"


def unique_labels(labels: list[str], urls: list[str]) -> list[str]:
    if len(set(labels)) == len(labels):
        return labels
    return [f"{lab}@{urlsplit(u).port or u}" for lab, u in zip(labels, urls)]


def check_reachable(urls: list[str]) -> None:
    """Raise ServerUnreachable for the first given server that does not answer."""
    async def check() -> None:
        async with new_http_client(10.0) as http:
            for url in urls:
                await fetch_model(http, url)

    asyncio.run(check())


def prepare_workload(plan: BenchPlan, url: str, model: str) -> wl.Workload:
    """Build (or load) the workload, counting prompt tokens with this server's tokenizer if it can."""
    async def build() -> wl.Workload:
        async with new_http_client(60.0) as http:
            if plan.workload.is_file:
                work = wl.from_file(plan.workload, plan.default_max_tokens)
            else:
                costs = await fetch_word_costs(http, url, model)
                word_costs, max_len = costs if costs else (wl.WordCosts.approximate(), None)
                work = wl.generate(plan.workload, word_costs, max_len)
            counts = await count_prompt_tokens(http, url, model, [r.prompt for r in work.requests])
            if counts is not None:
                work.requests = [wl.BenchRequest(r.prompt, r.max_tokens, n) for r, n in zip(work.requests, counts)]
                work.token_counting = wl.SERVER_TOKENIZER
            return work

    return asyncio.run(build())


def _servers(plan: BenchPlan) -> Iterator[_Served]:
    if plan.launch is None:
        for url, label in zip(plan.urls, plan.labels):
            yield _Served(label, url)
        return
    for served in launched(plan.launch):
        yield _Served(served.label, served.url, served.variant, served.info)


def run_bench(plan: BenchPlan, observer: Observer) -> tuple[BenchResult, wl.Workload]:
    """Measure every server; raises WorkloadError, ServerUnreachable or LaunchError on user-facing faults."""
    if plan.workload.is_file:
        wl.load_jsonl(plan.workload.source, plan.default_max_tokens)  # fail before touching a server
    else:
        wl.check_source(plan.workload.source)
    if plan.urls:
        check_reachable(plan.urls)
    runs: list[ServerRun] = []
    work: wl.Workload | None = None
    for served in _servers(plan):
        model = asyncio.run(_model(served.url))
        if work is None:
            work = prepare_workload(plan, served.url, model)
        label = served.label or auto_label(served.url)
        snap = scrape_sync(served.url)
        target = Target(label, served.url, model, local=served.launch_info is not None or is_local(served.url))
        run = ServerRun(label, served.url, model, served.variant,
                        (snap.proxima.allocator if snap.proxima else "stock") if snap.ok else None,
                        target.local, launch=served.launch_info)
        run.levels, run.stopped = asyncio.run(run_sweep(target, work, plan.levels, plan.params, observer))
        runs.append(run)
    if plan.launch is None:
        fixed = unique_labels([r.label for r in runs], [r.url for r in runs])
        for run, label in zip(runs, fixed):
            run.label = label
            for level in run.levels:
                level.server = label
    assert work is not None
    p = plan.params
    result = BenchResult(
        created_at=dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        command=plan.command,
        config=_config(plan),
        workload=work.describe(),
        runs=runs,
        verdict=verdict(runs, p.slo_p95_s, p.max_error_rate),
    )
    result.notes.extend(client_notes(result))
    return result, work


async def _model(url: str) -> str:
    async with new_http_client(10.0) as http:
        return await fetch_model(http, url)


def _config(plan: BenchPlan) -> dict:
    p = plan.params
    config = {
        "levels": [{"kind": k, "value": v} for k, v in plan.levels],
        "requests_per_level": p.requests_per_level, "duration_s": p.duration_s,
        "slo_p95_e2e_s": p.slo_p95_s, "max_error_rate": p.max_error_rate,
        "avalanche_factor": p.avalanche_factor, "min_samples": p.min_samples,
        "request_timeout_s": p.request_timeout_s, "sample_interval_s": p.sample_interval_s, "seed": p.seed,
        "endpoint": "/v1/completions (stream, include_usage, ignore_eos, temperature 0)",
    }
    if plan.launch is not None:
        config["launch"] = {"model": plan.launch.model, "variants": list(plan.launch.variants),
                            "vllm_args": list(plan.launch.vllm_args), "side_by_side": plan.launch.side_by_side}
    return config


# A client above this share of one core, or waking this late, may be what limits the figures.
CLIENT_CPU_WARN = 0.8
CLIENT_LAG_WARN_S = 0.02


def client_notes(result: BenchResult) -> list[str]:
    notes = []
    for run in result.runs:
        busy = [lv for lv in run.levels if lv.client_cpu > CLIENT_CPU_WARN
                or (lv.client_loop_lag_p99_s or 0) > CLIENT_LAG_WARN_S]
        if busy:
            worst = max(busy, key=lambda lv: lv.client_cpu)
            notes.append(
                f"{run.label}: the client was busy at {', '.join(lv.label for lv in busy)} (up to "
                f"{worst.client_cpu:.0%} of a core, event-loop lag p99 {1e3 * (worst.client_loop_lag_p99_s or 0):.0f} ms); "
                "figures there may be limited by the client or by CPU shared with the server"
            )
    return notes
