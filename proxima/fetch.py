"""Bounded reads of a server's HTTP endpoints, for the tools (top, doctor, bench).

A tool watching several servers must not be held by one: every read here has a cap on the body
(`MAX_METRICS_BYTES`) and on its total time (httpx's timeouts are per operation, so a server that
trickles a byte a second would never time out). The one rule for what a server URL is
(`normalize_url`) and for the shape of `/v1/models` (`first_model`) also live here; whether a
URL is this machine is `proxima.hosts`.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from urllib.parse import urlsplit

import httpx

# A real /metrics is tens of KiB (a two-engine vLLM 0.26 server: 97 KiB, tests/data/dp2); 4 MiB
# leaves room for many engines and adapters while bounding parse time, which is pure Python
# (200k label values took ~15 s).
MAX_METRICS_BYTES = 4 << 20


class BodyTooLarge(ValueError):
    pass


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


async def get_text(client: httpx.AsyncClient, url: str, timeout: float,
                   max_bytes: int = MAX_METRICS_BYTES) -> str:
    """GET `url`'s body as text, within `timeout` seconds in all and `max_bytes`.

    The read runs in the caller's task under `asyncio.timeout`, not in a task of its own under
    `asyncio.wait_for`: on Python 3.11 wait_for returns the answer, and drops the caller's cancel,
    when the cancel lands as the read completes, and the caller (a sampler, say) then goes on
    reading as if nothing had asked it to stop.
    """
    try:
        async with asyncio.timeout(timeout):
            return await _read(client, url, timeout, max_bytes)
    except TimeoutError:
        raise ScrapeTimeout(f"no complete answer within {timeout:g} s") from None


async def _read(client: httpx.AsyncClient, url: str, timeout: float, max_bytes: int) -> str:
    async with client.stream("GET", url, timeout=timeout) as response:
        response.raise_for_status()
        body = bytearray()
        async for chunk in response.aiter_bytes():
            body += chunk
            _check_size(body, max_bytes)
        return body.decode(response.encoding or "utf-8", errors="replace")


def get_text_sync(client: httpx.Client | None, url: str, timeout: float,
                  max_bytes: int = MAX_METRICS_BYTES) -> str:
    """The blocking form: the deadline is checked between chunks, each read waits at most
    `timeout`, so a trickling server costs at most about twice the budget."""
    deadline = time.monotonic() + timeout
    own = client is None
    client = client or httpx.Client()
    try:
        with client.stream("GET", url, timeout=timeout) as response:
            response.raise_for_status()
            body = bytearray()
            for chunk in response.iter_bytes():
                body += chunk
                _check_size(body, max_bytes)
                if time.monotonic() > deadline:
                    raise ScrapeTimeout(f"no complete answer within {timeout:g} s")
            return body.decode(response.encoding or "utf-8", errors="replace")
    finally:
        if own:
            client.close()


def _check_size(body: bytearray, max_bytes: int) -> None:
    if len(body) > max_bytes:
        raise BodyTooLarge(f"answer larger than {max_bytes >> 20} MiB; not read")


@dataclass(frozen=True, slots=True)
class ServedModel:
    id: str
    max_model_len: int | None


def first_model(payload: object) -> ServedModel:
    """The first model of an OpenAI `/v1/models` answer; ValueError names what is missing."""
    data = payload.get("data") if isinstance(payload, dict) else None
    if not isinstance(data, list):
        raise ValueError('/v1/models is not an OpenAI model list (no "data" list); '
                         "is this an OpenAI-compatible server?")
    if not data:
        raise ValueError("the server lists no model at /v1/models")
    first = data[0]
    if not isinstance(first, dict) or not isinstance(first.get("id"), str) or not first["id"]:
        raise ValueError('/v1/models lists a model without an "id"; is this an OpenAI-compatible server?')
    max_len = first.get("max_model_len")
    valid = isinstance(max_len, int) and not isinstance(max_len, bool) and max_len > 0
    return ServedModel(first["id"], max_len if valid else None)
