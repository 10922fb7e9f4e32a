"""End-to-end CPU throughput: vLLM with Proxima's slot attention vs stock vLLM's CPU backend.

Offline `vllm.LLM`, in-process engine (VLLM_ENABLE_V1_MULTIPROCESSING=0), one model built by
`proxima model tiny DIR`, N prompts of random token ids (lengths 32-96 unless --prompt-tokens,
fixed seed) generating M tokens each with ignore_eos, greedy. Prints output tokens/s.

    proxima model tiny /tmp/tiny-cpuopt
    python scripts/bench_cpu_e2e.py --model /tmp/tiny-cpuopt --omp-threads 1
    git show b62f6eb:proxima/engine/attention/reference.py > /tmp/reference_before.py
    python scripts/bench_cpu_e2e.py --model /tmp/tiny-cpuopt --baseline /tmp/reference_before.py \
        --rounds 3 --repeats 4 --omp-threads 1

Each variant runs through the engine harness (proxima.harness) in a fresh process of its own
(vLLM's plugin registry is per process): "stock" (plain vLLM, block size 32, its CPU attention),
"proxima" (`proxima serve`'s token slots and slot attention) and, with --baseline,
"proxima-baseline": the same with `slot_attention_torch`/`write_kv` taken from the given file.
Variants alternate round by round so a loaded machine slows each alike. Printed: median and best
output tokens/s, and tokens per second of the engine process's CPU time. On a small shared
machine pass --omp-threads 1: with more, OpenMP barriers wait on threads descheduled by other
work and one process's figures spread over two orders of magnitude.
"""

from __future__ import annotations

import argparse
import hashlib
import statistics
import sys
import time
from pathlib import Path

from proxima.harness import (
    TINY_CPU_ARGS,
    EngineProcessError,
    EngineSpec,
    open_engine,
    run_isolated,
    vllm_flags,
)

VARIANTS = ("stock", "proxima-baseline", "proxima")


def run_variant(variant: str, model: str, prompts: int, output_tokens: int, repeats: int,
                baseline: str | None, kv_cache_mib: int = 8,
                prompt_tokens: tuple[int, int] = (32, 96)) -> dict:
    """One variant in this process: warm up, then time `repeats` generate() calls."""
    import random

    import torch
    from vllm import SamplingParams

    if variant == "proxima-baseline":
        use_baseline_attention(baseline)
    flags = vllm_flags(kv_cache_memory_bytes=kv_cache_mib << 20, enable_prefix_caching=False, seed=0,
                       block_size=32 if variant == "stock" else None)
    # Nothing recorded: tok/s of the engines alone (stock without even Proxima's observer).
    spec = EngineSpec(model, "stock" if variant == "stock" else "token", TINY_CPU_ARGS + flags, record=False)
    with open_engine(spec) as engine:
        rng = random.Random(0)
        batch = [{"prompt_token_ids": [rng.randrange(3, 512) for _ in range(rng.randint(*prompt_tokens))]}
                 for _ in range(prompts)]
        params = SamplingParams(max_tokens=output_tokens, ignore_eos=True, temperature=0.0)
        engine.llm.generate(batch[:8], SamplingParams(max_tokens=8, ignore_eos=True), use_tqdm=False)
        rates, cpu_rates, digest = [], [], hashlib.sha256()
        for _ in range(repeats):
            start, cpu_start = time.perf_counter(), time.process_time()
            outputs = engine.llm.generate(batch, params, use_tqdm=False)
            elapsed, cpu_spent = time.perf_counter() - start, time.process_time() - cpu_start
            num_tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
            rates.append(num_tokens / elapsed)
            cpu_rates.append(num_tokens / cpu_spent)
    for o in outputs:  # greedy: the same tokens whatever the attention implementation, up to fp ties
        digest.update(repr(list(o.outputs[0].token_ids)).encode())
    return {"variant": variant, "tokens_per_s": rates, "tokens_per_cpu_s": cpu_rates,
            "outputs_sha256": digest.hexdigest()[:16], "torch_threads": torch.get_num_threads()}


def use_baseline_attention(path: str) -> None:
    """Point the backend at another reference.py (same process: the engine runs in-process)."""
    import importlib.util

    from proxima.engine.attention import backend

    spec = importlib.util.spec_from_file_location("reference_baseline", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    backend.slot_attention_torch = module.slot_attention_torch
    # reference.py held write_kv until it moved to slot_rows.py: an older file brings its own.
    backend.write_kv = getattr(module, "write_kv", backend.write_kv)


def drive(args: argparse.Namespace) -> None:
    variants = [v for v in VARIANTS if (v != "proxima-baseline" or args.baseline)
                and (not args.variants or v in args.variants.split(","))]
    results: dict[str, list[float]] = {v: [] for v in variants}
    cpu_results: dict[str, list[float]] = {v: [] for v in variants}
    for round_index in range(args.rounds):
        for variant in variants:
            env = {"OMP_NUM_THREADS": str(args.omp_threads)} if args.omp_threads else None
            try:
                result = run_isolated(run_variant, variant, args.model, args.prompts, args.output_tokens,
                                      args.repeats, args.baseline, args.kv_cache_mib,
                                      tuple(int(x) for x in args.prompt_tokens.split("-")), env=env,
                                      timeout=args.timeout)
            except EngineProcessError as err:
                sys.exit(f"error: variant {variant} failed: {err}")
            results[variant].extend(result["tokens_per_s"])
            cpu_results[variant].extend(result["tokens_per_cpu_s"])
            print(f"round {round_index + 1} {variant:17} outputs {result['outputs_sha256']} "
                  f"threads {result['torch_threads']}  tok/s "
                  + " ".join(f"{r:7.1f}" for r in result["tokens_per_s"]) + "  tok/cpu-s "
                  + " ".join(f"{r:7.1f}" for r in result["tokens_per_cpu_s"]), flush=True)
    print(f"\n{args.prompts} prompts x {args.output_tokens} output tokens, {args.rounds} rounds x "
          f"{args.repeats} repeats. tok/cpu-s: output tokens per second of the engine process's CPU "
          f"time; best: the least disturbed repeat on a shared machine.")
    columns = {"median tok/s": {v: statistics.median(r) for v, r in results.items()},
               "best tok/s": {v: max(r) for v, r in results.items()},
               "median tok/cpu-s": {v: statistics.median(r) for v, r in cpu_results.items()}}
    print(f"  {'variant':17}" + "".join(f" {name:>26}" for name in columns))
    for variant in variants:
        cells = (f"{c[variant]:9.1f} ({c[variant] / c['stock']:5.2f}x stock)" for c in columns.values())
        print(f"  {variant:17}" + "".join(f" {cell:>26}" for cell in cells))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True, help="model directory (proxima model tiny DIR)")
    parser.add_argument("--baseline", help="another reference.py to run as variant proxima-baseline")
    parser.add_argument("--variants",
                        help=f"comma-separated subset of {', '.join(VARIANTS)} (stock is needed)")
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--prompt-tokens", default="32-96", help="prompt length range LO-HI (tokens)")
    parser.add_argument("--kv-cache-mib", type=int, default=8,
                        help="KV cache per engine (8 MiB: 8,192 tiny-model tokens; the real model "
                             "keeps 46 KiB a token in float32, so give it e.g. 512)")
    parser.add_argument("--output-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=2, help="fresh processes per variant")
    parser.add_argument("--repeats", type=int, default=3, help="timed generate() calls per process")
    parser.add_argument("--omp-threads", type=int, default=0,
                        help="OMP_NUM_THREADS for every engine process (0: the library default)")
    parser.add_argument("--timeout", type=float, default=900, help="seconds allowed per process")
    args = parser.parse_args()
    if not (Path(args.model) / "config.json").is_file():
        sys.exit(f"error: {args.model} is not a model directory; build one with `proxima model tiny DIR`")
    if args.baseline and not Path(args.baseline).is_file():
        sys.exit(f"error: --baseline {args.baseline} is not a file")
    drive(args)


if __name__ == "__main__":
    main()
