"""The demo's work: a tiny model served by Proxima, one hello-world request, then a burst of
concurrent chat-like requests while the server's KV telemetry is sampled.

The requests go through `proxima.load`, the samples through `proxima.sampling`; rendering lives
in proxima/cli/demo.py; this module returns plain results.
"""

from __future__ import annotations

import asyncio
import random
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from proxima.load import Completion, LoadDriver, random_prompt
from proxima.sampling import Sampler
from proxima.scrape import ServerSnapshot
from proxima.server_process import ManagedServer, ServerSpec

# Float32 for exact greedy outputs on CPU; a small KV budget so that the burst fills the cache.
DEMO_SERVER_ARGS = ("--dtype", "float32", "--max-model-len", "1024", "--enforce-eager",
                    "--max-num-seqs", "128")
REQUEST_TIMEOUT_S = 600.0


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


def burst_requests(num_requests: int, seed: int) -> list[tuple[str, int]]:
    """(prompt, max_tokens) of each request: 20-150 words, 16-96 tokens out (ignore_eos)."""
    rng = random.Random(seed)
    return [(random_prompt(rng, 20, 150), rng.randint(16, 96)) for _ in range(num_requests)]


async def drive(url: str, model: str, num_requests: int, concurrency: int, seed: int,
                result: DemoResult, sample_every_s: float = 0.25) -> None:
    async with httpx.AsyncClient() as client:
        sampler = Sampler(url, sample_every_s, client=client)
        async with sampler.running():  # ends with one more reading, after the settle below
            start = time.perf_counter()
            done = await LoadDriver(client, url, model).each_once(
                burst_requests(num_requests, seed), concurrency, timeout=REQUEST_TIMEOUT_S)
            result.wall_s = time.perf_counter() - start
            await asyncio.sleep(0.5)  # let the engine publish its idle state
    result.requests_ok += sum(c.ok for c in done)
    result.requests_failed += sum(not c.ok for c in done)
    result.output_tokens += sum(c.completion_tokens for c in done if c.ok)
    result.samples.extend(s.snapshot for s in sampler.samples)


def hello(url: str, model: str) -> Completion:
    """One short completion, as a first sign of life (not greedy to the end: EOS may stop it)."""
    async def once() -> Completion:
        async with httpx.AsyncClient() as client:
            return await LoadDriver(client, url, model).complete("hello world", 8, ignore_eos=False,
                                                                 timeout=120.0)

    return asyncio.run(once())


def start_server(model_dir: Path, kv_bytes: int, port: int, log_path: Path) -> ManagedServer:
    spec = ServerSpec(model=str(model_dir), variant="token", port=port, log_path=log_path,
                      args=(*DEMO_SERVER_ARGS, "--kv-cache-memory-bytes", str(kv_bytes)))
    return ManagedServer(spec)
