"""`LoadDriver.chat` and `each_chat_once` against a stand-in transport: the answer's text and token
ids are read, and a server's failure is a failed result, never an exception."""

from __future__ import annotations

import asyncio
import json

import httpx

from proxima.load import LoadDriver


def _driver(handler) -> tuple[LoadDriver, httpx.AsyncClient]:
    client = httpx.AsyncClient(transport=httpx.MockTransport(handler))
    return LoadDriver(client, "http://stand-in", "smol"), client


def test_chat_reads_the_message_and_its_token_ids():
    seen: list[dict] = []

    def handler(request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        seen.append(body)
        assert request.url.path == "/v1/chat/completions"
        answer = f"answer to {body['messages'][-1]['content']}"
        return httpx.Response(200, json={
            "choices": [{"message": {"role": "assistant", "content": answer}, "token_ids": [5, 6]}],
            "usage": {"prompt_tokens": 30, "completion_tokens": 2}})

    async def go():
        driver, client = _driver(handler)
        async with client:
            one = await driver.chat([{"role": "user", "content": "hi"}], 16)
            chats = [([{"role": "user", "content": str(i)}], 8) for i in range(5)]
            many = await driver.each_chat_once(chats, 2)
        return one, many

    one, many = asyncio.run(go())
    assert one.ok and one.text == "answer to hi" and one.token_ids == (5, 6)
    assert (one.prompt_tokens, one.completion_tokens) == (30, 2)
    assert [c.text for c in many] == [f"answer to {i}" for i in range(5)]  # in request order
    assert seen[0]["temperature"] == 0.0 and seen[0]["max_tokens"] == 16 and seen[0]["model"] == "smol"
    assert "ignore_eos" not in seen[0]  # a chat ends where the model ends its turn


def test_chat_failures_are_results():
    answers = iter([httpx.Response(500, text="boom"), httpx.Response(200, json={"choices": [{}]}),
                    httpx.Response(200, json={"choices": [{"message": None}]})])

    async def go():
        driver, client = _driver(lambda request: next(answers))
        async with client:
            return [await driver.chat([{"role": "user", "content": "x"}], 4) for _ in range(3)]

    results = asyncio.run(go())
    assert [r.ok for r in results] == [False, False, False]
    assert results[0].error.startswith("HTTP 500") and "malformed answer" in results[2].error
