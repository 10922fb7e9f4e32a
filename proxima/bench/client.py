"""The load-generating client: streaming OpenAI `/v1/completions` over one `httpx.AsyncClient`.

Each request streams (`"stream": true`, usage included) with vLLM's `ignore_eos`, so the output
length is exactly `max_tokens` on every engine. Timings are taken on arrival of each SSE line:
TTFT = first token chunk, ITL = gaps between token chunks, E2E = until the stream ends. The time
the client itself spends handling lines is summed per request (`overhead_s`), so a client that
cannot keep up shows in the results rather than as a slower server.

Never raises for a server's failure: a refused connection, a reset stream or an HTTP error is a
`failed` result with the reason; a request over its deadline is `timed_out`.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field

import httpx

from proxima.bench.workload import VOCABULARY, BenchRequest, WordCosts
from proxima.fetch import first_model

OK, FAILED, TIMED_OUT, CANCELLED = "ok", "failed", "timed_out", "cancelled"


class ServerUnreachable(RuntimeError):
    """The server did not answer `/v1/models`; the message says where and why."""


@dataclass(slots=True)
class RequestResult:
    index: int
    status: str = CANCELLED  # until the request finishes one way or another
    sent_at: float = 0.0  # perf_counter
    ttft: float | None = None
    e2e: float | None = None
    last_token_at: float | None = None  # seconds after sent_at
    itls: list[float] = field(default_factory=list)
    num_chunks: int = 0
    output_tokens: int = 0
    prompt_tokens: int | None = None
    error: str | None = None
    overhead_s: float = 0.0
    text: list[str] | None = None  # the answer's pieces, kept only when a next turn needs them

    @property
    def tpot(self) -> float | None:
        """Time per output token after the first, as vLLM's benchmark defines it."""
        if self.status != OK or self.output_tokens < 2 or self.ttft is None or self.last_token_at is None:
            return None
        return (self.last_token_at - self.ttft) / (self.output_tokens - 1)


def new_http_client(request_timeout_s: float) -> httpx.AsyncClient:
    # No connection limit: a queue inside the client would be measured as server latency.
    return httpx.AsyncClient(
        limits=httpx.Limits(max_connections=None, max_keepalive_connections=512),
        timeout=httpx.Timeout(request_timeout_s, connect=10.0),
    )


async def fetch_model(http: httpx.AsyncClient, url: str) -> str:
    """The first served model's name; raises ServerUnreachable with a one-line reason."""
    try:
        response = await http.get(url.rstrip("/") + "/v1/models", timeout=10.0)
        response.raise_for_status()
        return first_model(response.json()).id
    except httpx.ConnectError:
        raise ServerUnreachable(f"cannot reach {url}: connection refused (is the server running?)") from None
    except httpx.TimeoutException:
        raise ServerUnreachable(f"cannot reach {url}: timed out") from None
    except httpx.HTTPStatusError as err:
        raise ServerUnreachable(
            f"{url}/v1/models answered HTTP {err.response.status_code}; is it an OpenAI-compatible server?"
        ) from None
    except (httpx.HTTPError, httpx.InvalidURL) as err:
        raise ServerUnreachable(f"cannot reach {url}: {type(err).__name__}: {err}") from None
    except json.JSONDecodeError:
        raise ServerUnreachable(f"{url}/v1/models did not answer JSON; is it an OpenAI-compatible server?") \
            from None
    except ValueError as err:  # first_model: not an OpenAI model list
        raise ServerUnreachable(f"{url}: {err}") from None


async def _tokenize(http: httpx.AsyncClient, url: str, model: str, prompt: str) -> dict:
    response = await http.post(url.rstrip("/") + "/tokenize", json={"model": model, "prompt": prompt},
                               timeout=30.0)
    response.raise_for_status()
    return response.json()


async def fetch_word_costs(http: httpx.AsyncClient, url: str,
                           model: str) -> tuple[WordCosts, int | None] | None:
    """Token cost of every vocabulary word from the server's tokenizer, and its max_model_len.

    None when the server has no `/tokenize` (not vLLM, or disabled): callers approximate.
    """
    gate = asyncio.Semaphore(16)

    async def count(prompt: str) -> dict:
        async with gate:
            return await _tokenize(http, url, model, prompt)

    try:
        empty = await count("")
        firsts = await asyncio.gather(*(count(w) for w in VOCABULARY))
        laters = await asyncio.gather(*(count("the " + w) for w in VOCABULARY))
        the = await count("the")
    except (httpx.HTTPError, ValueError, KeyError):
        return None
    special = int(empty["count"])
    first = {w: int(r["count"]) - special for w, r in zip(VOCABULARY, firsts)}
    later = {w: int(r["count"]) - int(the["count"]) for w, r in zip(VOCABULARY, laters)}
    if min(first.values()) < 1 or min(later.values()) < 1:
        return None  # a tokenizer that merges across words: the additive model does not hold
    max_len = empty.get("max_model_len")
    return WordCosts(first, later, special), int(max_len) if max_len else None


async def count_prompt_tokens(http: httpx.AsyncClient, url: str, model: str, prompts: list[str],
                              parallel: int = 16) -> list[int] | None:
    """Exact prompt lengths by the server's tokenizer (None if it cannot count them all)."""
    gate = asyncio.Semaphore(parallel)

    async def one(prompt: str) -> int:
        async with gate:
            return int((await _tokenize(http, url, model, prompt))["count"])

    try:
        return list(await asyncio.gather(*(one(p) for p in prompts)))
    except (httpx.HTTPError, ValueError, KeyError):
        return None


class StreamingClient:
    """Sends one workload request and fills its `RequestResult` (never raises for server faults)."""

    def __init__(self, http: httpx.AsyncClient, url: str, model: str, request_timeout_s: float) -> None:
        self.http = http
        self.endpoint = url.rstrip("/") + "/v1/completions"
        self.model = model
        self.request_timeout_s = request_timeout_s

    def payload(self, request: BenchRequest) -> dict:
        return {
            "model": self.model, "prompt": request.prompt, "max_tokens": request.max_tokens,
            "temperature": 0.0, "stream": True, "stream_options": {"include_usage": True},
            "ignore_eos": True,
        }

    async def send(self, request: BenchRequest, result: RequestResult) -> RequestResult:
        result.sent_at = time.perf_counter()
        try:
            async with asyncio.timeout(self.request_timeout_s):
                await self._stream(request, result)
        except TimeoutError:
            result.status, result.error = TIMED_OUT, f"no complete answer within {self.request_timeout_s:g}s"
        except httpx.ConnectError:
            result.status, result.error = FAILED, "connection refused"
        except (httpx.RemoteProtocolError, httpx.ReadError, httpx.WriteError) as err:
            result.status, result.error = FAILED, f"connection lost: {type(err).__name__}"
        except httpx.HTTPError as err:
            result.status, result.error = FAILED, f"{type(err).__name__}: {err}"
        except asyncio.CancelledError:
            result.status = CANCELLED
            raise
        return result

    async def _stream(self, request: BenchRequest, result: RequestResult) -> None:
        start = result.sent_at
        async with self.http.stream("POST", self.endpoint, json=self.payload(request)) as response:
            if response.status_code != 200:
                body = (await response.aread())[:300].decode(errors="replace")
                result.status, result.error = FAILED, f"HTTP {response.status_code}: {_message(body)}"
                return
            state = _StreamState(start)
            buffer = b""
            # Bytes split on the SSE event separator (cheaper than aiter_lines(): the client
            # may share a few cores with the server).
            async for raw in response.aiter_bytes():
                now = time.perf_counter()
                buffer += raw
                if b"\r" in buffer:
                    buffer = buffer.replace(b"\r\n", b"\n")
                *events, buffer = buffer.split(b"\n\n")
                for event in events:
                    for line in event.split(b"\n"):
                        if line.startswith(b"data:") and not state.take(line[5:].strip(), now, result):
                            result.overhead_s += time.perf_counter() - now
                            return
                result.overhead_s += time.perf_counter() - now
                # No break after [DONE]: a body read to its end returns the connection to the
                # pool; leaving early closes it, and every request would pay a new connection.
            result.e2e = time.perf_counter() - start
        if not state.finished or result.ttft is None:
            result.status = FAILED
            result.error = "stream ended before [DONE]" if not state.finished else "no tokens"
            return
        if not result.output_tokens:
            result.output_tokens = result.num_chunks  # a server without usage reporting
        result.status = OK


class _StreamState:
    """Token timing across the events of one stream."""

    __slots__ = ("finished", "previous", "start")

    def __init__(self, start: float) -> None:
        self.start = start
        self.previous: float | None = None
        self.finished = False

    def take(self, data: bytes, now: float, result: RequestResult) -> bool:
        """Account one `data:` payload; False when the stream is to be abandoned as failed."""
        if data == b"[DONE]":
            self.finished = True
            return True
        try:
            chunk = json.loads(data)
        except json.JSONDecodeError:
            result.status, result.error = FAILED, "malformed stream chunk"
            return False
        if choices := chunk.get("choices"):
            result.num_chunks += 1
            if result.text is not None:
                result.text.append(choices[0].get("text") or "")
            if self.previous is None:
                result.ttft = now - self.start
            else:
                result.itls.append(now - self.previous)
            self.previous = now
            result.last_token_at = now - self.start
        elif usage := chunk.get("usage"):
            result.output_tokens = int(usage.get("completion_tokens") or 0)
            result.prompt_tokens = usage.get("prompt_tokens")
        elif error := chunk.get("error"):
            result.status, result.error = FAILED, f"server error: {_message(json.dumps(error))}"
            return False
        return True


def _message(body: str) -> str:
    """The `message` of an OpenAI-style error body, else the body itself, on one line."""
    try:
        parsed = json.loads(body)
        found = parsed.get("error", parsed) if isinstance(parsed, dict) else parsed
        if isinstance(found, dict):
            found = found.get("message", found)
        text = str(found)
    except (json.JSONDecodeError, AttributeError):
        text = body
    return " ".join(text.split())[:200]
