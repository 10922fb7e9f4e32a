"""The demo's work: a real instruct model (SmolLM2-135M-Instruct, built from a pinned PyPI
package) served by Proxima, one first question, then a burst of customer-service chats sharing
one system prompt while the server's KV telemetry is sampled.

The requests go through `proxima.load`, the samples through `proxima.sampling`; rendering lives
in proxima/cli/demo.py; this module returns plain results.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from proxima.chat_prompts import SUPPORT_QUESTIONS, general_chat, support_chat
from proxima.fetch import client_limits
from proxima.load import Completion, LoadDriver
from proxima.sampling import Sampler
from proxima.scrape import ServerSnapshot
from proxima.server_process import ManagedServer, ServerSpec

FIRST_QUESTION = "What is the capital of France?"
# A 512-token step budget: vLLM's CPU start-up runs one full step to size memory, and at its
# default (2048) that step alone took most of a minute for this 30-layer model on 2 cores.
# The demo's server is local and has one user: it shows the exact figures (the slot map at peak,
# token-exact hits), which a shared server withholds by default (docs/security.md).
DEMO_SERVER_ARGS = ("--max-model-len", "2048", "--enforce-eager", "--max-num-seqs", "64",
                    "--max-num-batched-tokens", "512", "--proxima-exact-kv-figures")
REQUEST_TIMEOUT_S = 600.0


@dataclass(slots=True)
class ChatExchange:
    question: str
    answer: Completion


@dataclass(slots=True)
class DemoResult:
    url: str
    first: ChatExchange
    requests_ok: int = 0
    requests_failed: int = 0
    prompt_tokens: int = 0
    output_tokens: int = 0
    wall_s: float = 0.0
    examples: list[ChatExchange] = field(default_factory=list)
    samples: list[ServerSnapshot] = field(default_factory=list)

    @property
    def peak(self) -> ServerSnapshot | None:
        live = [s for s in self.samples if s.ok and s.proxima is not None]
        return max(live, key=lambda s: s.proxima.slots_used, default=None)

    @property
    def last(self) -> ServerSnapshot | None:
        return self.samples[-1] if self.samples else None


def burst_questions(num_requests: int, seed: int) -> list[str]:
    """Customers' questions, each from the fixed list, in a seeded order (repeats once the list
    is used up, as real customers repeat each other)."""
    rng = random.Random(seed)
    questions: list[str] = []
    while len(questions) < num_requests:
        questions += rng.sample(SUPPORT_QUESTIONS, len(SUPPORT_QUESTIONS))
    return questions[:num_requests]


async def drive(url: str, model: str, questions: list[str], concurrency: int, max_tokens: int,
                result: DemoResult, sample_every_s: float = 0.25, num_examples: int = 2) -> None:
    chats = [(support_chat(q), max_tokens) for q in questions]
    async with httpx.AsyncClient(limits=client_limits()) as client:
        sampler = Sampler(url, sample_every_s, client=client)
        async with sampler.running():  # ends with one more reading, after the settle below
            start = time.perf_counter()
            done = await LoadDriver(client, url, model).each_chat_once(chats, concurrency,
                                                                       timeout=REQUEST_TIMEOUT_S)
            result.wall_s = time.perf_counter() - start
            await asyncio.sleep(0.5)  # let the engine publish its idle state
    result.requests_ok += sum(c.ok for c in done)
    result.requests_failed += sum(not c.ok for c in done)
    result.prompt_tokens += sum(c.prompt_tokens for c in done if c.ok)
    result.output_tokens += sum(c.completion_tokens for c in done if c.ok)
    result.examples += [ChatExchange(q, c) for q, c in zip(questions, done) if c.ok][:num_examples]
    result.samples.extend(s.snapshot for s in sampler.samples)


def ask_first(url: str, model: str) -> ChatExchange:
    """The first question, greedy, as a user would ask it (the model's own default system prompt)."""
    async def once() -> Completion:
        async with httpx.AsyncClient(limits=client_limits()) as client:
            return await LoadDriver(client, url, model).chat(general_chat(FIRST_QUESTION), 64,
                                                             timeout=REQUEST_TIMEOUT_S)

    return ChatExchange(FIRST_QUESTION, asyncio.run(once()))


def demo_max_model_len() -> int:
    return int(DEMO_SERVER_ARGS[DEMO_SERVER_ARGS.index("--max-model-len") + 1])


def kv_bytes_per_token(model_dir: Path, dtype: str) -> int:
    """K and V of one token over every layer in the serving dtype, from the model's config: the
    demo refuses a KV budget vLLM would refuse after a minute of start-up (one chat must fit)."""
    config = json.loads((Path(model_dir) / "config.json").read_text())
    head = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    itemsize = 4 if dtype == "float32" else 2
    return 2 * config["num_hidden_layers"] * config["num_key_value_heads"] * head * itemsize


def start_server(model_dir: Path, dtype: str, kv_bytes: int, port: int, log_path: Path) -> ManagedServer:
    spec = ServerSpec(model=str(model_dir), variant="token", port=port, log_path=log_path,
                      args=(*DEMO_SERVER_ARGS, "--dtype", dtype, "--kv-cache-memory-bytes", str(kv_bytes)))
    return ManagedServer(spec)
