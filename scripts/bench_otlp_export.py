"""Engine-thread cost of the OTLP exporter's latency export, per scheduler step.

One decode step of R running requests hands the sinks R allocate timings and one step timing
(and frees as requests finish); this times `OtelKVExporter.observe_latencies` for such a step,
median of --repeats runs of --steps steps, with the export thread idle (an hour's interval,
a loopback sink that accepts the last export). `--otel-from FILE` also times another copy of
proxima/metrics/otel.py, for a before-and-after on one machine, e.g.
  git show 3fc1ea7:proxima/metrics/otel.py > /tmp/otel_before.py

usage: python scripts/bench_otlp_export.py [--requests N] [--steps N] [--repeats N]
                                           [--otel-from FILE]
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import numpy as np

from proxima.metrics.otel import OtelKVExporter


class _Sink(BaseHTTPRequestHandler):
    """Accepts every OTLP export (the shutdown's last one), on loopback."""

    def do_POST(self) -> None:  # noqa: N802 (http.server's naming)
        self.rfile.read(int(self.headers.get("content-length", 0)))
        self.send_response(200)
        self.send_header("content-length", "0")
        self.end_headers()

    def log_message(self, *args) -> None:
        pass


def per_step_us(exporter, values: list[float], steps: int, repeats: int) -> float:
    runs = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(steps):
            exporter.observe_latencies("allocate", values)
            exporter.observe_latencies("step", values[:1])
        runs.append((time.perf_counter() - start) / steps * 1e6)
    return statistics.median(runs)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--requests", type=int, default=64, help="running requests per decode step")
    p.add_argument("--steps", type=int, default=2000)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--otel-from", help="another copy of proxima/metrics/otel.py to time beside this one")
    args = p.parse_args()
    values = list(np.random.default_rng(0).uniform(1e-6, 2e-5, args.requests))
    exporters = {"this checkout": OtelKVExporter}
    if args.otel_from:
        spec = importlib.util.spec_from_file_location("otel_before", args.otel_from)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        exporters["--otel-from"] = module.OtelKVExporter
    print(f"OTLP latency export per step ({args.requests} requests per step), "
          f"median of {args.repeats} x {args.steps} steps:")
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Sink)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    endpoint = f"http://127.0.0.1:{server.server_address[1]}"
    for name, cls in exporters.items():
        exporter = cls(endpoint, export_interval_ms=3_600_000)
        us = per_step_us(exporter, values, args.steps, args.repeats)
        print(f"  {name:<16} {us:8.1f} us/step  ({us / (args.requests + 1):6.2f} us per value)")
        exporter.shutdown()
    server.shutdown()


if __name__ == "__main__":
    main()
