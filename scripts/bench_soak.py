"""Soak: mixed traffic against `proxima serve` for a long time; do slots, memory and requests hold?

Starts `proxima serve` on loopback (tiny model, CPU) through `proxima.server_process`, then
alternates bursts of mixed traffic with quiet periods until --duration has passed:
  stream      streamed completion read to [DONE]; its token count checked
  complete    plain completion; its token count checked
  disconnect  streamed completion the client drops after three chunks
  abort       plain completion the client gives up on after --abort-after-s
  bad         a request the server must refuse with 4xx (max_tokens -1, unknown model,
              a prompt over --max-model-len, a body that is not JSON)
After each burst it waits for the server to go idle and records whether Proxima's slots in use
came back to zero, and how fast. Every second it samples the server's RSS (the whole process
tree: launcher, API server, engine), slots in use, running/waiting requests and the telemetry
error counter. At the end: every request's outcome against its kind (a 5xx, a connection error,
a stream without [DONE] or a wrong token count is a lost request), the server's own count of
finished requests against the client's, and the RSS trend over the quiet points after each burst
(least-squares slope with a 95% confidence interval, after a warm-up share of the run).

usage: python scripts/bench_soak.py MODEL_DIR [--duration 600] [--burst-s 15] [--concurrency 8]
                                    [--seed 0] [--variant token|block] [--json OUT.json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import sys
import time
from collections import Counter
from pathlib import Path

import httpx
import psutil

from proxima.exposition import Samples
from proxima.metrics.catalog import Vllm
from proxima.probes.trend import linear_trend
from proxima.scrape import scrape
from proxima.server_process import ManagedServer, ServerSpec

SERVER_ARGS = ("--dtype", "float32", "--max-model-len", "1024", "--kv-cache-memory-bytes", str(64 << 20),
               "--enforce-eager", "--max-num-seqs", "32")
KINDS = {"stream": 0.40, "complete": 0.15, "disconnect": 0.20, "abort": 0.10, "bad": 0.15}
WORDS = "the quick brown fox jumps over a lazy dog while memory slots fill and empty again".split()


def tree_rss(pid: int) -> dict[str, int]:
    """RSS of each process of the server's tree, by role (launcher, API server, engine, ...)."""
    root = psutil.Process(pid)
    out: dict[str, int] = {}
    for proc in [root, *root.children(recursive=True)]:
        try:
            cmd = " ".join(proc.cmdline())
            role = ("launcher" if "proxima.cli.main" in cmd else
                    "api_server" if "api_server" in cmd else proc.name())
            out[role] = out.get(role, 0) + proc.memory_info().rss
        except psutil.Error:
            pass
    return out


def prompt(rng: random.Random, words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(words))


async def one(http: httpx.AsyncClient, url: str, model: str, kind: str, rng: random.Random,
              abort_after_s: float) -> str:
    """Send one request of `kind`; return its outcome ("ok" or what went wrong)."""
    body = {"model": model, "prompt": prompt(rng, rng.randint(3, 120)), "temperature": 0}
    try:
        if kind in ("stream", "disconnect"):
            n = rng.randint(8, 64) if kind == "stream" else 200
            body |= {"max_tokens": n, "ignore_eos": True, "stream": True,
                     "stream_options": {"include_usage": True}}
            chunks, done, tokens = 0, False, None
            async with http.stream("POST", f"{url}/v1/completions", json=body, timeout=120) as r:
                if r.status_code != 200:
                    return f"{kind}: HTTP {r.status_code}"
                async for line in r.aiter_lines():
                    if line == "data: [DONE]":
                        done = True
                    elif line.startswith("data: "):
                        chunks += 1
                        if kind == "disconnect" and chunks == 3:
                            return "ok"  # leaving the block closes the connection mid-stream
                        usage = json.loads(line[6:]).get("usage")
                        tokens = usage.get("completion_tokens") if usage else tokens
            if kind == "disconnect":
                return "disconnect: the stream ended before the client dropped it"
            # A chunk may carry several tokens: the final usage chunk is the count.
            return "ok" if done and tokens == n else f"stream: {tokens}/{n} tokens, done={done}"
        if kind == "complete":
            n = rng.randint(4, 48)
            r = await http.post(f"{url}/v1/completions", json=body | {"max_tokens": n, "ignore_eos": True},
                                timeout=120)
            got = r.json().get("usage", {}).get("completion_tokens") if r.status_code == 200 else None
            return "ok" if got == n else f"complete: HTTP {r.status_code}, {got}/{n} tokens"
        if kind == "abort":
            try:
                await http.post(f"{url}/v1/completions", json=body | {"max_tokens": 800, "ignore_eos": True},
                                timeout=abort_after_s)
            except httpx.TimeoutException:
                return "ok"
            return "finished"  # done before the client gave up: served, not lost
        bad = rng.choice(["negative", "model", "long", "json"])
        if bad == "json":
            r = await http.post(f"{url}/v1/completions", content=b"{not json",
                                headers={"content-type": "application/json"}, timeout=60)
        else:
            req = dict(body, max_tokens=8)
            if bad == "negative":
                req["max_tokens"] = -1
            elif bad == "model":
                req["model"] = "no-such-model"
            else:
                req["prompt"] = prompt(rng, 3000)
            r = await http.post(f"{url}/v1/completions", json=req, timeout=60)
        return "ok" if 400 <= r.status_code < 500 else f"bad/{bad}: HTTP {r.status_code}"
    except httpx.HTTPError as err:
        return f"{kind}: {type(err).__name__}"


async def burst(http, url, model, rng, seconds: float, concurrency: int, abort_after_s: float,
                outcomes: Counter, sent: Counter) -> None:
    deadline = time.monotonic() + seconds
    kinds, weights = list(KINDS), list(KINDS.values())

    async def worker(k: int) -> None:
        wrng = random.Random(rng.random() + k)
        while time.monotonic() < deadline:
            kind = wrng.choices(kinds, weights)[0]
            sent[kind] += 1
            outcome = await one(http, url, model, kind, wrng, abort_after_s)
            outcomes[(kind, outcome)] += 1

    await asyncio.gather(*(worker(k) for k in range(concurrency)))


async def wait_idle(http, url: str, timeout: float = 60.0) -> tuple[bool, float, float]:
    """(slots back to zero, seconds it took, slots in use at the end)."""
    start = time.monotonic()
    used = math.nan
    while time.monotonic() - start < timeout:
        snap = await scrape(http, url)
        if snap.ok and snap.proxima is not None:
            used = snap.proxima.slots_used
            if used == 0 and snap.running == 0 and snap.waiting == 0:
                return True, time.monotonic() - start, 0.0
        await asyncio.sleep(0.2)
    return False, timeout, used


def slope_ci(ts: list[float], ys: list[float]) -> tuple[float, float]:
    """Least-squares slope and its 95% half-width (units of y per unit of t), by probes/trend.py
    (the one Student-t table)."""
    trend = linear_trend(ts, ys)
    if trend is None:
        return math.nan, math.nan
    return trend.slope, (trend.ci95_high - trend.ci95_low) / 2


async def soak(url: str, pid: int, model: str, args) -> dict:
    rng = random.Random(args.seed)
    outcomes: Counter = Counter()
    sent: Counter = Counter()
    samples: list[dict] = []
    quiet: list[dict] = []
    stop = False
    # Idle connections expire before uvicorn's 5 s keep-alive does: at equal timeouts a request
    # sent on a connection the server is closing fails with ReadError (the client's race, not a loss).
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=64, keepalive_expiry=2.0)
    async with httpx.AsyncClient(limits=limits) as http:
        first = (await http.get(f"{url}/metrics")).text
        start = time.monotonic()

        async def sampler() -> None:
            while not stop:
                snap = await scrape(http, url)
                kv = snap.proxima
                rss = tree_rss(pid)
                samples.append({"t": time.monotonic() - start, "rss": sum(rss.values()), "ok": snap.ok,
                                "slots_used": kv.slots_used if kv else None, "running": snap.running,
                                "waiting": snap.waiting,
                                "telemetry_errors": kv.telemetry_errors_total if kv else None})
                await asyncio.sleep(1.0)

        task = asyncio.create_task(sampler())
        while time.monotonic() - start < args.duration:
            await burst(http, url, model, rng, args.burst_s, args.concurrency, args.abort_after_s,
                        outcomes, sent)
            zero, took, left = await wait_idle(http, url)
            await asyncio.sleep(1.0)  # let the engine's idle publish and the allocator settle
            rss = tree_rss(pid)
            quiet.append({"t": time.monotonic() - start, "rss": sum(rss.values()), "rss_by_process": rss,
                          "slots_zero": zero, "seconds_to_zero": took, "slots_left": left})
            print(f"[{quiet[-1]['t']:6.0f} s] burst {len(quiet)}: slots zero={zero} in {took:.1f} s, "
                  f"RSS {quiet[-1]['rss'] / 2**20:.0f} MiB", file=sys.stderr)
        stop = True
        await task
        last = (await http.get(f"{url}/metrics")).text
    return summarize(first, last, outcomes, sent, samples, quiet, args)


REASONS = ("length", "stop", "abort", "error")


def finished(text: str, reason: str) -> float:
    """vllm:request_success_total of one finished_reason (read through Proxima's exposition layer)."""
    return Samples(text).total(Vllm.REQUEST_SUCCESS, finished_reason=reason) or 0.0


def summarize(first, last, outcomes: Counter, sent: Counter, samples, quiet, args) -> dict:
    lost = {f"{k}: {o}": n for (k, o), n in outcomes.items() if o not in ("ok", "finished")}
    completed = sum(n for (k, o), n in outcomes.items() if (k in ("stream", "complete") and o == "ok")
                    or o == "finished")
    dropped = sum(n for (k, o), n in outcomes.items() if k in ("disconnect", "abort") and o == "ok")
    warm = args.warmup_share * quiet[-1]["t"]
    fit = [q for q in quiet if q["t"] >= warm]
    slope, half = slope_ci([q["t"] / 3600 for q in fit], [q["rss"] / 2**20 for q in fit]) \
        if len(fit) >= 3 else (math.nan, math.nan)
    served = {r: finished(last, r) - finished(first, r) for r in REASONS}
    by_process = {}
    if len(fit) >= 3:
        for role in fit[-1]["rss_by_process"]:
            pts = [(q["t"] / 3600, q["rss_by_process"].get(role, 0) / 2**20) for q in fit]
            by_process[role] = slope_ci([t for t, _ in pts], [y for _, y in pts])
    errors = [s["telemetry_errors"] for s in samples if s["telemetry_errors"] is not None]
    return {
        "duration_s": quiet[-1]["t"], "bursts": len(quiet), "concurrency": args.concurrency,
        "sent": dict(sent), "requests_sent": sum(sent.values()), "lost": lost,
        "client_completed": completed, "client_dropped": dropped,
        "server_finished": served,
        # vLLM 0.26 does not count client aborts as finished; a dropped request the engine had
        # already generated in full counts as "length". So: completed <= length <= completed + dropped.
        "server_count_consistent": completed <= served["length"] + served["stop"] <= completed + dropped,
        "slots_zero_after_every_burst": all(q["slots_zero"] for q in quiet),
        "seconds_to_zero_max": max(q["seconds_to_zero"] for q in quiet),
        "slots_in_use_max": max((s["slots_used"] or 0) for s in samples),
        "scrape_failures": sum(not s["ok"] for s in samples),
        "telemetry_errors": (errors[-1] - errors[0]) if errors else None,
        "rss_mib_first_quiet": quiet[0]["rss"] / 2**20, "rss_mib_last_quiet": quiet[-1]["rss"] / 2**20,
        "rss_mib_min": min(s["rss"] for s in samples) / 2**20,
        "rss_mib_max": max(s["rss"] for s in samples) / 2**20,
        "rss_slope_mib_per_h": slope, "rss_slope_ci95_mib_per_h": half,
        "rss_fit_points": len(fit), "rss_fit_from_s": warm,
        "rss_slope_by_process_mib_per_h": by_process,
        "rss_mib_by_process_first_last": {r: (quiet[0]["rss_by_process"].get(r, 0) / 2**20, v / 2**20)
                                          for r, v in quiet[-1]["rss_by_process"].items()},
        "quiet": quiet, "samples": samples,
    }


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("model")
    p.add_argument("--duration", type=float, default=600.0, help="seconds of traffic (bursts + quiet)")
    p.add_argument("--burst-s", type=float, default=15.0)
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--abort-after-s", type=float, default=0.2)
    p.add_argument("--warmup-share", type=float, default=0.2, help="share of the run left out of the RSS fit")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--variant", default="token", choices=("token", "block"),
                   help="block: stock allocation and attention under the same load (a baseline)")
    p.add_argument("--json", type=Path)
    p.add_argument("--log", type=Path, default=Path("soak-server.log"))
    args = p.parse_args()
    spec = ServerSpec(model=args.model, variant=args.variant, args=SERVER_ARGS, log_path=args.log)
    with ManagedServer(spec) as server:
        assert server.pid is not None
        result = asyncio.run(soak(server.url, server.pid, args.model, args))
    result["command"] = " ".join(sys.argv)
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))
    brief = {k: v for k, v in result.items() if k not in ("quiet", "samples")}
    print(json.dumps(brief, indent=1))
    ok = (not result["lost"] and result["slots_zero_after_every_burst"]
          and result["server_finished"]["error"] == 0 and result["server_count_consistent"])
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
