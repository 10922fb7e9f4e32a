"""The demo's work: a tiny model served by Proxima, one hello-world request, then a burst of
concurrent chat-like requests while the server's KV telemetry is sampled.

Rendering lives in proxima/cli/demo.py; this module returns plain results.
"""

from __future__ import annotations

import asyncio
import random
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from proxima.launcher import ManagedServer, ServerSpec
from proxima.scrape import ServerSnapshot, scrape

WORDS = ("the quick brown fox jumps over a lazy dog while seven wizards quietly hex jolly bad kings "
         "memory slots cache tokens request serve model engine block page fragment free used").split()
# Float32 for exact greedy outputs on CPU; a small KV budget so that the burst fills the cache.
DEMO_SERVER_ARGS = ("--dtype", "float32", "--max-model-len", "1024", "--enforce-eager",
                    "--max-num-seqs", "128")


@dataclass(slots=True)
class DemoResult:
    url: str
    hello_text: str
    requests_ok: int = 0
    requests_failed: int = 0
    output_tokens: int = 0
    wall_s: float = 0.0
    samples: list[ServerSnapshot] = field(default_factory=list)

    @property
    def peak(self) -> ServerSnapshot | None:
        live = [s for s in self.samples if s.ok and s.proxima is not None]
        return max(live, key=lambda s: s.proxima.slots_used, default=None)

    @property
    def last(self) -> ServerSnapshot | None:
        return self.samples[-1] if self.samples else None


async def _one_request(client: httpx.AsyncClient, url: str, model: str, rng: random.Random) -> int:
    prompt = " ".join(rng.choice(WORDS) for _ in range(rng.randint(20, 150)))
    body = {"model": model, "prompt": prompt, "max_tokens": rng.randint(16, 96), "temperature": 0,
            "ignore_eos": True}
    r = await client.post(f"{url}/v1/completions", json=body, timeout=600)
    r.raise_for_status()
    return r.json()["usage"]["completion_tokens"]


async def drive(url: str, model: str, num_requests: int, concurrency: int, seed: int,
                result: DemoResult, sample_every_s: float = 0.25) -> None:
    rng = random.Random(seed)
    queue = list(range(num_requests))
    done = asyncio.Event()
    async with httpx.AsyncClient() as client:

        async def worker() -> None:
            while queue:
                queue.pop()
                try:
                    # Await first, then add: `total += await ...` reads the total before the
                    # await and loses the other workers' updates.
                    tokens = await _one_request(client, url, model, rng)
                    result.output_tokens += tokens
                    result.requests_ok += 1
                except httpx.HTTPError:
                    result.requests_failed += 1

        async def sampler() -> None:
            while not done.is_set():
                result.samples.append(await scrape(client, url))
                try:
                    await asyncio.wait_for(done.wait(), sample_every_s)
                except asyncio.TimeoutError:
                    pass
            await asyncio.sleep(0.5)  # let the engine publish its idle state
            result.samples.append(await scrape(client, url))

        sampling = asyncio.create_task(sampler())
        start = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        result.wall_s = time.perf_counter() - start
        done.set()
        await sampling


def hello(url: str, model: str) -> str:
    r = httpx.post(f"{url}/v1/completions", timeout=120,
                   json={"model": model, "prompt": "hello world", "max_tokens": 8, "temperature": 0})
    r.raise_for_status()
    return r.json()["choices"][0]["text"]


def start_server(model_dir: Path, kv_bytes: int, port: int, log_path: Path) -> ManagedServer:
    spec = ServerSpec(model=str(model_dir), variant="token", port=port, log_path=log_path,
                      args=(*DEMO_SERVER_ARGS, "--kv-cache-memory-bytes", str(kv_bytes)))
    return ManagedServer(spec)
