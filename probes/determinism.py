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

from proxima.probes.base import ProbeContext, ProbeResult, Status
from proxima.probes.load import Completion, make_prompt
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


async def run(ctx: ProbeContext) -> ProbeResult:
    prompts = [make_prompt(7 + 13 * i, 12 + 6 * i) for i in range(NUM_PROMPTS)]
    reference = await _alone(ctx, prompts)
    failed = [r.error for r in reference if not r.ok]
    if failed:
        return ProbeResult(CHECK, Status.ERROR, f"reference requests failed: {failed[0]}", runbook=RUNBOOK)
    repeat = await _alone(ctx, prompts)
    async with ctx.load.steady(BACKGROUND_CONCURRENCY, max_tokens=MAX_TOKENS, prompt_words=20, first_index=5000):
        await asyncio.sleep(0.3)  # let the background requests occupy the batch first
        loaded = list(await asyncio.gather(*(ctx.load.complete(p, MAX_TOKENS, seed=SEED) for p in prompts)))

    by_ids = all(r.token_ids is not None for r in reference)
    evidence: dict = {
        "prompts": NUM_PROMPTS,
        "max_tokens": MAX_TOKENS,
        "seed": SEED,
        "compared_as": "token ids" if by_ids else "text (server returned no token ids)",
    }
    diverged: dict[str, dict[int, str]] = {
        "repeat": compare_runs(reference, repeat),
        "under_load": compare_runs(reference, loaded),
    }
    if ctx.compare_url:
        compare_model, _, error = await discover(ctx.client, ctx.compare_url)
        if error is not None:
            return ProbeResult(CHECK, Status.ERROR, f"cannot reach --compare {ctx.compare_url}: {error}",
                               evidence, RUNBOOK)
        evidence["compare_url"] = ctx.compare_url
        evidence["compare_model"] = compare_model
        diverged["vs_compare"] = compare_runs(reference, await _alone(ctx, prompts, ctx.compare_url, compare_model))
    for name, found in diverged.items():
        evidence[f"{name}_divergent"] = f"{len(found)}/{NUM_PROMPTS}"
        for i, where in sorted(found.items()):
            evidence[f"{name}.prompt{i}"] = f"diverges at {where}"

    parts = [f"{len(found)}/{NUM_PROMPTS} prompts diverge {name.replace('_', ' ')} at "
             + ", ".join(w.split(" (")[0] for _, w in sorted(found.items()))
             for name, found in diverged.items() if found]
    if diverged["repeat"] or diverged.get("vs_compare"):
        advice = ["compare the two servers' flags: --dtype, --quantization, --kv-cache-dtype, model revision",
                  "rerun with --enforce-eager on both (CUDA graphs change kernels per batch size)",
                  ("if only Proxima diverges from stock on the same model, roll back (runbooks/rollback-to-stock.md) "
                   "and report the prompt and the first divergent token")]
        return ProbeResult(CHECK, Status.FAIL, "; ".join(parts), evidence, RUNBOOK, tuple(advice))
    if diverged["under_load"]:
        return ProbeResult(
            CHECK, Status.WARN, "; ".join(parts) + " (batch-composition dependence)", evidence, RUNBOOK,
            (("expected of stock vLLM kernels on GPU; set VLLM_BATCH_INVARIANT=1 on the server if answers "
              "must not depend on load (costs throughput)"),),
        )
    scope = "alone, repeated and under load" + (" and against --compare" if ctx.compare_url else "")
    return ProbeResult(CHECK, Status.OK,
                       f"{NUM_PROMPTS} prompts x {MAX_TOKENS} tokens identical {scope}", evidence, RUNBOOK)
