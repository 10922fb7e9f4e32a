"""The traffic a probe drives: single completions, bursts, and a steady load it must stop.

Layer: probes (I/O). Requests go to the URL the driver was built for, or to the one URL a caller
names (the doctor's `--compare` server); nothing else. Every task started here is cancelled and
awaited before the call that started it returns, so no load outlives a probe or the doctor (a
cancelled httpx request closes its connection, and vLLM aborts a request whose client left).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass

import httpx

_WORDS = (
    "memory slots cache tokens request serve model engine block page fragment free used the quick "
    "brown fox jumps over a lazy dog while seven wizards quietly hex jolly bad kings"
).split()


def make_prompt(index: int, num_words: int) -> str:
    """A deterministic prompt, distinct per index (so prefix caching cannot share it)."""
    words = [_WORDS[(index * 7 + j * (1 + index % 5)) % len(_WORDS)] for j in range(max(1, num_words - 1))]
    return f"{index} " + " ".join(words)


@dataclass(frozen=True, slots=True)
class Completion:
    ok: bool
    text: str = ""
    token_ids: tuple[int, ...] | None = None  # None when the server does not return them
    prompt_tokens: int = 0
    completion_tokens: int = 0
    latency_s: float = 0.0
    error: str | None = None


@dataclass(slots=True)
class LoadStats:
    """Counts of a steady load, updated while it runs."""

    num_sent: int = 0
    num_ok: int = 0
    num_errors: int = 0
    num_tokens: int = 0  # prompt + completion tokens of the requests that succeeded
    last_error: str | None = None

    @property
    def mean_request_tokens(self) -> float | None:
        return self.num_tokens / self.num_ok if self.num_ok else None

    def record(self, result: Completion) -> None:
        if result.ok:
            self.num_ok += 1
            self.num_tokens += result.prompt_tokens + result.completion_tokens
        else:
            self.num_errors += 1
            self.last_error = result.error


class LoadDriver:
    def __init__(self, client: httpx.AsyncClient, url: str, model: str | None = None) -> None:
        self.client = client
        self.url = url.rstrip("/")
        self.model = model

    async def complete(
        self,
        prompt: str,
        max_tokens: int,
        *,
        temperature: float = 0.0,
        seed: int | None = None,
        ignore_eos: bool = True,
        timeout: float = 60.0,
        url: str | None = None,
        model: str | None = None,
    ) -> Completion:
        """One /v1/completions request. Never raises for a server's failure (cancellation passes)."""
        body: dict = {
            "model": model or self.model,
            "prompt": prompt,
            "max_tokens": max_tokens,
            "temperature": temperature,
            "ignore_eos": ignore_eos,
            "return_token_ids": True,
        }
        if seed is not None:
            body["seed"] = seed
        start = time.perf_counter()
        try:
            response = await self.client.post(
                (url or self.url).rstrip("/") + "/v1/completions", json=body, timeout=timeout
            )
        except httpx.HTTPError as err:
            return Completion(ok=False, error=f"{type(err).__name__}: {err}".rstrip(": "),
                              latency_s=time.perf_counter() - start)
        latency = time.perf_counter() - start
        if response.status_code != 200:
            return Completion(ok=False, error=f"HTTP {response.status_code}: {response.text[:200]}",
                              latency_s=latency)
        try:
            data = response.json()
            choice = data["choices"][0]
            usage = data.get("usage") or {}
        except (ValueError, KeyError, IndexError) as err:
            return Completion(ok=False, error=f"unexpected response: {err}", latency_s=latency)
        ids = choice.get("token_ids")
        return Completion(
            ok=True,
            text=choice.get("text") or "",
            token_ids=tuple(int(t) for t in ids) if ids is not None else None,
            prompt_tokens=int(usage.get("prompt_tokens") or 0),
            completion_tokens=int(usage.get("completion_tokens") or 0),
            latency_s=latency,
        )

    async def burst(self, prompts: Sequence[str], max_tokens: int, timeout: float, **kwargs) -> list[Completion]:
        """Send all prompts at once; whatever is unfinished after `timeout` is cancelled."""
        tasks = [asyncio.ensure_future(self.complete(p, max_tokens, timeout=timeout, **kwargs))
                 for p in prompts]
        try:
            done, _ = await asyncio.wait(tasks, timeout=timeout)
        finally:
            await _cancel(tasks)
        return [t.result() if t in done and not t.cancelled() else Completion(ok=False, error="timed out")
                for t in tasks]

    @contextlib.asynccontextmanager
    async def steady(self, concurrency: int, max_tokens: int, prompt_words: int = 32,
                     first_index: int = 1000) -> AsyncIterator[LoadStats]:
        """Keep `concurrency` requests in flight until the block exits (then cancel them)."""
        stats = LoadStats()
        counter = iter(range(first_index, first_index + 10_000_000))

        async def worker() -> None:
            while True:
                stats.num_sent += 1
                result = await self.complete(make_prompt(next(counter), prompt_words), max_tokens)
                stats.record(result)
                if not result.ok:  # a failing server answers at once: do not hammer it
                    await asyncio.sleep(0.2)

        tasks = [asyncio.ensure_future(worker()) for _ in range(concurrency)]
        try:
            yield stats
        finally:
            await _cancel(tasks)


async def _cancel(tasks: Sequence[asyncio.Future]) -> None:
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
