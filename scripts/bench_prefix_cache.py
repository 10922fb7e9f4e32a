"""Host cost of the token-exact prefix cache and of the allocator's duplicate-free check.

1. Lookup and insert for a 2,000-token prompt against a tree holding ~100k cached tokens: 500
   conversations behind 20 system prompts (each cached conversation is a few hundred tokens), so
   each lookup walks a shared system prompt and then one conversation, as a chat server's would.
   `lookup` is what `get_computed_blocks` runs (match + the path's slots); `admit+release` is a
   whole request's life in the cache (lock the hit, allocate the rest, cache it, release it).
2. A decode step on a full cache: 70 requests behind one 300-token system prompt each take one
   slot per step, so every step evicts; with eviction one slot at a time (`evict_chunk=1`) against
   the shipped chunk of `token_cache.EVICT_CHUNK` slots.
3. `SlotAllocator.free` of a request's slots, with the always-on duplicate check, against the
   same free without it (numpy calls only; the checks it replaces were off unless
   PROXIMA_CHECK_INVARIANTS=1).

usage: python scripts/bench_prefix_cache.py [--repeats 2000]
"""

from __future__ import annotations

import argparse
import random
import time

import numpy as np

from proxima.engine.slot_allocator import SlotAllocator
from proxima.engine.token_cache import EVICT_CHUNK, TokenSlotCache

NS = (0, None)


def percentiles(samples: list[float]) -> str:
    us = np.array(samples) * 1e6
    return f"p50 {np.percentile(us, 50):8.1f} us   p99 {np.percentile(us, 99):8.1f} us"


def build_cache(rng: random.Random, num_slots: int) -> tuple[TokenSlotCache, list[list[int]]]:
    cache = TokenSlotCache(num_slots, caching=True)
    systems = [[rng.randrange(3, 32000) for _ in range(rng.randint(100, 600))] for _ in range(20)]
    convs = []
    for i in range(500):
        tokens = systems[i % 20] + [rng.randrange(3, 32000) for _ in range(rng.randint(100, 300))]
        hit = cache.lookup(NS, np.array(tokens[:-1]))
        cache.allocate(f"c{i}", len(tokens), hit, namespace=NS)
        cache.cache(f"c{i}", tokens, len(tokens))
        cache.release(f"c{i}", tokens, len(tokens))
        convs.append(tokens)
    return cache, convs


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=2000)
    args = p.parse_args()
    rng = random.Random(0)
    cache, convs = build_cache(rng, 400_000)
    print(f"tree: {cache.num_cached:,} cached tokens in {cache.tree.num_nodes:,} nodes")
    lookups, lives = [], []
    for _ in range(args.repeats):
        base = convs[rng.randrange(len(convs))]
        prompt = base + [rng.randrange(3, 32000) for _ in range(2000 - len(base))]
        arr = np.array(prompt[:-1], dtype=np.int64)
        t0 = time.perf_counter()
        hit = cache.lookup(NS, arr)
        t1 = time.perf_counter()
        cache.allocate("r", len(prompt), hit, namespace=NS)
        cache.cache("r", prompt, len(prompt))
        cache.release("r", prompt, len(prompt))
        t2 = time.perf_counter()
        lookups.append(t1 - t0)
        lives.append(t2 - t0)
        cache.reset() if cache.num_cached > 150_000 else None
    print(f"lookup, 2,000-token prompt:        {percentiles(lookups)}")
    print(f"lookup+admit+cache+release:        {percentiles(lives)}")

    for chunk in (1, EVICT_CHUNK):
        print(f"decode step, 70 requests, full cache, evict_chunk={chunk:>2}: "
              f"{percentiles(decode_steps(chunk, args.repeats // 4))}")

    alloc = SlotAllocator(1 << 20)
    for n in (1, 200, 2000):
        checked, unchecked = [], []
        for _ in range(args.repeats):
            slots = alloc.allocate(n)
            t0 = time.perf_counter()
            alloc.free(slots)
            t1 = time.perf_counter()
            slots = alloc.allocate(n)
            t2 = time.perf_counter()
            _free_unchecked(alloc, slots)
            t3 = time.perf_counter()
            checked.append(t1 - t0)
            unchecked.append(t3 - t2)
        print(f"free({n:>4}) with duplicate check:  {percentiles(checked)}   "
              f"without: {percentiles(unchecked)}")


def decode_steps(evict_chunk: int, steps: int) -> list[float]:
    """Seconds per decode step of 70 running requests on a cache full of cached entries."""
    rng = random.Random(1)
    cache = TokenSlotCache(8192, caching=True, evict_chunk=evict_chunk)
    system = [rng.randrange(3, 400) for _ in range(300)]
    running: dict[str, list[int]] = {}
    times, n = [], 0
    for step in range(200 + steps):
        t0 = time.perf_counter()
        for rid, tokens in list(running.items()):
            tokens.append(rng.randrange(3, 400))
            if cache.allocate(rid, len(tokens)) is None or len(tokens) > 450:
                cache.release(rid, tokens, len(tokens) - 1)
                del running[rid]
        if step >= 200:
            times.append(time.perf_counter() - t0)
        while len(running) < 70:  # new requests behind the shared system prompt
            tokens = system + [rng.randrange(3, 400) for _ in range(rng.randint(20, 100))]
            hit = cache.lookup(NS, np.array(tokens[:-1]))
            if cache.allocate(f"r{n}", len(tokens), hit, namespace=NS) is not None:
                cache.cache(f"r{n}", tokens, len(tokens))
                running[f"r{n}"] = tokens
            n += 1
    return times


def _free_unchecked(alloc: SlotAllocator, slots: np.ndarray) -> None:
    """The free as it was before the duplicate check (range and in-use checks kept)."""
    if slots.min() < 0 or slots.max() >= alloc.num_slots or not alloc._in_use[slots].all():
        raise ValueError("bad free")
    alloc._in_use[slots] = False
    top = alloc._num_free
    alloc._free_stack[top: top + slots.size] = slots[::-1]
    alloc._num_free = top + slots.size


if __name__ == "__main__":
    main()
