"""`proxima serve` through real HTTP: the OpenAI API works, bad requests get clear 4xx answers,
the server keeps serving, and every slot comes back."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import httpx
import pytest

from proxima.scrape import scrape_sync
from proxima.server_process import free_port

pytestmark = pytest.mark.engine


def _complete(url: str, model: str, **body) -> httpx.Response:
    return httpx.post(f"{url}/v1/completions", json={"model": model, **body}, timeout=120)


def _assert_still_serving(url: str, model: str) -> None:
    r = _complete(url, model, prompt="hello world", max_tokens=4)
    assert r.status_code == 200, r.text


def test_hello_world_completion(proxima_server, tiny_model):
    r = _complete(proxima_server.url, tiny_model, prompt="hello world", max_tokens=8, temperature=0)
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["usage"]["completion_tokens"] == 8
    assert body["choices"][0]["finish_reason"] == "length"


def test_chat_completion_uses_the_tiny_models_template(proxima_server, tiny_model):
    r = httpx.post(
        f"{proxima_server.url}/v1/chat/completions",
        json={"model": tiny_model, "messages": [{"role": "user", "content": "the quick brown fox"}],
              "max_tokens": 6, "temperature": 0},
        timeout=120,
    )
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 6


def test_streaming_completion_yields_chunks_then_done(proxima_server, tiny_model):
    chunks, done = [], False
    with httpx.stream(
        "POST", f"{proxima_server.url}/v1/completions", timeout=120,
        json={"model": tiny_model, "prompt": "memory slots cache", "max_tokens": 10, "stream": True,
              "ignore_eos": True, "stream_options": {"include_usage": True}},
    ) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if not line.startswith("data: "):
                continue
            data = line[len("data: "):]
            if data == "[DONE]":
                done = True
                break
            chunks.append(json.loads(data))
    assert done
    text_chunks = [c for c in chunks if c["choices"]]
    assert len(text_chunks) >= 2, "tokens were not streamed one step at a time"
    assert chunks[-1]["usage"]["completion_tokens"] == 10


def test_greedy_output_matches_stock_server(proxima_server, stock_server, tiny_model):
    body = {"prompt": "seven wizards quietly hex jolly bad kings", "max_tokens": 24, "temperature": 0,
            "ignore_eos": True}
    ours = _complete(proxima_server.url, tiny_model, **body).json()["choices"][0]["text"]
    stock = _complete(stock_server.url, tiny_model, **body).json()["choices"][0]["text"]
    assert ours == stock


@pytest.mark.parametrize(
    "body, fragment",
    [
        ({"prompt": "fox " * 1500, "max_tokens": 4}, "maximum context length"),
        ({"prompt": "hello", "max_tokens": 0}, "max_tokens"),
        ({"prompt": "hello", "max_tokens": 10**9}, "max"),
        ({"prompt": "hello", "max_tokens": -5}, "max_tokens"),
    ],
    ids=["prompt-longer-than-max-model-len", "max-tokens-zero", "max-tokens-absurd", "max-tokens-negative"],
)
def test_bad_requests_get_clear_4xx_and_server_keeps_serving(proxima_server, tiny_model, body, fragment):
    r = _complete(proxima_server.url, tiny_model, **body)
    assert 400 <= r.status_code < 500, (r.status_code, r.text)
    assert fragment in r.text.lower() or fragment in r.text
    _assert_still_serving(proxima_server.url, tiny_model)


def test_malformed_json_is_rejected_and_server_keeps_serving(proxima_server, tiny_model):
    r = httpx.post(f"{proxima_server.url}/v1/completions", content=b'{"model": "x", "prompt": ',
                   headers={"content-type": "application/json"}, timeout=30)
    assert 400 <= r.status_code < 500
    _assert_still_serving(proxima_server.url, tiny_model)


def test_slots_reported_on_metrics_and_all_returned(proxima_server, tiny_model):
    _assert_still_serving(proxima_server.url, tiny_model)
    snap = scrape_sync(proxima_server.url)
    assert snap.ok and snap.proxima is not None
    kv = snap.proxima
    assert kv.allocator == "token" and kv.granularity == 1
    assert kv.slots_total == 32 << 10  # 32 MiB of KV at 1 KiB per token
    assert kv.slots_used == 0 and kv.live_tokens == 0
    assert kv.slots_free == kv.slots_total
    assert kv.bytes_per_token == 1024


def test_startup_line_states_allocator_slots_and_bytes_per_token(proxima_server):
    # The whole log: other tests' requests may have pushed the start-up lines far back.
    log = proxima_server.spec.log_path.read_text(errors="replace")
    assert "Proxima: allocator=token slots=32768 kv_bytes_per_token=1024" in log


def test_shared_prompts_hit_the_token_prefix_cache_and_reset_empties_it(proxima_server, tiny_model):
    url = proxima_server.url
    system = "you are a helpful assistant for the memory cache team " * 6
    before = scrape_sync(url)
    for question in ("what is a slot", "what is a block"):
        r = _complete(url, tiny_model, prompt=system + question, max_tokens=4, temperature=0)
        assert r.status_code == 200, r.text
    after = scrape_sync(url)
    hits = after.prefix_cache_hits_total - before.prefix_cache_hits_total
    # The second request reused the whole system prompt; hits are reported in whole 16-token blocks.
    assert hits >= (len(system.split()) - 1) // 16 * 16 > 0 and hits % 16 == 0
    assert after.proxima.kv_figures == "block"
    assert after.proxima.prefix_hit_tokens_total - before.proxima.prefix_hit_tokens_total == hits
    assert after.proxima.slots_cached > 0 and after.proxima.slots_used == 0
    r = httpx.post(f"{url}/reset_prefix_cache", timeout=30)
    assert r.status_code == 200, r.text
    _assert_still_serving(url, tiny_model)  # publishes the state after the reset
    assert scrape_sync(url).proxima.slots_cached < after.proxima.slots_cached
    log = proxima_server.spec.log_path.read_text(errors="replace")
    assert "prefix_cache=on kv_figures=block" in log


def test_unsupported_option_is_refused_before_start(tiny_model):
    proc = subprocess.run(
        [sys.executable, "-m", "proxima.cli.main", "serve", tiny_model, "--kv-cache-dtype",
         "turboquant_k8v4", "--port", str(free_port())],
        capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 2
    assert "--kv-cache-dtype turboquant_k8v4" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_bad_telemetry_interval_is_refused_before_start(tiny_model):
    env = {**os.environ, "PROXIMA_TELEMETRY_INTERVAL_S": "fast"}
    proc = subprocess.run(
        [sys.executable, "-m", "proxima.cli.main", "serve", tiny_model, "--check"],
        capture_output=True, text=True, timeout=300, env=env,
    )
    assert proc.returncode == 2
    assert "PROXIMA_TELEMETRY_INTERVAL_S='fast' is not a number of seconds" in proc.stderr
    assert "Traceback" not in proc.stderr
