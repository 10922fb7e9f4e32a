"""How much load `proxima bench`'s client can send: req/s and streamed tokens/s it sustains with one
worker (its own event loop) and with its default worker count, against a server that costs
next to nothing (tests/fast_standin.py, in a process of its own).

Each concurrency level runs for --seconds through bench's own level runner (`run_sweep`), so the
figures are what a bench level can measure at most on this machine; the client's CPU per process
shows which side ran out. On a machine of few cores the stand-in takes a core of its own share.

  python scripts/bench_client.py --concurrency 64,256 --seconds 5 --max-tokens 64
  python scripts/bench_client.py --concurrency 64,256 --workers 1 --streams-per-pool 256  # one pool
"""

from __future__ import annotations

import argparse
import asyncio
import subprocess
import sys
import time
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parents[1]
sys.path.append(str(ROOT))  # tests.fast_standin; the installed proxima (with proxima.probes) wins

from proxima.bench import drive  # noqa: E402
from proxima.bench import workload as wl  # noqa: E402
from proxima.bench.results import CONCURRENCY  # noqa: E402
from proxima.bench.sweep import Observer, SweepParams, Target, run_sweep  # noqa: E402
from proxima.bench.workers import available_cores  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--concurrency", default="64,256")
    parser.add_argument("--seconds", type=float, default=5.0, help="per level")
    parser.add_argument("--max-tokens", type=int, default=64, help="tokens streamed per request")
    parser.add_argument("--itl-ms", type=float, default=0.0, help="the stand-in's spacing of tokens")
    parser.add_argument("--streams-per-pool", type=int, default=None,
                        help="streams per httpx pool in bench's own process (e.g. 256: one pool at c=256); "
                        "workers keep the default")
    parser.add_argument("--workers", default="1,auto",
                        help="worker counts to compare (auto: bench's default)")
    args = parser.parse_args()
    if args.streams_per_pool:
        drive.STREAMS_PER_POOL = args.streams_per_pool

    server = subprocess.Popen([sys.executable, "-m", "tests.fast_standin", "--itl-ms", str(args.itl_ms)],
                              cwd=ROOT, stdout=subprocess.PIPE, text=True)
    try:
        url = server.stdout.readline().strip()
        work = wl.generate(wl.WorkloadPlan("short-chat", 2000, 0, wl.Range(20, 20),
                                           wl.Range(args.max_tokens, args.max_tokens)),
                           wl.WordCosts.approximate())
        levels = [(CONCURRENCY, float(c)) for c in args.concurrency.split(",")]
        print(f"{available_cores()} cores; stand-in at {url}, {args.max_tokens} tokens a request, "
              f"{args.seconds:g} s a level")
        print(f"{'workers':>8} {'level':>7} {'req/s':>8} {'tok/s':>9} {'sent':>6} {'failed':>6}  client CPU "
              "by process (bench first); the stand-in's CPU")
        best: dict[str, tuple[float, float]] = {}
        for workers in args.workers.split(","):
            params = SweepParams(requests_per_level=None, duration_s=args.seconds, slo_p95_s=60.0,
                                 request_timeout_s=60.0, sample_interval_s=0,
                                 client_workers=None if workers == "auto" else int(workers))
            target = Target("standin", url, "standin", local=True)
            for level in levels:
                served = psutil.Process(server.pid)
                busy0, t0 = sum(served.cpu_times()[:2]), time.perf_counter()
                (lv,), _ = asyncio.run(run_sweep(target, work, [level], params, Observer()))
                server_cpu = (sum(served.cpu_times()[:2]) - busy0) / (time.perf_counter() - t0)
                cpu = " ".join(f"{c:.0%}" for c in lv.client_cpu_by_process)
                lag = 1e3 * (lv.client_loop_lag_p99_s or 0)
                print(f"{workers:>8} {lv.label:>7} {lv.rps:8.1f} {lv.output_tps:9.0f} {lv.num_sent:6d} "
                      f"{lv.failed + lv.timed_out:6d}  {lv.client_workers} worker(s): {cpu}, lag p99 "
                      f"{lag:.0f} ms; stand-in {server_cpu:.0%}")
                if lv.rps > best.get(workers, (0.0, 0.0))[0]:
                    best[workers] = (lv.rps, lv.output_tps)
        for workers, (rps, tps) in best.items():
            print(f"max sustained, workers={workers}: {rps:.1f} req/s, {tps:.0f} streamed tok/s")
    finally:
        server.terminate()
        server.wait(10)


if __name__ == "__main__":
    main()
