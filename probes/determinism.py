"""Check `determinism`: at temperature 0 with a fixed seed, the same prompt gives the same tokens.

Runs a few fixed prompts (1) alone, twice; (2) all at once while the probe keeps other requests
in flight, so that each prompt lands in a different batch; (3) alone on the `--compare` server,
when one is given. Outputs are compared as token ids (vLLM 0.26 returns them with
`"return_token_ids": true`); a server that does not return ids is compared by text and says so.
Divergence between two alone runs is real non-determinism (fail); divergence only under load is
batch-composition dependence, which stock vLLM on GPU shows unless VLLM_BATCH_INVARIANT=1 (warn);
divergence against the compare server means the two engines compute different things (fail),
unless every such divergence is explained by rounding (warn): either a near tie at the first
differing token (both servers' top logprobs list both choices within `TIE_NATS` of each other,
which two correct engines that round differently produce: bf16, one rounding step of a logit up to
32 is 0.125 nats), or, teacher-forced, the compare server fed the reference's own tokens picks the
same next token at `FORCED_AGREEMENT` of the positions or more. In bf16 rounding differences
compound over a free-running answer until two correct engines part at a clear margin (stock vLLM
against itself with another block size did in 2 of 120 answers on CPU one day, 0 the next); fed
the same tokens, they cannot compound: bf16 engines agree on about 98% of next tokens, a quantised KV cache on
87-90%, other weights on few.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, replace

from proxima.load import Completion, LoadDriver, make_prompt
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
TOP_LOGPROBS = 5  # asked with every request: enough to find the other server's choice among them
TIE_NATS = 0.13
FORCED_AGREEMENT = 0.9  # teacher-forced next-token agreement that counts as the same computation


@dataclass(frozen=True, slots=True)
class Divergence:
    where: str  # "token 3 (17 vs 42)", "request failed: ..."
    tie_gap: float | None = None  # a near tie: the larger of the two runs' logprob gaps there
    forced: tuple[int, int] | None = None  # teacher-forced: (positions agreeing, positions scored)

    @property
    def forced_agrees(self) -> bool:
        return self.forced is not None and self.forced[0] >= FORCED_AGREEMENT * self.forced[1] > 0

    @property
    def rounding(self) -> bool:
        """Explained by two correct engines rounding differently (see the module docstring)."""
        return self.tie_gap is not None or self.forced_agrees


def near_tie_gap(a: Completion, b: Completion, at: int) -> float | None:
    """At position `at`, where `a` and `b` chose different tokens: the larger of the two runs'
    logprob gaps between their own choice and the other's, when each run's top logprobs list both
    choices; None when they cannot tell (no logprobs, or one run's choice outside the other's list)."""
    if a.top_logprobs is None or b.top_logprobs is None:
        return None
    if at >= min(len(a.top_logprobs), len(b.top_logprobs)):
        return None
    top_a, top_b = a.top_logprobs[at], b.top_logprobs[at]
    if not top_a or not top_b:
        return None
    chose_a, chose_b = max(top_a, key=top_a.__getitem__), max(top_b, key=top_b.__getitem__)
    if chose_a == chose_b or chose_b not in top_a or chose_a not in top_b:
        return None
    return max(top_a[chose_a] - top_a[chose_b], top_b[chose_b] - top_b[chose_a])


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


def compare_runs(reference: list[Completion], other: list[Completion]) -> dict[int, Divergence]:
    """prompt index -> where `other` leaves `reference` (failed requests count as divergent), with
    the near-tie gap there when the runs' logprobs show one (token ids compared only)."""
    found: dict[int, Divergence] = {}
    for i, (ref, run) in enumerate(zip(reference, other)):
        if not (ref.ok and run.ok):
            found[i] = Divergence(f"request failed: {(run.error if not run.ok else ref.error)}")
            continue
        where = first_divergence(ref, run)
        if where is not None:
            by_ids = ref.token_ids is not None and run.token_ids is not None
            gap = near_tie_gap(ref, run, where[0]) if by_ids else None
            found[i] = Divergence(where[1], gap if gap is not None and gap <= TIE_NATS else None)
    return found


async def _complete(ctx: ProbeContext, prompt: str, url: str | None = None,
                    model: str | None = None) -> Completion:
    return await ctx.load.complete(prompt, MAX_TOKENS, seed=SEED, url=url, model=model,
                                   top_logprobs=TOP_LOGPROBS)


async def _alone(ctx: ProbeContext, prompts: list[str], url: str | None = None,
                 model: str | None = None) -> list[Completion]:
    return [await _complete(ctx, p, url, model) for p in prompts]


ADVICE = {
    "diverges": ("compare the two servers' flags: --dtype, --quantization, --kv-cache-dtype, model revision",
                 "rerun with --enforce-eager on both (CUDA graphs change kernels per batch size)",
                 ("if only Proxima diverges from stock on the same model, roll back "
                  "(proxima runbook rollback-to-stock) and report the prompt and the first divergent token")),
    "batch_dependent": (("expected of stock vLLM kernels on GPU; set VLLM_BATCH_INVARIANT=1 on the server if "
                         "answers must not depend on load (costs throughput)"),),
    "near_ties": (("the servers differ only where two tokens were (nearly) equally likely, or after rounding "
                   "drift compounded over an answer (fed the same tokens they agree): the same model rounded "
                   "differently (bf16 kernels do; float32 servers should agree exactly)"),
                  "rank the two by perplexity or top-1 agreement over many tokens, not by equal answers"),
}


@dataclass(frozen=True, slots=True)
class Readings:
    diverged: dict[str, dict[int, Divergence]]  # run name -> prompt index -> where it leaves the reference
    compared: bool  # a --compare server was run too
    evidence: Evidence


async def gather(ctx: ProbeContext) -> Readings:
    prompts = [make_prompt(7 + 13 * i, 12 + 6 * i) for i in range(NUM_PROMPTS)]
    reference = []
    for prompt in prompts:  # one at a time, and not past the first failure: each costs its timeout
        reference.append(await _complete(ctx, prompt))
        if not reference[-1].ok:
            raise Unmeasured(Status.ERROR, f"reference requests failed: {reference[-1].error}")
    repeat = await _alone(ctx, prompts)
    async with ctx.load.steady(BACKGROUND_CONCURRENCY, max_tokens=MAX_TOKENS, prompt_words=20,
                               first_index=5000):
        await asyncio.sleep(0.3)  # let the background requests occupy the batch first
        loaded = list(await asyncio.gather(*(_complete(ctx, p) for p in prompts)))

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
        diverged["vs_compare"] = await teacher_forced(ctx.load, reference, compare_runs(reference, compared),
                                                      ctx.compare_url, compare_model)
    for name, found in diverged.items():
        evidence[f"{name}_divergent"] = f"{len(found)}/{NUM_PROMPTS}"
        for i, d in sorted(found.items()):
            tie = f", a near tie (logprob gap {d.tie_gap:.3f} nats)" if d.tie_gap is not None else ""
            if d.forced is not None:
                tie += (f"; fed the reference's tokens, the compare server picks the same next token at "
                        f"{d.forced[0]}/{d.forced[1]} positions")
            evidence[f"{name}.prompt{i}"] = f"diverges at {d.where}{tie}"
    return Readings(diverged, bool(ctx.compare_url), evidence)


async def teacher_forced(driver: LoadDriver, reference: list[Completion], found: dict[int, Divergence],
                         url: str | None = None, model: str | None = None) -> dict[int, Divergence]:
    """Each clear-margin divergence, with the server at `url` (the driver's by default) fed the
    reference's own prompt and answer: how many of the answer's tokens it ranks first (left as it
    is when the server cannot say)."""
    for i, d in found.items():
        ref = reference[i]
        if d.tie_gap is not None or not ref.ok or ref.token_ids is None or ref.prompt_token_ids is None:
            continue
        ranks = await driver.teacher_forced_ranks((*ref.prompt_token_ids, *ref.token_ids),
                                                  len(ref.prompt_token_ids), url=url, model=model)
        if ranks:
            found[i] = replace(d, forced=(sum(r == 1 for r in ranks), len(ranks)))
    return found


def judge(r: Readings) -> Verdict:
    parts = [f"{len(found)}/{NUM_PROMPTS} prompts diverge {name.replace('_', ' ')} at "
             + ", ".join(d.where.split(" (")[0] for _, d in sorted(found.items()))
             for name, found in r.diverged.items() if found]
    vs_compare = r.diverged.get("vs_compare", {})
    if r.diverged["repeat"] or not all(d.rounding for d in vs_compare.values()):
        return Verdict(Status.FAIL, "; ".join(parts), ("diverges",))
    if vs_compare:
        why = []
        if any(d.tie_gap is not None for d in vs_compare.values()):
            why.append(f"at a near tie: both servers' top logprobs within {TIE_NATS} nats")
        if any(d.tie_gap is None for d in vs_compare.values()):
            why.append(f"fed the same tokens, the servers pick the same next token at {FORCED_AGREEMENT:.0%} "
                       "of positions or more")
        return Verdict(Status.WARN, "; ".join(parts) + f" (rounding: {'; '.join(why)})", ("near_ties",))
    if r.diverged["under_load"]:
        return Verdict(Status.WARN, "; ".join(parts) + " (batch-composition dependence)",
                       ("batch_dependent",))
    scope = "alone, repeated and under load" + (" and against --compare" if r.compared else "")
    return Verdict(Status.OK, f"{NUM_PROMPTS} prompts x {MAX_TOKENS} tokens identical {scope}")


advise = table_advice(ADVICE)


async def run(ctx: ProbeContext) -> ProbeResult:
    return await run_steps(CHECK, RUNBOOK, ctx, gather, judge, advise)
