"""`proxima top`'s Textual app driven with `App.run_test()` and a pilot.

Servers are real HTTP servers on loopback serving /metrics captured from real vLLM servers
(tests/data/top/README.md); stopping and restarting one is a server going down and coming back.
Waits are bounded (a hang fails the test) but nothing asserts on time.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from proxima.tui.app import TopApp
from proxima.tui.collector import Collector
from proxima.tui.help import HelpScreen
from proxima.tui.record import Recorder, load_recording
from tests.top_support import MetricsServer, screen_text

DATA = Path(__file__).parent / "data" / "top"
PROXIMA_TEXT = (DATA / "proxima_metrics.txt").read_text()
STOCK_TEXT = (DATA / "stock_metrics.txt").read_text()
SIZE = (120, 40)


async def wait_until(pilot, condition, what: str, limit_s: float = 15.0) -> None:
    for _ in range(int(limit_s / 0.05)):
        if condition():
            return
        await pilot.pause(0.05)
    raise AssertionError(f"gave up waiting for {what}")


@pytest.fixture
def servers():
    with MetricsServer(PROXIMA_TEXT) as proxima, MetricsServer(STOCK_TEXT) as stock:
        yield proxima, stock


def _live(*urls: str, interval: float = 0.1, recorder=None) -> TopApp:
    return TopApp.live(Collector(urls), interval=interval, recorder=recorder)


@pytest.mark.asyncio
async def test_keys_help_switch_aggregate_rate_and_quit(servers):
    proxima, stock = servers
    app = _live(proxima.url, stock.url)
    async with app.run_test(size=SIZE) as pilot:
        await wait_until(pilot, lambda: app.state.frames_seen >= 2, "two frames")
        text = screen_text(app)
        assert "Proxima token allocator" in text and "11,158 / 32,768 used" in text

        await pilot.press("question_mark")
        assert isinstance(app.screen, HelpScreen) and "Keys" in screen_text(app)
        await pilot.press("escape")
        assert not isinstance(app.screen, HelpScreen)

        await pilot.press("tab")
        assert app.selected == 1 and "stock vLLM (block size 128)" in screen_text(app)
        assert "exposes only vllm:kv_cache_usage_perc" in screen_text(app)
        await pilot.press("s")
        assert app.selected == 0  # wraps around
        await pilot.press("2")
        assert app.selected == 1

        await pilot.press("a")
        text = screen_text(app)
        assert app.selected is None and "all 2 servers" in text and "TTFT p95" in text
        assert re.search(r"all servers\s+ok\s+\d+", text)  # the totals row
        await pilot.press("a")
        assert app.selected == 1  # back to the server it came from

        await pilot.press("minus")
        assert app.interval == pytest.approx(0.2)
        await pilot.press("minus")
        assert app.interval == pytest.approx(0.25)
        await pilot.press("plus")
        assert app.interval == pytest.approx(0.2)
        await pilot.pause(0.05)
        assert "every 0.2s (5 Hz)" in screen_text(app)

        await pilot.press("q")
        await pilot.pause(0.1)
    assert app.return_code == 0 and not app.is_running


@pytest.mark.asyncio
async def test_pause_freezes_the_display_while_collection_goes_on(servers):
    proxima, _ = servers
    app = _live(proxima.url)
    async with app.run_test(size=SIZE) as pilot:
        await wait_until(pilot, lambda: app.state.frames_seen >= 2, "two frames")
        assert "running     41" in screen_text(app)
        await pilot.press("p")
        frozen = screen_text(app)
        assert "PAUSED" in frozen
        running = 'vllm:num_requests_running{engine="0",model_name="/tmp/top-tiny"}'
        proxima.text = PROXIMA_TEXT.replace(f"{running} 41.0", f"{running} 7.0")
        assert proxima.text != PROXIMA_TEXT
        seen = app.state.frames_seen

        def collected_while_paused() -> bool:
            return app.state.views[0].running == 7.0 and app.state.frames_seen > seen + 2

        await wait_until(pilot, collected_while_paused, "collection to go on while paused")
        assert screen_text(app) == frozen  # new figures collected, not drawn
        await pilot.press("p")
        text = screen_text(app)
        assert "PAUSED" not in text and "running     7 " in text


@pytest.mark.asyncio
async def test_server_going_down_and_coming_back(servers):
    proxima, stock = servers
    app = _live(proxima.url, stock.url)
    async with app.run_test(size=SIZE) as pilot:
        await wait_until(pilot, lambda: app.state.views[0].ok and app.state.frames_seen >= 2, "first frames")
        proxima.stop()
        await wait_until(pilot, lambda: not app.state.views[0].ok, "the server to be seen down")
        await pilot.pause(0.3)  # a few failed scrapes: down is retried, not fatal
        text = screen_text(app)
        assert app.is_running
        assert "DOWN since" in text and "(retrying)" in text and "1 down" in text
        assert "down: connection refused" in text and "figures as last seen at" in text
        assert "11,158 / 32,768 used" in text  # last known figures stay on screen, marked stale
        assert app.state.views[0].stale and app.state.views[0].scrape_errors >= 2
        assert app.state.views[1].ok  # the other server is unaffected

        proxima.start()  # same port
        await wait_until(pilot, lambda: app.state.views[0].ok, "the server to come back")
        await pilot.pause(0.05)
        text = screen_text(app)
        assert "DOWN" not in text and "1 down" not in text
        errors = app.state.views[0].scrape_errors
        assert errors >= 2 and f"scrape errors {errors}" in text


@pytest.mark.asyncio
async def test_live_recording_holds_every_collected_frame(servers, tmp_path):
    proxima, stock = servers
    path = tmp_path / "live.jsonl"
    recorder = Recorder(path, (proxima.url, stock.url), 0.1, 0.0)
    app = _live(proxima.url, stock.url, recorder=recorder)
    async with app.run_test(size=SIZE) as pilot:
        await wait_until(pilot, lambda: app.state.frames_seen >= 4, "four frames")
        assert "● rec " in screen_text(app)
        await pilot.press("q")
    rec = load_recording(path)
    assert len(rec.frames) == app.state.frames_seen
    assert rec.frames[-len(app.state.frames):] == app.state.frames


@pytest.mark.asyncio
async def test_replay_keys_step_jump_and_speed():
    recording = load_recording(DATA / "session.jsonl")
    n = len(recording.frames)
    app = TopApp.replay(recording, start=10)
    async with app.run_test(size=SIZE) as pilot:
        await pilot.press("p")
        start = app.position
        assert start >= 10 and "PAUSED" in screen_text(app)
        await pilot.pause(0.3)
        assert app.position == start  # paused: the playhead holds
        await pilot.press("left", "left")
        assert app.position == start - 2 and app.state.frames_seen <= start - 2
        assert app.state.now == recording.frames[start - 3].taken_at
        await pilot.press("right")
        assert app.position == start - 1 and app.state.now == recording.frames[start - 2].taken_at
        await pilot.press("end")
        assert app.position == n and "end of recording" in screen_text(app)
        assert app.state.views[1].level == "danger"
        await pilot.press("home")
        assert app.position == 1
        await pilot.press("plus", "plus")
        assert app.speed == 4.0 and "speed 4x" in screen_text(app)


@pytest.mark.asyncio
async def test_replay_plays_at_the_recorded_pace_times_speed():
    recording = load_recording(DATA / "session.jsonl")
    app = TopApp.replay(recording)
    async with app.run_test(size=SIZE) as pilot:
        first = app.position
        await pilot.press(*["plus"] * 6)  # 64x
        await wait_until(pilot, lambda: app.position == len(recording.frames), "the end of the recording")
        assert first == 1 and app.state.frames_seen >= len(recording.frames) - 1
