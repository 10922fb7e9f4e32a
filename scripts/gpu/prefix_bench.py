"""On the GPU machine: the prefix-cache A/B as users would run it.

Stock vLLM with its defaults (FlashAttention 3, block 16, prefix caching on) and `proxima serve`
(token slots, token-exact prefix cache on) run side by side on one H200, each on the
8B-shaped dummy model at a 1 GiB KV budget; `proxima bench` then sweeps each workload
(`shared-prefix`, `multi-turn`) across both, level by level. Each bench writes its results,
workload and report under OUT/bench-WORKLOAD; the server logs go to OUT/logs.

usage: python3 scripts/gpu/prefix_bench.py MODEL_DIR OUT [--workloads shared-prefix,multi-turn]
       [-c 32,128] [-n 160] [--repeat 1] [--kv-cache-dtype auto] [--proxima-first | --solo]
(after `.gpu-bundle/device.sh install && source /tmp/gpu-env`; scripts/gpu/run.sh prefix runs it)
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

from proxima.server_process import ManagedServer, ServerSpec

KV_BYTES = 1 << 30


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("model")
    p.add_argument("out", type=Path)
    p.add_argument("--workloads", default="shared-prefix,multi-turn")
    p.add_argument("-c", "--concurrency", default="32,128")
    p.add_argument("-n", "--requests", default="160")
    p.add_argument("--repeat", default="1", help="runs of each level (bench's --repeat: 95%% intervals)")
    p.add_argument("--kv-cache-dtype", default="auto")
    p.add_argument("--proxima-first", action="store_true",
                   help="proxima as A: its levels run first (to tell ordering effects from engines)")
    p.add_argument("--solo", action="store_true",
                   help="one server at a time, each alone on the GPU (to tell sharing effects from engines)")
    args = p.parse_args()
    logs = args.out / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    # Two servers share the GPU: each may take 40% of it (the model is 16 GB, the KV 1 GiB).
    flags = ("--load-format", "dummy", "--dtype", "bfloat16", "--max-model-len", "2048",
             "--kv-cache-memory-bytes", str(KV_BYTES), "--max-num-seqs", "512",
             "--gpu-memory-utilization", "0.4", "--kv-cache-dtype", args.kv_cache_dtype)
    servers = [ManagedServer(ServerSpec(args.model, variant, args=flags,
                                        log_path=logs / f"{variant}.log"))
               for variant in ("stock", "token")]
    if args.solo:
        return _solo(servers, args)
    try:
        for server in servers:
            server.spawn()
        for server in servers:
            server.wait_ready(timeout=900)
        pair = [(servers[0].url, "stock"), (servers[1].url, "proxima")]
        if args.proxima_first:
            pair.reverse()
        (url_a, label_a), (url_b, label_b) = pair
        failed = 0
        for workload in args.workloads.split(","):
            cmd = ["proxima", "bench", "--a", url_a, "--b", url_b, "--label-a", label_a,
                   "--label-b", label_b, "--workload", workload, "-c", args.concurrency,
                   "-n", args.requests, "--repeat", args.repeat, "--slo-p95", "20",
                   "--out", str(args.out / f"bench-{workload}")]
            print("$", " ".join(cmd), flush=True)
            failed |= subprocess.run(cmd, check=False).returncode
        return failed
    finally:
        for server in servers:
            server.stop()


def _solo(servers: list[ManagedServer], args: argparse.Namespace) -> int:
    failed = 0
    for server, label in zip(servers, ("stock", "proxima"), strict=True):
        try:
            server.spawn()
            server.wait_ready(timeout=900)
            for workload in args.workloads.split(","):
                cmd = ["proxima", "bench", "--url", server.url, "--workload", workload,
                       "-c", args.concurrency, "-n", args.requests, "--repeat", args.repeat,
                       "--slo-p95", "20", "--out", str(args.out / f"bench-{workload}-{label}")]
                print("$", " ".join(cmd), flush=True)
                failed |= subprocess.run(cmd, check=False).returncode
        finally:
            server.stop()
    return failed


if __name__ == "__main__":
    sys.exit(main())
