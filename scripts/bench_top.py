"""Refresh cost of `proxima top`: CPU time of the monitoring process against a real, busy server.

Runs the real Textual app headless (collector + rendering, 120x40) for --seconds at --interval,
while a child process drives completions at the server (its CPU is not counted: `process_time`
is this process's own). Prints the CPU share of one core, for the full app and for collection
alone. With --record FILE it also saves the session as a `proxima top` recording (that is how
tests/data/top/session.jsonl was made).

  python scripts/bench_top.py --url http://127.0.0.1:8000 --seconds 30
  python scripts/bench_top.py --url http://127.0.0.1:8000 --seconds 30 --record /tmp/session.jsonl

Traffic ramps in three phases (light, medium, saturating: more requests than KV slots, so the
recording shows a waiting queue and preemptions). Requests use ignore_eos so lengths are as asked.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import subprocess
import sys
import time

WORDS = ("hello", "world", "cache", "token", "slot", "proxima", "memory", "block", "request", "serve")
# (share of the run, concurrency, prompt words, max new tokens): prompt words ≈ 3.7 tokens each here.
WARMUP_S = 3.0
PHASES = ((0.3, 6, (10, 60), (16, 128)), (0.35, 40, (40, 120), (64, 400)), (0.35, 96, (80, 120), (300, 550)))


async def drive(url: str, seconds: float, model: str | None) -> dict[str, int]:
    import httpx

    counts = {"ok": 0, "failed": 0}
    async with httpx.AsyncClient(timeout=600) as client:
        if model is None:
            model = (await client.get(url + "/v1/models")).json()["data"][0]["id"]
        start = time.monotonic()
        end = start + seconds

        async def worker(phase_end: float, words: tuple[int, int], new: tuple[int, int]) -> None:
            while time.monotonic() < min(phase_end, end):
                prompt = " ".join(random.choice(WORDS) for _ in range(random.randint(*words)))
                body = {"model": model, "prompt": prompt, "max_tokens": random.randint(*new),
                        "ignore_eos": True}
                try:
                    response = await client.post(url + "/v1/completions", json=body)
                    counts["ok" if response.status_code == 200 else "failed"] += 1
                except httpx.HTTPError:
                    counts["failed"] += 1

        t = start
        tasks: list[asyncio.Task] = []
        for share, concurrency, words, new in PHASES:
            phase_end = t + share * seconds
            tasks += [asyncio.create_task(worker(phase_end, words, new)) for _ in range(concurrency)]
            await asyncio.sleep(max(0.0, phase_end - time.monotonic()))
            t = phase_end
        await asyncio.wait(tasks, timeout=5)
        for task in tasks:
            task.cancel()
    return counts


def run_app(urls: list[str], seconds: float, interval: float, record: str | None) -> dict[str, float]:
    from proxima.tui.app import TopApp
    from proxima.tui.collector import Collector
    from proxima.tui.record import Recorder

    collector = Collector(urls)
    recorder = Recorder(record, tuple(urls), interval, time.time()) if record else None
    app = TopApp.live(collector, interval=interval, recorder=recorder)
    marks: dict[str, float] = {}

    async def main() -> None:
        running = asyncio.create_task(app.run_async(headless=True, size=(120, 40)))
        await asyncio.sleep(WARMUP_S)  # start-up (CSS, first layout) is paid once; measure the refresh
        marks.update(cpu=time.process_time(), wall=time.perf_counter(), frames=app.state.frames_seen)
        await asyncio.sleep(seconds)
        marks.update(cpu1=time.process_time(), wall1=time.perf_counter(), frames1=app.state.frames_seen)
        app.exit()
        await running

    cpu0 = time.process_time()
    asyncio.run(main())
    return {"cpu_s": marks["cpu1"] - marks["cpu"], "wall_s": marks["wall1"] - marks["wall"],
            "frames": marks["frames1"] - marks["frames"], "skipped": app.ticks_skipped,
            "startup_cpu_s": marks["cpu"] - cpu0}


def run_collector(urls: list[str], seconds: float, interval: float) -> dict[str, float]:
    from proxima.tui.collector import Collector, scrape_timeout
    from proxima.tui.state import DashboardState

    async def main() -> int:
        collector, state = Collector(urls), DashboardState.empty(urls)
        await asyncio.sleep(WARMUP_S)  # the same traffic phases as the app run
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            tick = time.monotonic()
            state = state.advance(await collector.collect(scrape_timeout(interval)))
            await asyncio.sleep(max(0.0, interval - (time.monotonic() - tick)))
        await collector.aclose()
        return state.frames_seen

    cpu0, wall0 = time.process_time(), time.perf_counter()
    frames = asyncio.run(main())
    return {"cpu_s": time.process_time() - cpu0, "wall_s": time.perf_counter() - wall0 - WARMUP_S,
            "frames": frames}


def _answers(url: str) -> bool:
    import httpx

    try:
        return httpx.get(url + "/health", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--url", action="append", required=True, help="server to watch (repeatable)")
    parser.add_argument("--seconds", type=float, default=30.0)
    parser.add_argument("--interval", type=float, default=0.5)
    parser.add_argument("--record", help="also save the session as a proxima top recording")
    parser.add_argument("--no-load", action="store_true", help="watch only; drive no traffic")
    parser.add_argument("--app-only", action="store_true", help="skip the collector-only measurement")
    parser.add_argument("--drive", action="store_true", help=argparse.SUPPRESS)  # the child process
    args = parser.parse_args()
    if args.drive:
        async def drive_all() -> list[dict[str, int]]:
            return await asyncio.gather(*(drive(u, args.seconds, None) for u in args.url))

        print(json.dumps(asyncio.run(drive_all())))
        return

    def start_load() -> subprocess.Popen | None:
        up = [u for u in args.url if _answers(u)]
        if args.no_load or not up:
            return None
        command = [sys.executable, __file__, "--drive", *(f"--url={u}" for u in up),
                   "--seconds", str(args.seconds + WARMUP_S)]
        return subprocess.Popen(command, stdout=subprocess.PIPE, text=True)

    runs = [("app", lambda: run_app(args.url, args.seconds, args.interval, args.record))]
    if not args.app_only:
        runs.append(("collector", lambda: run_collector(args.url, args.seconds, args.interval)))
    results = {}
    for name, fn in runs:
        load = start_load()
        results[name] = fn()
        if load is not None:
            results[name]["load"] = json.loads(load.communicate(timeout=120)[0] or "null")
    for name, r in results.items():
        share = 100 * r["cpu_s"] / r["wall_s"]
        line = (f"{name:<9} {r['cpu_s']:.2f} s CPU over {r['wall_s']:.1f} s wall = {share:.2f}% of one core; "
                f"{r['frames']} frames at {args.interval:g} s")
        if "skipped" in r:
            line += f", {r['skipped']} ticks skipped (scrape still in flight)"
        if "startup_cpu_s" in r:
            line += f"; start-up {r['startup_cpu_s']:.2f} s CPU, not counted"
        if "load" in r:
            line += f"; load {r['load']}"
        print(line)


if __name__ == "__main__":
    main()
