"""Soak: the same mixed traffic against `proxima serve` and stock vLLM, side by side, for a long
time; do requests, slots and memory hold, process by process?

Starts the servers on loopback (tiny model, CPU) through `proxima.server_process`, then, for
each server at once, alternates bursts of mixed traffic with quiet periods until --duration has
passed. Every request goes through the one load generator (`proxima.streaming.StreamingClient`,
`proxima.load`'s `LoadDriver.complete` and `run_jobs`); each kind has the outcome it must have:
  stream      streamed completion read to [DONE], its token count checked
  complete    whole completion, its token count checked
  disconnect  streamed completion the client drops mid-stream (its deadline is 0.5 s)
  abort       whole completion of 600 tokens the client gives up on after --abort-after-s
  bad         a request the server must refuse with 4xx (max_tokens -1, an unknown model, a
              prompt over --max-model-len)
Each server's traffic is drawn from its own generator seeded alike: both see the same requests.
After each burst, once the server is idle (`proxima.sampling.wait_idle`), a quiet point records
Proxima's slots in use (must be 0) and the resident memory of each process of the server's tree:
supervisor (`proxima serve` only), API server, engine core, worker. Meanwhile a
`proxima.sampling.Sampler` reads each server every second (the timeline in the raw results).

The memory trend of each process is the least-squares slope through its quiet points
(`proxima.probes.trend.linear_trend`, with its 95% interval), over the run after --warmup-share
and over its second half, in MiB per hour.

usage: python scripts/bench_soak.py MODEL_DIR [--duration 3600] [--burst-s 15] [--concurrency 8]
       [--variants token,stock] [--seed 0] [--out DIR]
writes DIR/soak.json (everything) and prints the summary (also in DIR/summary.json).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import re
import shutil
import subprocess
import sys
import time
from collections import Counter
from contextlib import ExitStack
from pathlib import Path

import httpx
import psutil

from proxima.exposition import Samples
from proxima.files import write_atomic
from proxima.load import LoadDriver, new_http_client, run_jobs
from proxima.metrics.catalog import Vllm
from proxima.probes.trend import linear_trend
from proxima.sampling import Sampler, wait_idle
from proxima.scrape import scrape
from proxima.server_process import ManagedServer, ServerSpec
from proxima.streaming import OK, TIMED_OUT, RequestResult, StreamingClient

SERVER_ARGS = ("--dtype", "float32", "--max-model-len", "1024", "--kv-cache-memory-bytes", str(64 << 20),
               "--enforce-eager", "--max-num-seqs", "32")
KINDS = {"stream": 0.40, "complete": 0.15, "disconnect": 0.20, "abort": 0.10, "bad": 0.15}
WORDS = "the quick brown fox jumps over a lazy dog while memory slots fill and empty again".split()
DISCONNECT_AFTER_S = 0.5
# An aborted request asks for more than it will get, within --max-model-len with any prompt here.
ABORTED_TOKENS = 600


def _tree(pid: int) -> list[psutil.Process]:
    try:
        root = psutil.Process(pid)
        return [root, *root.children(recursive=True)]
    except psutil.Error:
        return []


def _role(proc: psutil.Process) -> str:
    title = " ".join(proc.cmdline())  # vLLM titles its processes
    return ("supervisor" if "proxima.cli.main" in title else
            "api_server" if "api_server" in title else
            "engine_core" if "EngineCore" in title else
            "worker" if "Worker" in title else
            "resource_tracker" if "resource_tracker" in title else proc.name())


def _anonymous_bytes(pid: int) -> int:
    """Resident anonymous memory (heaps, arenas, tensors), from smaps_rollup: what grows when a
    process allocates, as opposed to files and libraries it maps."""
    try:
        for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
            if line.startswith("Anonymous:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return 0


def memory_by_process(pid: int) -> tuple[dict[str, int], dict[str, int], dict[str, int]]:
    """Resident bytes (RSS), unique bytes (USS: pages no other process shares, so a library
    paged in once does not count) and anonymous resident bytes of each process of a server's
    tree, by role."""
    rss: dict[str, int] = {}
    uss: dict[str, int] = {}
    anon: dict[str, int] = {}
    for proc in _tree(pid):
        try:
            role = _role(proc)
            info = proc.memory_full_info()
            rss[role] = rss.get(role, 0) + info.rss
            uss[role] = uss.get(role, 0) + info.uss
            anon[role] = anon.get(role, 0) + _anonymous_bytes(proc.pid)
        except psutil.Error:
            pass
    return rss, uss, anon


def heap_report(pid: int, log: Path) -> dict[str, dict]:
    """glibc's own account of the heap of the engine core and worker (`malloc_stats()`, called
    through gdb after the run; it prints to the process's stderr, the server log): bytes malloc
    holds from the system and bytes in use by the program. A heap whose free bytes (system less
    in use) make up the RSS growth is memory malloc keeps after frees (fragmentation), not a leak.
    Attaching pauses the process and may interrupt a system call in it: for the end of a run only."""
    out: dict[str, dict] = {}
    gdb = shutil.which("gdb")
    for proc in _tree(pid):
        try:
            role = _role(proc)
        except psutil.Error:
            continue
        if role not in ("engine_core", "worker") or gdb is None:
            continue
        before = log.stat().st_size
        try:
            subprocess.run([gdb, "-p", str(proc.pid), "-batch", "-ex", "call (void)malloc_stats()"],
                           capture_output=True, text=True, timeout=120)
        except (OSError, subprocess.SubprocessError) as err:
            out[role] = {"error": str(err)}
            continue
        time.sleep(0.5)
        with log.open("rb") as f:
            f.seek(before)
            text = f.read().decode(errors="replace")
        arenas = re.findall(r"Arena \d+:\s*system bytes\s*=\s*(\d+)\s*in use bytes\s*=\s*(\d+)", text)
        total = re.search(r"Total \(incl\. mmap\):\s*system bytes\s*=\s*(\d+)\s*in use bytes\s*=\s*(\d+)",
                          text)
        mmap = re.search(r"max mmap bytes\s*=\s*(\d+)", text)
        out[role] = {"arenas": len(arenas), "system_mib": round(int(total[1]) / 2**20, 1),
                     "in_use_mib": round(int(total[2]) / 2**20, 1),
                     "free_in_malloc_mib": round((int(total[1]) - int(total[2])) / 2**20, 1),
                     "max_mmap_mib": round(int(mmap[1]) / 2**20, 1) if mmap else None,
                     } if total else {"error": "no malloc_stats output in the server log"}
    return out


class Traffic:
    """One server's mixed requests, each through `proxima.load`; outcomes counted by kind."""

    def __init__(self, http: httpx.AsyncClient, url: str, model: str, seed: int,
                 abort_after_s: float) -> None:
        self.driver = LoadDriver(http, url, model)
        self.stream = StreamingClient(http, url, model, request_timeout_s=120.0)
        self.disconnect = StreamingClient(http, url, model, request_timeout_s=DISCONNECT_AFTER_S)
        self.rng = random.Random(seed)
        self.abort_after_s = abort_after_s
        self.sent: Counter = Counter()
        self.outcomes: Counter = Counter()

    def prompt(self, words: int) -> str:
        return " ".join(self.rng.choice(WORDS) for _ in range(words))

    def job(self):
        """The next request, drawn now (so both servers' sequences match), sent when awaited."""
        kind = self.rng.choices(list(KINDS), list(KINDS.values()))[0]
        prompt = self.prompt(self.rng.randint(3, 120))
        n = self.rng.randint(8, 64)
        bad = self.rng.choice(["negative", "model", "long"])
        long_prompt = self.prompt(3000) if kind == "bad" and bad == "long" else ""

        async def send() -> None:
            self.sent[kind] += 1
            self.outcomes[(kind, await self._send(kind, prompt, n, bad, long_prompt))] += 1

        return send

    async def _send(self, kind: str, prompt: str, n: int, bad: str, long_prompt: str) -> str:
        if kind == "stream":
            r = await self.stream.send(prompt, n, RequestResult(0))
            if r.status == OK and r.output_tokens == n:
                return "ok"
            return f"{r.status}: {r.error} ({r.output_tokens}/{n} tokens)"
        if kind == "disconnect":
            r = await self.disconnect.send(prompt, 200, RequestResult(0))
            return "ok" if r.status in (OK, TIMED_OUT) else f"{r.status}: {r.error}"
        if kind == "complete":
            c = await self.driver.complete(prompt, n, timeout=120.0)
            return "ok" if c.ok and c.completion_tokens == n else f"{c.error} ({c.completion_tokens}/{n})"
        if kind == "abort":
            c = await self.driver.complete(prompt, ABORTED_TOKENS, timeout=self.abort_after_s)
            return "ok" if not c.ok and c.error.startswith("timed out") else "finished" if c.ok else c.error
        if bad == "negative":
            c = await self.driver.complete(prompt, -1, timeout=60.0)
        elif bad == "model":
            c = await self.driver.complete(prompt, 8, timeout=60.0, model="no-such-model")
        else:
            c = await self.driver.complete(long_prompt, 8, timeout=60.0)
        return "ok" if not c.ok and (c.error or "").startswith("HTTP 4") else f"bad/{bad}: {c.error}"

    def until(self, deadline: float):
        while time.monotonic() < deadline:
            yield self.job()


def dump_stacks(pid: int, path: Path) -> None:
    """Every Python stack of the server's processes (py-spy, when installed) into `path`: what a
    server that stopped finishing its requests was doing."""
    spy = shutil.which("py-spy") or str(Path(sys.executable).with_name("py-spy"))
    lines = []
    for proc in _tree(pid):
        try:
            done = subprocess.run([spy, "dump", "--pid", str(proc.pid)], capture_output=True, text=True,
                                  timeout=60)
            lines += [f"== {proc.pid} {' '.join(proc.cmdline())[:120]}", done.stdout, done.stderr]
        except (OSError, subprocess.SubprocessError, psutil.Error) as err:
            lines.append(f"== {proc.pid}: no stacks ({err})")
    write_atomic(path, "\n".join(lines))


async def soak_one(label: str, server: ManagedServer, model: str, args, t0: float) -> dict:
    quiet: list[dict] = []
    dumped = False
    died_at = None
    async with new_http_client(120.0) as http:
        first = (await http.get(f"{server.url}/metrics")).text
        traffic = Traffic(http, server.url, model, args.seed, args.abort_after_s)
        sampler = Sampler(server.url, 1.0, here=True, pid=server.pid, t0=t0)
        async with sampler.running(final=False):
            while time.monotonic() - t0 < args.duration:
                if not server.alive():  # its engine died (vLLM ends the server): nothing left to soak
                    died_at = time.monotonic() - t0
                    print(f"[{died_at:6.0f} s] {label}: the server exited", file=sys.stderr, flush=True)
                    break
                await run_jobs(traffic.until(time.monotonic() + args.burst_s), args.concurrency)
                idle = await wait_idle(http, server.url, timeout_s=60.0, poll_s=0.2)
                if idle is None and not dumped:  # a minute after its burst it still has work: why?
                    dumped = True
                    path = args.out / f"{label}-stacks-{time.monotonic() - t0:.0f}s.txt"
                    await asyncio.to_thread(dump_stacks, server.pid, path)
                # The engine's idle publish, the allocator settled, and the worker's idle heap
                # trim (PROXIMA_IDLE_TRIM_S, 1 s after its last step) done before memory is read.
                await asyncio.sleep(args.settle_s)
                snap = await scrape(http, server.url)
                kv = snap.proxima
                rss, uss, anon = memory_by_process(server.pid)
                quiet.append({"t": time.monotonic() - t0, "idle": idle is not None,
                              "requests_sent": sum(traffic.sent.values()),
                              "slots_used": kv.slots_used if kv else None,
                              "slots_cached": kv.slots_cached if kv else None,
                              "rss_by_process": rss, "uss_by_process": uss, "anon_by_process": anon})
                print(f"[{quiet[-1]['t']:6.0f} s] {label} burst {len(quiet)}: idle={idle is not None} "
                      f"slots_used={quiet[-1]['slots_used']} RSS "
                      + " ".join(f"{k}={v / 2**20:.0f}" for k, v in sorted(rss.items())) + " MiB",
                      file=sys.stderr, flush=True)
        try:
            last = (await http.get(f"{server.url}/metrics")).text
        except httpx.HTTPError:  # gone since its last burst: its counts end where they began
            died_at = died_at if died_at is not None else time.monotonic() - t0
            last = first
    timeline = [{"t": s.t, "ok": s.snapshot.ok, "rss": s.rss_bytes, "running": s.snapshot.running,
                 "waiting": s.snapshot.waiting,
                 "slots_used": s.snapshot.proxima.slots_used if s.snapshot.proxima else None}
                for s in sampler.samples]
    result = summarize(label, first, last, traffic, quiet, timeline, args)
    result["server_exited_at_s"] = died_at
    return result


REASONS = ("length", "stop", "abort", "error")


def finished(text: str, reason: str) -> float:
    """vllm:request_success_total of one finished_reason (read through Proxima's exposition layer)."""
    return Samples(text).total(Vllm.REQUEST_SUCCESS, finished_reason=reason) or 0.0


def trend(points: list[tuple[float, float]], per: float = 3600) -> dict | None:
    """MiB per `per` units of x (seconds: per hour) through (x, bytes) points, with its 95% interval."""
    fit = linear_trend([x / per for x, _ in points], [b / 2**20 for _, b in points])
    if fit is None:
        return None
    return {"mib": round(fit.slope, 2), "ci95": [round(fit.ci95_low, 2), round(fit.ci95_high, 2)],
            "points": fit.n, "significant_rise": fit.significant_rise}


def slopes(quiet: list[dict], key: str, warm: float, end: float) -> dict:
    """Per role (and in all): MiB per hour after the warm-up and over the second half, and MiB
    per 1,000 requests after the warm-up (the servers do not serve equally many in an hour)."""
    roles = sorted({r for q in quiet for r in q[key]}) + ["total"]
    out = {}
    for role in roles:
        values = [sum(q[key].values()) if role == "total" else q[key].get(role, 0) for q in quiet]
        out[role] = {
            "mib_per_h_after_warmup": trend([(q["t"], v) for q, v in zip(quiet, values) if q["t"] >= warm]),
            "mib_per_h_second_half": trend([(q["t"], v) for q, v in zip(quiet, values) if q["t"] >= end / 2]),
            "mib_per_1k_requests_after_warmup": trend(
                [(q["requests_sent"], v) for q, v in zip(quiet, values) if q["t"] >= warm], per=1000),
        }
    return out


def summarize(label, first: str, last: str, traffic: Traffic, quiet: list[dict], timeline, args) -> dict:
    outcomes = traffic.outcomes
    lost = {f"{k}: {o}": n for (k, o), n in outcomes.items() if o not in ("ok", "finished")}
    completed = sum(n for (k, o), n in outcomes.items() if (k in ("stream", "complete") and o == "ok")
                    or o == "finished")
    served = {r: finished(last, r) - finished(first, r) for r in REASONS}
    quiet = [q for q in quiet if q["rss_by_process"]]  # none once the server is gone
    end = quiet[-1]["t"]
    warm = args.warmup_share * end
    first_q, last_q = quiet[0]["rss_by_process"], quiet[-1]["rss_by_process"]
    roles = sorted(set(first_q) | set(last_q))
    return {
        "label": label, "duration_s": end, "bursts": len(quiet), "concurrency": args.concurrency,
        "sent": dict(traffic.sent), "requests_sent": sum(traffic.sent.values()), "lost": lost,
        "client_completed": completed, "server_finished": served,
        "idle_after_every_burst": all(q["idle"] for q in quiet),
        "slots_zero_after_every_burst": all(q["slots_used"] in (0, None) for q in quiet),
        "scrape_failures": sum(not s["ok"] for s in timeline),
        "rss_mib_first_last": {r: [round(first_q.get(r, 0) / 2**20, 1), round(last_q.get(r, 0) / 2**20, 1)]
                               for r in roles},
        "rss_slope": slopes(quiet, "rss_by_process", warm, end),
        "uss_slope": slopes(quiet, "uss_by_process", warm, end),
        "anon_slope": slopes(quiet, "anon_by_process", warm, end), "warmup_s": warm,
        "quiet": quiet, "timeline": timeline,
    }


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("model")
    p.add_argument("--duration", type=float, default=3600.0, help="seconds of traffic (bursts + quiet)")
    p.add_argument("--burst-s", type=float, default=15.0)
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--abort-after-s", type=float, default=0.2)
    p.add_argument("--settle-s", type=float, default=3.0,
                   help="seconds from idle to a quiet point's reading (runs before 2026-12-04 16:00: 1)")
    p.add_argument("--warmup-share", type=float, default=0.2, help="share of the run left out of the fit")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--variants", default="token,stock", help="servers run side by side: token, block, stock")
    p.add_argument("--out", type=Path, default=Path("soak-results"))
    p.add_argument("--server-env", action="append", default=[], metavar="NAME=VALUE",
                   help="an environment variable for every server (repeatable), e.g. MALLOC_ARENA_MAX=2")
    p.add_argument("--heap-report", action="store_true",
                   help="after the run, glibc's heap figures of the engine core and worker (gdb)")
    args = p.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    bad = [e for e in args.server_env if "=" not in e or not e.split("=", 1)[0]]
    if bad:
        p.error(f"--server-env takes NAME=VALUE, got {', '.join(bad)}")
    server_env = dict(e.split("=", 1) for e in args.server_env)
    with ExitStack() as stack:
        servers = {}
        for variant in variants:
            spec = ServerSpec(model=args.model, variant=variant, args=SERVER_ARGS,
                              log_path=args.out / f"{variant}-server.log", env=server_env)
            servers[variant] = stack.enter_context(ManagedServer(spec).spawn())
        for server in servers.values():
            server.wait_ready(timeout=900)

        async def both() -> list[dict]:
            t0 = time.monotonic()
            return await asyncio.gather(*(soak_one(v, s, args.model, args, t0) for v, s in servers.items()))

        results = asyncio.run(both())
        if args.heap_report:
            for result, server in zip(results, servers.values(), strict=True):
                result["heap"] = heap_report(server.pid, server.spec.log_path)
    report = {"command": " ".join(sys.argv), "server_args": list(SERVER_ARGS), "server_env": server_env,
              "kinds": KINDS,
              "runs": results}
    write_atomic(args.out / "soak.json", json.dumps(report, indent=1))
    brief = {r["label"]: {k: v for k, v in r.items() if k not in ("quiet", "timeline")} for r in results}
    write_atomic(args.out / "summary.json", json.dumps(brief, indent=1))
    print(json.dumps(brief, indent=1))
    ok = all(not r["lost"] and r["slots_zero_after_every_burst"] and r["server_finished"]["error"] == 0
             and r["server_exited_at_s"] is None for r in results)
    return 0 if ok and not any(math.isnan(r["duration_s"]) for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
