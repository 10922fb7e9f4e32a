"""`proxima top` against a real Proxima server with real traffic: the numbers it shows are the
server's own, as `proxima.scrape` reads them from the same /metrics."""

from __future__ import annotations

import asyncio
import threading
import time

import httpx
import pytest
from typer.testing import CliRunner

from proxima import fmt
from proxima.cli.main import app as cli
from proxima.scrape import ServerSnapshot, scrape_sync
from proxima.tui.app import TopApp
from proxima.tui.collector import Collector
from tests.top_support import screen_text

pytestmark = pytest.mark.engine


def _complete(url: str, model: str, n: int) -> None:
    with httpx.Client(timeout=120) as client:
        for i in range(n):
            body = {"model": model, "prompt": "hello world " * (3 + 5 * i), "max_tokens": 6 + 5 * i,
                    "ignore_eos": True}
            response = client.post(url + "/v1/completions", json=body)
            assert response.status_code == 200, response.text


def _key(s: ServerSnapshot) -> tuple:
    kv = s.proxima
    return (s.running, s.waiting, s.requests_finished_total, s.generation_tokens_total, s.ttft.count,
            kv.slots_used, kv.slots_total, kv.live_tokens, kv.allocator_latency["allocate"].count)


def _settled(url: str) -> ServerSnapshot:
    """Scrape until two looks agree: the last request's figures have all reached /metrics."""
    last = scrape_sync(url)
    for _ in range(60):
        time.sleep(0.25)
        now = scrape_sync(url)
        if now.ok and last.ok and _key(now) == _key(last) and now.running == 0:
            return now
        last = now
    raise AssertionError("server metrics did not settle")


def test_once_shows_the_servers_own_numbers(proxima_server, tiny_model):
    url = proxima_server.url
    _complete(url, tiny_model, 4)
    before = _settled(url)
    result = CliRunner().invoke(cli, ["top", url, "--once", "--interval", "0.2"])
    after = scrape_sync(url)
    assert result.exit_code == 0, result.output
    assert _key(after) == _key(before)  # nothing moved while top looked
    out, kv = result.stdout, after.proxima
    assert f"Proxima {kv.allocator} allocator (granularity {kv.granularity})" in out
    assert f"{fmt.count(kv.slots_used)} / {fmt.count(kv.slots_total)} used" in out
    assert f"{fmt.count(kv.live_tokens)} live ({fmt.pct(kv.token_usage)})" in out
    assert f"finished    {fmt.count(after.requests_finished_total):<8}" in out
    assert f"running     {fmt.count(after.running):<8}" in out
    for name, hist in (("TTFT", after.ttft), ("ITL", after.itl), ("E2E", after.e2e)):
        assert hist.count > 0
        assert f"{name:<12}{fmt.seconds(hist.quantile(0.5)):>9}{fmt.seconds(hist.quantile(0.95)):>9}" in out
    alloc = kv.allocator_latency["allocate"]
    assert f"allocate {fmt.seconds(alloc.quantile(0.5))}/{fmt.seconds(alloc.quantile(0.99))}" in out
    assert "since server start" in out
    assert "N/A: no GPU readable through NVML on this host" in out  # loopback: read, and none here


@pytest.mark.asyncio
async def test_live_app_follows_traffic(proxima_server, tiny_model):
    url = proxima_server.url
    start = _settled(url)
    app = TopApp.live(Collector([url]), interval=0.2)
    async with app.run_test(size=(120, 40)) as pilot:
        while app.state.frames_seen < 1:  # the window's first look comes before any traffic
            await pilot.pause(0.05)
        traffic = threading.Thread(target=_complete, args=(url, tiny_model, 3))
        traffic.start()
        while traffic.is_alive():
            await pilot.pause(0.1)
        traffic.join()
        settled = await asyncio.to_thread(_settled, url)
        for _ in range(100):
            view = app.state.views[0]
            if (view.finished_total == settled.requests_finished_total
                    and view.kv.slots_used == settled.proxima.slots_used):
                break
            await pilot.pause(0.1)
        view = app.state.views[0]
        assert view.finished_total == settled.requests_finished_total == start.requests_finished_total + 3
        assert view.kv.slots_total == settled.proxima.slots_total
        assert view.kv.slots_used == settled.proxima.slots_used
        # The window's quantiles are the histogram delta since the window's first look.
        assert view.e2e.count == settled.e2e.count - start.e2e.count == 3
        assert view.e2e == settled.e2e.since(start.e2e)
        points = app.state.series[0]
        assert max(p.generation_rate or 0 for p in points) > 0  # the traffic shows in the history
        await pilot.pause(0.3)
        text = screen_text(app)
        assert f"finished    {fmt.count(settled.requests_finished_total)}" in text
        kv = settled.proxima
        assert f"{fmt.count(kv.slots_used)} / {fmt.count(kv.slots_total)} used" in text
