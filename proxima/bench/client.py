"""What `proxima bench` asks a server besides load: its model (`/v1/models`) and its tokenizer's
counts (`/tokenize`), so that a workload can be built to exact token lengths.

The load itself goes through `proxima.load`. `fetch_model` raises `ServerUnreachable` with a
one-line reason; the tokenizer queries return None when the server cannot answer them.
"""

from __future__ import annotations

import asyncio

import httpx

from proxima.bench.workload import VOCABULARY, WordCosts
from proxima.fetch import describe_http_error, first_model, get_json, token_count

# Each read of the server's model list or tokenizer, in all (a trickling server costs this much);
# callers may pass less (bench: at most its --timeout).
READ_TIMEOUT_S = 10.0
# All tokenizer queries of one workload together: a slow /tokenize is given up on, and the
# workload approximated, rather than waited on query by query.
TOKENIZE_BUDGET_S = 60.0


class ServerUnreachable(RuntimeError):
    """The server did not answer `/v1/models`; the message says where and why."""


async def fetch_model(http: httpx.AsyncClient, url: str, timeout: float = READ_TIMEOUT_S) -> str:
    """The first served model's name; raises ServerUnreachable with a one-line reason."""
    url = url.rstrip("/")
    try:
        return first_model(await get_json(http, url + "/v1/models", timeout)).id
    except (httpx.ConnectError, httpx.ConnectTimeout) as err:
        raise ServerUnreachable(f"cannot reach {url}: {describe_http_error(err)}") from None
    except (httpx.HTTPError, httpx.InvalidURL, ValueError) as err:
        reason = describe_http_error(err)
    if "OpenAI" not in reason and "lists no model" not in reason and "API key" not in reason:
        reason += "; is it an OpenAI-compatible server?"
    raise ServerUnreachable(f"{url}/v1/models: {reason}")


async def _count(http: httpx.AsyncClient, url: str, model: str, prompt: str,
                 timeout: float) -> tuple[int, int | None]:
    return token_count(await get_json(http, url.rstrip("/") + "/tokenize", timeout,
                                      json_body={"model": model, "prompt": prompt}))


async def _all(coros, budget_s: float) -> list | None:
    """Every result, or None as soon as one fails (the others cancelled) or the budget runs out."""
    failed = False
    try:
        async with asyncio.timeout(budget_s):
            try:
                async with asyncio.TaskGroup() as group:
                    tasks = [group.create_task(c) for c in coros]
            except* (httpx.HTTPError, httpx.InvalidURL, ValueError):
                failed = True
    except TimeoutError:
        failed = True
    return None if failed else [t.result() for t in tasks]


async def fetch_word_costs(http: httpx.AsyncClient, url: str, model: str,
                           timeout: float = READ_TIMEOUT_S) -> tuple[WordCosts, int | None] | None:
    """Token cost of every vocabulary word from the server's tokenizer, and its max_model_len.

    None when the server has no `/tokenize` (not vLLM, or disabled), or answers it slowly or
    wrongly: callers approximate.
    """
    gate = asyncio.Semaphore(16)

    async def count(prompt: str) -> tuple[int, int | None]:
        async with gate:
            return await _count(http, url, model, prompt, timeout)

    prompts = ["", "the", *VOCABULARY, *("the " + w for w in VOCABULARY)]
    counts = await _all([count(p) for p in prompts], TOKENIZE_BUDGET_S)
    if counts is None:
        return None
    (special, max_len), (the, _) = counts[:2]
    firsts, laters = counts[2:2 + len(VOCABULARY)], counts[2 + len(VOCABULARY):]
    first = {w: n - special for w, (n, _) in zip(VOCABULARY, firsts)}
    later = {w: n - the for w, (n, _) in zip(VOCABULARY, laters)}
    if min(first.values()) < 1 or min(later.values()) < 1:
        return None  # a tokenizer that merges across words: the additive model does not hold
    return WordCosts(first, later, special), max_len


async def count_prompt_tokens(http: httpx.AsyncClient, url: str, model: str, prompts: list[str],
                              parallel: int = 16, timeout: float = READ_TIMEOUT_S) -> list[int] | None:
    """Exact prompt lengths by the server's tokenizer (None if it cannot count them all, in time)."""
    gate = asyncio.Semaphore(parallel)

    async def one(prompt: str) -> int:
        async with gate:
            return (await _count(http, url, model, prompt, timeout))[0]

    return await _all([one(p) for p in prompts], TOKENIZE_BUDGET_S + len(prompts) / parallel)
