"""The real model's equivalence scenarios, driven over HTTP against one running server.

SmolLM2-135M-Instruct in float32 (tests/conftest.py's `smol_model`), greedy, through the OpenAI
chat API of `proxima serve` or stock vLLM's server, so that the chat template, tokenisation and
end-of-turn are the ones users get. Until the in-process engine harness lands this is how the
real model reaches the engine-equivalence tests (tests/test_real_model_equivalence.py).

Scenarios (what each engine must answer token for token as the other does):
  support    16 customer-service chats at once, sharing one ~430-token system prompt: longer than
             the 256-token step budget (chunked prefill), not a multiple of a 32-token block, and
             shared within the burst while the first request is still computing it;
  general    8 everyday questions at once under the model's own default system prompt;
  multiturn  4 conversations, second turn resending the first question, the answer and a new
             question (a cached prompt *and* answer are reused);
  passages   8 passages of the accuracy text (proxima/accuracy_corpus.py, ~3,300 tokens), scored
             teacher-forced: vLLM's top-20 `prompt_logprobs` at every position. Free-running
             greedy answers cannot compare two fp8 engines exactly (see
             tests/test_real_model_equivalence.py); next-token distributions on one fixed text can.
"""

from __future__ import annotations

import asyncio

import httpx

from proxima.accuracy_corpus import passages
from proxima.chat_prompts import GENERAL_QUESTIONS, SUPPORT_QUESTIONS, general_chat, support_chat
from proxima.load import Completion, LoadDriver
from proxima.scrape import scrape

# 64 MiB of KV: 1,456 float32 slots (30 layers x 3 KV heads x 64 x K+V x 4 bytes = 45 KiB a
# token), enough for the 16-chat burst without preemption (the tiny-model tests cover that).
SERVER_ARGS = (
    "--dtype", "float32", "--max-model-len", "1024", "--enforce-eager", "--max-num-seqs", "16",
    "--max-num-batched-tokens", "256", "--kv-cache-memory-bytes", str(64 << 20),
)
# name: (server variant, its own flags). vLLM's CPU backend needs blocks of a multiple of 32.
RUNS = {
    "token": ("token", ()),
    "token-nocache": ("token", ("--no-enable-prefix-caching",)),
    "stock": ("stock", ("--block-size", "32")),
    "token-fp8": ("token", ("--kv-cache-dtype", "fp8")),
    "stock-fp8": ("stock", ("--block-size", "32", "--kv-cache-dtype", "fp8")),
    "stock-fp8-b16": ("stock", ("--block-size", "16", "--kv-cache-dtype", "fp8")),
}
MAX_TOKENS = 48
TIMEOUT_S = 600.0
TOP_LOGPROBS = 20  # vLLM's default --max-logprobs
NUM_PASSAGES, PASSAGE_CHARS = 8, 1200  # 300-534 tokens each with SmolLM2's tokenizer


def _ids(done: list[Completion]) -> list[list[int]]:
    for c in done:
        assert c.ok and c.token_ids is not None, c.error
    return [list(c.token_ids) for c in done]


async def run_scenarios(url: str, model: str, concurrency: int | None = None, score: bool = True) -> dict:
    """Every scenario's greedy token ids, and the server's KV figures after each (via /metrics).
    `concurrency`: requests in flight at once (default: each scenario's whole burst); `score`:
    also score the passages."""
    out: dict = {}
    async with httpx.AsyncClient(timeout=TIMEOUT_S) as client:
        driver = LoadDriver(client, url, model)

        async def burst(chats: list[list[dict[str, str]]]) -> list[Completion]:
            return await driver.each_chat_once([(c, MAX_TOKENS) for c in chats], concurrency or len(chats),
                                               timeout=TIMEOUT_S)

        async def after() -> dict:
            await asyncio.sleep(0.3)  # the engine publishes its idle state on its next idle step
            snap = await scrape(client, url)
            assert snap.ok, snap.error
            kv = snap.proxima
            return {"prefix_hits": snap.prefix_cache_hits_total,
                    "slots_used": kv.slots_used if kv else None,
                    "requests_holding": kv.requests_holding_slots if kv else None,
                    "bytes_per_token": kv.bytes_per_token if kv else None}

        support = [support_chat(q) for q in SUPPORT_QUESTIONS[:16]]
        done = await burst(support)
        out["support"] = {"outputs": _ids(done), "prompt_tokens": [c.prompt_tokens for c in done],
                          "after": await after()}

        done = await burst([general_chat(q) for q in GENERAL_QUESTIONS[:8]])
        out["general"] = {"outputs": _ids(done), "after": await after()}

        convs = [support_chat(q) for q in SUPPORT_QUESTIONS[16:20]]
        first = await burst(convs)
        follow_ups = [SUPPORT_QUESTIONS[40 + i] for i in range(len(convs))]
        second = await burst([c + [{"role": "assistant", "content": a.text}, {"role": "user", "content": q}]
                              for c, a, q in zip(convs, first, follow_ups)])
        out["multiturn"] = {"outputs": [_ids(first), _ids(second)], "after": await after()}

        if score:
            out["passages"] = {"scored": [await _score(client, url, model, text)
                                          for text in passages(NUM_PASSAGES, PASSAGE_CHARS)]}
    return out


async def _score(client: httpx.AsyncClient, url: str, model: str, text: str) -> dict:
    """One passage's prompt token ids and vLLM's prompt logprobs (JSON form), teacher-forced."""
    response = await client.post(f"{url}/v1/completions", json={
        "model": model, "prompt": text, "max_tokens": 1, "temperature": 0,
        "prompt_logprobs": TOP_LOGPROBS, "return_token_ids": True})
    assert response.status_code == 200, response.text[:500]
    choice = response.json()["choices"][0]
    return {"prompt_token_ids": choice["prompt_token_ids"], "prompt_logprobs": choice["prompt_logprobs"]}
