"""A level's load sent from several processes, so that the client is not what saturates.

Why: one event loop on one core, streaming at c=256 on an H200, ran at 93-97% of its core and
served fewer req/s than at c=64 on both servers (issue 29); scripts/bench_client.py measures
what one worker sustains. Each worker is a spawned process with its own event loop and httpx
pool (`proxima.bench.drive`), sending its share of one schedule:
  concurrency c: worker k keeps c_k requests in flight (the c_k add up to c); every worker takes
    the level's next request from one shared counter, so each is sent once, in order;
  rate r: the parent draws the level's Poisson arrival times (`drive.arrival_offsets`, the times
    one process would use) and deals them out round-robin; all workers time them from one start.
Workers report each request's start and end to the parent in batches (every `BATCH_S`); the
parent keeps the level's one state (avalanche checks, progress) and on its stop tells the workers
to stop; they cancel what is in flight and report it cancelled. No request is lost: a worker's
last message follows every end it reports, and a worker that dies has its unfinished requests
failed with the reason.
"""

from __future__ import annotations

import asyncio
import math
import multiprocessing as mp
import os
import queue
import signal
import time
from dataclasses import dataclass, field, fields
from itertools import islice, takewhile

from proxima.bench.drive import arrival_offsets, closed_loop, open_loop, pooled_client
from proxima.bench.meters import CpuMeter, LoopLagProbe
from proxima.bench.results import CONCURRENCY, percentile
from proxima.bench.workload import BenchRequest
from proxima.streaming import CANCELLED, FAILED, RequestResult

# One worker per this many streams in flight. Measured on the H200 (docs/benchmarks.md, issue 29):
# one worker's CPU follows the tokens it streams; at c=64, where an H200 streams the most tokens
# per request (9.6k tok/s), one worker per 32 streams (4.8k tok/s each) ran at 72-73% of its core,
# so 24 puts each near half a core there, and the workers ran lower at every higher level.
# scripts/bench_client.py measures what one worker sustains on the machine at hand.
STREAMS_PER_WORKER = 24
BATCH_S = 0.02  # how often a worker reports: the watchdog and progress lag by at most this
START_TIMEOUT_S = 60.0  # spawned interpreters importing httpx, on a loaded machine
LEAD_S = 0.1  # the shared start is this far after the last worker is ready
STARTED, FINISHED = "s", "f"


def available_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def default_worker_cap() -> int:
    """The most workers bench starts unasked: half the cores. The server under test often shares the
    host (its API server and engine core each keep a core busy), and a worker needs a core when its
    streams' tokens arrive: on the H200's 16-core host at c=512, 16 workers at 11-23% of a core each
    woke up to 22 ms late (p99) where 11 at c=256 woke within 6 ms (docs/benchmarks.md, issue 29)."""
    return max(1, available_cores() // 2)


def client_workers(asked: int | None, kind: str, value: float) -> int:
    """Worker processes for one level: as asked, else one per STREAMS_PER_WORKER, at most
    `default_worker_cap`; never more than a concurrency level's streams."""
    wanted = asked or min(default_worker_cap(), math.ceil(value / STREAMS_PER_WORKER))
    return max(1, min(wanted, int(value)) if kind == CONCURRENCY else wanted)


@dataclass(frozen=True, slots=True)
class WorkerSpec:
    """One worker's share of a level (picklable: it crosses to a spawned process)."""

    worker: int
    url: str
    model: str
    requests: tuple[BenchRequest, ...]  # the whole workload; indices below point into it
    concurrency: int = 0  # closed loop: requests this worker keeps in flight
    offset: int = 0
    count: int | None = None  # requests of the level, across all workers (None: until duration)
    arrivals: tuple[tuple[float, int], ...] = ()  # open loop: (seconds after start, workload index)
    duration_s: float | None = None
    request_timeout_s: float = 120.0
    api_key: str | None = field(default=None, repr=False)


def split(total: int, parts: int) -> list[int]:
    """`total` in `parts` near-equal whole shares, larger first."""
    return [total // parts + (k < total % parts) for k in range(parts)]


def plan_workers(num_workers: int, kind: str, value: float, requests: list[BenchRequest], offset: int,
                 count: int | None, duration_s: float | None, seed: int, *, url: str, model: str,
                 request_timeout_s: float, api_key: str | None) -> list[WorkerSpec]:
    common = dict(url=url, model=model, requests=tuple(requests), duration_s=duration_s,
                  request_timeout_s=request_timeout_s, api_key=api_key)
    if kind == CONCURRENCY:
        return [WorkerSpec(k, concurrency=c, offset=offset, count=count, **common)
                for k, c in enumerate(split(int(value), num_workers))]
    times = arrival_offsets(seed, value)
    if duration_s is not None:
        times = takewhile(lambda at: at < duration_s, times)
    n = len(requests)
    arrivals = [(at, (offset + k) % n) for k, at in enumerate(islice(times, count))]
    return [WorkerSpec(k, arrivals=tuple(arrivals[k::num_workers]), **common) for k in range(num_workers)]


@dataclass(slots=True)
class ClientLoad:
    """The client's own side of a level: how long it ran and how busy each process was."""

    duration_s: float = 0.0
    cpu_by_process: list[float] = field(default_factory=list)  # fraction of one core each
    lag_p99_s: float | None = None  # the latest-waking loop's p99


# ------------------------------------------------------------------ in a worker process

class _Relay:
    """A worker's tally: every start and end goes to the parent, in order, in batches."""

    def __init__(self, worker: int, events) -> None:
        self.worker, self.events = worker, events
        self.stop = asyncio.Event()
        self._seq: dict[int, int] = {}
        self._next = 0
        self._pending: list[tuple[str, int, RequestResult]] = []

    def started(self, result: RequestResult) -> None:
        self._seq[id(result)] = self._next
        self._pending.append((STARTED, self._next, result))
        self._next += 1

    def finished(self, result: RequestResult) -> None:
        self._pending.append((FINISHED, self._seq.pop(id(result)), result))

    def request_done(self, target, result: RequestResult) -> None:
        pass  # the parent's observer hears of it through `finished`

    def flush(self) -> None:
        if not self._pending:
            return
        # A start is sent with its sent_at, which client.send set before its first await.
        batch = [(kind, seq, (r.index, r.sent_at) if kind == STARTED else r)
                 for kind, seq, r in self._pending]
        self._pending = []
        self.events.put(("events", self.worker, batch))

    async def run(self, stop) -> None:
        while True:
            await asyncio.sleep(BATCH_S)
            self.flush()
            if stop.is_set():
                self.stop.set()


def _shared_source(spec: WorkerSpec, counter):
    n = len(spec.requests)
    while True:
        with counter.get_lock():
            k = counter.value
            counter.value = k + 1
        if spec.count is not None and k >= spec.count:
            return
        index = (spec.offset + k) % n
        yield index, spec.requests[index]


async def _work(spec: WorkerSpec, events, stop, counter, t0: float) -> ClientLoad:
    relay = _Relay(spec.worker, events)
    await asyncio.sleep(max(0.0, t0 - time.perf_counter()))
    cpu = CpuMeter()
    deadline = t0 + spec.duration_s if spec.duration_s else None
    # An open loop's share in requests/s, counted as streams (a request of about a second each).
    span = spec.arrivals[-1][0] if spec.arrivals else 1.0
    streams = spec.concurrency or len(spec.arrivals) / max(1.0, span)
    async with pooled_client(spec.url, spec.model, spec.request_timeout_s, spec.api_key, streams) as client, \
            LoopLagProbe() as lag:
        flusher = asyncio.create_task(relay.run(stop))
        try:
            if spec.concurrency:
                await closed_loop(client, relay, relay, None, _shared_source(spec, counter), spec.concurrency,
                                  deadline)
            else:
                arrivals = ((at, i, spec.requests[i]) for at, i in spec.arrivals)
                await open_loop(client, relay, relay, None, arrivals, t0, deadline)
        finally:
            flusher.cancel()
            await asyncio.gather(flusher, return_exceptions=True)
            relay.flush()
    return ClientLoad(time.perf_counter() - t0, [cpu.fraction()], percentile(lag.lags, 99))


def _child(spec: WorkerSpec, events, stop, go, counter, start_at) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the parent, which stops us
    events.put(("ready", spec.worker, None))
    load = None
    if go.wait(START_TIMEOUT_S) and not stop.is_set():
        load = asyncio.run(_work(spec, events, stop, counter, start_at.value))
    events.put(("done", spec.worker, load))


# ------------------------------------------------------------------ in the parent

class _Merge:
    """Workers' reports turned back into the level's records, one RequestResult per request turn."""

    def __init__(self, state, observer, target) -> None:
        self.state, self.observer, self.target = state, observer, target
        self.live: dict[tuple[int, int], RequestResult] = {}

    def take(self, worker: int, batch: list) -> None:
        for kind, seq, payload in batch:
            if kind == STARTED:
                index, sent_at = payload
                result = self.live[(worker, seq)] = RequestResult(index, sent_at=sent_at)
                self.state.started(result)
            else:
                self.finish(self.live.pop((worker, seq)), payload)

    def finish(self, result: RequestResult, final: RequestResult) -> None:
        for f in fields(RequestResult):
            setattr(result, f.name, getattr(final, f.name))
        self.state.finished(result)
        if result.status != CANCELLED:
            self.observer.request_done(self.target, result)

    def lost(self, worker: int, why: str) -> None:
        for key in [k for k in self.live if k[0] == worker]:
            result = self.live.pop(key)
            self.finish(result, RequestResult(result.index, FAILED, result.sent_at, error=why))


def _get_all(events, timeout: float) -> list:
    """What the workers have sent, waiting at most `timeout` for the first message (one thread hop)."""
    got: list = []
    try:
        got.append(events.get(timeout=timeout))
        while len(got) < 256:
            got.append(events.get_nowait())
    except queue.Empty:
        pass
    return got


async def run_in_workers(specs: list[WorkerSpec], state, observer, target) -> ClientLoad:
    """Send one level from `len(specs)` worker processes into `state` (which says when to stop)."""
    ctx = mp.get_context("spawn")  # never fork a process that holds an event loop and threads
    events, stop, go = ctx.Queue(), ctx.Event(), ctx.Event()
    counter, start_at = ctx.Value("q", 0), ctx.Value("d", 0.0)
    procs = {s.worker: ctx.Process(target=_child, args=(s, events, stop, go, counter, start_at), daemon=True,
                                   name=f"proxima-bench-worker-{s.worker}") for s in specs}
    for proc in procs.values():
        proc.start()
    merge, load = _Merge(state, observer, target), ClientLoad()
    ready: set[int] = set()
    done: dict[int, ClientLoad | None] = {}
    relay_stop = asyncio.create_task(_when_stopped(state, stop))
    t0 = time.perf_counter()
    try:
        while len(done) < len(procs):
            for message in await asyncio.to_thread(_get_all, events, 0.1):
                what, worker, payload = message
                if what == "events":
                    merge.take(worker, payload)
                elif what == "ready":
                    ready.add(worker)
                    if len(ready) == len(procs):
                        t0 = start_at.value = time.perf_counter() + LEAD_S
                        go.set()
                else:
                    done[worker] = payload
            if not go.is_set() and time.perf_counter() - t0 > START_TIMEOUT_S:
                state.abort(f"client workers did not start within {START_TIMEOUT_S:g}s")
                stop.set()
                go.set()
            for worker, proc in procs.items():
                if worker not in done and not proc.is_alive() and events.empty():
                    why = f"client worker {worker} exited (code {proc.exitcode})"
                    merge.lost(worker, why)
                    done[worker] = None
                    if not go.is_set():  # the others would wait for it until START_TIMEOUT_S
                        state.abort(f"{why} before the level started")
                        stop.set()
                        go.set()
        load.duration_s = max(0.0, time.perf_counter() - t0)
    finally:
        stop.set()
        go.set()
        relay_stop.cancel()
        for proc in procs.values():
            await asyncio.to_thread(proc.join, 5.0)
            if proc.is_alive():
                proc.kill()
    finished = [w for w in done.values() if w is not None]
    load.cpu_by_process = [c for w in finished for c in w.cpu_by_process]
    lags = [w.lag_p99_s for w in finished if w.lag_p99_s is not None]
    load.lag_p99_s = max(lags) if lags else None
    return load


async def _when_stopped(state, stop) -> None:
    await state.stop.wait()
    stop.set()
