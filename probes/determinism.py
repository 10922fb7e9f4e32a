"""Check `determinism`: at temperature 0 with a fixed seed, the same prompt gives the same tokens.

Runs a few fixed prompts (1) alone, twice; (2) all at once while the probe keeps other requests
in flight, so that each prompt lands in a different batch; (3) alone on the `--compare` server,
when one is given. Outputs are compared as token ids (vLLM 0.26 returns them with
`"return_token_ids": true`); a server that does not return ids is compared by text and says so.
Divergence between two alone runs is real non-determinism (fail); divergence only under load is
batch-composition dependence, which stock vLLM on GPU shows unless VLLM_BATCH_INVARIANT=1 (warn);
divergence against the compare server means the two engines compute different things (fail).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

from proxima.load import Completion, make_prompt
from proxima.probes.base import (
    Evidence,
    ProbeContext,
    ProbeResult,
    Status,
    Unmeasured,
    Verdict,
    run_steps,
    table_advice,
)
from proxima.probes.runner import discover

CHECK = "determinism"
RUNBOOK = "runbooks/nondeterministic-output.md"
NUM_PROMPTS = 4
MAX_TOKENS = 24
SEED = 1234
BACKGROUND_CONCURRENCY = 8


def first_divergence(a: Completion, b: Completion) -> tuple[int, str] | None:
    """(index, description) of the first differing token (or character), None when equal."""
    if a.token_ids is not None and b.token_ids is not None:
        x, y, what = a.token_ids, b.token_ids, "token"
    else:
        x, y, what = a.text, b.text, "character"
    for i, (p, q) in enumerate(zip(x, y)):
        if p != q:
            return i, f"{what} {i} ({p!r} vs {q!r})"
    if len(x) != len(y):
        n = min(len(x), len(y))
        return n, f"{what} {n} (lengths {len(x)} vs {len(y)})"
    return None


def compare_runs(reference: list[Completion], other: list[Completion]) -> dict[int, str]:
    """prompt index -> where `other` leaves `reference` (failed requests count as divergent)."""
    found: dict[int, str] = {}
    for i, (ref, run) in enumerate(zip(reference, other)):
        if not (ref.ok and run.ok):
            found[i] = f"request failed: {(run.error if not run.ok else ref.error)}"
            continue
        where = first_divergence(ref, run)
        if where is not None:
            found[i] = where[1]
    return found


async def _alone(ctx: ProbeContext, prompts: list[str], url: str | None = None,
                 model: str | None = None) -> list[Completion]:
    return [await ctx.load.complete(p, MAX_TOKENS, seed=SEED, url=url, model=model) for p in prompts]


ADVICE = {
    "diverges": ("compare the two servers' flags: --dtype, --quantization, --kv-cache-dtype, model revision",
                 "rerun with --enforce-eager on both (CUDA graphs change kernels per batch size)",
                 ("if only Proxima diverges from stock on the same model, roll back "
                  "(proxima runbook rollback-to-stock) and report the prompt and the first divergent token")),
    "batch_dependent": (("expected of stock vLLM kernels on GPU; set VLLM_BATCH_INVARIANT=1 on the server if "
                         "answers must not depend on load (costs throughput)"),),
}


@dataclass(frozen=True, slots=True)
class Readings:
    diverged: dict[str, dict[int, str]]  # run name -> prompt index -> where it leaves the reference
    compared: bool  # a --compare server was run too
    evidence: Evidence


async def gather(ctx: ProbeContext) -> Readings:
    prompts = [make_prompt(7 + 13 * i, 12 + 6 * i) for i in range(NUM_PROMPTS)]
    reference = []
    for prompt in prompts:  # one at a time, and not past the first failure: each costs its timeout
        reference.append(await ctx.load.complete(prompt, MAX_TOKENS, seed=SEED))
        if not reference[-1].ok:
            raise Unmeasured(Status.ERROR, f"reference requests failed: {reference[-1].error}")
    repeat = await _alone(ctx, prompts)
    async with ctx.load.steady(BACKGROUND_CONCURRENCY, max_tokens=MAX_TOKENS, prompt_words=20,
                               first_index=5000):
        await asyncio.sleep(0.3)  # let the background requests occupy the batch first
        loaded = list(await asyncio.gather(*(ctx.load.complete(p, MAX_TOKENS, seed=SEED) for p in prompts)))

    by_ids = all(r.token_ids is not None for r in reference)
    evidence: Evidence = {
        "prompts": NUM_PROMPTS,
        "max_tokens": MAX_TOKENS,
        "seed": SEED,
        "compared_as": "token ids" if by_ids else "text (server returned no token ids)",
    }
    diverged = {"repeat": compare_runs(reference, repeat), "under_load": compare_runs(reference, loaded)}
    if ctx.compare_url:
        compare_model, _, error = await discover(ctx.client, ctx.compare_url)
        if error is not None:
            raise Unmeasured(Status.ERROR, f"--compare: {error}", evidence)
        evidence["compare_url"] = ctx.compare_url
        evidence["compare_model"] = compare_model
        compared = await _alone(ctx, prompts, ctx.compare_url, compare_model)
        diverged["vs_compare"] = compare_runs(reference, compared)
    for name, found in diverged.items():
        evidence[f"{name}_divergent"] = f"{len(found)}/{NUM_PROMPTS}"
        for i, where in sorted(found.items()):
            evidence[f"{name}.prompt{i}"] = f"diverges at {where}"
    return Readings(diverged, bool(ctx.compare_url), evidence)


def judge(r: Readings) -> Verdict:
    parts = [f"{len(found)}/{NUM_PROMPTS} prompts diverge {name.replace('_', ' ')} at "
             + ", ".join(w.split(" (")[0] for _, w in sorted(found.items()))
             for name, found in r.diverged.items() if found]
    if r.diverged["repeat"] or r.diverged.get("vs_compare"):
        return Verdict(Status.FAIL, "; ".join(parts), ("diverges",))
    if r.diverged["under_load"]:
        return Verdict(Status.WARN, "; ".join(parts) + " (batch-composition dependence)",
                       ("batch_dependent",))
    scope = "alone, repeated and under load" + (" and against --compare" if r.compared else "")
    return Verdict(Status.OK, f"{NUM_PROMPTS} prompts x {MAX_TOKENS} tokens identical {scope}")


advise = table_advice(ADVICE)


async def run(ctx: ProbeContext) -> ProbeResult:
    return await run_steps(CHECK, RUNBOOK, ctx, gather, judge, advise)
