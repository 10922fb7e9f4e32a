"""The one load generator: OpenAI `/v1/completions` requests, for the doctor's probes, `proxima
bench` and `proxima demo`.

One request body (`completion_body`: greedy, and with vLLM's `ignore_eos` unless told otherwise,
so the output is exactly `max_tokens` long on every engine; `chat_body` for a real model's chats,
which end where the model ends its turn), two ways to read the answer:
  `LoadDriver.complete`   here: the whole answer at once, token ids included (`chat` likewise);
                          `burst`, `steady`, `each_once` and `each_chat_once` keep many in flight;
  `StreamingClient.send`  `proxima.streaming`: streamed and timed, for `proxima bench`.
Generated prompts are drawn from `WORDS`, the words the tiny test model's tokenizer is trained
on (`proxima.tiny_model`), so they cost it one token a word; `proxima bench` builds its
workloads from its own vocabulary (`proxima.bench.workload`).

Requests go only to the URL a driver was built for or the one a caller names. Never raises for a
server's failure: a refused connection, a reset stream, an HTTP error or an odd answer is a
failed result with the reason. Every task started here is cancelled and awaited before the call
that started it returns, so no load outlives its caller (a cancelled httpx request closes its
connection, and vLLM aborts a request whose client left).
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass

import httpx

from proxima.completion_answers import (
    completion_answer,
    completion_prompt_ids,
    completion_top_logprobs,
    prompt_token_ranks,
)
from proxima.fetch import (
    MalformedAnswer,
    auth_headers,
    client_limits,
    describe_http_error,
    fetch,
    parse_json,
)

WORDS = (
    "the quick brown fox jumps over a lazy dog while seven wizards quietly hex jolly bad kings "
    "memory slots cache tokens request serve model engine block page fragment free used"
).split()


def make_prompt(index: int, num_words: int) -> str:
    """A deterministic prompt, distinct per index (so prefix caching cannot share it)."""
    words = [WORDS[(index * 7 + j * (1 + index % 5)) % len(WORDS)] for j in range(max(1, num_words - 1))]
    return f"{index} " + " ".join(words)


def random_prompt(rng: random.Random, min_words: int, max_words: int) -> str:
    """Between `min_words` and `max_words` words drawn from `WORDS` by `rng`."""
    return " ".join(rng.choice(WORDS) for _ in range(rng.randint(min_words, max_words)))


def completion_body(model: str | None, prompt: str, max_tokens: int, *, temperature: float = 0.0,
                    ignore_eos: bool = True, seed: int | None = None, stream: bool = False,
                    top_logprobs: int = 0) -> dict:
    body: dict = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": temperature,
                  "ignore_eos": ignore_eos}
    if top_logprobs:
        body["logprobs"] = top_logprobs
    if stream:
        body.update(stream=True, stream_options={"include_usage": True})
    else:
        body["return_token_ids"] = True  # vLLM 0.26; other servers ignore it
    if seed is not None:
        body["seed"] = seed
    return body


def chat_body(model: str | None, messages: Sequence[dict[str, str]], max_tokens: int, *,
              temperature: float = 0.0, seed: int | None = None) -> dict:
    body: dict = {"model": model, "messages": list(messages), "max_tokens": max_tokens,
                  "temperature": temperature, "return_token_ids": True}
    if seed is not None:
        body["seed"] = seed
    return body


def completions_url(url: str) -> str:
    return url.rstrip("/") + "/v1/completions"


def chat_url(url: str) -> str:
    return url.rstrip("/") + "/v1/chat/completions"


def new_http_client(request_timeout_s: float, api_key: str | None = None) -> httpx.AsyncClient:
    """A client for load: no connection limit, because a queue inside the client would be
    measured as server latency. `api_key` goes with every request (vLLM's --api-key)."""
    return httpx.AsyncClient(
        limits=client_limits(max_connections=None, max_keepalive_connections=512),
        timeout=httpx.Timeout(request_timeout_s, connect=10.0),
        headers=auth_headers(api_key),
    )


# ---------------------------------------------------------------- whole answers

@dataclass(frozen=True, slots=True)
class Completion:
    ok: bool
    text: str = ""
    token_ids: tuple[int, ...] | None = None  # None when the server does not return them
    prompt_tokens: int = 0
    completion_tokens: int = 0
    latency_s: float = 0.0
    error: str | None = None
    # Asked for (`complete(top_logprobs=n)`): each position's n most likely tokens, text -> logprob.
    top_logprobs: tuple[dict[str, float], ...] | None = None
    prompt_token_ids: tuple[int, ...] | None = None  # vLLM returns them with the completion's ids


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

    async def complete(self, prompt: str, max_tokens: int, *, temperature: float = 0.0,
                       seed: int | None = None, ignore_eos: bool = True, timeout: float = 60.0,
                       url: str | None = None, model: str | None = None, top_logprobs: int = 0) -> Completion:
        """One /v1/completions request, read whole within `timeout` s and `MAX_ANSWER_BYTES`.
        Never raises for a server's failure (cancellation passes); an answer of the wrong shape
        is a failed one (unreadable logprobs only leave ``top_logprobs`` None)."""
        body = completion_body(model or self.model, prompt, max_tokens, temperature=temperature,
                               ignore_eos=ignore_eos, seed=seed, top_logprobs=top_logprobs)
        return await self._send(completions_url(url or self.url), body, timeout)

    async def chat(self, messages: Sequence[dict[str, str]], max_tokens: int, *, temperature: float = 0.0,
                   seed: int | None = None, timeout: float = 60.0) -> Completion:
        """One /v1/chat/completions request: the model's chat template, ending at its end of turn
        (or `max_tokens`). Never raises for a server's failure (cancellation passes)."""
        body = chat_body(self.model, messages, max_tokens, temperature=temperature, seed=seed)
        return await self._send(chat_url(self.url), body, timeout, chat=True)

    async def _send(self, endpoint: str, body: dict, timeout: float, chat: bool = False) -> Completion:
        start = time.perf_counter()
        try:
            answer = await fetch(self.client, "POST", endpoint, timeout, json_body=body)
        except (httpx.HTTPError, ValueError) as err:  # ValueError: BodyTooLarge
            return Completion(ok=False, error=describe_http_error(err), latency_s=time.perf_counter() - start)
        latency = time.perf_counter() - start
        if answer.status != 200:
            return Completion(ok=False, error=f"HTTP {answer.status}: {error_message(answer.text()[:2000])}",
                              latency_s=latency)
        try:
            payload = answer.json()
            text, ids, prompt_tokens, completion_tokens = completion_answer(payload, body["max_tokens"],
                                                                            chat=chat)
        except MalformedAnswer as err:
            return Completion(ok=False, error=f"malformed answer: {err}", latency_s=latency)
        return Completion(ok=True, text=text, token_ids=ids, prompt_tokens=prompt_tokens,
                          completion_tokens=completion_tokens, latency_s=latency,
                          top_logprobs=completion_top_logprobs(payload) if "logprobs" in body else None,
                          prompt_token_ids=completion_prompt_ids(payload))

    async def teacher_forced_ranks(self, token_ids: Sequence[int], scored_from: int, *,
                                   url: str | None = None, model: str | None = None,
                                   timeout: float = 60.0) -> tuple[int, ...] | None:
        """The server fed `token_ids` as one prompt: the rank of each of them from position
        `scored_from` on among its next-token choices there (1: its own greedy choice). None when the
        server cannot say (an error, or a server without vLLM's ``prompt_logprobs``)."""
        body = {"model": model or self.model, "prompt": list(token_ids), "max_tokens": 1, "temperature": 0.0,
                "prompt_logprobs": 1}
        try:
            answer = await fetch(self.client, "POST", completions_url(url or self.url), timeout,
                                 json_body=body)
            payload = answer.json() if answer.status == 200 else None
        except (httpx.HTTPError, ValueError):
            return None
        return prompt_token_ranks(payload, token_ids, scored_from)

    async def burst(self, prompts: Sequence[str], max_tokens: int, timeout: float,
                    **kwargs) -> list[Completion]:
        """Send all prompts at once; whatever is unfinished after `timeout` is cancelled."""
        tasks = [asyncio.ensure_future(self.complete(p, max_tokens, timeout=timeout, **kwargs))
                 for p in prompts]
        try:
            done, _ = await asyncio.wait(tasks, timeout=timeout)
        finally:
            await _cancel(tasks)
        return [t.result() if t in done and not t.cancelled() else Completion(ok=False, error="timed out")
                for t in tasks]

    async def each_once(self, requests: Sequence[tuple[str, int]], concurrency: int,
                        **kwargs) -> list[Completion]:
        """Send each (prompt, max_tokens) once, `concurrency` in flight; results in request order."""
        return await self._each_once(requests, concurrency, self.complete, kwargs)

    async def each_chat_once(self, chats: Sequence[tuple[Sequence[dict[str, str]], int]], concurrency: int,
                             **kwargs) -> list[Completion]:
        """Send each (messages, max_tokens) chat once, `concurrency` in flight; results in order."""
        return await self._each_once(chats, concurrency, self.chat, kwargs)

    async def _each_once(self, requests: Sequence[tuple], concurrency: int, send,
                         kwargs: dict) -> list[Completion]:
        results: list[Completion] = [Completion(ok=False, error="not sent")] * len(requests)

        def job(index: int, what, max_tokens: int) -> Callable[[], Awaitable[None]]:
            async def run() -> None:
                results[index] = await send(what, max_tokens, **kwargs)
            return run

        await run_jobs((job(i, p, n) for i, (p, n) in enumerate(requests)), concurrency)
        return results

    @contextlib.asynccontextmanager
    async def steady(self, concurrency: int, max_tokens: int, prompt_words: int = 32,
                     first_index: int = 1000) -> AsyncIterator[LoadStats]:
        """Keep `concurrency` requests in flight until the block exits (then cancel them)."""
        stats = LoadStats()
        counter = iter(range(first_index, first_index + 10_000_000))
        stopping = False

        async def worker() -> None:
            # The flag as well as the cancel: a worker whose cancel were lost below it would still
            # stop after its request in flight, rather than keep the load going.
            while not stopping:
                stats.num_sent += 1
                result = await self.complete(make_prompt(next(counter), prompt_words), max_tokens)
                stats.record(result)
                if not result.ok:  # a failing server answers at once: do not hammer it
                    await asyncio.sleep(0.2)

        tasks = [asyncio.ensure_future(worker()) for _ in range(concurrency)]
        try:
            yield stats
        finally:
            stopping = True
            await _cancel(tasks)


async def run_jobs(jobs: Iterable[Callable[[], Awaitable[object]]], concurrency: int) -> None:
    """The worker pool under `each_once` (and a soak's mixed traffic): `concurrency` workers take
    jobs from one shared iterator until it ends, so each job runs once and `concurrency` are in
    flight; every worker is cancelled and awaited before this returns."""
    pending = iter(jobs)

    async def worker() -> None:
        for job in pending:
            await job()

    tasks = [asyncio.ensure_future(worker()) for _ in range(max(1, concurrency))]
    try:
        await asyncio.gather(*tasks)
    finally:
        await _cancel(tasks)


async def _cancel(tasks: Sequence[asyncio.Future]) -> None:
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


def error_message(body: str) -> str:
    """The `message` of an OpenAI-style error body, else the body itself, on one line."""
    try:
        parsed = parse_json(body)
        found = parsed.get("error", parsed) if isinstance(parsed, dict) else parsed
        if isinstance(found, dict):
            found = found.get("message", found)
        text = str(found)
    except MalformedAnswer:
        text = body
    return " ".join(text.split())[:200]
