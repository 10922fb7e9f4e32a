"""Fixed scenarios on one real vLLM engine, and what happened, as plain data.

Run by tests/test_engine_equivalence.py through the engine harness (proxima.harness), in the
session's engine processes (conftest.py: vLLM's attention registry is per process), once per
engine variant; the slot accounting is read from the in-process scheduler after every scenario.

Variants: `token` (Proxima, prefix cache on, vLLM's default), `token-nocache` (Proxima,
`--no-enable-prefix-caching`), `stock` (vLLM's CPU backend, block 32, prefix cache on).
"""

from __future__ import annotations

import random

from proxima.harness import TINY_CPU_ARGS, EngineSpec, open_engine, vllm_flags
from proxima.load import random_prompt

KV_BUDGET_TOKENS = 1536  # far below what the big batch needs: forces preemption in both engines
# Small step budget: prompts longer than it are prefilled in chunks.
SCENARIO_ARGS = TINY_CPU_ARGS + vllm_flags(seed=0, max_num_batched_tokens=96, max_num_seqs=48,
                                           kv_cache_memory_bytes=KV_BUDGET_TOKENS * 1024)  # 1 KiB a token


def prompts(n: int, seed: int, lo: int = 3, hi: int = 300) -> list[str]:
    rng = random.Random(seed)
    return [random_prompt(rng, lo, hi) for _ in range(n)]


def engine_spec(model: str, variant: str, *args: str) -> EngineSpec:
    """`token`, `token-nocache` or `stock` (block 32 unless `args` say otherwise), with `args`."""
    if variant == "stock":
        return EngineSpec(model, "stock", SCENARIO_ARGS + ("--block-size", "32") + args)
    cache = ("--no-enable-prefix-caching",) if variant == "token-nocache" else ()
    return EngineSpec(model, "token", SCENARIO_ARGS + cache + args, env={"PROXIMA_CHECK_INVARIANTS": "1"})


def slot_state(engine) -> dict:
    mgr = engine.kv_manager
    if hasattr(mgr, "cache"):
        mgr.cache.assert_consistent()
        return {"slots_used": mgr.cache.num_referenced, "requests_holding_slots": len(mgr.table),
                "slots_total": mgr.cache.num_slots, "slots_cached": mgr.cache.num_cached,
                "hit_tokens": mgr.cache.counters.hit_tokens}
    pool, block_size = mgr.block_pool, engine.scheduler.block_size
    return {"slots_used": (pool.num_gpu_blocks - 1 - pool.get_num_free_blocks()) * block_size,
            "requests_holding_slots": len(mgr.coordinator.single_type_managers[0].req_to_blocks),
            "slots_total": (pool.num_gpu_blocks - 1) * block_size}


def run(model: str, variant: str) -> dict:
    with open_engine(engine_spec(model, variant)) as engine:
        return scenarios(engine, variant)


def scenarios(engine, variant: str) -> dict:
    from vllm import SamplingParams

    llm, recorder = engine.llm, engine.recorder
    out: dict = {"variant": variant, "scenarios": {}}

    # 1. Varied lengths, all at once: chunked prefill (prompts > 96 tokens) and preemption
    #    (the batch needs far more than KV_BUDGET_TOKENS), greedy.
    ps = prompts(120, seed=1)
    rng = random.Random(2)
    params = [SamplingParams(temperature=0, max_tokens=rng.randint(1, 48), ignore_eos=True) for _ in ps]
    results = llm.generate(ps, params, use_tqdm=False)
    out["scenarios"]["varied"] = {
        "outputs": [list(r.outputs[0].token_ids) for r in results],
        "request_ids": [r.request_id for r in results],
        "max_tokens": [p.max_tokens for p in params],
        "prompt_lens": [len(r.prompt_token_ids) for r in results],
        "preemptions": recorder.preemptions,
        "after": slot_state(engine),
    }

    # 2. n > 1 (parallel sampling: children fork from one prompt). vLLM allows n > 1 only with
    #    sampling; a per-request seed makes it deterministic, so both engines must agree.
    #    One prompt per call, each short enough that its 3 children prefill in one step: vLLM
    #    0.26 on CPU fails seeded sampling for a request whose prefill is split into chunks
    #    (its CPU torch.Generator has no offset), stock and Proxima alike.
    n3 = []
    for p in prompts(4, seed=3, lo=3, hi=25):
        (r,) = llm.generate(
            [p], SamplingParams(temperature=0.8, seed=7, n=3, max_tokens=24, ignore_eos=True),
            use_tqdm=False,
        )
        n3.append([list(c.token_ids) for c in r.outputs])
    out["scenarios"]["n3"] = {
        "outputs": n3,
        "after": slot_state(engine),
    }

    # 3. Requests aborted mid-generation, beside requests that run to completion.
    llm_engine = llm.llm_engine
    ps = prompts(12, seed=4, hi=80)
    sp = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    ids = [f"abort-{i}" for i in range(len(ps))]
    for rid, p in zip(ids, ps):
        llm_engine.add_request(rid, p, sp)
    finished: dict[str, list[int]] = {}
    for _ in range(6):
        for o in llm_engine.step():
            if o.finished:
                finished[o.request_id] = list(o.outputs[0].token_ids)
    aborted = ids[::2]
    llm_engine.abort_request(aborted)
    held_after_abort = slot_state(engine)
    while llm_engine.has_unfinished_requests():
        for o in llm_engine.step():
            if o.finished:
                finished[o.request_id] = list(o.outputs[0].token_ids)
    out["scenarios"]["abort"] = {
        "aborted": aborted,
        "completed": {rid: toks for rid, toks in finished.items() if rid not in aborted},
        "after_abort": held_after_abort,
        "after": slot_state(engine),
    }

    # 4. Shared prefixes in one burst: system prompts of 5, 20, 33, 47 and 150 tokens (shorter
    #    than a block, ending mid-block, spanning chunks), each followed by varied user turns,
    #    plus two prompts sent twice; all submitted at once, so later requests share what
    #    earlier ones are computing in the same step.
    systems = [tokens(n, seed=10 + n) for n in (5, 20, 33, 47, 150)]
    rng = random.Random(5)
    shared = [systems[i % len(systems)] + tokens(rng.randint(1, 40), seed=100 + i) for i in range(40)]
    shared += shared[:2]
    results = llm.generate([{"prompt_token_ids": p} for p in shared],
                           SamplingParams(temperature=0, max_tokens=16, ignore_eos=True), use_tqdm=False)
    out["scenarios"]["shared"] = {
        "outputs": [list(r.outputs[0].token_ids) for r in results],
        "cached_tokens": sum(r.num_cached_tokens or 0 for r in results),
        "preemptions": recorder.preemptions,
        "after": slot_state(engine),
    }

    # 5. Multi-turn: each next turn resends the conversation so far (prompt and answer) and a
    #    new user turn; 12 conversations, 3 turns, one burst per turn.
    convs = [systems[2] + tokens(rng.randint(3, 30), seed=200 + i) for i in range(12)]
    answers: list[list[list[int]]] = [[] for _ in convs]
    for turn in range(3):
        results = llm.generate([{"prompt_token_ids": c} for c in convs],
                               SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
                               use_tqdm=False)
        for i, r in enumerate(results):
            answers[i].append(list(r.outputs[0].token_ids))
            convs[i] = convs[i] + answers[i][-1] + tokens(rng.randint(2, 20), seed=300 + 10 * turn + i)
    out["scenarios"]["multiturn"] = {"outputs": answers, "after": slot_state(engine)}
    out["preemptions"] = recorder.preemptions
    return out


def tokens(n: int, seed: int) -> list[int]:
    """n token ids of the tiny model's vocabulary (ids 3.. are ordinary tokens)."""
    rng = random.Random(seed)
    return [rng.randrange(3, 500) for _ in range(n)]
