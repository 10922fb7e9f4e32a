"""scripts/bench_prefix_precision.py measures what a higher-precision prefix buys by replacing each
layer's K/V with what a cache would read back; these hold its attention to transformers' own and
its prefix split to the positions it names (tiny model, float32)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("bench_prefix_precision",
                                                  ROOT / "scripts" / "bench_prefix_precision.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def models(bench, tiny_model):
    from transformers import AttentionInterface, AutoModelForCausalLM

    AttentionInterface.register("proxima_kv_as_cached", bench._attention)
    load = lambda impl: AutoModelForCausalLM.from_pretrained(  # noqa: E731
        tiny_model, dtype=torch.float32, attn_implementation=impl).eval()
    return load("proxima_kv_as_cached"), load("sdpa")


def _place(bench, prefix: str, rest: str, prefix_len: int, cap: int | None = None) -> None:
    bench.Placement.prefix, bench.Placement.rest = prefix, rest
    bench.Placement.prefix_len, bench.Placement.cap = prefix_len, cap


IDS = [(37 * i + 11) % 500 + 3 for i in range(96)]


def test_the_hook_at_float32_is_transformers_attention_with_and_without_a_cache(bench, models):
    hooked, stock = models
    _place(bench, "fp32", "fp32", 0)
    seq = bench.Sequence(IDS, 60)
    with torch.inference_mode():
        expected = torch.log_softmax(stock(torch.tensor([IDS])).logits[0, 59:-1].float(), -1)
    whole = bench._log_probs(hooked, seq)
    torch.testing.assert_close(whole, expected, rtol=1e-5, atol=1e-5)
    # The first 40 tokens from a cache, the rest fed after them (the chats' shared prefix).
    cached = bench._log_probs(hooked, seq, bench._prefix_cache(hooked, IDS[:40]), 40)
    torch.testing.assert_close(cached, expected, rtol=1e-5, atol=1e-5)


def test_only_positions_past_the_prefix_read_the_rest_dtype(bench, models):
    hooked, _ = models
    seq = bench.Sequence(IDS, 1)
    _place(bench, "fp32", "fp32", 0)
    reference = bench._log_probs(hooked, seq)
    _place(bench, "fp32", "int8_per_token_head", 50)
    split = bench._log_probs(hooked, seq)
    # Rows are predictions for positions 1.. : row r has seen positions 0..r.
    torch.testing.assert_close(split[:50], reference[:50], rtol=0, atol=0)
    assert (split[50:] - reference[50:]).abs().amax(-1).min() > 0, "every later position reads int8 KV"
    # A cap keeps only the prefix's first positions in its dtype (the attention-sink placement).
    _place(bench, "fp32", "int8_per_token_head", 50, cap=4)
    sinks = bench._log_probs(hooked, seq)
    torch.testing.assert_close(sinks[:4], reference[:4], rtol=0, atol=0)
    assert (sinks[4:] - reference[4:]).abs().amax(-1).min() > 0, "positions 4.. read int8 KV"
    _place(bench, "int8_per_token_head", "fp32", 96)
    everywhere = bench._log_probs(hooked, seq)
    _place(bench, "int8_per_token_head", "int8_per_token_head", 0)
    torch.testing.assert_close(bench._log_probs(hooked, seq), everywhere, rtol=0, atol=0)
