"""Cost of Proxima's KV telemetry: engine throughput with it on and off, and the time the
scheduler spends collecting and exporting it, as a share of the engine's wall time.

Each run is a fresh process (token allocator, tiny model, CPU) serving the same burst; runs
alternate on/off so that drift in the machine's load hits both. The direct share is the robust
figure on a shared machine; the throughput A/B is reported beside it with its spread.

While busy the engine publishes at most once per PROXIMA_TELEMETRY_INTERVAL_S (default 0.05 s);
``--interval 0`` measures the cost of publishing on every step.

usage: python scripts/bench_telemetry_overhead.py [--model DIR] [--repeats 3] [--requests 256]
                                                  [--interval SECONDS]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from proxima.files import write_atomic


def child(model: str, telemetry: bool, requests: int, interval: str | None) -> dict:
    os.environ.update(VLLM_ENABLE_V1_MULTIPROCESSING="0", PROXIMA_ALLOCATOR="token",
                      PROXIMA_TELEMETRY="on" if telemetry else "off")
    if interval is not None:
        os.environ["PROXIMA_TELEMETRY_INTERVAL_S"] = interval
    from vllm import LLM, SamplingParams, TokensPrompt

    llm = LLM(model, dtype="float32", max_model_len=1024, enforce_eager=True, block_size=1,
              kv_cache_memory_bytes=16 << 20, max_num_seqs=256, enable_prefix_caching=False,
              scheduler_cls="proxima.engine.scheduler.ProximaScheduler")
    scheduler = llm.llm_engine.engine_core.engine_core.scheduler
    spent, steps = [0.0], [0]
    schedule = scheduler.schedule

    def counted_schedule(*a, **k):
        steps[0] += 1
        return schedule(*a, **k)

    scheduler.schedule = counted_schedule

    def timed(fn):
        def wrapper(*a, **k):
            t = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                spent[0] += time.perf_counter() - t
        return wrapper

    if telemetry:  # everything telemetry adds to a step: stats, export, latency observations
        scheduler._collect_stats = timed(scheduler._collect_stats)
        for sink in scheduler.kv_sinks:
            sink.publish = timed(sink.publish)
            sink.observe_latencies = timed(sink.observe_latencies)
    rng = random.Random(0)
    work = [([rng.randrange(3, 400) for _ in range(rng.randint(50, 200))], rng.randint(20, 100))
            for _ in range(requests)]
    prompts = [TokensPrompt(prompt_token_ids=p) for p, _ in work]
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for _, n in work]
    llm.generate(prompts[:8], params[:8], use_tqdm=False)
    spent[0], steps[0] = 0.0, 0
    t = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    wall = time.perf_counter() - t
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    return {"telemetry": telemetry, "tok_s": tokens / wall, "wall_s": wall, "telemetry_s": spent[0],
            "steps": steps[0]}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default=None)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--requests", type=int, default=256)
    p.add_argument("--interval", default=None, help="PROXIMA_TELEMETRY_INTERVAL_S (default: the engine's)")
    p.add_argument("--child", nargs=2, help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.child:
        write_atomic(a.child[1], json.dumps(child(a.model, a.child[0] == "on", a.requests, a.interval)))
        return
    model = a.model
    if model is None:
        from proxima.tiny_model import build_tiny_model

        model = str(build_tiny_model(Path(tempfile.mkdtemp()) / "tiny"))
    runs = {"on": [], "off": []}
    for _ in range(a.repeats):
        for mode in ("on", "off"):
            with tempfile.NamedTemporaryFile(suffix=".json") as f:
                env = {k: v for k, v in os.environ.items() if not k.startswith("PROXIMA_")}
                interval = ["--interval", a.interval] if a.interval is not None else []
                subprocess.run([sys.executable, __file__, "--model", model, "--requests", str(a.requests),
                                *interval, "--child", mode, f.name], check=True, env=env,
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
                runs[mode].append(json.loads(Path(f.name).read_text()))
    on = [r["tok_s"] for r in runs["on"]]
    off = [r["tok_s"] for r in runs["off"]]
    share = [r["telemetry_s"] / r["wall_s"] for r in runs["on"]]
    per_step = [1e6 * r["telemetry_s"] / max(r["steps"], 1) for r in runs["on"]]
    step_ms = [1e3 * r["wall_s"] / max(r["steps"], 1) for r in runs["on"]]
    print(f"throughput on : median {statistics.median(on):.1f} tok/s  runs {[round(x, 1) for x in on]}")
    print(f"throughput off: median {statistics.median(off):.1f} tok/s  runs {[round(x, 1) for x in off]}")
    change = statistics.median(on) / statistics.median(off) - 1
    print(f"throughput change with telemetry: {100 * change:+.2f}%")
    print(f"time in telemetry / engine wall time: median {100 * statistics.median(share):.3f}% "
          f"(runs {[round(100 * s, 3) for s in share]})")
    print(f"telemetry per scheduler step: median {statistics.median(per_step):.0f} us; "
          f"engine step: median {statistics.median(step_ms):.2f} ms")


if __name__ == "__main__":
    main()
