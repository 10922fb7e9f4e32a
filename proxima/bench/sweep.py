"""Load levels and sweeps against one server: closed-loop concurrency and open-loop Poisson rate.

A level sends a window of the workload, either through N workers that each keep one request in
flight (concurrency) or at exponentially distributed arrival times (rate), for `requests` or
`duration`, whichever ends first. While it runs, a `proxima.sampling.Sampler` reads the server
and a watchdog looks for an avalanche: once `min_samples` requests have finished, an error rate above
`max_error_rate`, or a P95 E2E above `avalanche_factor` x the SLO (requests still in flight count
with their age, so a hang is seen before it completes), stops the level; the in-flight requests
are cancelled and higher levels of that sweep are not run for this server.
"""

from __future__ import annotations

import asyncio
import bisect
import heapq
import time
from collections import Counter
from dataclasses import dataclass, field

import httpx

from proxima.bench.drive import arrival_offsets, closed_loop, open_loop, pooled_client, request_source
from proxima.bench.meters import CpuMeter, LoopLagProbe
from proxima.bench.repeats import combine
from proxima.bench.results import CONCURRENCY, RATE, LevelResult, Stats, TimelinePoint, percentile
from proxima.bench.workers import ClientLoad, client_workers, plan_workers, run_in_workers
from proxima.bench.workload import Workload
from proxima.fetch import auth_headers, client_limits
from proxima.load import new_http_client
from proxima.sampling import SCRAPE_TIMEOUT_S, Sampler, wait_idle
from proxima.scrape import ServerSnapshot, scrape
from proxima.streaming import CANCELLED, FAILED, OK, TIMED_OUT, RequestResult


@dataclass(frozen=True, slots=True)
class SweepParams:
    requests_per_level: int | None = 100
    duration_s: float | None = None
    slo_p95_s: float = 2.0
    max_error_rate: float = 0.10
    avalanche_factor: float = 3.0
    min_samples: int = 10
    request_timeout_s: float = 120.0
    sample_interval_s: float = 0.5
    seed: int = 0
    client_workers: int | None = None  # processes sending each level (None: `workers.client_workers`)
    repeat: int = 1  # runs of each level (`proxima.bench.repeats`)
    # Sent with every request and scrape (vLLM's --api-key); never written to the results.
    api_key: str | None = field(default=None, repr=False)

    @property
    def scrape_timeout_s(self) -> float:
        """A reading of the server's /metrics in all: the scrape layer's default, at most the
        request deadline (a bench told to give requests 2 s does not wait 5 s on a scrape)."""
        return min(SCRAPE_TIMEOUT_S, self.request_timeout_s)


@dataclass(frozen=True, slots=True)
class Target:
    label: str
    url: str
    model: str
    local: bool = False
    pid: int | None = None  # the server's process, when bench launched it


class Observer:
    """Hooks for progress display (and for tests); all no-ops here."""

    def level_started(self, target: Target, kind: str, value: float, total: int | None) -> None: ...

    def request_done(self, target: Target, result: RequestResult) -> None: ...

    def level_finished(self, target: Target, level: LevelResult) -> None: ...

    def event(self, text: str) -> None:
        """Work between levels (a server starting, answers being checked), as one line of text."""


class _LevelState:
    """Results of one level so far, and the decision to stop it early.

    Counts are kept incrementally and latencies in sorted order (`insort`), so a check costs
    O(in flight) plus one merge, not a pass over every request of a long level.
    """

    def __init__(self, params: SweepParams, total: int | None) -> None:
        self.params = params
        self.total = total
        self.results: list[RequestResult] = []
        self.in_flight: dict[int, RequestResult] = {}
        self.peak_in_flight = 0
        self.num_done = 0
        self.errors: Counter[str] = Counter()
        self.sorted_e2e: list[float] = []
        self.stop = asyncio.Event()
        self.aborted: str | None = None

    def started(self, result: RequestResult) -> None:
        self.results.append(result)
        self.in_flight[id(result)] = result
        self.peak_in_flight = max(self.peak_in_flight, len(self.in_flight))

    def finished(self, result: RequestResult) -> None:
        self.in_flight.pop(id(result), None)
        if result.status == OK:
            self.num_done += 1
            if result.e2e is not None:
                bisect.insort(self.sorted_e2e, result.e2e)
        elif result.status in (FAILED, TIMED_OUT):
            self.num_done += 1
            self.errors[result.error or result.status] += 1
        self.check(latency=False)

    def check(self, latency: bool = True) -> None:
        """Error rate on every completion; latency (which merges in-flight ages) on the watchdog's tick."""
        p = self.params
        if self.stop.is_set() or self.num_done < min(p.min_samples, self.total or p.min_samples):
            return
        num_errors = sum(self.errors.values())
        if num_errors / self.num_done > p.max_error_rate:
            self.abort(f"error rate {num_errors / self.num_done:.0%} > {p.max_error_rate:.0%} "
                        f"after {self.num_done} requests ({self.errors.most_common(1)[0][0]})")
            return
        if not latency:
            return
        now = time.perf_counter()
        ages = sorted(now - r.sent_at for r in self.in_flight.values() if r.sent_at)
        p95 = percentile(list(heapq.merge(self.sorted_e2e, ages)), 95, presorted=True)
        limit = p.avalanche_factor * p.slo_p95_s
        if p95 is not None and p95 > limit:
            self.abort(f"P95 E2E {p95:.2f}s > {p.avalanche_factor:g}x SLO ({limit:g}s)")

    def abort(self, reason: str) -> None:
        self.aborted = reason
        self.stop.set()


async def _watchdog(state: _LevelState) -> None:
    while not state.stop.is_set():
        await asyncio.sleep(0.25)
        state.check()


async def _settled_counters(http: httpx.AsyncClient, url: str, before: ServerSnapshot,
                            completed: int, timeout_s: float) -> ServerSnapshot:
    """The server's counters once they have caught up with what the client saw (bounded wait)."""
    previous = await scrape(http, url, timeout_s)
    for _ in range(20):
        if not previous.ok:
            return previous
        await asyncio.sleep(0.1)
        current = await scrape(http, url, timeout_s)
        caught_up = current.requests_finished_total - before.requests_finished_total >= completed
        steady = (current.requests_finished_total, current.generation_tokens_total) == (
            previous.requests_finished_total, previous.generation_tokens_total)
        previous = current
        if caught_up and steady:
            break
    return previous


async def run_level(target: Target, workload: Workload, kind: str, value: float,
                    offset: int, params: SweepParams, observer: Observer,
                    started_s: float = 0.0) -> LevelResult:
    state = _LevelState(params, params.requests_per_level)
    num_workers = client_workers(params.client_workers, kind, value)
    observer.level_started(target, kind, value, params.requests_per_level)
    async with httpx.AsyncClient(headers=auth_headers(params.api_key), limits=client_limits()) as scrape_http:
        before = await scrape(scrape_http, target.url, params.scrape_timeout_s)
        cpu = CpuMeter()
        # Off the event loop that times the tokens; no extra reading when the level ends.
        sampler = Sampler(target.url, params.sample_interval_s, here=target.local, off_loop=True,
                          timeout_s=max(1.0, 4 * params.sample_interval_s),
                          headers=auth_headers(params.api_key))
        async with sampler.running(final=False), LoopLagProbe() as lag:
            watchdog = asyncio.create_task(_watchdog(state))
            try:
                if num_workers > 1:
                    specs = plan_workers(num_workers, kind, value, workload.requests, offset,
                                         params.requests_per_level, params.duration_s, params.seed,
                                         url=target.url, model=target.model,
                                         request_timeout_s=params.request_timeout_s, api_key=params.api_key)
                    client = await run_in_workers(specs, state, observer, target)
                else:
                    client = await _in_process(target, workload, kind, value, offset, params, state,
                                               observer)
            finally:
                watchdog.cancel()
                await asyncio.gather(watchdog, return_exceptions=True)
            # This process first (it runs the sampler and the watchdog), then each worker.
            client.cpu_by_process.insert(0, cpu.fraction())
            lags = [x for x in (percentile(lag.lags, 99), client.lag_p99_s) if x is not None]
            client.lag_p99_s = max(lags) if lags else None
        completed = sum(r.status == OK for r in state.results)
        after = await _settled_counters(scrape_http, target.url, before, completed, params.scrape_timeout_s)
        level = summarize(target.label, kind, value, state, client, sampler, before, after)
        level.started_s = started_s
        if after.ok:  # the next level starts on an idle server, also after an avalanche
            # (cancelled streams take a moment to be aborted)
            await wait_idle(scrape_http, target.url, timeout_s=30.0, poll_s=0.2)
        elif state.aborted:
            level.aborted = f"{state.aborted}; server unreachable ({after.error})"
    observer.level_finished(target, level)
    return level


async def _in_process(target: Target, workload: Workload, kind: str, value: float,
                      offset: int, params: SweepParams, state: _LevelState, observer: Observer) -> ClientLoad:
    """The level from this process's event loop (`--client-workers 1`); a rate counts as streams."""
    source = request_source(workload, offset, params.requests_per_level)
    async with pooled_client(target.url, target.model, params.request_timeout_s, params.api_key,
                             value) as client:
        t0 = time.perf_counter()
        deadline = t0 + params.duration_s if params.duration_s else None
        if kind == CONCURRENCY:
            await closed_loop(client, state, observer, target, source, int(value), deadline)
        else:
            arrivals = ((at, index, request)
                        for at, (index, request) in zip(arrival_offsets(params.seed, value), source))
            await open_loop(client, state, observer, target, arrivals, t0, deadline)
        return ClientLoad(time.perf_counter() - t0)


def summarize(label: str, kind: str, value: float, state: _LevelState, client: ClientLoad,
              sampler: Sampler, before: ServerSnapshot, after: ServerSnapshot) -> LevelResult:
    results = state.results
    ok = [r for r in results if r.status == OK]
    duration = client.duration_s
    level = LevelResult(label, kind, value, num_sent=len(results), completed=len(ok),
                        failed=sum(r.status == FAILED for r in results),
                        timed_out=sum(r.status == TIMED_OUT for r in results),
                        cancelled=sum(r.status == CANCELLED for r in results),
                        duration_s=duration, aborted=state.aborted, peak_in_flight=state.peak_in_flight)
    level.prompt_tokens = sum(r.prompt_tokens or 0 for r in ok)
    level.output_tokens = sum(r.output_tokens for r in ok)
    if duration > 0:
        level.rps = len(ok) / duration
        level.output_tps = level.output_tokens / duration
        level.total_tps = (level.output_tokens + level.prompt_tokens) / duration
    level.ttft = Stats.of([r.ttft for r in ok if r.ttft is not None])
    level.itl = Stats.of([x for r in ok for x in r.itls])
    level.tpot = Stats.of([t for t in (r.tpot for r in ok) if t is not None])
    level.e2e = Stats.of([r.e2e for r in ok if r.e2e is not None])
    level.errors = dict(Counter(r.error or r.status for r in results if r.status in (FAILED, TIMED_OUT))
                        .most_common(5))
    level.client_workers = max(1, len(client.cpu_by_process) - 1)
    level.client_cpu_by_process = client.cpu_by_process
    level.client_cpu = max(client.cpu_by_process, default=0.0)
    level.client_loop_lag_p99_s = client.lag_p99_s
    if level.output_tokens:
        level.client_overhead_us_per_token = 1e6 * sum(r.overhead_s for r in ok) / level.output_tokens
    level.timeline = [TimelinePoint.of(s) for s in sampler.samples]
    samples = [s for s in level.timeline if s.ok]

    def peak(attr: str):
        values = [getattr(s, attr) for s in samples if getattr(s, attr) is not None]
        return max(values) if values else None

    level.peak_running, level.peak_waiting = peak("running"), peak("waiting")
    level.peak_kv_usage, level.peak_token_usage = peak("kv_usage"), peak("token_usage")
    level.peak_fragmentation = peak("fragmentation")
    gpu = [s.gpu_memory_bytes for s in level.timeline if s.gpu_memory_bytes is not None]
    level.peak_gpu_memory_bytes = max(gpu) if gpu else None
    if before.ok and after.ok:
        level.preemptions = after.preemptions_total - before.preemptions_total
        queries = after.prefix_cache_queries_total - before.prefix_cache_queries_total
        if queries > 0:
            level.prefix_cache_hit_rate = (after.prefix_cache_hits_total
                                           - before.prefix_cache_hits_total) / queries
        level.server_requests_finished = after.requests_finished_total - before.requests_finished_total
        level.server_prompt_tokens = after.prompt_tokens_total - before.prompt_tokens_total
        level.server_generation_tokens = after.generation_tokens_total - before.generation_tokens_total
    return level


def levels_to_run(concurrency: list[int], rates: list[float]) -> list[tuple[str, float]]:
    return [(CONCURRENCY, float(c)) for c in sorted(concurrency)] + [(RATE, r) for r in sorted(rates)]


def level_offsets(workload: Workload, levels: list[tuple[str, float]],
                  params: SweepParams) -> list[list[int]]:
    """Where each run of each level starts in the workload (`[level][repetition]`): the same for
    every server, so that an A/B sends the same requests at the same level even when one server's
    earlier level was cut short; each run takes fresh prompts, so that a repetition is not a
    replay of the one before from the prefix cache."""
    runs = len(levels) * params.repeat
    stride = params.requests_per_level or max(1, len(workload.requests) // max(1, runs))
    return [[(i * params.repeat + r) * stride for r in range(params.repeat)] for i in range(len(levels))]


class ServerSweep:
    """The levels of one server, run one at a time (possibly interleaved with another server's).

    After an aborted level, higher levels of its kind are skipped; once the server stops
    answering, every remaining level is.
    """

    def __init__(self, target: Target, workload: Workload, levels: list[tuple[str, float]],
                 params: SweepParams, observer: Observer, results: list[LevelResult] | None = None) -> None:
        self.target, self.workload, self.levels = target, workload, levels
        self.params, self.observer = params, observer
        self.offsets = level_offsets(workload, levels, params)
        # The caller's list when given: finished levels are there even if the sweep is interrupted.
        self.results: list[LevelResult] = [] if results is None else results
        self._stopped: list[str] = []
        self._broken: set[str] = set()
        self._gone = False
        self._t0: float | None = None
        self._runs: dict[int, list[LevelResult]] = {}  # each level's runs so far (`--repeat`)

    @property
    def stopped(self) -> str | None:
        return "; ".join(self._stopped) or None

    async def run(self, http: httpx.AsyncClient, index: int, repetition: int = 0) -> LevelResult | None:
        """One run of level `index`; after its last (or one stopped early) the level is recorded."""
        kind, value = self.levels[index]
        runs = self._runs.setdefault(index, [])
        if self._gone or kind in self._broken or (runs and runs[-1].aborted):
            return None
        if self._t0 is None:
            self._t0 = time.perf_counter()
        level = await run_level(self.target, self.workload, kind, value, self.offsets[index][repetition],
                                self.params, self.observer, started_s=time.perf_counter() - self._t0)
        runs.append(level)
        if repetition < self.params.repeat - 1 and not level.aborted:
            return level
        level = combine(runs)
        self.results.append(level)
        if level.aborted:
            self._broken.add(kind)
            skipped = [v for k, v in self.levels if k == kind and v > value]
            if skipped:
                self._stopped.append(f"{kind} sweep stopped at {level.label} ({level.aborted}); "
                                     f"not run: {', '.join(f'{v:g}' for v in skipped)}")
            if not (await scrape(http, self.target.url, self.params.scrape_timeout_s)).ok:
                self._gone = True
                self._stopped.append("server unreachable: remaining levels not run")
        return level


async def run_sweep(target: Target, workload: Workload, levels: list[tuple[str, float]], params: SweepParams,
                    observer: Observer, results: list[LevelResult] | None = None,
                    ) -> tuple[list[LevelResult], str | None]:
    """All levels for one server, in order (appended to ``results`` as each finishes, when given)."""
    sweep = ServerSweep(target, workload, levels, params, observer, results)
    async with new_http_client(params.request_timeout_s, params.api_key) as http:
        for index in range(len(levels)):
            for repetition in range(params.repeat):
                await sweep.run(http, index, repetition)
    return sweep.results, sweep.stopped


async def run_interleaved(targets: list[Target], workload: Workload, levels: list[tuple[str, float]],
                          params: SweepParams, observer: Observer,
                          results: list[list[LevelResult]] | None = None,
                          ) -> list[tuple[list[LevelResult], str | None]]:
    """Servers that are up at the same time take turns run by run (A, B, A, B, ...): a drift in the
    machine's background load then falls on both sides of each comparison, not on one server."""
    sinks = results if results is not None else [None] * len(targets)
    sweeps = [ServerSweep(t, workload, levels, params, observer, sink) for t, sink in zip(targets, sinks)]
    async with new_http_client(params.request_timeout_s, params.api_key) as http:
        for index in range(len(levels)):
            for repetition in range(params.repeat):
                for sweep in sweeps:
                    await sweep.run(http, index, repetition)
    return [(sweep.results, sweep.stopped) for sweep in sweeps]
