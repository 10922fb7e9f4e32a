"""Block-granular disclosure: what the slot manager tells clients about a prefix hit depends on
the shared length only to the whole 16-token block, while the cache still shares every token.

The attack (docs/security.md): a victim's prompt is `known + [secret] + rest`; an attacker who
knows `known` sends `known + [guess] + filler` and reads every figure the server publishes. A
right guess shares one token more than a wrong one. Here each guess runs against a fresh
manager holding the same history, and every disclosed figure (the KV gauges and counters, vLLM's
hit counter, the usage ratio, the per-request cached and cache-creation counts) is compared
between the secret and wrong guesses, during the probe and at rest after it, with the victim
finished or still running. Exact figures must tell the secret apart (so the comparison can fail).
"""

from __future__ import annotations

import random

from hypothesis import example, given, settings
from hypothesis import strategies as st

from proxima.engine.kv_sources import SlotKVSource
from tests.kv_manager_support import StandInRequest, admit, manager

BLOCK = 16


def _disclosed(mgr, running, probe=None) -> dict:
    source = SlotKVSource(mgr, "token", exact=mgr.exact_figures, clock=lambda: 0.0)
    stats = source.collect(running)
    figures = {"stats": stats, "usage": mgr.usage}
    if probe is not None:
        figures["cache_creation_base"] = mgr.estimate_cached_tokens(probe)
    return figures


def _attack(exact: bool, guess: int, known: list[int], secret: int, rest: list[int],
            filler: list[int], history: list[list[int]], victim_running: bool,
            answer_len: int = 0, probes: int = 1) -> list[dict]:
    """The figures during each probe, after its answer and after it. The probe's answer
    (`answer_len` tokens, each computed) repeats the victim's tokens after the same position:
    duplicates if the prompt was. `probes`: the attacker sends the probe again."""
    mgr = manager(exact_figures=exact)
    for i, tokens in enumerate(history):  # other traffic cached before
        other = StandInRequest(f"h{i}", list(tokens), num_prompt_tokens=len(tokens))
        admit(mgr, other)
        mgr.free(other)
    victim = StandInRequest("victim", known + [secret] + rest, num_prompt_tokens=len(known) + 1 + len(rest))
    admit(mgr, victim)
    for token in (401, 402, 403):  # the victim's answer
        victim.all_token_ids.append(token)
        assert mgr.allocate_slots(victim, 1) is not None
        victim.num_computed_tokens += 1
    if not victim_running:
        mgr.free(victim)
    mgr.make_prefix_cache_stats()  # what vLLM exported before the probe
    running = [victim] if victim_running else []
    seen = []
    for n in range(probes):
        probe = StandInRequest(f"probe{n}", known + [guess] + filler,
                               num_prompt_tokens=len(known) + 1 + len(filler))
        hit = admit(mgr, probe)
        seen.append({"hit_reported": mgr.disclosed(hit), "hits": mgr.make_prefix_cache_stats().hits,
                     **_disclosed(mgr, running + [probe], probe)})
        following = victim.all_token_ids[probe.num_tokens:]
        for token in (following + [450] * answer_len)[:answer_len]:
            probe.all_token_ids.append(token)
            assert mgr.allocate_slots(probe, 1) is not None
            probe.num_computed_tokens += 1
        seen.append(_disclosed(mgr, running + [probe]))
        probe.all_token_ids.append(450)  # the last generated token, never computed, then release
        mgr.free(probe)
        seen.append(_disclosed(mgr, running))
    mgr.cache.assert_consistent()
    return seen


# Fixed examples, so CI judges the code and not the draw; 5,000 random ones passed when this was
# written (raise max_examples and drop derandomize to search again).
@settings(max_examples=300, derandomize=True, database=None)
@given(known_len=st.integers(1, 70), rest_len=st.integers(0, 40), filler_len=st.integers(1, 40),
       copied=st.integers(0, 20), victim_running=st.booleans(), seed=st.integers(0, 2**16),
       answer_len=st.integers(0, 20), probes=st.integers(1, 2))
# Found by a random search: the probe's filler equals the victim's next token, so a right guess
# shares the probe's whole prompt, whose last token it must compute anyway (a duplicate).
@example(known_len=62, rest_len=29, filler_len=1, copied=0, victim_running=False, seed=29,
         answer_len=0, probes=1)
@example(known_len=62, rest_len=29, filler_len=1, copied=0, victim_running=True, seed=29,
         answer_len=0, probes=1)
def test_no_disclosed_figure_tells_the_secret_from_a_wrong_guess(known_len, rest_len, filler_len,
                                                                 copied, victim_running, seed,
                                                                 answer_len, probes):
    """`copied`: the filler starts with that many of the victim's tokens after the secret, so a
    right guess also shares them (duplicates the probe computes itself, kept or freed).
    The cache never fills: under memory pressure, whether an admission evicts depends on its exact
    slot count (docs/security.md, what remains)."""
    rng = random.Random(seed)
    known = [rng.randrange(3, 300) for _ in range(known_len)]
    secret = 310
    rest = [rng.randrange(3, 300) for _ in range(rest_len)]
    filler = (rest[:copied] + [rng.randrange(3, 300) for _ in range(filler_len)])[:max(filler_len, copied)]
    # Some of the history shares part of the known prefix: branches at other depths.
    history = [known[: rng.randrange(0, known_len + 1)] + [rng.randrange(3, 300) for _ in range(5)]
               for _ in range(3)]
    args = (known, secret, rest, filler, history, victim_running, answer_len, probes)
    wrong = [_attack(False, g, *args) for g in (311, 312)]
    right = _attack(False, secret, *args)
    assert wrong[0] == wrong[1]  # the figures depend on what was shared, not on which token
    shared_right = known_len + 1 + next((i for i, (a, b) in enumerate(zip(rest, filler)) if a != b),
                                             min(len(rest), len(filler)))
    if known_len // BLOCK != min(shared_right, known_len + len(filler)) // BLOCK:
        # The right guess shares a block more: a 16-token block cache tells it apart as well.
        return
    assert right == wrong[0]
    assert right[0]["stats"].occupancy is None and right[0]["stats"].prefix.hit_tokens_beyond_blocks is None


def test_exact_figures_tell_the_secret_apart_and_block_figures_do_not():
    known, secret, rest, filler = list(range(10, 34)), 310, list(range(40, 52)), [7, 8, 9]
    args = (known, secret, rest, filler, [], False)
    exact_wrong, exact_right = _attack(True, 311, *args), _attack(True, secret, *args)
    assert exact_right[0]["hit_reported"] == 25 and exact_wrong[0]["hit_reported"] == 24
    assert exact_right[0]["hits"] != exact_wrong[0]["hits"]
    assert exact_right[-1]["stats"].slots_cached != exact_wrong[-1]["stats"].slots_cached
    block_wrong, block_right = _attack(False, 311, *args), _attack(False, secret, *args)
    assert block_right == block_wrong and block_right[0]["hit_reported"] == 16


def test_block_figures_track_the_exact_ones_to_within_blocks():
    """The disclosed gauges stay honest: cached and used slots within one block per tree node of the
    exact counts, live tokens and fragmentation as exact as a block cache's, hit tokens whole blocks."""
    rng = random.Random(7)
    system = [rng.randrange(3, 300) for _ in range(300)]
    for exact in (True, False):
        mgr = manager(num_slots=8192, exact_figures=exact)
        running = []
        for i in range(40):
            question = [rng.randrange(3, 300) for _ in range(rng.randrange(5, 60))]
            req = StandInRequest(f"r{i}", system + question, num_prompt_tokens=len(system + question))
            admit(mgr, req)
            running.append(req)
        for req in running[:20]:
            mgr.free(req)
        stats = SlotKVSource(mgr, "token", exact=exact, clock=lambda: 0.0).collect(running[20:])
        if exact:
            truth = stats
            continue
        nodes = mgr.cache.tree.num_nodes
        assert abs(stats.slots_used - truth.slots_used) <= BLOCK * nodes
        assert abs(stats.slots_cached - truth.slots_cached) <= BLOCK * nodes
        assert stats.slots_used - stats.live_tokens == truth.slots_used - truth.live_tokens  # the waste
        assert stats.prefix.hit_tokens % BLOCK == 0
        assert truth.prefix.hit_tokens - stats.prefix.hit_tokens == truth.prefix.hit_tokens_beyond_blocks
        assert stats.slots_used + stats.slots_cached <= stats.slots_total
