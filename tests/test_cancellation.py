"""Ctrl-C must stop the tools whatever the timing: a cancel that lands as an inner await completes
is never lost (no server: answers come from httpx's MockTransport, the cancel is timed exactly).

Each test schedules the cancel (what the SIGINT handler does: `task.cancel()` from inside
whatever callback is running) in the very step that finishes a scrape or a probe, so that it
lands before the awaiting code resumes: the moment where Python 3.11's `asyncio.wait_for` returns
the inner result and drops the cancel.
"""

from __future__ import annotations

import asyncio
import sys
import types

import httpx

from proxima.fetch import get_text
from proxima.probes import runner
from proxima.probes.base import ProbeResult, Status
from proxima.sampling import Sampler

METRICS = b"vllm:num_requests_running 0\nvllm:num_requests_waiting 0\n"
URL = "http://127.0.0.1:9"  # never connected to: every request goes to the mock transport


async def _ends(task: asyncio.Future, timeout_s: float = 3.0) -> bool:
    """True if `task` ended within `timeout_s`; one that did not is cancelled (and left)."""
    done, _ = await asyncio.wait({task}, timeout=timeout_s)
    if not done:
        task.cancel()
    return bool(done)


def _client(on_request) -> httpx.AsyncClient:
    async def handler(request: httpx.Request) -> httpx.Response:
        on_request()
        return httpx.Response(200, content=METRICS)

    return httpx.AsyncClient(transport=httpx.MockTransport(handler))


def test_a_cancel_landing_as_a_read_completes_reaches_the_caller():
    async def main() -> asyncio.Task:
        loop = asyncio.get_running_loop()
        caller: asyncio.Task | None = None
        async with _client(lambda: loop.call_soon(caller.cancel)) as client:
            async def read_then_work() -> None:
                await get_text(client, URL + "/metrics", 5.0)
                await asyncio.sleep(30)  # the caller's next step; the cancel must land by here

            caller = asyncio.ensure_future(read_then_work())
            assert await _ends(caller), "the cancel was lost: the caller went on after the read"
        return caller

    assert asyncio.run(main()).cancelled()


def test_a_sampler_cancelled_as_its_scrape_completes_stops_sampling():
    """The doctor's hang: the phase is cancelled (Ctrl-C) while the sampler's scrape answers;
    the sampler's loop must stop rather than go on reading (and the phase wait on it forever)."""
    async def main() -> tuple[asyncio.Task, int, int]:
        loop = asyncio.get_running_loop()
        phase: asyncio.Task | None = None
        scrapes = 0

        def on_request() -> None:
            nonlocal scrapes
            scrapes += 1
            if scrapes == 2:
                loop.call_soon(phase.cancel)

        async with _client(on_request) as client:
            sampler = Sampler(URL, 0.05, client=client, here=False)

            async def run_phase() -> None:
                async with sampler.running():
                    await asyncio.sleep(30)

            phase = asyncio.ensure_future(run_phase())
            ended = await _ends(phase)
            seen = scrapes
            await asyncio.sleep(0.3)  # six intervals: a loop still running would scrape again
            assert ended, f"the phase never ended: the sampler went on ({scrapes} scrapes)"
        return phase, seen, scrapes

    phase, at_end, later = asyncio.run(main())
    assert phase.cancelled()
    assert at_end == later == 2


def test_a_cancel_landing_as_a_phase_ends_is_not_lost():
    """The block exits and the cancel lands as the sampler is told to stop: the phase must end
    cancelled, not carry on as if no Ctrl-C had come."""
    async def main() -> asyncio.Task:
        loop = asyncio.get_running_loop()
        phase: asyncio.Task | None = None
        async with _client(lambda: None) as client:
            sampler = Sampler(URL, 10.0, client=client, here=False)

            async def run_phase() -> None:
                async with sampler.running():
                    await asyncio.sleep(0.1)  # the first reading is in; the loop waits its interval
                    loop.call_soon(phase.cancel)
                await asyncio.sleep(30)  # the phase's next step; the cancel must land by here

            phase = asyncio.ensure_future(run_phase())
            assert await _ends(phase), "the cancel was lost: the phase went on after sampling"
        return phase

    assert asyncio.run(main()).cancelled()


def test_a_cancel_landing_as_a_probe_finishes_stops_the_doctor(monkeypatch):
    """Ctrl-C as a probe returns: the doctor must stop, not go on to its next check."""
    probe = types.ModuleType("proxima.probes.finishing_probe")
    monkeypatch.setitem(sys.modules, probe.__name__, probe)

    async def main() -> tuple[asyncio.Task, list[str]]:
        loop = asyncio.get_running_loop()
        ran: list[str] = []

        async def run(ctx) -> ProbeResult:
            loop.call_soon(doctor.cancel)  # Ctrl-C in the step that finishes this probe
            return ProbeResult("finishing_probe", Status.OK, "done")

        probe.run = run
        ctx = types.SimpleNamespace(window_s=1.0)

        async def run_checks() -> None:
            for name in ("first", "second"):
                await runner.run_probe("finishing_probe", ctx)
                ran.append(name)
                await asyncio.sleep(0)  # between checks, as the doctor moves on to the next

        doctor = asyncio.ensure_future(run_checks())
        assert await _ends(doctor)
        return doctor, ran

    doctor, ran = asyncio.run(main())
    assert doctor.cancelled() and ran == ["first"], f"the cancel was lost: the doctor ran {ran}"


def test_a_phase_shorter_than_one_scrape_keeps_its_reading():
    """The bench's flake: a level that ends while its first scrape is still answering (a busy
    2-core host) must keep that reading, not cancel it and report an empty timeline."""
    async def main() -> list:
        async def slow(request: httpx.Request) -> httpx.Response:
            await asyncio.sleep(0.3)
            return httpx.Response(200, content=METRICS)

        async with httpx.AsyncClient(transport=httpx.MockTransport(slow)) as client:
            sampler = Sampler(URL, 0.05, client=client, here=False)
            async with sampler.running(final=False):
                await asyncio.sleep(0.01)
            return sampler.samples

    samples = asyncio.run(main())
    assert len(samples) == 1 and samples[0].snapshot.ok
