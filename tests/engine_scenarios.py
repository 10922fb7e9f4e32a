"""Run fixed scenarios on one real vLLM engine and write what happened as JSON.

Executed as a subprocess by tests/test_engine_equivalence.py, once per engine variant, because
vLLM's plugins and attention registry are per process. The EngineCore runs in this process
(VLLM_ENABLE_V1_MULTIPROCESSING=0) so that the scheduler's slot accounting can be read after
every scenario.

Variants: `token` (Proxima, prefix cache on, vLLM's default), `token-nocache` (Proxima,
`enable_prefix_caching=False`), `stock` (vLLM's CPU backend, block 32, prefix cache on).

usage: python tests/engine_scenarios.py MODEL_DIR {token,token-nocache,stock} OUT.json
"""

from __future__ import annotations

import json
import os
import random
import sys

from proxima.load import random_prompt

KV_BUDGET_TOKENS = 1536  # far below what the big batch needs: forces preemption in both engines


def prompts(n: int, seed: int, lo: int = 3, hi: int = 300) -> list[str]:
    rng = random.Random(seed)
    return [random_prompt(rng, lo, hi) for _ in range(n)]


def engine_kwargs(variant: str) -> dict:
    kw = dict(
        dtype="float32", max_model_len=1024, enforce_eager=True, seed=0,
        # Small step budget: prompts longer than it are prefilled in chunks.
        max_num_batched_tokens=96, max_num_seqs=48, enable_prefix_caching=variant != "token-nocache",
        kv_cache_memory_bytes=KV_BUDGET_TOKENS * 1024,  # tiny model: 1 KiB of KV per token
    )
    if variant.startswith("token"):
        kw.update(block_size=1, scheduler_cls="proxima.engine.scheduler.ProximaScheduler")
    else:
        kw.update(block_size=32)
    return kw


def slot_state(llm) -> dict:
    scheduler = llm.llm_engine.engine_core.engine_core.scheduler
    mgr = scheduler.kv_cache_manager
    if hasattr(mgr, "cache"):
        mgr.cache.assert_consistent()
        return {"slots_used": mgr.cache.num_referenced, "requests_holding": len(mgr.table),
                "slots_total": mgr.cache.num_slots, "slots_cached": mgr.cache.num_cached,
                "hit_tokens": mgr.cache.counters.hit_tokens}
    pool = mgr.block_pool
    return {"slots_used": (pool.num_gpu_blocks - 1 - pool.get_num_free_blocks()) * scheduler.block_size,
            "requests_holding": len(mgr.coordinator.single_type_managers[0].req_to_blocks),
            "slots_total": (pool.num_gpu_blocks - 1) * scheduler.block_size}


def count_preemptions(llm) -> list[int]:
    """Wrap the scheduler's preemption path (test instrumentation) and return a live counter."""
    scheduler = llm.llm_engine.engine_core.engine_core.scheduler
    counter = [0]
    original = scheduler._preempt_request

    def counted(request, timestamp):
        counter[0] += 1
        return original(request, timestamp)

    scheduler._preempt_request = counted
    return counter


def run(model: str, variant: str) -> dict:
    from vllm import LLM, SamplingParams

    llm = LLM(model, **engine_kwargs(variant))
    preempted = count_preemptions(llm)
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
        "preemptions": preempted[0],
        "after": slot_state(llm),
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
        "after": slot_state(llm),
    }

    # 3. Requests aborted mid-generation, beside requests that run to completion.
    engine = llm.llm_engine
    ps = prompts(12, seed=4, hi=80)
    sp = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    ids = [f"abort-{i}" for i in range(len(ps))]
    for rid, p in zip(ids, ps):
        engine.add_request(rid, p, sp)
    finished: dict[str, list[int]] = {}
    for _ in range(6):
        for o in engine.step():
            if o.finished:
                finished[o.request_id] = list(o.outputs[0].token_ids)
    aborted = ids[::2]
    engine.abort_request(aborted)
    held_after_abort = slot_state(llm)
    while engine.has_unfinished_requests():
        for o in engine.step():
            if o.finished:
                finished[o.request_id] = list(o.outputs[0].token_ids)
    out["scenarios"]["abort"] = {
        "aborted": aborted,
        "completed": {rid: toks for rid, toks in finished.items() if rid not in aborted},
        "after_abort": held_after_abort,
        "after": slot_state(llm),
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
        "preemptions": preempted[0],
        "after": slot_state(llm),
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
    out["scenarios"]["multiturn"] = {"outputs": answers, "after": slot_state(llm)}
    out["preemptions"] = preempted[0]
    return out


def tokens(n: int, seed: int) -> list[int]:
    """n token ids of the tiny model's vocabulary (ids 3.. are ordinary tokens)."""
    rng = random.Random(seed)
    return [rng.randrange(3, 500) for _ in range(n)]


if __name__ == "__main__":
    model_dir, variant, out_path = sys.argv[1:4]
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ["PROXIMA_CHECK_INVARIANTS"] = "1"
    if variant.startswith("token"):
        os.environ["PROXIMA_ALLOCATOR"] = "token"
    result = run(model_dir, variant)
    tmp = out_path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(result, f)
    os.replace(tmp, out_path)
