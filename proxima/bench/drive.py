"""The load of one level on one event loop: closed-loop workers or open-loop arrivals.

Shared by the single-process level (`proxima.bench.sweep.run_level`) and each worker process
of a multi-worker level (`proxima.bench.workers`), so both send requests the same way. A
`Tally` is whatever counts requests as they start and finish and says when to stop: the level's
own state in one process, a relay to the parent in a worker. Every task started here is
cancelled and awaited before the call that started it returns.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import math
import random
import time
from collections.abc import AsyncIterator, Iterable, Iterator
from typing import Protocol

from proxima.bench.workload import BenchRequest, Workload
from proxima.load import new_http_client
from proxima.streaming import CANCELLED, OK, RequestResult, StreamingClient

# Streams in flight per httpx pool: one pool slows down as it grows. One event loop on 2 shared
# cores (scripts/bench_client.py --workers 1, with and without --streams-per-pool 256) sent 49 req/s
# at c=256 through one pool and 207 through eight of 32; at c=64, 72 through one and 179 through two.
STREAMS_PER_POOL = 32


class Tally(Protocol):
    stop: asyncio.Event

    def started(self, result: RequestResult) -> None: ...

    def finished(self, result: RequestResult) -> None: ...


class RequestSink(Protocol):
    def request_done(self, target, result: RequestResult) -> None: ...


class PooledClient:
    """Streaming clients over several httpx pools, taken in turn, so no pool holds many more than
    STREAMS_PER_POOL streams."""

    def __init__(self, clients: list[StreamingClient]) -> None:
        self._turn = itertools.cycle(clients)

    async def send(self, prompt: str, max_tokens: int, result: RequestResult) -> RequestResult:
        return await next(self._turn).send(prompt, max_tokens, result)


@contextlib.asynccontextmanager
async def pooled_client(url: str, model: str, request_timeout_s: float, api_key: str | None,
                        streams: float) -> AsyncIterator[PooledClient]:
    """A client for about `streams` requests in flight (each pool closed on exit)."""
    async with contextlib.AsyncExitStack() as stack:
        pools = [await stack.enter_async_context(new_http_client(request_timeout_s, api_key))
                 for _ in range(max(1, math.ceil(streams / STREAMS_PER_POOL)))]
        yield PooledClient([StreamingClient(http, url, model, request_timeout_s) for http in pools])


def request_source(workload: Workload, offset: int, count: int | None) -> Iterator[tuple[int, BenchRequest]]:
    """(index into the workload, request) for the level starting at `offset`, wrapping around."""
    n = len(workload.requests)
    indices = itertools.count(offset) if count is None else range(offset, offset + count)
    return ((i % n, workload.requests[i % n]) for i in indices)


def arrival_offsets(seed: int, rate: float) -> Iterator[float]:
    """Poisson arrival times in seconds after the level's start (the first at 0), from the seed:
    the same times whether one process sends them or several share them out."""
    rng = random.Random(f"{seed}:{rate}")
    at = 0.0
    while True:
        yield at
        at += rng.expovariate(rate)


async def send_turns(client: PooledClient, tally: Tally, sink: RequestSink, target, request: BenchRequest,
                     result: RequestResult) -> None:
    """Send one request, then, for a conversation, each next turn after the previous answer."""
    turn: BenchRequest | None = request
    while turn is not None:
        if turn.followups:
            result.text = []
        tally.started(result)
        try:
            await client.send(turn.prompt, turn.max_tokens, result)
        finally:
            tally.finished(result)
            if result.status != CANCELLED:
                sink.request_done(target, result)
        if result.status != OK or tally.stop.is_set():
            return
        turn = turn.next_turn("".join(result.text or ()))
        result = RequestResult(result.index)


async def closed_loop(client: PooledClient, tally: Tally, sink: RequestSink, target,
                      source: Iterable[tuple[int, BenchRequest]], concurrency: int,
                      deadline: float | None) -> None:
    """`concurrency` workers, each keeping one request in flight, all drawing from `source`."""
    source = iter(source)  # one shared iterator: each request goes to one worker

    async def worker() -> None:
        for index, request in source:
            if tally.stop.is_set() or (deadline and time.perf_counter() >= deadline):
                return
            await send_turns(client, tally, sink, target, request, RequestResult(index))

    await until_done_or_stopped([asyncio.create_task(worker()) for _ in range(concurrency)], tally)


async def open_loop(client: PooledClient, tally: Tally, sink: RequestSink, target,
                    arrivals: Iterable[tuple[float, int, BenchRequest]], t0: float,
                    deadline: float | None) -> None:
    """Each request sent at `t0` + its arrival offset, whether or not earlier ones have finished."""
    tasks: list[asyncio.Task] = []
    for at, index, request in arrivals:
        delay = t0 + at - time.perf_counter()
        if delay > 0:
            # asyncio.timeout, not asyncio.wait_for: on Python 3.11 wait_for drops a Ctrl-C
            # that lands as `stop` is set, and the run would go on to its next level.
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(delay):
                    await tally.stop.wait()
        if tally.stop.is_set() or (deadline and time.perf_counter() >= deadline):
            break
        tasks.append(asyncio.create_task(send_turns(client, tally, sink, target, request,
                                                    RequestResult(index))))
    await until_done_or_stopped(tasks, tally)


async def until_done_or_stopped(tasks: list[asyncio.Task], tally: Tally) -> None:
    if not tasks:
        return
    stopper = asyncio.create_task(tally.stop.wait())
    pending = set(tasks)
    while pending and not tally.stop.is_set():
        _, pending = await asyncio.wait(pending | {stopper}, return_when=asyncio.FIRST_COMPLETED)
        pending.discard(stopper)
    for task in pending:
        task.cancel()
    stopper.cancel()
    await asyncio.gather(*tasks, stopper, return_exceptions=True)
