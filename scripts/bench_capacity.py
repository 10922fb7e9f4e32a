"""Capacity at a fixed KV budget: stock vLLM (prefix caching on, as users run it) against Proxima.

Workloads (`--workload`), all greedy, every request submitted as soon as it may be:
  short-chat     prompts of 50-200 tokens, outputs of 20-100, one burst
  shared-prefix  one 300-token system prompt + user turns of 20-100 tokens, outputs of 20-100,
                 one burst (the outside measurement's chat burst)
  multi-turn     conversations of 4 turns behind the same system prompt, 16 at a time: each
                 next turn resends the conversation so far (prompts and real answers) plus a new
                 user turn, and is submitted when the previous answer is complete; a new
                 conversation starts when one ends
Each engine runs at the same KV budget in bytes, through the engine harness (proxima.harness),
in a fresh process of its own. Every scheduler step is recorded (the harness's recorder): live
tokens, allocated slots, running requests, the tokens scheduled (computed) and the time the
step's scheduling took. Stock allocation runs under Proxima's observing scheduler (the `block`
variant), which leaves vLLM's block manager and its prefix cache untouched and only reads them. vLLM's CPU
attention needs blocks that are multiples of 32, so stock block 16 runs on the GPU only.
Token-slot runs also report how many KV tiles of what attention reads are dense (their slots one
ascending run): of every running context, and of the contexts being prefilled.

usage: python scripts/bench_capacity.py [--workload short-chat] [--model DIR] [--requests 400]
                                        [--kv-tokens 8192] [--json OUT] [--kv-cache-dtype auto|fp8]
(fp8: every engine stores e4m3 K/V in the same budget of bytes)
"""

from __future__ import annotations

import argparse
import json
import random
import tempfile
import time
from pathlib import Path

from proxima.files import write_atomic
from proxima.harness import TINY_CPU_ARGS, EngineSpec, open_engine, run_isolated, vllm_flags

# name: (allocator, block size, prefix caching)
VARIANTS = {"stock-b32": ("block", 32, True), "stock-b128": ("block", 128, True),
            "proxima": ("token", 1, True), "proxima-nocache": ("token", 1, False)}
WORKLOADS = ("short-chat", "shared-prefix", "multi-turn")
SYSTEM_PROMPT_TOKENS = 300
TURNS = 4
ACTIVE_CONVERSATIONS = 16


def _ids(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(3, 400) for _ in range(n)]


def workload(name: str, n: int, seed: int) -> list[tuple[list[int], int]]:
    """First requests of every conversation: (prompt token ids, output length)."""
    rng = random.Random(seed)
    if name == "short-chat":
        return [(_ids(rng, rng.randint(50, 200)), rng.randint(20, 100)) for _ in range(n)]
    system = _ids(random.Random(seed ^ 0x5EED), SYSTEM_PROMPT_TOKENS)
    num_first = n if name == "shared-prefix" else -(-n // TURNS)
    return [(system + _ids(rng, rng.randint(20, 100)), rng.randint(20, 100)) for _ in range(num_first)]


def next_turn(rng: random.Random, conversation: list[int], answer: list[int]) -> tuple[list[int], int]:
    return conversation + answer + _ids(rng, rng.randint(20, 100)), rng.randint(20, 100)


def engine_spec(model: str, variant: str, kv_tokens: int, seed: int, kv_cache_dtype: str) -> EngineSpec:
    allocator, block_size, prefix_caching = VARIANTS[variant]
    flags = vllm_flags(seed=seed, block_size=block_size, kv_cache_memory_bytes=kv_tokens * 1024,
                       max_num_seqs=512, max_num_batched_tokens=2048,
                       enable_prefix_caching=prefix_caching, kv_cache_dtype=kv_cache_dtype)
    # Every figure below is per scheduler step: publish the KV telemetry on every step. One
    # client measuring the allocator: token-exact hit figures.
    env = {"PROXIMA_TELEMETRY_INTERVAL_S": "0", "PROXIMA_KV_FIGURES": "exact"}
    return EngineSpec(model, allocator, TINY_CPU_ARGS + flags, env=env)


def run_engine(model: str, variant: str, workload_name: str, requests: int, kv_tokens: int,
               seed: int, kv_cache_dtype: str = "auto") -> dict:
    from proxima.harness.tiles import ContextTiles

    with open_engine(engine_spec(model, variant, kv_tokens, seed, kv_cache_dtype)) as engine:
        if engine.spec.variant != "token":
            return drive(engine, variant, workload_name, requests, seed) | {"kv_cache_dtype": kv_cache_dtype}
        # Contiguous KV tiles among what attention reads, every step (token slots only)
        tiles = ContextTiles(engine)
        with engine.listening(tiles):
            result = drive(engine, variant, workload_name, requests, seed)
        return result | tiles.shares() | {"kv_cache_dtype": kv_cache_dtype}


def drive(engine, variant: str, workload_name: str, requests: int, seed: int) -> dict:
    """Submit the workload (next turns as answers complete) and sum up the recorded steps."""
    import numpy as np
    from vllm import SamplingParams, TokensPrompt

    llm_engine, recorder = engine.llm.llm_engine, engine.recorder
    prompts: dict[str, list[int]] = {}

    def submit(rid: str, prompt: list[int], out_len: int) -> None:
        prompts[rid] = prompt
        llm_engine.add_request(rid, TokensPrompt(prompt_token_ids=prompt),
                               SamplingParams(temperature=0, max_tokens=out_len, ignore_eos=True))

    firsts = workload(workload_name, requests, seed)
    # multi-turn: ACTIVE_CONVERSATIONS users chat at a time; each next conversation starts when
    # one ends. The other workloads submit everything at once.
    active = ACTIVE_CONVERSATIONS if workload_name == "multi-turn" else len(firsts)
    for i, (prompt, out_len) in enumerate(firsts[:active]):
        submit(f"c{i}-t0", prompt, out_len)
    next_conversation = active
    turn_rng = random.Random(seed + 1)
    submitted = len(prompts)
    start, output_tokens, prompt_tokens, hit_tokens = time.perf_counter(), 0, 0, 0
    while llm_engine.has_unfinished_requests():
        for o in llm_engine.step():
            if not o.finished:
                continue
            answer = list(o.outputs[0].token_ids)
            output_tokens += len(answer)
            prompt_tokens += len(o.prompt_token_ids)
            hit_tokens += o.num_cached_tokens or 0
            conv, _, turn = o.request_id.rpartition("-t")
            if workload_name != "multi-turn":
                continue
            if int(turn) + 1 < TURNS:
                submit(f"{conv}-t{int(turn) + 1}", *next_turn(turn_rng, prompts[o.request_id], answer))
                submitted += 1
            elif next_conversation < len(firsts):
                submit(f"c{next_conversation}-t0", *firsts[next_conversation])
                next_conversation += 1
                submitted += 1
    wall = time.perf_counter() - start
    steps = recorder.steps
    step_times = np.array([s.seconds for s in steps])
    allocator, block_size, prefix_caching = VARIANTS[variant]
    result = {
        "variant": variant, "workload": workload_name, "allocator": allocator,
        "block_size": block_size, "prefix_caching": prefix_caching, "requests": submitted,
        "slots_total": recorder.last_kv.slots_total,
        "slot_efficiency_mean": recorder.slot_efficiency(),
        "running_peak": recorder.running_peak(), "running_mean": recorder.running_mean(),
        "running_mean_while_waiting": recorder.running_mean_while_waiting()[0],
        "preemptions": recorder.preemptions, "output_tokens": output_tokens,
        "prompt_tokens": prompt_tokens, "cache_hit_tokens": hit_tokens,
        "tokens_computed": sum(s.num_scheduled_tokens for s in steps),
        "output_tokens_per_s": output_tokens / wall, "wall_s": wall, "steps": len(steps),
        "schedule_ms_p50": float(np.percentile(step_times, 50) * 1e3),
        "schedule_ms_p99": float(np.percentile(step_times, 99) * 1e3),
    }
    if allocator == "token":  # pure allocator time: the slot manager times each call
        a = np.array([s.allocator_seconds for s in steps]) * 1e6
        result["allocator_us_per_step_p50"] = float(np.percentile(a, 50))
        result["allocator_us_per_step_p99"] = float(np.percentile(a, 99))
    return result


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="model dir (default: build the tiny model)")
    p.add_argument("--workload", choices=WORKLOADS, default="short-chat")
    p.add_argument("--variants", default=",".join(VARIANTS), help="comma-separated subset")
    p.add_argument("--requests", type=int, default=400)
    p.add_argument("--kv-tokens", type=int, default=8192, help="KV budget in tokens of the tiny model")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", type=Path, default=None)
    p.add_argument("--kv-cache-dtype", default="auto", help="vLLM's --kv-cache-dtype for every engine")
    args = p.parse_args()
    model = args.model
    if model is None:
        from proxima.tiny_model import build_tiny_model

        model = str(build_tiny_model(Path(tempfile.mkdtemp()) / "tiny"))
    results = {name: run_isolated(run_engine, model, name, args.workload, args.requests, args.kv_tokens,
                                  args.seed, args.kv_cache_dtype)
               for name in args.variants.split(",")}
    cols = ["slots_total", "slot_efficiency_mean", "running_peak", "running_mean",
            "running_mean_while_waiting", "preemptions", "prompt_tokens", "cache_hit_tokens",
            "tokens_computed", "output_tokens_per_s", "schedule_ms_p50", "schedule_ms_p99"]
    print(f"workload {args.workload}, a KV budget of {args.kv_tokens} float32 tokens of the tiny "
          f"model, KV dtype {args.kv_cache_dtype}")
    print(f"{'engine':<16}" + "".join(f"{c:>20}" for c in cols))
    for name, r in results.items():
        print(f"{name:<16}" + "".join(f"{r[c]:>20.3f}" if isinstance(r[c], float) else f"{r[c]:>20}"
                                      for c in cols))
    px = results.get("proxima")
    if px is not None and "allocator_us_per_step_p50" in px:
        print(f"proxima allocator time per step: p50 {px['allocator_us_per_step_p50']:.1f} us, "
              f"p99 {px['allocator_us_per_step_p99']:.1f} us")
    for name, r in results.items():
        if "dense_tiles_64" in r:
            print(f"{name}: KV tiles whose slots are one ascending run, over all steps: "
                  f"{r['dense_tiles_64']:.1%} of 64-token tiles, {r['dense_tiles_128']:.1%} of 128 "
                  f"(running contexts); {r.get('prefill_dense_tiles_64', 0):.1%} of 64-token tiles "
                  f"(contexts being prefilled)")
    for base in (n for n in results if n.startswith("stock") and px is not None):
        b = results[base]
        waiting = px["running_mean_while_waiting"] / max(b["running_mean_while_waiting"], 1e-9)
        print(f"mean running proxima/{base}: {px['running_mean'] / b['running_mean']:.2f}x; "
              f"while requests wait: {waiting:.2f}x")
    if args.json:
        write_atomic(args.json, json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
