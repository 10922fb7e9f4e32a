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
