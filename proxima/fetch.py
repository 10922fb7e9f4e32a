"""Bounded, validated reads of a server's HTTP endpoints, for the tools (top, doctor, bench).

Layer: I/O under `proxima.scrape` (`/metrics`), `proxima.load` and `proxima.streaming`
(completions, whole and streamed), `proxima.bench.client` (`/v1/models`, `/tokenize`) and the
probes (`/v1/models`, `/version`).
Invariants:
  - every read has a cap on its body (`max_bytes`) and on its total time (`timeout`): httpx's
    timeouts are per operation, so a server that trickles a byte a second would otherwise never
    time out, and one that streams an endless body would fill memory;
  - JSON is parsed strictly (`parse_json`): no NaN or Infinity, no nesting deep enough to exhaust
    the parser's stack; the shapes the tools rely on are checked here (`first_model`,
    `token_count`) and in `proxima.completion_answers` (a /v1/completions answer), so a
    wrong-typed answer is a `MalformedAnswer` naming what is wrong, never a TypeError three calls
    later;
  - a failure becomes one line (`describe_http_error`), which the tools put after the server's URL.
The one rule for what a server URL is (`normalize_url`) and for which API key a tool sends
(`api_key_from`) also live here; whether a URL is this machine is `proxima.hosts`.
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import time
from dataclasses import dataclass
from urllib.parse import urlsplit

import httpx

# A real /metrics is tens of KiB (a two-engine vLLM 0.26 server: 97 KiB, tests/data/dp2); 4 MiB
# leaves room for many engines and adapters while bounding parse time, which is pure Python
# (200k label values took ~15 s).
MAX_METRICS_BYTES = 4 << 20
# /v1/models, /tokenize, /version and a whole (non-streamed) completion. The largest the tools
# ask for is a completion with its token ids: ~10 bytes a token, so 4 MiB is 400k tokens.
MAX_ANSWER_BYTES = 4 << 20
# One server-sent event of a stream (a token chunk is ~300 bytes; with logprobs a few KiB), and a
# whole stream: an answer of max_tokens chunks is far below either.
MAX_EVENT_BYTES = 1 << 20
MAX_STREAM_BYTES = 64 << 20
# Nesting no real answer comes near (an OpenAI answer is 4 deep): deeper is refused before the
# JSON parser's recursion, which at ~200,000 levels ends in RecursionError.
MAX_JSON_DEPTH = 64

API_KEY_ENVS = ("VLLM_API_KEY", "OPENAI_API_KEY")

# vLLM's server closes a connection idle for VLLM_HTTP_TIMEOUT_KEEP_ALIVE (5 s), and httpx keeps
# one for 5 s by default: a request sent on a connection in its last instant meets the server's
# close and fails (ReadError or RemoteProtocolError), a failure of the client that a tool would
# report as the server's (scripts/keepalive_race.py reproduces it). Every client the tools make
# retires idle connections well before the server does (`client_limits`).
KEEPALIVE_EXPIRY_S = 2.0


def client_limits(max_connections: int | None = 100,
                  max_keepalive_connections: int | None = 20) -> httpx.Limits:
    """httpx's connection limits (its defaults unless given) with idle connections retired
    after KEEPALIVE_EXPIRY_S: the limits of every client the tools make."""
    return httpx.Limits(max_connections=max_connections, max_keepalive_connections=max_keepalive_connections,
                        keepalive_expiry=KEEPALIVE_EXPIRY_S)


class BodyTooLarge(ValueError):
    pass


class MalformedAnswer(ValueError):
    """The server answered, but not what the endpoint returns (not JSON, wrong types, implausible)."""


class ScrapeTimeout(httpx.TimeoutException):
    """The whole read took longer than its budget (a slow or trickling server)."""


def normalize_url(text: str) -> str:
    """`localhost:8000` → `http://localhost:8000`; raises ValueError naming what is wrong."""
    url = text.strip().rstrip("/")
    if "://" not in url:
        url = "http://" + url
    try:
        parts = urlsplit(url)  # raises ValueError on e.g. "http://[::1" (an unclosed IPv6 host)
        host = parts.hostname
    except ValueError as err:
        raise ValueError(f"not a server URL: {text!r} ({err}; expected e.g. http://127.0.0.1:8000)") from None
    if parts.scheme not in ("http", "https") or not host:
        raise ValueError(f"not a server URL: {text!r} (expected e.g. http://127.0.0.1:8000)")
    try:
        parts.port  # noqa: B018 (raises ValueError on a bad port)
    except ValueError:
        raise ValueError(f"bad port in {text!r} (expected e.g. http://127.0.0.1:8000)") from None
    return url


def api_key_from(option: str | None, env: dict[str, str] | None = None) -> str | None:
    """The API key a tool sends: `--api-key`, else $VLLM_API_KEY (the key a vLLM server started in
    this environment checks), else $OPENAI_API_KEY (what OpenAI clients read)."""
    env = os.environ if env is None else env
    for value in (option, *(env.get(name) for name in API_KEY_ENVS)):
        if value and value.strip():
            return value.strip()
    return None


def auth_headers(api_key: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


# ---------------------------------------------------------------- bounded reads

@dataclass(frozen=True, slots=True)
class Answer:
    """A whole HTTP answer, read within its byte and time budget."""

    status: int
    body: bytes
    encoding: str | None = None

    @property
    def ok(self) -> bool:
        return 200 <= self.status < 300

    def text(self) -> str:
        return self.body.decode(self.encoding or "utf-8", errors="replace")

    def json(self) -> object:
        return parse_json(self.body)


async def fetch(client: httpx.AsyncClient, method: str, url: str, timeout: float, *,
                max_bytes: int = MAX_ANSWER_BYTES, json_body: object = None) -> Answer:
    """`method url` (with `json_body`), the whole answer within `timeout` seconds in all and
    `max_bytes`, whatever its status. Raises httpx errors, `ScrapeTimeout` and `BodyTooLarge`.

    The read runs in the caller's task under `asyncio.timeout`, not in a task of its own under
    `asyncio.wait_for`: on Python 3.11 wait_for returns the answer, and drops the caller's cancel,
    when the cancel lands as the read completes, and the caller (a sampler, say) then goes on
    reading as if nothing had asked it to stop.
    """
    try:
        async with asyncio.timeout(timeout):
            async with client.stream(method, url, json=json_body, timeout=timeout) as response:
                body = bytearray()
                async for chunk in response.aiter_bytes():
                    body += chunk
                    _check_size(body, max_bytes)
                return Answer(response.status_code, bytes(body), response.encoding)
    except TimeoutError:
        raise ScrapeTimeout(f"no complete answer within {timeout:g} s") from None


def fetch_sync(client: httpx.Client | None, method: str, url: str, timeout: float, *,
               max_bytes: int = MAX_ANSWER_BYTES, json_body: object = None) -> Answer:
    """The blocking form: the deadline is checked between chunks, each read waits at most
    `timeout`, so a trickling server costs at most about twice the budget."""
    deadline = time.monotonic() + timeout
    own = client is None
    client = client or httpx.Client(limits=client_limits())
    try:
        with client.stream(method, url, json=json_body, timeout=timeout) as response:
            body = bytearray()
            for chunk in response.iter_bytes():
                body += chunk
                _check_size(body, max_bytes)
                if time.monotonic() > deadline:
                    raise ScrapeTimeout(f"no complete answer within {timeout:g} s")
            return Answer(response.status_code, bytes(body), response.encoding)
    finally:
        if own:
            client.close()


class HTTPStatus(httpx.HTTPError):
    """A non-2xx answer to a read that needs a 2xx one."""

    def __init__(self, status: int, body: bytes = b"") -> None:
        super().__init__(f"HTTP {status}")
        self.status, self.body = status, body


def checked(answer: Answer) -> Answer:
    if not answer.ok:
        raise HTTPStatus(answer.status, answer.body[:300])
    return answer


async def get_text(client: httpx.AsyncClient, url: str, timeout: float,
                   max_bytes: int = MAX_METRICS_BYTES) -> str:
    """GET `url`'s body as text (2xx only), within `timeout` seconds in all and `max_bytes`."""
    return checked(await fetch(client, "GET", url, timeout, max_bytes=max_bytes)).text()


def get_text_sync(client: httpx.Client | None, url: str, timeout: float,
                  max_bytes: int = MAX_METRICS_BYTES) -> str:
    return checked(fetch_sync(client, "GET", url, timeout, max_bytes=max_bytes)).text()


async def get_json(client: httpx.AsyncClient, url: str, timeout: float, *,
                   max_bytes: int = MAX_ANSWER_BYTES, json_body: object = None) -> object:
    """GET (POST with `json_body`) a JSON answer, 2xx only, bounded, strictly parsed."""
    method = "GET" if json_body is None else "POST"
    return checked(await fetch(client, method, url, timeout, max_bytes=max_bytes, json_body=json_body)).json()


async def read_start(response: httpx.Response, limit: int) -> bytes:
    """The first `limit` bytes of an answer being streamed (an error's message), never an endless
    body."""
    body = b""
    async for chunk in response.aiter_bytes():
        body += chunk
        if len(body) >= limit:
            break
    return body[:limit]


def _check_size(body: bytearray, max_bytes: int) -> None:
    if len(body) > max_bytes:
        raise BodyTooLarge(f"answer larger than {_size(max_bytes)}; not read")


def _size(n: int) -> str:
    return f"{n >> 20} MiB" if n >= 1 << 20 else f"{n >> 10} KiB"


def describe_http_error(err: Exception) -> str:
    """One line for a failed read, as the tools show it after the server's URL."""
    if isinstance(err, httpx.ConnectError):
        return "connection refused (is the server running?)"
    if isinstance(err, httpx.TimeoutException):
        return f"timed out ({err})" if isinstance(err, ScrapeTimeout) else "timed out"
    status = err.status if isinstance(err, HTTPStatus) else (
        err.response.status_code if isinstance(err, httpx.HTTPStatusError) else None)
    if status in (401, 403):
        return (f"HTTP {status}: the server wants an API key (pass --api-key KEY, or set "
                f"{' or '.join(API_KEY_ENVS)})")
    if status is not None:
        return f"HTTP {status}"
    if isinstance(err, (BodyTooLarge, MalformedAnswer)):
        return str(err)
    if isinstance(err, (httpx.RemoteProtocolError, httpx.ReadError)):
        return f"connection lost mid-answer ({type(err).__name__})"
    return f"{type(err).__name__}: {err}"


# ---------------------------------------------------------------- strict JSON and its shapes

def _refuse_constant(name: str) -> float:
    raise MalformedAnswer(f"{name} in a JSON answer (not a number)")


def parse_json(body: bytes | str) -> object:
    """Strict JSON: NaN and ±Infinity refused, nesting deeper than MAX_JSON_DEPTH refused before
    parsing (bracket count outside strings), undecodable or truncated text a MalformedAnswer."""
    text = body.decode("utf-8", errors="replace") if isinstance(body, bytes) else body
    if _depth(text) > MAX_JSON_DEPTH:
        raise MalformedAnswer(f"JSON nested more than {MAX_JSON_DEPTH} deep")
    try:
        return json.loads(text, parse_constant=_refuse_constant)
    except (json.JSONDecodeError, RecursionError) as err:
        raise MalformedAnswer(f"not JSON ({err})" if text.strip() else "an empty answer") from None
    except ValueError as err:  # e.g. an integer of more than 4,300 digits
        raise MalformedAnswer(f"not JSON ({err})") from None


def _depth(text: str) -> int:
    """Deepest bracket nesting outside strings. A cheap pre-check: most answers have no string
    with a bracket in it, so the first pass (which ignores strings) is exact and C-fast."""
    opens = text.count("[") + text.count("{")
    if opens <= MAX_JSON_DEPTH:
        return opens
    depth = deepest = 0
    in_string = escaped = False
    for ch in text:
        if in_string:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == '"':
                in_string = False
        elif ch == '"':
            in_string = True
        elif ch in "[{":
            depth += 1
            if depth > deepest:
                deepest = depth
                if deepest > MAX_JSON_DEPTH:
                    return deepest
        elif ch in "]}":
            depth -= 1
    return deepest


def is_count(value: object) -> bool:
    """A non-negative integer as JSON gives one (a bool is not a count)."""
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


@dataclass(frozen=True, slots=True)
class ServedModel:
    id: str
    max_model_len: int | None


# No model has a context near this; a larger max_model_len is a wrong answer, not a big model.
MAX_PLAUSIBLE_CONTEXT = 1 << 30


def first_model(payload: object) -> ServedModel:
    """The first model of an OpenAI `/v1/models` answer; ValueError names what is missing."""
    data = payload.get("data") if isinstance(payload, dict) else None
    if not isinstance(data, list):
        raise MalformedAnswer('/v1/models is not an OpenAI model list (no "data" list); '
                              "is this an OpenAI-compatible server?")
    if not data:
        raise MalformedAnswer("the server lists no model at /v1/models")
    first = data[0]
    if not isinstance(first, dict) or not isinstance(first.get("id"), str) or not first["id"].strip():
        raise MalformedAnswer('/v1/models lists a model without an "id"; '
                              "is this an OpenAI-compatible server?")
    if len(first["id"]) > 4096:
        raise MalformedAnswer("/v1/models lists a model id longer than 4,096 characters")
    max_len = first.get("max_model_len")
    valid = is_count(max_len) and 0 < max_len <= MAX_PLAUSIBLE_CONTEXT
    return ServedModel(first["id"], max_len if valid else None)


def token_count(payload: object) -> tuple[int, int | None]:
    """(`count`, `max_model_len` or None) of a vLLM `/tokenize` answer; MalformedAnswer otherwise."""
    count = payload.get("count") if isinstance(payload, dict) else None
    if not is_count(count) or count > MAX_PLAUSIBLE_CONTEXT:
        raise MalformedAnswer(f'/tokenize answered without a token "count" ({_shown(payload)})')
    max_len = payload.get("max_model_len")
    valid = is_count(max_len) and 0 < max_len <= MAX_PLAUSIBLE_CONTEXT
    return count, max_len if valid else None


def _shown(value: object, limit: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "..."
