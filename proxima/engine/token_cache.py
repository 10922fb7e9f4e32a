"""Requests' KV slots over one slot pool, with token-exact prefix sharing.

Layer: between the allocator and tree (slot numbers, token runs) and vLLM's manager (requests).
No vLLM, no metrics: tests drive it with plain arrays.

Every slot is in exactly one state:
  free        in the allocator's free stack
  cached      held by the prefix tree, referenced by no request (evicted on demand, LRU first)
  referenced  in a request's slot list: either on its tree path (locked, possibly shared with
              other requests) or private to it (tokens not in the tree)

A request's slot list is `[tree path | private tail]`: its first `num_in_tree` slots are exactly
the slots of its locked tree path, the rest are its own. Admission locks the hit's path before
checking capacity (so eviction never takes what the request is about to read) and evicts only
what the new slots need. While a request runs, the prompt tokens it is computing this step join
the tree at once, so a request admitted later in the same step already shares them (each layer
writes a step's K/V before attention reads it). If the tree already holds the tokens a request is
computing (another request cached them first), its copies stay private until it ends: a slot the
step is writing is never swapped under it. At release, the computed tokens (prompt and output)
join the tree, duplicates of what the tree holds are freed, the path is unlocked, and what was
never computed is freed.

Figures in whole blocks (`keep_duplicates`, docs/security.md): whether a request's tokens
duplicate what the tree holds is token-exact knowledge of other requests' tokens. A block cache
keeps such duplicates (each request computes and caches its own blocks), so under block figures
the duplicates a release would free are kept instead as spare runs: cached like a branch of the
tree, counted like one, and evicted before anything the tree holds.

Error contract: `allocate` returns None, changing nothing, when the slots do not fit even after
evicting every cached slot; releasing an unknown request is a no-op.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Hashable, Sequence
from dataclasses import dataclass

import numpy as np

from proxima.engine.radix_tree import TOKEN_DTYPE, Node, RadixTree
from proxima.engine.slot_allocator import SlotAllocator
from proxima.engine.slot_table import RequestSlotTable

# Slots evicted at least per eviction, when one is needed (a few percent of a small cache).
EVICT_CHUNK = 64


@dataclass(frozen=True, slots=True)
class PrefixHit:
    """What `lookup` found: the path's end node, its length, and its slots in token order."""

    namespace: Hashable
    node: Node
    num_tokens: int
    slots: np.ndarray


@dataclass(slots=True)
class _Path:
    namespace: Hashable | None  # None: this request neither reads nor writes the cache
    node: Node
    num_in_tree: int
    diverged: bool = False  # the tree already held tokens it computed: the rest stays private


@dataclass(slots=True)
class CacheCounters:
    """Monotonic counts since start (exported as counters)."""

    hit_tokens: int = 0  # tokens admitted from the cache instead of computed
    hit_tokens_beyond_blocks: int = 0  # of those, tokens a `reference_block` cache would miss
    evicted_tokens: int = 0
    evicted_block_slots: int = 0  # the same, in whole blocks (RadixTree.num_evictable_blocks)

    @property
    def hit_tokens_in_blocks(self) -> int:
        """Hit tokens counted in whole reference blocks: what a block cache reports."""
        return self.hit_tokens - self.hit_tokens_beyond_blocks


class TokenSlotCache:
    def __init__(self, num_slots: int, caching: bool, reference_block: int = 16,
                 check_invariants: bool = False, evict_chunk: int = EVICT_CHUNK,
                 keep_duplicates: bool = False) -> None:
        self.allocator = SlotAllocator(num_slots, check_invariants=check_invariants)
        self.table = RequestSlotTable()
        self.tree = RadixTree(reference_block)
        self.caching = caching
        self.reference_block = reference_block
        self.check_invariants = check_invariants
        self.counters = CacheCounters()
        self.evict_chunk = evict_chunk
        self.keep_duplicates = keep_duplicates
        self._paths: dict[str, _Path] = {}
        # Spare runs (keep_duplicates): (slots, position of the first), oldest first.
        self._spares: deque[tuple[np.ndarray, int]] = deque()
        self.num_spare = 0
        self.num_spare_blocks = 0
        # Sum over requests of num_in_tree % reference_block: the partial block at each path's end.
        self.path_remainders = 0

    # -- sizes ----------------------------------------------------------------------------------

    @property
    def num_slots(self) -> int:
        return self.allocator.num_slots

    @property
    def num_cached(self) -> int:
        """Slots holding cache entries no request references (reusable, evictable)."""
        return self.tree.num_evictable + self.num_spare

    @property
    def num_referenced(self) -> int:
        """Slots some live request references, each counted once however many share it."""
        return self.allocator.num_used - self.num_cached

    @property
    def num_available(self) -> int:
        """Slots an allocation may take: free ones and cached ones it may evict."""
        return self.allocator.num_free + self.num_cached

    @property
    def num_referenced_in_blocks(self) -> int:
        """`num_referenced` as block figures count it: locked tree slots by the block boundaries
        their nodes cross, plus each request's own slots and the partial block its path ends in.
        Per request that is its slot count, whatever length of it is shared (the sharing shows
        only through the boundaries of shared nodes): the exact shared length does not leak."""
        tree = self.tree
        return self.num_referenced - tree.num_locked + tree.num_locked_blocks + self.path_remainders

    @property
    def num_cached_in_blocks(self) -> int:
        """`num_cached` as block figures count it: tree nodes and spare runs by block boundaries."""
        return self.tree.num_evictable_blocks + self.num_spare_blocks

    def can_fit(self, num_slots: int, reserve: int = 0) -> bool:
        return num_slots + reserve <= self.num_available

    # -- lookup and admission -------------------------------------------------------------------

    def lookup(self, namespace: Hashable, tokens: np.ndarray) -> PrefixHit | None:
        """The longest cached prefix of `tokens` (pass at most what may be reused). No locks."""
        if not self.caching or tokens.size == 0:
            return None
        node, n = self.tree.match(namespace, tokens)
        if n == 0:
            return None
        return PrefixHit(namespace, node, n, self.tree.path_slots(node))

    def allocate(self, request_id: str, num_tokens: int, hit: PrefixHit | None = None,
                 reserve: int = 0, namespace: Hashable | None = None,
                 must_fit: int = 0) -> np.ndarray | None:
        """Hold slots for the request's first `num_tokens` tokens; return the new slots.

        `hit` (a new request's lookup) is shared instead of allocated; `namespace` names the cache
        a new request may write (None: it never shares). `must_fit`: also refuse unless this many
        tokens in all would fit (vLLM's admission gate for whole prompts).
        """
        path = self._paths.get(request_id)
        locked = False
        if path is None and hit is not None:
            self.tree.lock(hit.node)  # before any eviction: the hit must survive this call
            locked = True
        num_held = self.table.num_slots_of(request_id) + (hit.num_tokens if locked else 0)
        num_new = max(0, num_tokens - num_held)
        if not self.can_fit(num_new, reserve) or (must_fit and not self.can_fit(must_fit - num_held,
                                                                                 reserve)):
            if locked:
                self.tree.unlock(hit.node)
            return None
        if num_new > self.allocator.num_free:
            # At least EVICT_CHUNK at a time: a full cache otherwise evicts one slot per decode
            # per request, and each eviction is a heap pop and a free (scripts/bench_prefix_cache.py).
            self._evict(max(num_new - self.allocator.num_free, self.evict_chunk))
        if path is None:
            if locked:
                self._paths[request_id] = _Path(hit.namespace, hit.node, hit.num_tokens)
                self.path_remainders += hit.num_tokens % self.reference_block
                self.table.append(request_id, hit.slots)
                self.counters.hit_tokens += hit.num_tokens
                self.counters.hit_tokens_beyond_blocks += hit.num_tokens % self.reference_block
            else:
                ns = namespace if self.caching else None
                self._paths[request_id] = _Path(ns, self.tree.root(ns), 0)
        slots = self.allocator.allocate(num_new)
        assert slots is not None  # can_fit said they fit, and eviction made them free
        self.table.append(request_id, slots)
        if self.check_invariants:
            self.assert_consistent()
        return slots

    def cache(self, request_id: str, tokens: Sequence[int], num_tokens: int) -> None:
        """The request's first `num_tokens` tokens are computed or being computed: share them."""
        path = self._paths.get(request_id)
        if path is None or path.namespace is None or path.diverged:
            return
        start = path.num_in_tree
        end = min(num_tokens, self.table.num_slots_of(request_id))
        if end <= start:
            return
        run = np.asarray(tokens[start:end], dtype=TOKEN_DTYPE)
        slots = self.table.slots_of(request_id)[start:end]
        node = self.tree.extend(path.node, run, slots)
        if node is None:
            path.diverged = True
            return
        # The new leaf is the request's: move its lock from the old end to the new one.
        self.tree.lock(node)
        self.tree.unlock(path.node)
        rb = self.reference_block
        self.path_remainders += end % rb - path.num_in_tree % rb
        path.node, path.num_in_tree = node, end

    # -- release --------------------------------------------------------------------------------

    def release(self, request_id: str, tokens: Sequence[int], num_computed: int) -> None:
        """The request lets go of its slots: its first `num_computed` tokens (whose K/V are
        computed, or will be by the steps already scheduled) stay cached, the rest are freed."""
        # Validate before changing anything: a bad slot list must not lose the request's good slots.
        self.allocator.check_held(self.table.slots_of(request_id))
        path = self._paths.pop(request_id, None)
        slots = self.table.pop(request_id)
        if path is None:
            self.allocator.free(slots)
            return
        self.path_remainders -= path.num_in_tree % self.reference_block
        keep = min(num_computed, slots.size) if path.namespace is not None else 0
        to_free = [slots[max(keep, path.num_in_tree):]]
        if keep > path.num_in_tree:
            run = np.asarray(tokens[path.num_in_tree:keep], dtype=TOKEN_DTYPE)
            _, present = self.tree.insert(path.node, run, slots[path.num_in_tree:keep])
            duplicates = slots[path.num_in_tree:path.num_in_tree + present]
            if present and self.keep_duplicates:
                self._add_spare(duplicates.copy(), path.num_in_tree)
            else:
                to_free.append(duplicates)
        self.tree.unlock(path.node)
        if keep < path.num_in_tree:
            # Scheduled tokens that will not be computed (preempted in the step that cached them):
            # nobody else can hold them yet, so they leave the tree.
            to_free.append(self.tree.truncate(path.node, keep))
        self.allocator.free(np.concatenate(to_free))
        if self.check_invariants:
            self.assert_consistent()

    # -- cache control --------------------------------------------------------------------------

    def reset(self) -> bool:
        """Drop every cached entry; refused (False) while any request holds slots, as in vLLM."""
        if len(self.table):
            return False
        spares = [run for run, _ in self._spares]
        self._spares.clear()
        self.num_spare = self.num_spare_blocks = 0
        self.allocator.free(np.concatenate([self.tree.evict_all(), *spares]))
        return True

    def evict_slots(self, slots: set[int]) -> None:
        doomed = [s for s in self._spares if not slots.isdisjoint(s[0].tolist())]
        if doomed:  # moved to the front, then dropped
            self._spares = deque(doomed + [s for s in self._spares if slots.isdisjoint(s[0].tolist())])
            self._drop_spares(len(doomed))
        self._count_evicted(self.tree.evict_slots, slots)

    def _evict(self, num_slots: int) -> None:
        num_slots -= self._drop_spares(len(self._spares), num_slots)
        if num_slots > 0:
            self._count_evicted(self.tree.evict, num_slots)

    def _count_evicted(self, evict, arg) -> None:
        blocks = self.tree.num_evictable_blocks
        freed = evict(arg)
        self.counters.evicted_tokens += freed.size
        self.counters.evicted_block_slots += blocks - self.tree.num_evictable_blocks
        self.allocator.free(freed)

    def _spare_blocks(self, start: int, size: int) -> int:
        rb = self.reference_block
        return ((start + size) // rb - start // rb) * rb

    def _add_spare(self, slots: np.ndarray, start: int) -> None:
        """Keep duplicates of tree tokens at positions [start, start + len) as a spare run."""
        self._spares.append((slots, start))
        self.num_spare += slots.size
        self.num_spare_blocks += self._spare_blocks(start, slots.size)

    def _drop_spares(self, max_runs: int, num_slots: int | None = None) -> int:
        """Free the oldest spare runs: `max_runs` of them, or only until `num_slots` are freed
        (the last one trimmed from its end, as the tree trims a leaf). Returns the slots freed."""
        freed = 0
        while self._spares and max_runs > 0 and (num_slots is None or freed < num_slots):
            run, start = self._spares.popleft()
            max_runs -= 1
            drop = run.size if num_slots is None else min(run.size, num_slots - freed)
            blocks = self._spare_blocks(start, run.size) - self._spare_blocks(start, run.size - drop)
            if drop < run.size:
                self._spares.appendleft((run[: run.size - drop], start))
            freed += drop
            self.num_spare -= drop
            self.num_spare_blocks -= blocks
            self.counters.evicted_tokens += drop
            self.counters.evicted_block_slots += blocks
            self.allocator.free(run[run.size - drop:])
        return freed

    def num_in_tree(self, request_id: str) -> int:
        path = self._paths.get(request_id)
        return path.num_in_tree if path is not None else 0

    # -- invariants -----------------------------------------------------------------------------

    def assert_consistent(self) -> None:
        """Every slot exactly one of free, cached or referenced; every path what its list says."""
        self.allocator.assert_consistent()
        self.tree.assert_consistent()
        tree_slots = self.tree.all_slots()
        private = [self.table.slots_of(rid)[p.num_in_tree:] for rid, p in self._paths.items()]
        spares = [run for run, _ in self._spares]
        owned = np.concatenate([tree_slots, *private, *spares])
        assert self.num_spare == sum(run.size for run in spares)
        assert self.num_spare_blocks == sum(self._spare_blocks(start, r.size) for r, start in self._spares)
        assert self.path_remainders == sum(p.num_in_tree % self.reference_block for p in self._paths.values())
        assert np.unique(owned).size == owned.size, "a slot is owned twice"
        assert owned.size == self.allocator.num_used, (owned.size, self.allocator.num_used)
        assert self.allocator.in_use[owned].all(), "an owned slot is free in the allocator"
        for rid, p in self._paths.items():
            on_path = self.tree.path_slots(p.node)
            assert on_path.size == p.num_in_tree, (rid, on_path.size, p.num_in_tree)
            assert np.array_equal(self.table.slots_of(rid)[: p.num_in_tree], on_path), rid
        assert set(self._paths) == set(self.table.request_ids())
