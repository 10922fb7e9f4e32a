"""The token-exact prefix cache (radix tree + slot cache) on plain arrays, no vLLM.

Unit tests for each rule the engine relies on, and a hypothesis state machine over random
request lifetimes checking after every operation that each slot is exactly one of free, cached
or referenced, that no slot has two owners, and that everything comes back.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from proxima.engine.radix_tree import RadixTree
from proxima.engine.token_cache import TokenSlotCache

NS = (0, None)
SYSTEM = list(range(1000, 1037))  # 37 tokens: two full 16-token blocks and 5 more


def admit(cache: TokenSlotCache, rid: str, tokens: list[int], ns=NS, compute: int | None = None):
    """What the scheduler does for a new request: lookup (all but the last token), allocate, cache."""
    hit = cache.lookup(ns, np.array(tokens[:-1]))
    slots = cache.allocate(rid, len(tokens), hit, namespace=ns)
    assert slots is not None
    cache.cache(rid, tokens, len(tokens) if compute is None else compute)
    return hit


def test_hit_is_token_exact_and_shares_the_slots():
    cache = TokenSlotCache(200, caching=True, check_invariants=True)
    a, b = SYSTEM + [1, 2, 3], SYSTEM + [4, 5]
    assert admit(cache, "a", a) is None
    hit = admit(cache, "b", b)
    assert hit.num_tokens == 37  # a block cache of 16 would share 32
    assert np.array_equal(cache.table.slots_of("b")[:37], cache.table.slots_of("a")[:37])
    assert cache.counters.hit_tokens == 37 and cache.counters.hit_tokens_beyond_blocks == 5
    # Shared slots count once: 37 + 3 + 2 referenced, and the tree knows 37 are shared.
    assert cache.num_referenced == 42 and cache.tree.shared_excess == 37
    assert cache.tree.shared_excess_blocks == 32


def test_tokens_being_computed_are_shared_within_the_same_step():
    cache = TokenSlotCache(200, caching=True, check_invariants=True)
    admit(cache, "a", SYSTEM + [1])  # scheduled, not yet computed: already in the tree
    hit = cache.lookup(NS, np.array(SYSTEM + [2]))
    assert hit is not None and hit.num_tokens == 37


def test_chunked_prefill_shares_only_what_is_scheduled():
    cache = TokenSlotCache(200, caching=True, check_invariants=True)
    a = SYSTEM + [1]
    assert cache.allocate("a", 20, None, namespace=NS) is not None
    cache.cache("a", a, 20)  # first chunk: 20 tokens
    assert cache.lookup(NS, np.array(SYSTEM)).num_tokens == 20


def test_namespaces_never_share():
    cache = TokenSlotCache(200, caching=True, check_invariants=True)
    admit(cache, "a", SYSTEM + [1], ns=(1, None))
    assert cache.lookup((2, None), np.array(SYSTEM)) is None
    assert cache.lookup((1, "salt"), np.array(SYSTEM)) is None
    assert cache.lookup((1, None), np.array(SYSTEM)).num_tokens == 37


def test_release_keeps_computed_tokens_and_frees_the_rest():
    cache = TokenSlotCache(200, caching=True, check_invariants=True)
    tokens = SYSTEM + [1, 2]
    admit(cache, "a", tokens)
    cache.allocate("a", len(tokens) + 3)  # three decode slots
    cache.release("a", tokens + [7, 8, 9], len(tokens) + 2)  # the last sampled token has no KV
    assert cache.num_referenced == 0 and cache.num_cached == len(tokens) + 2
    assert cache.allocator.num_used == len(tokens) + 2
    assert cache.lookup(NS, np.array(tokens + [7, 8, 9])).num_tokens == len(tokens) + 2


def test_duplicates_computed_in_flight_stay_private_then_are_freed():
    cache = TokenSlotCache(200, caching=True, check_invariants=True)
    a = SYSTEM + [1]
    cache.allocate("a", 10, None, namespace=NS)
    cache.cache("a", a, 10)
    admit(cache, "b", a)  # hits a's 10 tokens, computes and caches the other 28
    cache.allocate("a", len(a))
    cache.cache("a", a, len(a))  # a computes its own copies of what b already cached
    assert cache.num_in_tree("a") == 10
    cache.release("a", a, len(a))
    assert cache.num_cached == 0  # a's copies were duplicates: freed, not cached twice
    assert cache.allocator.num_used == len(a)
    cache.release("b", a, len(a))
    assert cache.num_cached == len(a)


def test_under_block_figures_duplicates_are_kept_as_spares_counted_like_a_branch_evicted_first():
    """What a block cache does with a block it computed twice: it keeps both (docs/security.md)."""
    cache = TokenSlotCache(200, caching=True, check_invariants=True, keep_duplicates=True, evict_chunk=1)
    a = SYSTEM + [1]  # 38 tokens
    cache.allocate("a", 10, None, namespace=NS)
    cache.cache("a", a, 10)
    admit(cache, "b", a)
    cache.allocate("a", len(a))
    cache.cache("a", a, len(a))  # positions 10..37 computed twice
    cache.release("a", a, len(a))
    cache.release("b", a, len(a))
    assert cache.num_spare == 28 and cache.num_cached == 38 + 28
    # As a branch [10, 38) would count: the boundaries at 16 and 32.
    assert cache.num_spare_blocks == 32 and cache.num_cached_in_blocks == 32 + 32
    assert cache.num_referenced == 0 and cache.num_referenced_in_blocks == 0
    assert cache.allocate("x", 200 - 66 + 7, None, namespace=NS) is not None  # evicts 7 slots
    assert cache.num_spare == 21 and cache.lookup(NS, np.array(a)).num_tokens == 38  # the tree kept
    # The spare now spans [10, 31): it lost the boundary at 32.
    assert cache.counters.evicted_tokens == 7 and cache.counters.evicted_block_slots == 16
    cache.release("x", [], 0)
    assert cache.reset() and cache.allocator.num_free == 200 and cache.num_spare == 0


def test_block_figures_count_each_request_by_its_own_slots_whatever_it_shares():
    """A 30-token request whose last token does or does not repeat a cached sequence's 30th: its
    hit is 29 either way, but one last token is a duplicate (it stays private, off the tree) and
    the other a branch. Block figures read the same for both, while it runs and after."""
    seen = []
    for last in (129, 7):
        cache = TokenSlotCache(200, caching=True, check_invariants=True, keep_duplicates=True)
        v = list(range(100, 140))
        admit(cache, "v", v)
        cache.release("v", v, len(v))
        probe = v[:29] + [last]
        assert admit(cache, "p", probe).num_tokens == 29
        running = (cache.num_referenced_in_blocks, cache.num_cached_in_blocks)
        cache.release("p", probe, len(probe))
        seen.append((cache.num_in_tree("p"), running, cache.num_cached_in_blocks))
    assert seen[0][1:] == seen[1][1:] == ((30, 16), 32)


def test_preempted_in_the_step_it_was_scheduled_uncaches_what_it_did_not_compute():
    cache = TokenSlotCache(200, caching=True, check_invariants=True)
    tokens = SYSTEM + [1]
    admit(cache, "a", tokens)
    cache.release("a", tokens, 16)  # preempted before its prompt was computed
    assert cache.num_cached == 16 and cache.allocator.num_used == 16
    assert cache.lookup(NS, np.array(tokens)).num_tokens == 16


def test_eviction_is_lru_and_token_exact():
    cache = TokenSlotCache(100, caching=True, check_invariants=True, evict_chunk=1)
    for rid, base in (("old", 0), ("new", 500)):
        tokens = list(range(base, base + 40))
        admit(cache, rid, tokens)
        cache.release(rid, tokens, 40)
    assert cache.num_cached == 80
    assert cache.allocate("x", 30, None, namespace=NS) is not None  # 20 free, evicts 10
    assert cache.counters.evicted_tokens == 10
    assert cache.lookup(NS, np.arange(0, 40)).num_tokens == 30  # the old entry lost its tail
    assert cache.lookup(NS, np.arange(500, 540)).num_tokens == 40


def test_eviction_takes_a_chunk_at_a_time_oldest_first():
    cache = TokenSlotCache(100, caching=True, check_invariants=True, evict_chunk=50)
    for rid, base in (("old", 0), ("new", 500)):
        tokens = list(range(base, base + 40))
        admit(cache, rid, tokens)
        cache.release(rid, tokens, 40)
    assert cache.allocate("x", 21, None, namespace=NS) is not None  # 20 free: evicts 50, not 1
    assert cache.counters.evicted_tokens == 50 and cache.allocator.num_free == 49
    assert cache.lookup(NS, np.arange(0, 40)) is None
    assert cache.lookup(NS, np.arange(500, 540)).num_tokens == 30


def test_allocation_never_evicts_the_hit_it_is_admitting():
    cache = TokenSlotCache(60, caching=True, check_invariants=True)
    tokens = SYSTEM + [1]
    admit(cache, "a", tokens)
    cache.release("a", tokens, len(tokens))
    hit = cache.lookup(NS, np.array(SYSTEM + [2]))
    # 22 free + 38 cached: 37 of those are the hit, so only 1 more may be evicted.
    assert cache.allocate("b", 37 + 24, hit, namespace=NS) is None
    assert cache.num_cached == 38 and cache.tree.num_locked == 0  # refused, changed nothing
    assert cache.allocate("b", 37 + 23, hit, namespace=NS) is not None
    assert np.array_equal(cache.table.slots_of("b")[:37], hit.slots)


def test_reset_refused_while_requests_hold_slots():
    cache = TokenSlotCache(100, caching=True, check_invariants=True)
    admit(cache, "a", SYSTEM)
    assert not cache.reset()
    cache.release("a", SYSTEM, len(SYSTEM))
    assert cache.reset() and cache.allocator.num_free == 100 and cache.num_cached == 0


def test_caching_off_shares_nothing():
    cache = TokenSlotCache(100, caching=False, check_invariants=True)
    admit(cache, "a", SYSTEM)
    assert cache.lookup(NS, np.array(SYSTEM)) is None
    cache.release("a", SYSTEM, len(SYSTEM))
    assert cache.allocator.num_free == 100


def test_split_keeps_locks_and_sizes():
    tree = RadixTree()
    root = tree.root(NS)
    leaf = tree.insert(root, np.arange(10), np.arange(10, dtype=np.int32))[0]
    tree.lock(leaf)
    node, n = tree.match(NS, np.array([0, 1, 2, 3, 99]))
    assert n == 4 and node.lock_ref == 1 and node.end == 4
    tree.assert_consistent()
    tree.unlock(leaf)
    assert tree.num_evictable == 10 and tree.num_locked == 0


# -- the state machine ---------------------------------------------------------------------------

PREFIXES = [[], SYSTEM[:5], SYSTEM, SYSTEM + [7, 7, 7]]


class CacheMachine(RuleBasedStateMachine):
    @initialize(num_slots=st.integers(40, 300), keep_duplicates=st.booleans())
    def start(self, num_slots, keep_duplicates):
        self.cache = TokenSlotCache(num_slots, caching=True, check_invariants=True,
                                    keep_duplicates=keep_duplicates)
        self.tokens: dict[str, list[int]] = {}
        self.computed: dict[str, int] = {}
        self.next_id = 0

    @rule(prefix=st.sampled_from(PREFIXES), tail=st.lists(st.integers(0, 3), min_size=1, max_size=30),
          salt=st.sampled_from([None, "s"]), chunk=st.integers(1, 64))
    def admit(self, prefix, tail, salt, chunk):
        tokens = prefix + tail
        ns = (0, salt)
        rid = f"r{self.next_id}"
        self.next_id += 1
        hit = self.cache.lookup(ns, np.array(tokens[:-1]))
        num_hit = hit.num_tokens if hit else 0
        end = min(len(tokens), num_hit + chunk)
        if self.cache.allocate(rid, end, hit, namespace=ns) is None:
            assert rid not in self.cache.table
            return
        self.cache.cache(rid, tokens, end)
        self.tokens[rid], self.computed[rid] = tokens, end

    @precondition(lambda self: self.tokens)
    @rule(data=st.data(), n=st.integers(1, 40))
    def step(self, data, n):
        rid = data.draw(st.sampled_from(sorted(self.tokens)))
        tokens = self.tokens[rid]
        end = self.computed[rid] + n
        while len(tokens) < end:  # generated tokens
            tokens.append(data.draw(st.integers(0, 3)))
        if self.cache.allocate(rid, end) is not None:
            self.cache.cache(rid, tokens, end)
            self.computed[rid] = end

    @precondition(lambda self: self.tokens)
    @rule(data=st.data())
    def release(self, data):
        rid = data.draw(st.sampled_from(sorted(self.tokens)))
        self.cache.release(rid, self.tokens.pop(rid), self.computed.pop(rid))

    @rule(prefix=st.sampled_from(PREFIXES), tail=st.lists(st.integers(0, 3), min_size=1, max_size=30),
          computed=st.integers(0, 60))
    def preempt_before_compute(self, prefix, tail, computed):
        """Admitted, then preempted in the same step: only what was computed before stays."""
        tokens = prefix + tail
        hit = self.cache.lookup(NS, np.array(tokens[:-1]))
        if self.cache.allocate("fresh", len(tokens), hit, namespace=NS) is None:
            return
        self.cache.cache("fresh", tokens, len(tokens))
        num_hit = hit.num_tokens if hit else 0
        self.cache.release("fresh", tokens, min(len(tokens), num_hit + computed))

    @rule(n=st.integers(1, 100))
    def evict(self, n):
        before = self.cache.num_cached
        self.cache._evict(n)
        assert self.cache.num_cached == max(0, before - n)

    @invariant()
    def consistent(self):
        c = self.cache
        c.assert_consistent()
        assert c.allocator.num_free + c.num_cached + c.num_referenced == c.num_slots
        holders = [c.table.slots_of(r) for r in self.tokens]
        if holders:
            held = np.unique(np.concatenate(holders))
            assert held.size == c.num_referenced  # shared slots counted once

    def teardown(self):
        for rid in list(self.tokens):
            self.cache.release(rid, self.tokens[rid], self.computed[rid])
        assert self.cache.num_referenced == 0 and self.cache.tree.num_locked == 0
        self.cache.reset()
        assert self.cache.allocator.num_free == self.cache.num_slots


TestCacheMachine = CacheMachine.TestCase
TestCacheMachine.settings = settings(max_examples=60, stateful_step_count=40)


@pytest.mark.parametrize("n", [1, 2, 50])
def test_tree_heap_stays_bounded(n):
    tree = RadixTree()
    root = tree.root(NS)
    leaf = tree.insert(root, np.arange(n), np.arange(n, dtype=np.int32))[0]
    for _ in range(5000):
        tree.lock(leaf)
        tree.unlock(leaf)
    tree.evict(0)
    assert len(tree._heap) <= 2 * tree.num_nodes + 1024


# -- the test-only leak fault: unreachable by accident ------------------------------------------

def test_leak_fault_is_ignored_without_the_test_switch(monkeypatch):
    import logging

    from proxima.engine import faults

    monkeypatch.setenv(faults.LEAK_ENV, "3")
    monkeypatch.delenv(faults.ENABLE_ENV, raising=False)
    # Listen on the module's own "vllm." logger: vLLM's logging setup stops it propagating.
    records: list[logging.LogRecord] = []
    handler = logging.Handler(logging.ERROR)
    handler.emit = records.append
    faults.logger.addHandler(handler)
    try:
        assert faults.leak_per_free_from_env() == 0
    finally:
        faults.logger.removeHandler(handler)
    assert any("ignored" in r.getMessage() for r in records)
    monkeypatch.setenv(faults.ENABLE_ENV, "1")
    assert faults.leak_per_free_from_env() == 3


@pytest.mark.parametrize("raw", ["-5", "0", "three", "1.5"])
def test_leak_fault_refuses_a_bad_value_naming_the_variable(monkeypatch, raw):
    from proxima.engine import faults
    from proxima.engine.settings import ProximaConfigError

    monkeypatch.setenv(faults.LEAK_ENV, raw)
    monkeypatch.setenv(faults.ENABLE_ENV, "1")
    with pytest.raises(ProximaConfigError, match=faults.LEAK_ENV):
        faults.leak_per_free_from_env()


# -- a bad free loses nothing ---------------------------------------------------------------------

def test_a_free_naming_a_slot_twice_is_refused_without_invariant_checks():
    from proxima.engine.slot_allocator import SlotAllocator

    alloc = SlotAllocator(16, check_invariants=False)
    slots = alloc.allocate(4)
    with pytest.raises(ValueError, match="twice"):
        alloc.free(np.array([slots[0], slots[1], slots[0]]))
    assert alloc.num_used == 4  # refused whole: nothing freed
    alloc.free(slots)
    again = alloc.allocate(16)
    assert np.unique(again).size == 16  # no slot handed out twice afterwards


def test_a_refused_release_keeps_the_requests_slots():
    cache = TokenSlotCache(64, caching=True)
    admit(cache, "a", SYSTEM[:10])
    held = cache.table.slots_of("a").copy()
    cache.allocator.free(held[-1:])  # corrupt: one of a's slots freed behind its back
    with pytest.raises(ValueError, match="not in use"):
        cache.release("a", SYSTEM[:10], 10)
    assert np.array_equal(cache.table.slots_of("a"), held)  # nothing forgotten
    assert cache.num_in_tree("a") == 10


def test_a_cache_that_never_fills_keeps_its_eviction_heap_bounded():
    """The same cached prompt read again and again never needs an eviction; each read used to
    leave one more stale entry in the LRU heap (100,000 reads: 100,000 entries, engine memory
    growing without bound). The heap stays within its compaction bound however many reads."""
    tree = RadixTree()
    prompt = np.arange(20, dtype=np.int32)
    tree.insert(tree.root(None), prompt, prompt.copy())
    for _ in range(20_000):
        node, matched = tree.match(None, prompt)
        assert matched == prompt.size
        tree.lock(node)
        tree.unlock(node)
    assert len(tree._heap) <= 2 * tree.num_nodes + 1024 + 1
    assert tree.evict(prompt.size).size == prompt.size  # and the entry that matters is still there
