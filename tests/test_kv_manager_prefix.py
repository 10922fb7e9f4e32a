"""The slot manager under the call pattern of vLLM's async scheduler, without an engine.

vLLM 0.26's AsyncScheduler calls `cache_blocks` after every step of every running request. On the
H200 that once turned each generated token into its own tree node, and locking those paths cost
3.1 ms of host time per step (docs/benchmarks.md, prefix cache). The manager is driven here as
the scheduler drives it, with stand-in requests carrying the fields it reads.
"""

from __future__ import annotations

from tests.kv_manager_support import StandInRequest, admit, manager

SYSTEM = list(range(100, 140))


def test_decode_steps_under_the_async_scheduler_add_no_tree_nodes():
    mgr = manager()
    req = StandInRequest("a", SYSTEM + [1, 2, 3], num_prompt_tokens=43)
    admit(mgr, req)
    nodes_after_prefill = mgr.cache.tree.num_nodes
    for token in range(200, 250):  # 50 decode steps: one new token each, then cache_blocks
        req.all_token_ids.append(token)
        assert mgr.allocate_slots(req, 1) is not None
        req.num_computed_tokens += 1
        mgr.cache_blocks(req, req.num_computed_tokens)
    assert mgr.cache.tree.num_nodes == nodes_after_prefill == 1
    mgr.free(req)
    # At release the answer joins the tree as one run behind the prompt.
    assert mgr.cache.tree.num_nodes == 2
    assert mgr.cache.num_cached == req.num_computed_tokens and mgr.cache.num_referenced == 0
    mgr.cache.assert_consistent()


def test_a_later_request_hits_the_answer_and_stats_count_the_hit():
    mgr = manager()
    first = StandInRequest("a", SYSTEM + [1, 2, 3], num_prompt_tokens=43)
    admit(mgr, first)
    first.all_token_ids += [7, 8]
    mgr.allocate_slots(first, 1)
    first.num_computed_tokens += 1  # token 7's K/V computed; 8 was sampled last, never fed back
    mgr.free(first)
    turn2 = StandInRequest("b", first.all_token_ids + [9, 9], num_prompt_tokens=47)
    assert admit(mgr, turn2) == 44  # the prompt and the answer's computed token
    stats = mgr.make_prefix_cache_stats()
    assert (stats.queries, stats.hits) == (43 + 47, 44)
    mgr.free(turn2)
    assert mgr.cache.num_referenced == 0
    mgr.cache.assert_consistent()


def test_occupancy_map_and_free_run_count_cached_slots_as_neither_used_nor_free():
    import numpy as np

    from proxima.engine.kv_sources import SlotKVSource
    from proxima.metrics import catalog

    mgr = manager(num_slots=1024)
    done = StandInRequest("done", list(range(1, 301)), num_prompt_tokens=300)
    admit(mgr, done)
    mgr.free(done)  # its 300 slots stay cached
    live = StandInRequest("live", list(range(1000, 1100)), num_prompt_tokens=100)
    admit(mgr, live)
    stats = SlotKVSource(mgr, "token", clock=lambda: 10.0).collect([live])  # slow figures due
    assert (stats.slots_used, stats.slots_cached) == (100, 300)
    edges = np.linspace(0, 1024, catalog.OCCUPANCY_SEGMENTS + 1).astype(np.int64)
    assert float(np.dot(stats.occupancy, np.diff(edges))) == 100  # used by requests only
    assert float(np.dot(stats.occupancy_cached, np.diff(edges))) == 300  # the cached map beside it
    assert stats.largest_free_run == 1024 - 400  # the slots neither used nor cached, in one run

    mgr.free(live)
    idle = SlotKVSource(mgr, "token", clock=lambda: 0.0).collect([])  # idle steps always refresh
    assert idle.slots_used == 0 and idle.slots_cached == 400
    assert not any(idle.occupancy)  # an idle cache full of prefixes is not "in use"
    assert float(np.dot(idle.occupancy_cached, np.diff(edges))) == 400
