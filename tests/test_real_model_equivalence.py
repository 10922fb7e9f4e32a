"""Proxima against stock vLLM on a real model: greedy chats token for token equal, prefix cache on
and off, float32 and fp8 KV.

The tiny model's tests (test_engine_equivalence.py, test_engine_fp8.py) cover preemption, n > 1
and aborts on random weights; here SmolLM2-135M-Instruct in float32, where ties between the two
best tokens are rare, so equal greedy answers mean equal attention, not equal rounding luck. The
chats are tests/real_model_scenarios.py's, over HTTP (the engine harness will take these runs in
process). Servers start two at a time (each holds about 4.5 GB across its three processes, and
the session's tiny-model servers may still be up):
  token + stock              Proxima (token slots, prefix cache on) / stock vLLM (block 32, on)
  token-fp8 + stock-fp8      the same, fp8 (e4m3) KV cache
  token-nocache              Proxima with --no-enable-prefix-caching
"""

from __future__ import annotations

import asyncio

import pytest
from tokenizers import Tokenizer

from proxima.server_process import ManagedServer, ServerSpec
from tests.real_model_scenarios import RUNS, SERVER_ARGS, run_scenarios

pytestmark = pytest.mark.engine

GROUPS = (("token", "stock"), ("token-fp8", "stock-fp8"), ("token-nocache",))
SCENARIOS = ("support", "general", "multiturn")
# 30 layers x 3 KV heads x head size 64 x (K + V): 46,080 bytes a token in float32, 11,520 in fp8.
FLOAT32_BYTES_PER_TOKEN, FP8_BYTES_PER_TOKEN = 46_080, 11_520


@pytest.fixture(scope="module")
def runs(smol_model, server_logs) -> dict[str, dict]:
    results: dict[str, dict] = {}
    for group in GROUPS:
        servers = {name: ManagedServer(ServerSpec(model=smol_model, variant=RUNS[name][0],
                                                  args=SERVER_ARGS + RUNS[name][1],
                                                  log_path=server_logs / f"smol-{name}.log"))
                   for name in group}
        try:
            for server in servers.values():
                server.spawn()
            for server in servers.values():
                server.wait_ready(timeout=900)
            for name, server in servers.items():
                results[name] = asyncio.run(run_scenarios(server.url, smol_model))
        finally:
            for server in servers.values():
                server.stop()
    return results


def _flat(run: dict, scenario: str) -> list[list[int]]:
    outputs = run[scenario]["outputs"]
    return outputs[0] + outputs[1] if scenario == "multiturn" else outputs


@pytest.mark.parametrize("scenario", SCENARIOS)
@pytest.mark.parametrize("ours,theirs", [("token", "stock"), ("token-nocache", "stock"),
                                         ("token-nocache", "token"), ("token-fp8", "stock-fp8")])
def test_greedy_chats_identical(runs, scenario, ours, theirs):
    a, b = _flat(runs[ours], scenario), _flat(runs[theirs], scenario)
    assert len(a) == len(b) > 0
    mismatched = [i for i, (x, y) in enumerate(zip(a, b)) if x != y]
    assert mismatched == [], f"{ours} vs {theirs}, {scenario}: chats whose answers differ: {mismatched}"


def test_answers_are_real(runs, smol_model):
    """A broken model build or engine that both sides share would pass the equalities above."""
    tokenizer = Tokenizer.from_file(f"{smol_model}/tokenizer.json")
    first = tokenizer.decode(runs["token"]["general"]["outputs"][0])  # "What is the capital of France?"
    assert "Paris" in first, first
    # The support chats really carry the ~430-token shared system prompt (chunked at 256).
    assert min(runs["token"]["support"]["prompt_tokens"]) > 400


def test_token_prefix_cache_shares_what_blocks_cannot(runs):
    def hits(name: str, scenario: str) -> float:
        return runs[name][scenario]["after"]["prefix_hits"]  # a counter: cumulative over scenarios

    # The general chats share only SmolLM2's ~30-token default system prompt: below one 32-token
    # block after the first, so stock shares less of it than token slots do.
    general = {name: hits(name, "general") - hits(name, "support") for name in ("token", "stock")}
    assert general["token"] > general["stock"]
    assert hits("token", "support") >= hits("stock", "support") > 0
    assert runs["token-nocache"]["multiturn"]["after"]["prefix_hits"] == 0


@pytest.mark.parametrize("name", ["token", "token-nocache", "token-fp8"])
@pytest.mark.parametrize("scenario", SCENARIOS)
def test_no_slot_held_after_each_scenario(runs, name, scenario):
    after = runs[name][scenario]["after"]
    assert after["slots_used"] == 0 and after["requests_holding"] == 0, after


def test_fp8_runs_store_fp8(runs):
    assert runs["token"]["support"]["after"]["bytes_per_token"] == FLOAT32_BYTES_PER_TOKEN
    assert runs["token-fp8"]["support"]["after"]["bytes_per_token"] == FP8_BYTES_PER_TOKEN
