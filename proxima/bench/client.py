"""What `proxima bench` asks a server besides load: its model (`/v1/models`) and its tokenizer's
counts (`/tokenize`), so that a workload can be built to exact token lengths.

The load itself goes through `proxima.load`. `fetch_model` raises `ServerUnreachable` with a
one-line reason; the tokenizer queries return None when the server cannot answer them.
"""

from __future__ import annotations

import asyncio
import json

import httpx

from proxima.bench.workload import VOCABULARY, WordCosts
from proxima.fetch import first_model


class ServerUnreachable(RuntimeError):
    """The server did not answer `/v1/models`; the message says where and why."""


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
