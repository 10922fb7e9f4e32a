"""Streamed, timed completions for `proxima bench` (and the soak): one request per `send`, timed on
arrival of each SSE line: TTFT = first token chunk, ITL = gaps between token chunks, E2E = until the
stream ends, and the time the client itself spends on each line (`overhead_s`), so a client that
cannot keep up shows in the results rather than as a slower server.

Same request body and the same promises as `proxima.load` (whole answers): requests go only to
the URL the client was built for, a server's failure is a result with its reason, never raised,
and nothing started here outlives the call.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field

import httpx

from proxima.fetch import (
    MAX_EVENT_BYTES,
    MAX_STREAM_BYTES,
    MalformedAnswer,
    is_count,
    parse_json,
    read_start,
)
from proxima.load import completion_body, completions_url, error_message

OK, FAILED, TIMED_OUT, CANCELLED = "ok", "failed", "timed_out", "cancelled"


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


class StreamingClient:
    """Sends one streamed request and fills its `RequestResult` (never raises for server faults)."""

    def __init__(self, http: httpx.AsyncClient, url: str, model: str, request_timeout_s: float) -> None:
        self.http = http
        self.endpoint = completions_url(url)
        self.model = model
        self.request_timeout_s = request_timeout_s

    def payload(self, prompt: str, max_tokens: int) -> dict:
        return completion_body(self.model, prompt, max_tokens, stream=True)

    async def send(self, prompt: str, max_tokens: int, result: RequestResult) -> RequestResult:
        """Stream one request into `result`. Every way it can end is a status: ok, failed (with
        the reason) or timed out, and cancelled only when the caller cancels; a server's answer
        of any shape never escapes as an exception, so no request is lost from the counts."""
        result.sent_at = time.perf_counter()
        try:
            async with asyncio.timeout(self.request_timeout_s):
                await self._stream(self.payload(prompt, max_tokens), max_tokens, result)
        except TimeoutError:
            result.status, result.error = TIMED_OUT, f"no complete answer within {self.request_timeout_s:g}s"
        except httpx.ConnectError:
            result.status, result.error = FAILED, "connection refused"
        except (httpx.RemoteProtocolError, httpx.ReadError, httpx.WriteError) as err:
            result.status, result.error = FAILED, f"connection lost: {type(err).__name__}"
        except httpx.HTTPError as err:
            result.status, result.error = FAILED, f"{type(err).__name__}: {err}"
        except MalformedAnswer as err:
            result.status, result.error = FAILED, f"malformed stream: {err}"
        except asyncio.CancelledError:
            result.status = CANCELLED
            raise
        except Exception as err:  # noqa: BLE001 (a bug here must cost one request, counted, not the run)
            result.status, result.error = FAILED, f"unexpected answer ({type(err).__name__}: {err})"
        return result

    async def _stream(self, body: dict, max_tokens: int, result: RequestResult) -> None:
        start = result.sent_at
        async with self.http.stream("POST", self.endpoint, json=body) as response:
            if response.status_code != 200:
                text = (await read_start(response, 2000)).decode(errors="replace")
                result.status, result.error = FAILED, f"HTTP {response.status_code}: {error_message(text)}"
                return
            state = _StreamState(start, max_tokens)
            buffer = b""
            received = 0
            # Bytes split on the SSE event separator (cheaper than aiter_lines(): the client
            # may share a few cores with the server).
            async for raw in response.aiter_bytes():
                now = time.perf_counter()
                received += len(raw)
                buffer += raw
                if b"\r" in buffer:
                    buffer = buffer.replace(b"\r\n", b"\n")
                *events, buffer = buffer.split(b"\n\n")
                if len(buffer) > MAX_EVENT_BYTES or received > MAX_STREAM_BYTES:
                    raise MalformedAnswer(f"an event over {MAX_EVENT_BYTES >> 20} MiB or a stream over "
                                          f"{MAX_STREAM_BYTES >> 20} MiB")
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
    """Token timing across the events of one stream, each event checked before it counts."""

    __slots__ = ("finished", "max_tokens", "previous", "start")

    def __init__(self, start: float, max_tokens: int) -> None:
        self.start = start
        self.max_tokens = max_tokens
        self.previous: float | None = None
        self.finished = False

    def take(self, data: bytes, now: float, result: RequestResult) -> bool:
        """Account one `data:` payload; False when the stream is to be abandoned as failed."""
        if data == b"[DONE]":
            self.finished = True
            return True
        try:
            chunk = parse_json(data)
            if not isinstance(chunk, dict):
                shown = error_message(data.decode(errors="replace"))
                raise MalformedAnswer(f"a chunk that is not an object ({shown})")
            if self.finished:
                raise MalformedAnswer("a chunk after [DONE]")
            if error := chunk.get("error"):
                result.status, result.error = FAILED, f"server error: {error_message(json.dumps(error))}"
                return False
            self._token(chunk, now, result)
            self._usage(chunk, result)
        except MalformedAnswer as err:
            result.status, result.error = FAILED, f"malformed stream chunk: {err}"
            return False
        return True

    def _token(self, chunk: dict, now: float, result: RequestResult) -> None:
        choices = chunk.get("choices")
        if choices is None or choices == []:
            return
        if not isinstance(choices, list) or not isinstance(choices[0], dict):
            raise MalformedAnswer('"choices" is not a list of objects')
        text = choices[0].get("text")
        if text is not None and not isinstance(text, str):
            raise MalformedAnswer('"text" is not a string')
        result.num_chunks += 1
        # One chunk a token, and at most one more (a last chunk that only carries finish_reason).
        if result.num_chunks > self.max_tokens + 1:
            raise MalformedAnswer(f"more token chunks than the {self.max_tokens} tokens asked for")
        if result.text is not None:
            result.text.append(text or "")
        if self.previous is None:
            result.ttft = now - self.start
        else:
            result.itls.append(now - self.previous)
        self.previous = now
        result.last_token_at = now - self.start

    def _usage(self, chunk: dict, result: RequestResult) -> None:
        usage = chunk.get("usage")
        if usage is None:
            return
        if not isinstance(usage, dict):
            raise MalformedAnswer('"usage" is not an object')
        completion, prompt = usage.get("completion_tokens"), usage.get("prompt_tokens")
        if not is_count(completion) or (prompt is not None and not is_count(prompt)):
            raise MalformedAnswer('"usage" token counts are not counts')
        if completion > self.max_tokens:
            raise MalformedAnswer(f"usage says {completion} tokens, more than the {self.max_tokens} "
                                  "asked for")
        result.output_tokens = completion
        result.prompt_tokens = prompt
