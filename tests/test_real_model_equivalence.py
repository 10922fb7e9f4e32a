"""Proxima against stock vLLM on a real model: greedy chats token for token equal with the prefix
cache on and off, next-token distributions equal in float32 and as close as fp8 allows.

The tiny model's tests (test_engine_equivalence.py, test_engine_fp8.py) cover preemption, n > 1
and aborts on random weights; here SmolLM2-135M-Instruct in float32, where ties between the two
best tokens are rare, so equal greedy answers mean equal attention, not equal rounding luck. The
work is tests/real_model_scenarios.py's, over HTTP (the engine harness will take these runs in
process). Servers start two at a time (each holds about 3 GB (PSS) across its processes, and the
session's tiny-model servers may still be up):
  token + stock              Proxima (token slots, prefix cache on) / stock vLLM (block 32, on)
  token-fp8 + stock-fp8      the same, fp8 (e4m3) KV cache
  token-nocache              Proxima with --no-enable-prefix-caching

fp8 on a real model cannot be compared by free-running greedy answers. Two correct attention
kernels differ in the last float32 bits (Proxima's batched torch and vLLM's C++ kernel sum in
another order: |logprob difference| up to 1.9e-5 here in float32); the next layer's K and V
inherit those bits, and where a value sits on an fp8 rounding boundary the stored code moves by
a whole e4m3 step (6-12%). Measured 2026-12-03: Proxima fp8 and stock fp8 gave the same greedy
answer to 15 of 32 chats (stock fp8 at blocks 32 and 64, one kernel, to all 32), and each fp8
engine to float32's only 4 of 32 (docs/benchmarks.md, "Real model"). So the
fp8 comparison is teacher-forced: next-token distributions over one fixed text, where the two fp8
engines must be far closer to each other than fp8 is to float32.
"""

from __future__ import annotations

import asyncio

import pytest
from tokenizers import Tokenizer

from proxima.accuracy import PositionLogprobs, from_vllm, greedy_agreement, kl_summary, perplexity
from proxima.server_process import ManagedServer, ServerSpec
from tests.conftest import STOCK_CPU_FP8, needs_stock_cpu_fp8, own_cores
from tests.real_model_scenarios import RUNS, SERVER_ARGS, run_scenarios

# The module's one fixture starts five servers in turn, and pytest-timeout charges it all to the
# first test: 12 minutes on the shared 2 cores at load 10-15 (the suite's default limit is 15).
pytestmark = [pytest.mark.engine, pytest.mark.timeout(2700)]

FP8_RUNS = ("token-fp8", "stock-fp8")  # left out where stock vLLM has no CPU fp8 KV (conftest)
GROUPS = tuple(g for g in (("token", "stock"), FP8_RUNS, ("token-nocache",))
               if STOCK_CPU_FP8 or g != FP8_RUNS)
SCORED = tuple(n for n in ("token", "stock", *FP8_RUNS) if STOCK_CPU_FP8 or n not in FP8_RUNS)
SCENARIOS = ("support", "general", "multiturn")
# 30 layers x 3 KV heads x head size 64 x (K + V): 46,080 bytes a token in float32, 11,520 in fp8.
FLOAT32_BYTES_PER_TOKEN, FP8_BYTES_PER_TOKEN = 46_080, 11_520


@pytest.fixture(scope="module")
def runs(smol_model, server_logs) -> dict[str, dict]:
    results: dict[str, dict] = {}
    for group in GROUPS:
        servers = {name: ManagedServer(ServerSpec(model=smol_model, variant=RUNS[name][0],
                                                  args=SERVER_ARGS + RUNS[name][1],
                                                  log_path=server_logs / f"smol-{name}.log",
                                                  env=own_cores(i, len(group))))
                   for i, name in enumerate(group)}
        try:
            for server in servers.values():
                server.spawn()
            for server in servers.values():
                server.wait_ready(timeout=900)
            for name, server in servers.items():
                results[name] = asyncio.run(run_scenarios(server.url, smol_model, score=name in SCORED))
        finally:
            for server in servers.values():
                server.stop()
    print_figures(results)  # docs/benchmarks.md quotes them (pytest -s shows them)
    return results


def _flat(run: dict, scenario: str) -> list[list[int]]:
    outputs = run[scenario]["outputs"]
    return outputs[0] + outputs[1] if scenario == "multiturn" else outputs


def _chats(run: dict) -> list[list[int]]:
    return [answer for scenario in SCENARIOS for answer in _flat(run, scenario)]


def _scored(run: dict) -> list[list[PositionLogprobs]]:
    return [from_vllm(s["prompt_token_ids"], s["prompt_logprobs"]) for s in run["passages"]["scored"]]


def _top1_agreement(a: list[list[PositionLogprobs]], b: list[list[PositionLogprobs]]) -> float:
    def top(positions: list[PositionLogprobs]) -> list[int]:
        return [max(p.logprobs, key=p.logprobs.get) for p in positions]

    pairs = [(x, y) for pa, pb in zip(a, b) for x, y in zip(top(pa), top(pb))]
    return sum(x == y for x, y in pairs) / len(pairs)


def print_figures(runs: dict[str, dict]) -> None:
    scored = {name: _scored(runs[name]) for name in SCORED}
    for name, passages in scored.items():
        print(f"{name}: perplexity {perplexity(passages):.4f} over {sum(map(len, passages))} tokens")
    for ref, test in (("stock", "token"), ("token", "token-fp8"), ("token", "stock-fp8"),
                      ("stock-fp8", "token-fp8")):
        if ref not in scored or test not in scored:
            continue
        kl = kl_summary(scored[ref], scored[test])
        chats = greedy_agreement(_chats(runs[ref]), _chats(runs[test]))
        print(f"KL({ref} || {test}): mean {kl.mean:.3g}, p99 {kl.p99:.3g}, max {kl.max:.3g} "
              f"(top-20 rest mass {kl.mean_rest_mass:.2f}); top-1 agreement "
              f"{_top1_agreement(scored[ref], scored[test]):.2%}; greedy chats identical "
              f"{chats.num_identical}/{chats.num_prompts}")


@pytest.mark.parametrize("scenario", SCENARIOS)
@pytest.mark.parametrize("ours,theirs", [("token", "stock"), ("token-nocache", "stock"),
                                         ("token-nocache", "token")])
def test_greedy_chats_identical(runs, scenario, ours, theirs):
    a, b = _flat(runs[ours], scenario), _flat(runs[theirs], scenario)
    assert len(a) == len(b) > 0
    mismatched = [i for i, (x, y) in enumerate(zip(a, b)) if x != y]
    assert mismatched == [], f"{ours} vs {theirs}, {scenario}: chats whose answers differ: {mismatched}"


def test_float32_next_token_distributions_equal_stock(runs):
    ours, stock = _scored(runs["token"]), _scored(runs["stock"])
    kl = kl_summary(stock, ours)
    # Measured: KL mean 3.5e-12, max 1.3e-9; every position's top token the same (3,277).
    assert kl.max < 1e-6 and _top1_agreement(stock, ours) == 1.0
    assert perplexity(ours) == pytest.approx(perplexity(stock), rel=1e-5)


@needs_stock_cpu_fp8
def test_fp8_next_token_distributions_as_close_to_stock_fp8_as_fp8_allows(runs):
    float32, ours, stock = (_scored(runs[name]) for name in ("token", "token-fp8", "stock-fp8"))
    cost_ours, cost_stock = kl_summary(float32, ours), kl_summary(float32, stock)
    between = kl_summary(stock, ours)
    # fp8 really is stored, and costs the same in both engines. Measured: KL from float32 mean
    # 0.0175 (Proxima) and 0.0176 (stock), top-1 agreement with float32 92%.
    assert cost_stock.mean > 1e-3
    assert cost_ours.mean == pytest.approx(cost_stock.mean, rel=0.1)
    # The two fp8 engines are far closer to each other than fp8 is to float32; how close depends
    # on the host, because Proxima's torch path sums in the host BLAS's order, stock's C++ kernel
    # in its own, and fp8 turns last-bit differences into whole-code steps in later layers.
    # Measured, the same code (d34b024 and 2026-12-06's main): KL mean 2.0e-4 (1.2% of fp8's own
    # 0.0176), p99 3.4e-3, top-1 99.3%, perplexity 24.061 against stock's 24.055 on 2026-12-03's
    # host; KL mean 9.8e-4 (5.6%), p99 0.010, top-1 98.3%, perplexity 24.062 on an AMD EPYC
    # (AVX-512, no AMX); stock's 24.0552 on both, float32's 23.731. A quantisation unlike
    # vLLM's (rounding, saturation, scale) moves the whole distribution, as far as fp8 itself.
    assert between.mean < 0.1 * cost_stock.mean and between.p99 < 0.25 * cost_stock.p99
    assert _top1_agreement(stock, ours) > 0.97
    assert perplexity(ours) == pytest.approx(perplexity(stock), rel=2e-3)


def test_answers_are_real(runs, smol_model):
    """A broken model build or engine that both sides share would pass the equalities above."""
    tokenizer = Tokenizer.from_file(f"{smol_model}/tokenizer.json")
    first = tokenizer.decode(runs["token"]["general"]["outputs"][0])  # "What is the capital of France?"
    assert "Paris" in first, first
    # The support chats really carry the ~430-token shared system prompt (chunked at 256).
    assert min(runs["token"]["support"]["prompt_tokens"]) > 400
    # Newton's English is hard for a 135M model, but not random: a uniform guess would be 49,152.
    assert 10 < perplexity(_scored(runs["token"])) < 40


def test_token_prefix_cache_shares_what_blocks_cannot(runs):
    def hits(name: str, scenario: str) -> float:
        return runs[name][scenario]["after"]["prefix_hits"]  # a counter: cumulative over scenarios

    # The general chats share only SmolLM2's ~30-token default system prompt: below one 32-token
    # block after the first, so stock shares less of it than token slots do.
    general = {name: hits(name, "general") - hits(name, "support") for name in ("token", "stock")}
    assert general["token"] > general["stock"]
    assert hits("token", "support") >= hits("stock", "support") > 0
    assert runs["token-nocache"]["multiturn"]["after"]["prefix_hits"] == 0


@pytest.mark.parametrize("name", ["token", "token-nocache",
                                  pytest.param("token-fp8", marks=needs_stock_cpu_fp8)])
@pytest.mark.parametrize("scenario", SCENARIOS)
def test_no_slot_held_after_each_scenario(runs, name, scenario):
    after = runs[name][scenario]["after"]
    assert after["slots_used"] == 0 and after["requests_holding"] == 0, after


@needs_stock_cpu_fp8
def test_fp8_runs_store_fp8(runs):
    assert runs["token"]["support"]["after"]["bytes_per_token"] == FLOAT32_BYTES_PER_TOKEN
    assert runs["token-fp8"]["support"]["after"]["bytes_per_token"] == FP8_BYTES_PER_TOKEN
