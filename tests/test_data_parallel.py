"""Data parallelism: each engine exports under its own `engine` label, and every figure that
combines engines is recomputed from their counts, never summed as ratios.

vLLM 0.26 resets `data_parallel_rank` to 0 in every engine of a dense model (the real rank is
`data_parallel_index`); labelled by the rank, two engines wrote the same series and multiprocess
`livesum` added their ratios. tests/data/dp2/metrics.txt is a real exposition of
`proxima serve --data-parallel-size 2` (tiny model, CPU) taken with requests running on both.
"""

from __future__ import annotations

import concurrent.futures
import threading
import time
from pathlib import Path

import httpx
import pytest

from proxima.metrics import catalog as c
from proxima.scrape import KVSnapshot, parse_metrics
from proxima.server_process import ManagedServer, ServerSpec
from tests.conftest import SERVER_ARGS

DP2_TEXT = (Path(__file__).parent / "data" / "dp2" / "metrics.txt").read_text()


def _assert_combined(kv: KVSnapshot, parts: list[KVSnapshot]) -> None:
    total = sum(p.slots_total for p in parts)
    block_slots = sum(p.block_usage * p.slots_total for p in parts)
    live = sum(p.live_tokens for p in parts)
    assert kv.slots_total == total and kv.live_tokens == live
    assert kv.block_usage == pytest.approx(block_slots / total)
    assert kv.token_usage == pytest.approx(live / total)
    assert kv.block_fragmentation == pytest.approx((block_slots - live) / block_slots if block_slots else 0)
    for ratio in (kv.block_usage, kv.token_usage, kv.fragmentation, kv.block_fragmentation, *kv.occupancy):
        assert 0.0 <= ratio <= 1.0
    assert kv.occupancy == pytest.approx([
        sum(p.occupancy[i] * p.slots_total for p in parts) / total for i in range(len(kv.occupancy))])


def test_two_engines_of_a_real_exposition_combine_from_their_counts():
    snap = parse_metrics(DP2_TEXT)
    assert snap.engines == ("0", "1")
    parts = [parse_metrics(DP2_TEXT, engine=e).proxima for e in ("0", "1")]
    assert all(p is not None and p.slots_used > 0 for p in parts), "the exposition should be under load"
    assert snap.proxima is not None and snap.proxima.engines == ("0", "1")
    _assert_combined(snap.proxima, parts)
    # Each engine alone reads its own gauges as exported.
    assert parts[1].block_usage == pytest.approx(_sample(c.BLOCK_USAGE.name, "1"))
    assert snap.proxima.block_fragmentation > 0  # was reported 0 for more than one engine
    # vLLM's own KV usage, weighted by each engine's blocks (both have the same number here).
    usages = [_sample(c.Vllm.KV_USAGE, e) for e in ("0", "1")]
    assert snap.kv_usage == pytest.approx(sum(usages) / 2)
    assert snap.num_gpu_blocks == 2 * parse_metrics(DP2_TEXT, engine="0").num_gpu_blocks


def _sample(name: str, engine: str) -> float:
    for line in DP2_TEXT.splitlines():
        if line.startswith(name + "{") and f'engine="{engine}"' in line:
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name} engine={engine} not in the exposition")


@pytest.mark.engine
def test_a_two_engine_server_labels_each_engine_and_ratios_stay_within_one(tiny_model, server_logs):
    stop = threading.Event()
    # vLLM gives each data-parallel engine's workers a port from `get_open_port()` (bind port 0, let
    # it go) that they bind seconds later: ManagedServer starts once more when that race is lost.
    spec = ServerSpec(model=tiny_model, variant="token", log_path=server_logs / "dp2.log",
                      args=(*SERVER_ARGS, "--data-parallel-size", "2"))
    # One pooled client, and answers long enough that each sender has a request in the engine most
    # of the time: on two cores shared with both engines' threads and the API server, this process
    # gets little CPU, and a run where each request (100 tokens, a new client each) spent ~2 s in
    # the client for 0.7 s in an engine kept one request an engine at most and never saw both hold
    # slots within 180 s (CI on this host, 2026-12-06).
    with ManagedServer(spec) as server, httpx.Client(timeout=300) as client, \
            concurrent.futures.ThreadPoolExecutor(8) as pool:
        def keep_sending(words: int) -> list[int]:
            codes = []
            while not stop.is_set():
                codes.append(client.post(f"{server.url}/v1/completions", json={
                    "model": tiny_model, "prompt": " ".join(["fox"] * words), "max_tokens": 400,
                    "ignore_eos": True}).status_code)
            return codes

        # Load is kept up until each engine has been seen holding slots under its own label: on two
        # loaded cores a scrape can take seconds, and a fixed batch may be over before both show.
        futures = [pool.submit(keep_sending, 20 + 7 * k) for k in range(8)]
        text, held = "", {"0": 0.0, "1": 0.0}
        deadline = time.monotonic() + 180
        try:
            while not all(held.values()) and time.monotonic() < deadline:
                text = client.get(f"{server.url}/metrics", timeout=30).text
                for engine in held:
                    snap = parse_metrics(text, engine=engine).proxima
                    assert snap is not None, f"engine {engine} exports no Proxima series"
                    held[engine] = max(held[engine], snap.slots_used)
                time.sleep(0.2)
        finally:
            stop.set()
        (server_logs / "dp2-metrics.txt").write_text(text)
        codes = [code for f in futures for code in f.result()]
        assert codes and set(codes) == {200}, codes
    info = [line for line in text.splitlines() if line.startswith(c.ALLOCATOR_INFO.name + "{")]
    assert len(info) == 2 and all(line.endswith(" 1.0") for line in info), info  # one series each
    assert all(held.values()), f"both engines should hold slots under load within 180 s: {held}"
    parts = [parse_metrics(text, engine=e).proxima for e in ("0", "1")]
    assert [p.slots_total for p in parts] == [32768, 32768]
    snap = parse_metrics(text)
    assert snap.proxima is not None
    _assert_combined(snap.proxima, parts)
