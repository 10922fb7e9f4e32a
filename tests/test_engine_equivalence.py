"""Proxima's engine against stock vLLM: token-for-token equal outputs, and every slot returned.

Each engine runs tests/engine_scenarios.py through the engine harness, in the session's engine
processes (vLLM's attention registry is per process): Proxima with token slots (block size 1)
and its prefix cache on (vLLM's default) and off, stock vLLM's CPU backend at block 32 with its
prefix cache on (as users run it), all float32, at a KV budget far too small for the batch (so
all preempt) and a 96-token step budget (so long prompts are prefilled in chunks). Scenarios:
120 varied prompts, n=3 parallel sampling, requests aborted mid-generation, a burst sharing
system prompts of several lengths (shorter than a block, ending mid-block), multi-turn
conversations.
"""

from __future__ import annotations

import pytest

from tests import engine_scenarios

pytestmark = pytest.mark.engine


@pytest.fixture(scope="module")
def runs(tiny_model, engine_process) -> dict[str, dict]:
    return {variant: engine_process(variant.removesuffix("-nocache")).call(
        engine_scenarios.run, tiny_model, variant, timeout=900) for variant in VARIANTS}


VARIANTS = ("token", "token-nocache", "stock")
SCENARIOS = ("varied", "n3", "abort", "shared", "multiturn")


def test_greedy_outputs_identical_on_120_varied_prompts(runs):
    token, stock = runs["token"]["scenarios"]["varied"], runs["stock"]["scenarios"]["varied"]
    assert len(token["outputs"]) == len(stock["outputs"]) == 120
    mismatched = [i for i, (a, b) in enumerate(zip(token["outputs"], stock["outputs"])) if a != b]
    assert mismatched == [], f"prompts whose outputs differ: {mismatched}"
    # Every request produced exactly what it asked for: none lost, none duplicated.
    assert [len(o) for o in token["outputs"]] == token["max_tokens"]
    assert len(set(token["request_ids"])) == 120


def test_scenario_exercised_chunked_prefill_and_preemption(runs):
    for variant in VARIANTS:
        varied = runs[variant]["scenarios"]["varied"]
        assert max(varied["prompt_lens"]) > 96, "no prompt long enough to be chunked"
        assert varied["preemptions"] > 0, f"{variant} never preempted: KV budget not tight enough"


def test_parallel_sampling_children_identical(runs):
    token, stock = runs["token"]["scenarios"]["n3"], runs["stock"]["scenarios"]["n3"]
    assert token["outputs"] == stock["outputs"]
    assert all(len(children) == 3 for children in token["outputs"])


def test_aborted_requests_release_slots_and_others_complete_identically(runs):
    token, stock = runs["token"]["scenarios"]["abort"], runs["stock"]["scenarios"]["abort"]
    assert token["completed"] == stock["completed"]
    assert sorted(token["completed"]) == sorted(set(f"abort-{i}" for i in range(12)) - set(token["aborted"]))
    # Right after the abort only the six survivors hold slots, exactly one per token they hold.
    assert token["after_abort"]["requests_holding_slots"] == 6
    assert 0 < token["after_abort"]["slots_used"] <= 6 * (80 * 2 + 40)


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_zero_slots_in_use_after_each_scenario(runs, scenario):
    for variant in VARIANTS:
        after = runs[variant]["scenarios"][scenario]["after"]
        assert after["slots_used"] == 0 and after["requests_holding_slots"] == 0, (variant, after)


def test_token_engine_has_slot_per_token_capacity(runs):
    # Same KV budget in bytes: the token engine counts it in single slots, stock in 32-slot blocks.
    assert runs["token"]["scenarios"]["varied"]["after"]["slots_total"] == 1536
    assert runs["stock"]["scenarios"]["varied"]["after"]["slots_total"] % 32 == 0


@pytest.mark.parametrize("scenario", ["shared", "multiturn"])
def test_prefix_sharing_outputs_identical_to_stock_with_its_cache_and_to_no_cache(runs, scenario):
    outputs = {v: runs[v]["scenarios"][scenario]["outputs"] for v in VARIANTS}
    assert outputs["token"] == outputs["stock"]
    assert outputs["token"] == outputs["token-nocache"]


def test_varied_and_abort_outputs_identical_with_the_cache_on_and_off(runs):
    for scenario in ("varied", "abort"):
        on, off = runs["token"]["scenarios"][scenario], runs["token-nocache"]["scenarios"][scenario]
        assert on["outputs" if scenario == "varied" else "completed"] == \
            off["outputs" if scenario == "varied" else "completed"], scenario


def test_token_cache_hits_what_a_block_cache_cannot(runs):
    token, stock = runs["token"]["scenarios"]["shared"], runs["stock"]["scenarios"]["shared"]
    # Every request shares its system prompt (the 5- and 20-token ones are below one 32-token
    # block), so token-exact sharing hits more tokens than stock's whole blocks.
    assert token["cached_tokens"] > stock["cached_tokens"] > 0
    assert token["after"]["hit_tokens"] > 0 and token["after"]["slots_cached"] > 0
    assert runs["token-nocache"]["scenarios"]["shared"]["cached_tokens"] == 0
    assert runs["token-nocache"]["scenarios"]["shared"]["after"]["slots_cached"] == 0
