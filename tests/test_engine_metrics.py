"""Each KV metric against what the engine did, for Proxima's token slots and stock block allocation.

Known prompts (5, 17, 33, 64 and 100 tokens) are prefilled in one step; the telemetry must then
say exactly: slots in use = live tokens for Proxima (fragmentation 0), whole 32-token blocks for
stock (fragmentation = the block arithmetic), the 16-token reference blocks for both, and the
Prometheus samples must equal the scheduler's stats.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from tests import metrics_scenarios

pytestmark = pytest.mark.engine

LENS = [5, 17, 33, 64, 100]


def blocks_of(lens, b):
    return sum(math.ceil(n / b) * b for n in lens)


@pytest.fixture(scope="module", params=["token", "block"])
def run(request, tiny_model, engine_process) -> dict:
    return engine_process(request.param).call(metrics_scenarios.main, tiny_model, request.param, timeout=900)


def test_slots_used_after_prefill_match_the_allocator_arithmetic(run):
    stats = run["after_prefill"]["stats"]
    live = sum(LENS)
    assert stats["live_tokens"] == live
    assert stats["requests_holding_slots"] == 5
    assert stats["reference_block_slots"] == blocks_of(LENS, 16)
    if run["variant"] == "token":
        assert stats["slots_used"] == live
        assert stats["slots_total"] == 4096
    else:
        assert stats["slots_used"] == blocks_of(LENS, 32) == 320
        assert stats["slots_total"] % 32 == 0


def test_one_decode_step_adds_one_slot_per_request_for_token_slots(run):
    before, after = run["after_prefill"]["stats"], run["after_one_decode"]["stats"]
    assert after["live_tokens"] == before["live_tokens"] + 5
    if run["variant"] == "token":
        assert after["slots_used"] == before["slots_used"] + 5
    else:  # only the 64-token request crosses a block boundary: one new 32-slot block
        assert after["slots_used"] == blocks_of([n + 1 for n in LENS], 32) == 352


def test_prometheus_samples_equal_the_stats(run):
    for phase in ("after_prefill", "after_one_decode", "idle", "after_pressure"):
        stats, prom = run[phase]["stats"], run[phase]["prom"]
        used, live, total = stats["slots_used"], stats["live_tokens"], stats["slots_total"]
        assert prom["proxima_kv_slots"] == total
        assert prom["proxima_kv_slots_used"] == used
        assert prom["proxima_kv_slots_free"] == total - used
        assert prom["proxima_kv_live_tokens"] == live
        assert prom["proxima_kv_requests_holding_slots"] == stats["requests_holding_slots"]
        assert prom["proxima_kv_token_usage_ratio"] == pytest.approx(live / total)
        assert prom["proxima_kv_block_usage_ratio"] == pytest.approx(stats["reference_block_slots"] / total)
        expected_frag = (used - live) / used if used else 0.0
        assert prom["proxima_kv_fragmentation_ratio"] == pytest.approx(expected_frag)
        ref = stats["reference_block_slots"]
        expected = (ref - live) / ref if ref else 0.0
        assert prom["proxima_kv_block_fragmentation_ratio"] == pytest.approx(expected)
        assert prom["proxima_kv_bytes_per_token"] == 1024
        assert prom["proxima_kv_cache_bytes"] >= total * 1024


def test_fragmentation_is_zero_for_token_slots_and_block_arithmetic_for_stock(run):
    prom = run["after_prefill"]["prom"]
    if run["variant"] == "token":
        assert prom["proxima_kv_fragmentation_ratio"] == 0.0
    else:
        assert prom["proxima_kv_fragmentation_ratio"] == pytest.approx(1 - sum(LENS) / 320)
    assert prom["proxima_kv_block_fragmentation_ratio"] == pytest.approx(1 - sum(LENS) / blocks_of(LENS, 16))


def test_idle_engine_reports_empty_cache(run):
    stats, prom = run["idle"]["stats"], run["idle"]["prom"]
    assert stats["slots_used"] == 0 and stats["live_tokens"] == 0 and stats["requests_holding_slots"] == 0
    assert prom["proxima_kv_largest_free_run_slots"] == stats["slots_total"]
    assert prom["occupancy_0"] == 0.0


def test_occupancy_map_shows_the_prefilled_slots(run):
    stats = run["after_prefill"]["stats"]
    assert len(stats["occupancy"]) == 64
    edges = np.linspace(0, stats["slots_total"], 65).astype(np.int64)
    slots_in_use = float(np.dot(stats["occupancy"], np.diff(edges)))
    assert slots_in_use == pytest.approx(stats["slots_used"], rel=1e-9)
    if run["variant"] == "token":  # a fresh cache hands out slots from 0 upwards
        full = int(stats["slots_used"] // (stats["slots_total"] / 64))
        assert stats["occupancy"][:full] == [1.0] * full


def test_preemption_counter_and_latency_histograms_count_what_happened(run):
    prom, calls = run["after_pressure"]["prom"], run["calls"]
    assert calls["preempt"] > 0, "the oversubscribed phase did not preempt"
    assert prom["proxima_kv_preemptions"] == calls["preempt"]
    # Every scheduler step is timed, including those between two throttled publishes.
    assert prom["latency_count_step"] == calls["schedule"]
    if run["variant"] == "token":
        assert prom["latency_count_allocate"] == calls["allocate_ok"]
        assert prom["latency_count_free"] >= 45  # every finished request, plus preemptions


def test_a_busy_engine_publishes_gauges_at_most_once_per_interval(run):
    """The pressure phase runs with an interval longer than itself: gauges hold while busy."""
    during, idle = run["during_pressure"], run["idle"]["prom"]
    assert during["running"] > 0
    for name in ("proxima_kv_slots_used", "proxima_kv_live_tokens", "proxima_kv_requests_holding_slots"):
        assert during["prom"][name] == idle[name] == 0
    # The closing idle step published what happened meanwhile (checked value by value above).
    assert run["after_pressure"]["prom"]["latency_count_step"] > during["prom"]["latency_count_step"]


# -- the prefix cache ------------------------------------------------------------------------------

def _prefix_run(tiny_model, engine_process, allocator: str) -> dict:
    return engine_process(allocator).call(metrics_scenarios.prefix_scenario, tiny_model, allocator,
                                          timeout=900)


@pytest.fixture(scope="module")
def prefix_run(tiny_model, engine_process) -> dict:
    return _prefix_run(tiny_model, engine_process, "token")


def test_stock_blocks_with_their_prefix_cache_count_shared_blocks_once(tiny_model, engine_process):
    run = _prefix_run(tiny_model, engine_process, "block")
    system, tails = run["system_len"], run["tails"]
    stats = run["first_prefill"]["stats"]
    # vLLM caches the first request's full 32-token block as it is allocated; the three others
    # share it in the same step. Live tokens count it once, and never exceed what is allocated.
    assert stats["live_tokens"] == sum(system + t for t in tails) - 3 * 32
    assert stats["live_tokens"] <= stats["slots_used"]
    assert run["first_prefill"]["prom"]["proxima_kv_token_usage_ratio"] <= 1.0


def test_shared_prefix_slots_count_once_and_hits_are_token_exact(prefix_run):
    from proxima.metrics import catalog as c

    system, tails = prefix_run["system_len"], prefix_run["tails"]
    first = prefix_run["first_prefill"]
    stats, prom = first["stats"], first["prom"]
    # One burst: the later three share the first's 40 scheduled system tokens in the same step.
    distinct = system + sum(tails)
    assert stats["slots_used"] == stats["live_tokens"] == distinct
    assert prom[c.FRAGMENTATION.name] == 0.0
    assert prom[c.SLOTS_USED.name] == prom[c.LIVE_TOKENS.name] == distinct
    assert prom[c.PREFIX_HIT_TOKENS.name] == 3 * system
    assert prom[c.PREFIX_HIT_BEYOND_BLOCKS.name] == 3 * (system % c.REFERENCE_BLOCK_SIZE)
    # 16-token blocks with a block cache would share 32 of the 40 tokens: 2 blocks each.
    block_slots = sum(-(-(system + t) // 16) * 16 for t in tails) - 3 * 32
    assert stats["reference_block_slots"] == block_slots


def test_finished_requests_stay_cached_and_the_next_burst_hits_all_but_the_last_token(prefix_run):
    from proxima.metrics import catalog as c

    system, tails = prefix_run["system_len"], prefix_run["tails"]
    idle = prefix_run["first_idle"]["prom"]
    # Computed: prompts and 3 of 4 outputs each (the last sampled token has no KV).
    cached = system + sum(t + 3 for t in tails)
    assert idle[c.SLOTS_USED.name] == 0 and idle[c.SLOTS_CACHED.name] == cached
    assert idle[c.SLOTS_FREE.name] == idle[c.SLOTS_TOTAL.name]  # cached slots are free to take
    second = prefix_run["second_prefill"]["prom"]
    hits = second[c.PREFIX_HIT_TOKENS.name] - idle[c.PREFIX_HIT_TOKENS.name]
    assert hits == sum(system + t - 1 for t in tails)
    assert prefix_run["second_idle"]["prom"][c.SLOTS_USED.name] == 0


def test_evictions_are_counted_and_free_exactly_what_was_needed(prefix_run):
    from proxima.metrics import catalog as c

    before, after = prefix_run["second_idle"]["prom"], prefix_run["flood_idle"]["prom"]
    evicted = after[c.PREFIX_EVICTED_TOKENS.name] - before[c.PREFIX_EVICTED_TOKENS.name]
    assert evicted > 0
    total = after[c.SLOTS_TOTAL.name]
    # Whatever is cached now plus what was evicted is everything ever cached: nothing lost.
    flood_cached = prefix_run["flood"] * 200
    assert after[c.SLOTS_CACHED.name] + evicted == before[c.SLOTS_CACHED.name] + flood_cached
    assert after[c.SLOTS_CACHED.name] <= total and after[c.SLOTS_USED.name] == 0
