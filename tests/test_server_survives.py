"""`proxima serve` answers the requests that kill stock vLLM 0.26 and stays up; its KV gauges are
exact at rest after a reset; its supervisor stays small.

One server for the module, on a small KV cache (4 MiB: 4,096 slots of the tiny model), so that
64 parallel answers of 256 tokens are preempted and resumed, as on a production server under
memory pressure. Stock vLLM dies on both requests below (every later request then fails with
500); the causes, in vLLM's source, are in `proxima/engine/request_guards.py`.
"""

from __future__ import annotations

import time

import httpx
import psutil
import pytest

from proxima.scrape import scrape_sync
from proxima.server_process import ManagedServer, ServerSpec

pytestmark = pytest.mark.engine

SMALL_KV = ("--dtype", "float32", "--max-model-len", "1024", "--kv-cache-memory-bytes", str(4 << 20),
            "--enforce-eager", "--max-num-seqs", "64")


@pytest.fixture(scope="module")
def small_server(tiny_model, server_logs):
    spec = ServerSpec(model=tiny_model, variant="token", args=SMALL_KV, log_path=server_logs / "small-kv.log",
                      env={"VLLM_SERVER_DEV_MODE": "1"})
    with ManagedServer(spec).start(timeout=600) as server:
        yield server


def _complete(server: ManagedServer, model: str, **body) -> httpx.Response:
    return httpx.post(f"{server.url}/v1/completions", json={"model": model, **body}, timeout=600)


def _still_serving(server: ManagedServer, model: str) -> None:
    r = _complete(server, model, prompt="hello world", max_tokens=4)
    assert r.status_code == 200, r.text
    assert server.alive()


@pytest.mark.parametrize("prompt", [[3, 512], [[3, 4], [5, 512]], [3, 10**6]])
def test_a_token_id_at_the_vocabulary_size_is_a_400_and_the_server_serves_on(small_server, tiny_model,
                                                                              prompt):
    r = _complete(small_server, tiny_model, prompt=prompt, max_tokens=3)
    assert r.status_code == 400, r.text
    assert "out of vocabulary" in r.json()["error"]["message"]
    _still_serving(small_server, tiny_model)


def test_the_largest_token_id_is_still_served(small_server, tiny_model):
    r = _complete(small_server, tiny_model, prompt=[3, 511], max_tokens=3)
    assert r.status_code == 200, r.text


def test_seeded_sampling_survives_preemption_on_cpu(small_server, tiny_model):
    before = scrape_sync(small_server.url, timeout=30)
    # 64 answers of 256 tokens need 16k slots of 4k: preempted and resumed, their prompt and answer
    # prefilled again in chunks whose sampled tokens are thrown away.
    r = _complete(small_server, tiny_model, prompt="the quick brown fox", max_tokens=256, n=64, seed=7,
                  temperature=1.0, ignore_eos=True)
    assert r.status_code == 200, r.text
    assert len(r.json()["choices"]) == 64
    after = scrape_sync(small_server.url, timeout=30)
    assert after.preemptions_total > before.preemptions_total  # the case this test is about happened
    _still_serving(small_server, tiny_model)


def test_a_reset_at_rest_reads_zero_cached_slots_without_another_request(small_server, tiny_model):
    system = "you are a helpful assistant for the memory cache team " * 6
    for question in ("what is a slot", "what is a block"):
        assert _complete(small_server, tiny_model, prompt=system + question, max_tokens=4).status_code == 200
    cached = scrape_sync(small_server.url, timeout=30).proxima.slots_cached
    assert cached > 0
    r = httpx.post(f"{small_server.url}/reset_prefix_cache", timeout=30)
    assert r.status_code == 200 and r.json().get("success") is not False, r.text
    kv = scrape_sync(small_server.url, timeout=30).proxima  # at rest: no step has run since
    assert (kv.slots_cached, kv.slots_used, kv.slots_free) == (0, 0, kv.slots_total), (cached, kv)


def test_an_abort_that_leaves_the_engine_at_rest_reads_zero_slots(small_server, tiny_model):
    """The client drops the only request mid-stream: vLLM aborts it and the engine sleeps without
    another step, so the gauges are published from the abort itself."""
    body = {"model": tiny_model, "prompt": "the quick brown fox", "max_tokens": 900, "stream": True,
            "ignore_eos": True}
    with httpx.stream("POST", f"{small_server.url}/v1/completions", json=body, timeout=120) as r:
        assert r.status_code == 200
        for k, _ in enumerate(r.iter_lines()):
            if k == 4:
                break  # leaving the block closes the connection: vLLM aborts the request
    used = None
    for _ in range(100):
        used = scrape_sync(small_server.url, timeout=30).proxima.slots_used
        if used == 0:
            break
        time.sleep(0.2)
    assert used == 0, used
    _still_serving(small_server, tiny_model)


def test_the_supervisor_stays_small(small_server):
    """The `proxima serve` process only waits on the server: it never imports torch or vLLM
    (it held 987 MiB when its preflight did, in-process). Its one child checked the configuration
    and is the server, listening on the port: vLLM imported once per start, not twice."""
    supervisor = psutil.Process(small_server.pid)
    assert "proxima.cli.main" in " ".join(supervisor.cmdline())
    assert supervisor.memory_info().rss < 150 << 20, supervisor.memory_info().rss
    (server,) = supervisor.children()
    assert "proxima.serve_command" in " ".join(server.cmdline())
    port = small_server.spec.port
    assert any(c.laddr.port == port and c.status == psutil.CONN_LISTEN for c in server.net_connections())
