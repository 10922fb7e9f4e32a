"""`proxima bench --check-answers`: the same greedy prompts to every server before its sweep, and
how many answers the servers share, so a broken engine (or a KV dtype that changes answers) shows
in the run that measures its speed.

Prompts are the accuracy set's questions (`proxima.chat_prompts`) as plain completions (any model
answers them, chat template or not), `ANSWER_TOKENS` greedy tokens each with a fixed seed and
`ignore_eos`, compared as token ids. A difference is classified as `probes.determinism` does: at a
near tie (both servers list both choices among their top logprobs, within `TIE_NATS`) two correct
engines that round differently part ways; at a clear margin, each later server is fed the first
server's prompt and answer while it is up (teacher forcing), and picking the same next token at
`FORCED_AGREEMENT` of the positions or more it parted through rounding drift that compounded over
the answer; anything else is a different computation.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

from proxima.chat_prompts import GENERAL_QUESTIONS, SUPPORT_QUESTIONS
from proxima.load import Completion, LoadDriver, new_http_client
from proxima.probes.determinism import (
    FORCED_AGREEMENT,
    TIE_NATS,
    TOP_LOGPROBS,
    Divergence,
    compare_runs,
    teacher_forced,
)

ANSWER_TOKENS = 32
CONCURRENCY = 8
SEED = 1234


QUESTIONS = (*GENERAL_QUESTIONS, *SUPPORT_QUESTIONS)


def answer_prompts() -> list[str]:
    return [f"Question: {q}\nAnswer:" for q in QUESTIONS]


@dataclass(frozen=True, slots=True)
class Answers:
    """One server's greedy completions, in prompt order, and where they leave the first server's
    (teacher-forced on this server; None for the first server itself)."""

    completions: list[Completion]
    vs_first: dict[int, Divergence] | None = None


async def collect(url: str, model: str, request_timeout_s: float, api_key: str | None,
                  first: Answers | None = None) -> Answers:
    """Every answer prompt's greedy completion from one server; with `first` (the first server's
    answers), also how these leave them, asked of this server while it is up."""
    async with new_http_client(request_timeout_s, api_key) as http:
        driver = LoadDriver(http, url, model)
        sem = asyncio.Semaphore(CONCURRENCY)

        async def one(prompt: str) -> Completion:
            async with sem:
                return await driver.complete(prompt, ANSWER_TOKENS, seed=SEED, timeout=request_timeout_s,
                                             top_logprobs=TOP_LOGPROBS)

        completions = list(await asyncio.gather(*(one(p) for p in answer_prompts())))
        if first is None:
            return Answers(completions)
        found = compare_runs(first.completions, completions)
        return Answers(completions, await teacher_forced(driver, first.completions, found))


@dataclass(frozen=True, slots=True)
class AnswerCheck:
    """`test`'s answers against `reference`'s."""

    reference: str
    test: str
    num_prompts: int
    identical: int
    near_ties: int  # differ, first at a near tie
    drift: int  # differ at a clear margin, but fed the same tokens the servers agree (rounding drift)
    differ: int  # differ, and not told from a different computation
    failed: int  # a request failed on either server
    kv_dtypes: tuple[str | None, str | None]
    examples: tuple[str, ...]  # the first few clear differences: prompt and first differing token
    # Each clear-margin parting that was teacher-forced, in prompt order: (prompt index, positions
    # where the test server picked the reference's next token, positions scored).
    forced: tuple[tuple[int, int, int], ...] = ()

    @property
    def expected_to_differ(self) -> bool:
        a, b = self.kv_dtypes
        return a is not None and b is not None and a != b

    def describe(self) -> str:
        head = (f"answers, {self.test} against {self.reference}: {self.identical}/{self.num_prompts} greedy "
                f"answers identical ({ANSWER_TOKENS} tokens each, sent before the sweep)")
        parts = []
        if self.near_ties:
            parts.append(f"{self.near_ties} part at a near tie (both servers' top logprobs within "
                         f"{TIE_NATS} nats: rounding, not a different computation)")
        if self.drift:
            parts.append(f"{self.drift} part at a clear margin after rounding drift (fed the same "
                         f"tokens, the servers pick the same next token at {FORCED_AGREEMENT:.0%} of "
                         "positions or more)")
        if self.forced:
            low = min(self.forced, key=lambda f: f[1] / f[2])
            parts.append(f"teacher-forced agreement at the clear partings {low[1]}/{low[2]} at lowest "
                         f"(prompt {low[0]})")
        if self.differ:
            parts.append(f"{self.differ} differ at a clear margin"
                         + (f", e.g. {'; '.join(self.examples)}" if self.examples else ""))
        if self.failed:
            parts.append(f"{self.failed} failed on a server")
        text = head + ("; " + "; ".join(parts) if parts else "")
        if self.expected_to_differ:
            text += (f". KV dtypes differ ({self.kv_dtypes[0]} against {self.kv_dtypes[1]}): answers are "
                     "expected to differ; rank their quality with scripts/bench_kv_accuracy.py")
        elif self.differ:
            text += (". Same KV dtype: answers that differ at a clear margin mean the engines compute "
                     "different things; check that before trusting either's speed")
        return text


def compare(reference: str, ref_answers: Answers, test: str, test_answers: Answers,
            kv_dtypes: tuple[str | None, str | None]) -> AnswerCheck:
    found = test_answers.vs_first
    if found is None:
        found = compare_runs(ref_answers.completions, test_answers.completions)
    failed = [i for i, d in found.items() if d.where.startswith("request failed")]
    ties = [i for i, d in found.items() if d.tie_gap is not None]
    drift = [i for i, d in found.items() if d.tie_gap is None and d.forced_agrees]
    clear = sorted(set(found) - set(failed) - set(ties) - set(drift))
    examples = tuple(f"{QUESTIONS[i]!r} at {found[i].where}" for i in clear[:3])
    forced = tuple((i, *d.forced) for i, d in sorted(found.items())
                   if d.tie_gap is None and d.forced is not None and d.forced[1] > 0)
    num = len(ref_answers.completions)
    return AnswerCheck(reference, test, num, num - len(found), len(ties), len(drift), len(clear), len(failed),
                       kv_dtypes, examples, forced)
