"""Microbenchmark of the CPU slot-attention path (`proxima.engine.attention.reference`).

Prints the median per-call time of `slot_attention_torch` and `write_kv` on representative
shapes, with K/V laid out as the backend hands them over: one (num_slots, 1, Hkv, 2*D) tensor
per layer, split into the strided halves `rows[..., :D]` / `rows[..., D:]`. Slots are a random
permutation of the cache (every gather is scattered: the worst case for locality).

    python scripts/bench_cpu_attention.py --threads 1
    git show b62f6eb:proxima/engine/attention/reference.py > /tmp/reference_before.py
    python scripts/bench_cpu_attention.py --baseline /tmp/reference_before.py --threads 1

(b62f6eb: the last commit before the CPU path was reworked.) On a small shared machine, use
--threads 1: with several threads every op waits on OpenMP barriers for threads descheduled by
other work, and the figures measure the machine's load more than the code.

With --baseline both implementations run on the same inputs, rounds interleaved (baseline,
current, baseline, ...), so a loaded machine slows both alike; medians over rounds are printed.
Each case first checks that the two implementations agree.
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import sys
import time
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

import torch


@dataclass(frozen=True, slots=True)
class Shape:
    name: str
    num_query_heads: int
    num_kv_heads: int
    head_size: int


TINY = Shape("tiny", 4, 2, 32)
LLAMA_8B = Shape("8b", 32, 8, 128)
TABLE_WIDTH = 1024  # vLLM's block table is max_model_len wide at block size 1


@dataclass(frozen=True, slots=True)
class Case:
    label: str
    shape: Shape
    requests: tuple[tuple[int, int], ...] = ()  # (q_len, seq_len) per request
    write_tokens: int = 0  # > 0: a write_kv case of that many tokens


def decode_batch(num_requests: int, context: int) -> tuple[tuple[int, int], ...]:
    # Contexts spread over [3/4 context, context], as in a batch of requests of different ages.
    gen = torch.Generator().manual_seed(num_requests * 7919 + context)
    lens = torch.randint(context * 3 // 4, context + 1, (num_requests,), generator=gen).tolist()
    lens[0] = context
    return tuple((1, length) for length in lens)


CASES = (
    [Case(f"decode n={n} ctx={c}", TINY, decode_batch(n, c)) for n in (16, 64) for c in (128, 512)]
    + [
        Case("mixed 32 decodes ctx=256 + prefill 128", TINY, decode_batch(32, 256) + ((128, 128),)),
        Case("prefill 512", TINY, ((512, 512),)),
        Case("chunked prefill 256 after 256", TINY, ((256, 512),)),
        Case("write_kv 64 tokens", TINY, write_tokens=64),
        Case("write_kv 512 tokens", TINY, write_tokens=512),
    ]
    + [Case(f"decode n={n} ctx={c}", LLAMA_8B, decode_batch(n, c)) for n in (4, 16) for c in (128, 512)]
    + [
        Case("prefill 512", LLAMA_8B, ((512, 512),)),
        Case("write_kv 64 tokens", LLAMA_8B, write_tokens=64),
    ]
)


def packed_cache(num_slots: int, shape: Shape, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V views exactly as `ProximaSlotAttentionImpl._split` builds them."""
    kv = torch.randn(num_slots, 1, shape.num_kv_heads, 2 * shape.head_size, generator=gen)
    rows = kv.view(num_slots, shape.num_kv_heads, 2 * shape.head_size)
    return rows[..., : shape.head_size], rows[..., shape.head_size :]


def attention_call(case: Case, gen: torch.Generator) -> Callable[[ModuleType], torch.Tensor]:
    s = case.shape
    num_slots = sum(seq for _, seq in case.requests) + 64
    k_cache, v_cache = packed_cache(num_slots, s, gen)
    order = torch.randperm(num_slots, generator=gen).to(torch.int32)
    slot_table = torch.zeros(len(case.requests), TABLE_WIDTH, dtype=torch.int32)
    taken = 0
    for r, (_, seq_len) in enumerate(case.requests):
        slot_table[r, :seq_len] = order[taken:taken + seq_len]
        taken += seq_len
    q_lens = torch.tensor([q for q, _ in case.requests])
    query_start_loc = torch.cat([torch.zeros(1, dtype=torch.int64), q_lens.cumsum(0)]).to(torch.int32)
    seq_lens = torch.tensor([seq for _, seq in case.requests], dtype=torch.int32)
    num_tokens = int(query_start_loc[-1])
    query = torch.randn(num_tokens, s.num_query_heads, s.head_size, generator=gen)
    output = torch.empty_like(query)
    scale = s.head_size ** -0.5

    def call(module: ModuleType) -> torch.Tensor:
        return module.slot_attention_torch(query, k_cache, v_cache, slot_table, query_start_loc, seq_lens,
                                           scale, output, num_tokens)

    return call


def write_call(case: Case, gen: torch.Generator) -> Callable[[ModuleType], torch.Tensor]:
    s, num_tokens = case.shape, case.write_tokens
    num_slots = 8192
    kv = torch.zeros(num_slots, 1, s.num_kv_heads, 2 * s.head_size)
    rows = kv.view(num_slots, s.num_kv_heads, 2 * s.head_size)
    k_cache, v_cache = rows[..., : s.head_size], rows[..., s.head_size :]
    # key/value as vLLM hands them over: strided slices of one fused QKV projection.
    width = (s.num_query_heads + 2 * s.num_kv_heads) * s.head_size
    qkv = torch.randn(num_tokens, width, generator=gen)
    q_size, kv_size = s.num_query_heads * s.head_size, s.num_kv_heads * s.head_size
    key = qkv[:, q_size:q_size + kv_size].view(num_tokens, s.num_kv_heads, s.head_size)
    value = qkv[:, q_size + kv_size:].view(num_tokens, s.num_kv_heads, s.head_size)
    slot_mapping = torch.randperm(num_slots, generator=gen)[:num_tokens]

    def call(module: ModuleType) -> torch.Tensor:
        module.write_kv(key, value, k_cache, v_cache, slot_mapping)
        return kv

    return call


def time_per_call(fn: Callable[[], object], budget_s: float) -> float:
    """Median seconds of one call over as many calls as fit in budget_s (at least 3).

    A median, not a mean: on a shared machine one descheduled call can take 100x the others.
    """
    times: list[float] = []
    start = time.perf_counter()
    while len(times) < 3 or time.perf_counter() - start < budget_s:
        begin = time.perf_counter()
        fn()
        times.append(time.perf_counter() - begin)
    return statistics.median(times)


def load_module(path: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location("reference_baseline", path)
    if spec is None or spec.loader is None:
        sys.exit(f"error: cannot load a module from {path}; pass a .py file")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    if not all(hasattr(module, name) for name in ("slot_attention_torch", "write_kv")):
        sys.exit(f"error: {path} has no slot_attention_torch/write_kv; pass a copy of reference.py")
    return module


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--baseline", help="path of another reference.py to compare against")
    parser.add_argument("--rounds", type=int, default=7, help="timed rounds per case (median reported)")
    parser.add_argument("--round-seconds", type=float, default=0.25, help="time budget of one round")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: leave the default)")
    parser.add_argument("--only", default="", help="run only cases whose label contains this text")
    args = parser.parse_args()
    if args.baseline and not Path(args.baseline).is_file():
        sys.exit(f"error: --baseline {args.baseline} is not a file")
    if args.threads:
        torch.set_num_threads(args.threads)

    from proxima.engine.attention import reference

    impls: dict[str, ModuleType] = {}
    if args.baseline:
        impls["before"] = load_module(args.baseline)
    impls["current"] = reference
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, median of {args.rounds} rounds")
    header = f"{'shape':5} {'case':40}" + "".join(f" {name + ' ms':>11}" for name in impls)
    print(header + ("  speedup" if args.baseline else ""))
    for case in CASES:
        if args.only not in case.label:
            continue
        gen = torch.Generator().manual_seed(zlib.crc32(f"{case.shape.name} {case.label}".encode()))
        make = write_call if case.write_tokens else attention_call
        call = make(case, gen)
        results = {name: call(module).clone() for name, module in impls.items()}
        if args.baseline:
            torch.testing.assert_close(results["current"], results["before"], atol=1e-4, rtol=1e-4)
        samples: dict[str, list[float]] = {name: [] for name in impls}
        for _ in range(args.rounds):
            for name, module in impls.items():
                samples[name].append(time_per_call(lambda m=module, c=call: c(m), args.round_seconds))
        medians = {name: statistics.median(times) * 1e3 for name, times in samples.items()}
        line = f"{case.shape.name:5} {case.label:40}" + "".join(f" {ms:11.3f}" for ms in medians.values())
        if args.baseline:
            line += f"  {medians['before'] / medians['current']:6.2f}x"
        print(line, flush=True)


if __name__ == "__main__":
    main()
