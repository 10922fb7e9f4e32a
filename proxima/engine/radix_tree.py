"""Token-exact prefix cache: a radix tree over token ids whose nodes own runs of KV slots.

Layer: beside the slot allocator, below the request-level cache (`token_cache.py`). Pure numpy:
no requests, no vLLM, no metrics. The design follows SGLang's `mem_cache/radix_cache.py` at page
size 1 (lock counts on the path, LRU eviction of unlocked leaves); the code is our own.

Representation (why):
- A node holds one run of the cached sequences: `tokens[i]` was computed into `slots[i]`, at
  absolute position `end - len(tokens) + i`. Runs, not tokens, are the unit, so a 300-token system
  prompt is one node and one numpy comparison, and nothing in the tree is per token.
- Sequences that must never share KV (other LoRA adapters, other `cache_salt`) live under other
  roots: `match` and `insert` take a namespace and never cross it.
- `lock_ref` counts the requests whose path runs through a node (lock increments every node up to
  the root), so a child's count never exceeds its parent's, and a node with count 0 has an
  unlocked subtree: it may be evicted once its children are gone.
- Eviction takes the least recently used unlocked leaf first, from a heap with lazy deletion
  (an entry whose node was touched, locked, re-parented or removed since it was pushed is
  skipped), and trims a leaf's tail when fewer tokens are needed than it holds: eviction is token
  exact too. Access times are a counter, not a clock, so runs are reproducible.

Sizes kept incrementally, so metrics read them in O(1):
  num_evictable  tokens in unlocked nodes (cached, referenced by no request)
  num_locked     tokens in locked nodes (referenced by at least one request)
  shared_excess  sum over nodes of (lock_ref - 1) * len: slots that requests share, counted
                 once per extra request (what a cache without sharing would have stored twice)
  shared_excess_blocks  the same, counting only full `reference_block`-token blocks, i.e. what a
                 block-granular prefix cache would have shared on the same requests
  num_evictable_blocks, num_locked_blocks  the first two counted in whole reference blocks: each
                 node as `reference_block` slots per block boundary its positions cross. Where
                 one sequence branches from another depends on the exact shared length; a count
                 made of block boundaries depends on it to the block only, which is what clients
                 may be told (kv_sources.py, docs/security.md)

Error contract: the tree never frees slots itself; `evict` returns the slots it dropped and the
caller gives them back to the allocator. Misuse (unlocking an unlocked node) raises.
"""

from __future__ import annotations

import heapq
from collections.abc import Hashable, Iterator

import numpy as np

from proxima.engine.slot_allocator import SLOT_DTYPE

TOKEN_DTYPE = np.int64
_EMPTY_SLOTS = np.empty(0, dtype=SLOT_DTYPE)
_EMPTY_TOKENS = np.empty(0, dtype=TOKEN_DTYPE)


class Node:
    __slots__ = ("children", "end", "last_access", "lock_ref", "parent", "slots", "tokens")

    def __init__(self, tokens: np.ndarray, slots: np.ndarray, parent: Node | None, end: int) -> None:
        self.tokens = tokens
        self.slots = slots
        self.children: dict[int, Node] = {}
        self.parent = parent  # None for a root, and for a node removed from the tree
        self.end = end  # absolute position just past this node's last token
        self.lock_ref = 0
        self.last_access = 0

    @property
    def start(self) -> int:
        return self.end - self.tokens.size

    def __repr__(self) -> str:
        return f"Node([{self.start}, {self.end}) lock={self.lock_ref} children={len(self.children)})"


def common_length(a: np.ndarray, b: np.ndarray) -> int:
    """Length of the common prefix of two token arrays."""
    n = min(a.size, b.size)
    differ = np.flatnonzero(a[:n] != b[:n])
    return int(differ[0]) if differ.size else n


class RadixTree:
    def __init__(self, reference_block: int = 16) -> None:
        self.reference_block = reference_block
        self._roots: dict[Hashable, Node] = {}
        self._heap: list[tuple[int, int, Node]] = []
        self._clock = 0
        self._pushes = 0
        self.num_nodes = 0
        self.num_evictable = 0
        self.num_locked = 0
        self.shared_excess = 0
        self.shared_excess_blocks = 0
        self.num_evictable_blocks = 0
        self.num_locked_blocks = 0

    @property
    def num_cached(self) -> int:
        return self.num_evictable + self.num_locked

    def root(self, namespace: Hashable) -> Node:
        node = self._roots.get(namespace)
        if node is None:
            node = self._roots[namespace] = Node(_EMPTY_TOKENS, _EMPTY_SLOTS, None, 0)
        return node

    # -- lookup and insertion -----------------------------------------------------------------

    def match(self, namespace: Hashable, tokens: np.ndarray) -> tuple[Node, int]:
        """Deepest node whose path is a prefix of `tokens`, and that path's length.

        A match that ends inside a node splits it there, so the returned node ends exactly at the
        matched length (and a request can lock exactly what it uses).
        """
        node, matched = self._descend(self.root(namespace), tokens)
        return node, matched

    def path_slots(self, node: Node) -> np.ndarray:
        """The slots of the path from the root to `node`, in token order."""
        runs = []
        while node.parent is not None:
            runs.append(node.slots)
            node = node.parent
        if not runs:
            return _EMPTY_SLOTS
        runs.reverse()
        return np.concatenate(runs)

    def insert(self, node: Node, tokens: np.ndarray, slots: np.ndarray) -> tuple[Node, int]:
        """Cache `tokens` (computed into `slots`) as the continuation of `node`'s path.

        Returns the node where the inserted sequence ends and how many leading tokens the tree
        held already (their `slots` are duplicates the caller should free: the tree keeps its own).
        """
        deepest, present = self._descend(node, tokens)
        if present < tokens.size:
            deepest = self._add_leaf(deepest, tokens[present:].copy(), slots[present:].copy())
        return deepest, present

    def extend(self, node: Node, tokens: np.ndarray, slots: np.ndarray) -> Node | None:
        """Insert only if the tree holds none of `tokens` after `node`; None (no change) if it does.

        Used while a request runs: its slots become the tree's only when nobody else already
        cached the same tokens, so a request's slot list always begins with its tree path.
        """
        if tokens.size == 0:
            return node
        if int(tokens[0]) in node.children:
            return None
        return self._add_leaf(node, tokens.copy(), slots.copy())

    def _descend(self, node: Node, tokens: np.ndarray) -> tuple[Node, int]:
        pos = 0
        n = tokens.size
        while pos < n:
            child = node.children.get(int(tokens[pos]))
            if child is None:
                break
            k = common_length(child.tokens, tokens[pos:])
            if k < child.tokens.size:
                node = self._split(child, k)
                pos += k
                break
            node = child
            pos += k
        return node, pos

    def _split(self, node: Node, k: int) -> Node:
        """Cut `node` after its first k tokens; return the new upper part (which keeps the locks)."""
        parent = node.parent
        assert parent is not None and 0 < k < node.tokens.size
        upper = Node(node.tokens[:k].copy(), node.slots[:k].copy(), parent, node.start + k)
        upper.lock_ref = node.lock_ref
        upper.last_access = node.last_access
        node.tokens = node.tokens[k:].copy()
        node.slots = node.slots[k:].copy()
        node.parent = upper
        upper.children[int(node.tokens[0])] = node
        parent.children[int(upper.tokens[0])] = upper
        self.num_nodes += 1
        return upper

    def _add_leaf(self, parent: Node, tokens: np.ndarray, slots: np.ndarray) -> Node:
        leaf = Node(tokens, slots, parent, parent.end + tokens.size)
        parent.children[int(tokens[0])] = leaf
        self.num_nodes += 1
        self.num_evictable += tokens.size
        self.num_evictable_blocks += self._full_blocks(leaf)
        leaf.last_access = self._tick()
        self._push(leaf)
        return leaf

    # -- references -----------------------------------------------------------------------------

    def lock(self, node: Node) -> None:
        """A request now reads the path to `node`: none of it may be evicted."""
        now = self._tick()
        while node.parent is not None:
            size = node.tokens.size
            if node.lock_ref == 0:
                blocks = self._full_blocks(node)
                self.num_evictable -= size
                self.num_locked += size
                self.num_evictable_blocks -= blocks
                self.num_locked_blocks += blocks
            else:
                self.shared_excess += size
                self.shared_excess_blocks += self._full_blocks(node)
            node.lock_ref += 1
            node.last_access = now
            node = node.parent

    def unlock(self, node: Node) -> None:
        now = self._tick()
        while node.parent is not None:
            if node.lock_ref <= 0:
                raise ValueError(f"unlock of an unlocked node {node!r}")
            node.lock_ref -= 1
            size = node.tokens.size
            if node.lock_ref == 0:
                blocks = self._full_blocks(node)
                self.num_locked -= size
                self.num_evictable += size
                self.num_locked_blocks -= blocks
                self.num_evictable_blocks += blocks
                node.last_access = now
                if not node.children:
                    self._push(node)
            else:
                self.shared_excess -= size
                self.shared_excess_blocks -= self._full_blocks(node)
            node = node.parent

    def _full_blocks(self, node: Node) -> int:
        """Slots of the full reference blocks that end inside this node."""
        b = self.reference_block
        return (node.end // b - node.start // b) * b

    # -- eviction -------------------------------------------------------------------------------

    def evict(self, num_tokens: int) -> np.ndarray:
        """Drop at least min(num_tokens, num_evictable) unlocked tokens, least recently used
        leaves first; return their slots (the caller frees them)."""
        freed: list[np.ndarray] = []
        need = min(num_tokens, self.num_evictable)
        while need > 0 and self._heap:
            stamp, _, node = heapq.heappop(self._heap)
            if not self._evictable_leaf(node) or stamp != node.last_access:
                continue
            size = node.tokens.size
            take = min(size, need)
            if take == size:
                freed.append(node.slots)
                self._remove(node)
            else:  # keep the head of the run: its prefix is still a valid cache entry
                freed.append(node.slots[size - take:])
                self._shorten(node, take)  # views: no copy per trim
                self._push(node)
            need -= take
        self._compact_heap()
        return np.concatenate(freed) if freed else _EMPTY_SLOTS

    def evict_slots(self, slots: set[int]) -> np.ndarray:
        """Drop every unlocked node holding any of `slots`, with its subtree; return the slots."""
        doomed = [n for n in self.nodes() if n.lock_ref == 0
                  and not slots.isdisjoint(n.slots.tolist())]
        freed = []
        for node in doomed:
            if node.parent is not None:  # not already gone with an ancestor
                freed.extend(self._remove_subtree(node))
        return np.concatenate(freed) if freed else _EMPTY_SLOTS

    def truncate(self, node: Node, keep: int) -> np.ndarray:
        """Cut the unlocked chain ending at `node` back to `keep` tokens; return the cut slots.

        For a request that cached tokens it then did not compute (preempted in the same step):
        nobody else can have reached them, so the chain is unlocked and has no other branches.
        """
        dropped = []
        while node.parent is not None and node.end > keep:
            if node.lock_ref or node.children:
                raise ValueError(f"cannot truncate {node!r}: another request reads past {keep}")
            parent = node.parent
            if node.start >= keep:
                dropped.append(node.slots)
                self._remove(node)
            else:
                cut = node.end - keep
                dropped.append(node.slots[-cut:])
                self._shorten(node, cut)
                node.tokens, node.slots = node.tokens.copy(), node.slots.copy()
            node = parent
        return np.concatenate(dropped) if dropped else _EMPTY_SLOTS

    def evict_all(self) -> np.ndarray:
        return self.evict(self.num_evictable)

    def _shorten(self, node: Node, cut: int) -> None:
        """Drop the last `cut` tokens of an unlocked node (as views of its arrays)."""
        blocks = self._full_blocks(node)
        keep = node.tokens.size - cut
        node.tokens, node.slots = node.tokens[:keep], node.slots[:keep]
        node.end -= cut
        self.num_evictable -= cut
        self.num_evictable_blocks -= blocks - self._full_blocks(node)

    def _remove(self, node: Node) -> None:
        parent = node.parent
        assert parent is not None and not node.children and node.lock_ref == 0
        del parent.children[int(node.tokens[0])]
        node.parent = None
        self.num_nodes -= 1
        self.num_evictable -= node.tokens.size
        self.num_evictable_blocks -= self._full_blocks(node)
        if parent.parent is not None and parent.lock_ref == 0 and not parent.children:
            self._push(parent)

    def _remove_subtree(self, node: Node) -> list[np.ndarray]:
        freed = []
        for child in list(node.children.values()):
            freed.extend(self._remove_subtree(child))
        freed.append(node.slots)
        self._remove(node)
        return freed

    def _evictable_leaf(self, node: Node) -> bool:
        return node.parent is not None and node.lock_ref == 0 and not node.children

    def _push(self, node: Node) -> None:
        self._pushes += 1
        heapq.heappush(self._heap, (node.last_access, self._pushes, node))
        # Here, not only after an eviction: a cache that never fills (the same prompts again and
        # again) never evicts, and its heap grew one entry per request (100k requests: 100k).
        self._compact_heap()

    def _compact_heap(self) -> None:
        # Stale entries pile up when nodes are touched without being evicted; rebuild from the
        # live evictable leaves once they outnumber the nodes, so the heap stays O(nodes)
        # (amortised O(1) a push: a rebuild costs O(nodes) and comes every nodes + 1024 pushes).
        if len(self._heap) > 2 * self.num_nodes + 1024:
            self._heap = [(n.last_access, i, n) for i, n in enumerate(self.nodes())
                          if self._evictable_leaf(n)]
            heapq.heapify(self._heap)

    def _tick(self) -> int:
        self._clock += 1
        return self._clock

    def cached_slots(self) -> np.ndarray:
        """Slots of unlocked nodes: cache entries no request references. A walk of the whole tree,
        for the telemetry's periodic occupancy scan, never the scheduling path."""
        runs = [n.slots for n in self.nodes() if not n.lock_ref]
        return np.concatenate(runs) if runs else _EMPTY_SLOTS

    # -- inspection (tests, invariant checks) ----------------------------------------------------

    def nodes(self) -> Iterator[Node]:
        stack = [child for root in self._roots.values() for child in root.children.values()]
        while stack:
            node = stack.pop()
            yield node
            stack.extend(node.children.values())

    def assert_consistent(self) -> None:
        evictable = locked = excess = count = evictable_blocks = locked_blocks = excess_blocks = 0
        for node in self.nodes():
            count += 1
            size = node.tokens.size
            blocks = self._full_blocks(node)
            assert size > 0 and node.slots.size == size, node
            parent = node.parent
            assert parent is not None and parent.children.get(int(node.tokens[0])) is node, node
            assert node.start == parent.end, node
            if parent.parent is not None:
                assert node.lock_ref <= parent.lock_ref, (node, parent)
            if node.lock_ref:
                locked += size
                locked_blocks += blocks
                excess += (node.lock_ref - 1) * size
                excess_blocks += (node.lock_ref - 1) * blocks
            else:
                evictable += size
                evictable_blocks += blocks
        assert count == self.num_nodes, (count, self.num_nodes)
        assert (evictable, locked, excess) == (self.num_evictable, self.num_locked, self.shared_excess)
        assert (evictable_blocks, locked_blocks, excess_blocks) == (
            self.num_evictable_blocks, self.num_locked_blocks, self.shared_excess_blocks)

    def all_slots(self) -> np.ndarray:
        runs = [n.slots for n in self.nodes()]
        return np.concatenate(runs) if runs else _EMPTY_SLOTS
