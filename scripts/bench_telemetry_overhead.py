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
import random
import statistics
import tempfile
import time
from pathlib import Path

from proxima.harness import TINY_CPU_ARGS, EngineSpec, open_engine, run_isolated, vllm_flags


def child(model: str, telemetry: bool, requests: int, interval: str | None) -> dict:
    """One engine: warm up, then time one burst; the time telemetry took is what the scheduler
    itself reports per step (collecting and exporting after vLLM's schedule(), SchedulerStep)."""
    from vllm import SamplingParams, TokensPrompt

    env = {"PROXIMA_TELEMETRY": "on" if telemetry else "off"}
    if interval is not None:
        env["PROXIMA_TELEMETRY_INTERVAL_S"] = interval
    flags = vllm_flags(kv_cache_memory_bytes=16 << 20, max_num_seqs=256, enable_prefix_caching=False)
    with open_engine(EngineSpec(model, "token", TINY_CPU_ARGS + flags, env=env)) as engine:
        rng = random.Random(0)
        work = [([rng.randrange(3, 400) for _ in range(rng.randint(50, 200))], rng.randint(20, 100))
                for _ in range(requests)]
        prompts = [TokensPrompt(prompt_token_ids=p) for p, _ in work]
        params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for _, n in work]
        engine.llm.generate(prompts[:8], params[:8], use_tqdm=False)
        engine.recorder.reset()
        t = time.perf_counter()
        outs = engine.llm.generate(prompts, params, use_tqdm=False)
        wall = time.perf_counter() - t
        steps = engine.recorder.steps
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    return {"telemetry": telemetry, "tok_s": tokens / wall, "wall_s": wall,
            "telemetry_s": sum(s.telemetry_seconds for s in steps), "steps": len(steps)}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default=None)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--requests", type=int, default=256)
    p.add_argument("--interval", default=None, help="PROXIMA_TELEMETRY_INTERVAL_S (default: the engine's)")
    a = p.parse_args()
    model = a.model
    if model is None:
        from proxima.tiny_model import build_tiny_model

        model = str(build_tiny_model(Path(tempfile.mkdtemp()) / "tiny"))
    runs = {"on": [], "off": []}
    for _ in range(a.repeats):
        for mode in ("on", "off"):
            runs[mode].append(run_isolated(child, model, mode == "on", a.requests, a.interval))
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
