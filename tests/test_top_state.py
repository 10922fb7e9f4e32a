"""`proxima top`'s state and rendering, on real data: a recorded session and captured /metrics.

No server is started: tests/data/top/ holds what real servers produced (see its README).
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from proxima import fmt
from proxima.scrape import ServerSnapshot, parse_metrics, rate
from proxima.tui import render
from proxima.tui.model import Frame, Settings
from proxima.tui.plain import render_plain
from proxima.tui.record import load_recording
from proxima.tui.state import DashboardState
from proxima.tui.views import baseline, merge_histograms

DATA = Path(__file__).parent / "data" / "top"


@pytest.fixture(scope="module")
def recording():
    return load_recording(DATA / "session.jsonl")


@pytest.fixture(scope="module")
def final(recording) -> DashboardState:
    state = DashboardState.empty(recording.urls)
    for frame in recording.frames:
        state = state.advance(frame)
    return state


def test_recording_fixture_is_what_the_tests_assume(recording):
    assert len(recording.urls) == 3 and len(recording.frames) >= 60
    last = recording.frames[-1].servers
    assert last[0].is_proxima and last[1].ok and not last[1].is_proxima and not last[2].ok


@pytest.mark.parametrize("window_s", [10.0, 600.0])
def test_windowed_quantiles_are_histogram_deltas_over_the_window(recording, window_s):
    state = DashboardState.empty(recording.urls, Settings(window_s=window_s))
    for frame in recording.frames:
        state = state.advance(frame)
    i, snap = 1, recording.frames[-1].servers[1]
    older = baseline(i, state.frames, state.times, state.now - window_s)
    if window_s < state.now - state.times[0]:
        assert older.taken_at <= state.now - window_s < older.taken_at + 2.0
    else:  # history shorter than the window: the window is the whole history, and says so
        assert older is next(f.servers[i] for f in state.frames if f.servers[i].ok)
    view = state.views[i]
    assert view.ttft == snap.ttft.since(older.ttft) and view.itl == snap.itl.since(older.itl)
    assert 0 < view.ttft.count <= snap.ttft.count
    if window_s == 10.0:
        assert view.ttft.count < snap.ttft.count  # the last 10 s, not the server's life
    assert view.window_s == pytest.approx(snap.taken_at - older.taken_at)


def test_rates_come_from_the_rate_window(recording, final):
    i = 1
    snap = recording.frames[-1].servers[i]
    older = baseline(i, final.frames, final.times, final.now - final.settings.rate_window_s)
    view = final.views[i]
    assert view.generation_rate == pytest.approx(rate(snap, older, "generation_tokens_total"))
    assert view.preemption_rate == pytest.approx(rate(snap, older, "preemptions_total"))
    assert view.generation_rate > 0


def test_proxima_kv_figures_and_headroom(recording, final):
    kv_snap = recording.frames[-1].servers[0].proxima
    view = final.views[0]
    assert view.kind == "proxima" and view.kv is not None
    assert view.kv.slots_used == kv_snap.slots_used and view.kv.slots_total == kv_snap.slots_total
    assert view.usage == pytest.approx(kv_snap.slots_used / kv_snap.slots_total)
    typical = kv_snap.live_tokens / kv_snap.requests_holding_slots
    assert view.typical_request_tokens == pytest.approx(typical)
    assert view.headroom_requests == pytest.approx(kv_snap.slots_free / typical)


def test_stock_server_is_judged_on_kv_usage_and_flagged(recording, final):
    snap, view = recording.frames[-1].servers[1], final.views[1]
    assert view.kind == "stock" and view.kv is None
    assert view.usage == pytest.approx(snap.kv_usage)
    assert view.capacity_tokens == snap.num_gpu_blocks * snap.block_size
    # The recording ends with the stock server's cache full, requests queued and preempting.
    assert snap.kv_usage > 0.95 and snap.waiting > 0
    assert view.level == "danger" and any("full" in a for a in view.alerts)


def test_down_server_is_shown_not_fatal(final):
    view = final.views[2]
    assert not view.ok and view.kind == "unknown" and view.level == "danger"
    assert view.scrape_errors == final.frames_seen  # every scrape of it failed
    assert "connection refused" in view.error


def test_aggregate_sums_live_servers(final):
    live = [v for v in final.views if v.ok]
    agg = final.aggregate
    assert agg.running == sum(v.running for v in live)
    assert agg.waiting == sum(v.waiting for v in live)
    assert agg.capacity_tokens == sum(v.capacity_tokens for v in live)
    assert agg.generation_rate == pytest.approx(sum(v.generation_rate for v in live))
    assert agg.ttft.count == sum(v.ttft.count for v in live)
    assert agg.level == "danger" and len(agg.alerts) >= 2


def test_server_going_down_keeps_last_figures_marked_stale(recording):
    frames = recording.frames[:10]
    state = DashboardState.empty(recording.urls)
    for frame in frames:
        state = state.advance(frame)
    before = state.views[0]
    down = replace(frames[-1].servers[0], ok=False, error="timed out", taken_at=frames[-1].taken_at + 0.5)
    state = state.advance(Frame(down.taken_at, (down, *frames[-1].servers[1:]), None))
    view = state.views[0]
    assert not view.ok and view.stale and view.error == "timed out"
    assert view.running == before.running and view.kv.slots_used == before.kv.slots_used
    assert view.generation_rate is None and view.down_since == down.taken_at
    assert state.series[0][-1].usage is None  # a gap in the sparkline, not a zero
    up = replace(frames[-1].servers[0], taken_at=down.taken_at + 0.5)
    state = state.advance(Frame(up.taken_at, (up, *frames[-1].servers[1:]), None))
    assert state.views[0].ok and state.views[0].down_since is None
    assert state.views[0].scrape_errors == before.scrape_errors + 1


def test_history_is_bounded(recording):
    state = DashboardState.empty(recording.urls, Settings(max_frames=20))
    for frame in recording.frames:
        state = state.advance(frame)
    assert len(state.frames) == 20 and all(len(s) == 20 for s in state.series)
    assert state.frames_seen == len(recording.frames)
    state = DashboardState.empty(recording.urls, Settings(history_s=5.0))
    for frame in recording.frames:
        state = state.advance(frame)
    assert state.times[-1] - state.times[1] <= 5.0 < state.times[-1] - state.times[0] + 1


def test_since_start_uses_cumulative_histograms():
    text = (DATA / "proxima_metrics.txt").read_text()
    a = parse_metrics(text, "http://127.0.0.1:1", taken_at=100.0)
    b = parse_metrics(text, "http://127.0.0.1:1", taken_at=100.5)
    state = DashboardState.empty(["http://127.0.0.1:1"], Settings(since_start=True))
    state = state.advance(Frame(100.0, (a,), None)).advance(Frame(100.5, (b,), None))
    assert state.views[0].window_s is None and state.views[0].ttft == b.ttft
    assert state.views[0].generation_rate == 0.0  # same counters twice: a real zero, not unknown


def test_merge_histograms_sums_same_buckets_and_skips_others():
    text = (DATA / "stock_metrics.txt").read_text()
    h = parse_metrics(text).ttft
    merged = merge_histograms([h, h])
    assert merged.count == 2 * h.count and merged.quantile(0.5) == pytest.approx(h.quantile(0.5))
    other = replace(h, buckets=h.buckets[:-1])
    assert merge_histograms([h, other]).count == h.count


@given(st.lists(st.floats(0, 1), min_size=1, max_size=128), st.integers(1, 300))
def test_resample_preserves_the_mean(values, width):
    out = render.resample(values, width)
    assert len(out) == width
    assert sum(out) / width == pytest.approx(sum(values) / len(values), abs=1e-9)
    assert all(-1e-12 <= v <= 1 + 1e-12 for v in out)


def test_occupancy_map_heights_follow_the_segments():
    lines = render.occupancy_map((0.0, 0.5, 1.0, 0.25), width=4, rows=2)
    top, bottom = (line.plain for line in lines)
    assert bottom == "·██▄" and top == "  █ "


def _style_at(line, offset: int):
    return next(span.style for span in line.spans if span.start <= offset < span.end)


def test_occupancy_map_stacks_cached_slots_above_the_used_ones_in_their_own_glyph_and_colour():
    # Idle with a cache full of prefixes; half used and half cached; a quarter used, a quarter cached.
    lines = render.occupancy_map((0.0, 0.5, 0.25), width=3, rows=2, cached=(1.0, 0.5, 0.25))
    top, bottom = lines
    assert (top.plain, bottom.plain) == ("▒▒ ", "▒█▄")
    cached = render.style(f"{render.CACHED} on grey15")
    assert _style_at(top, 0) == cached and _style_at(bottom, 0) == cached
    assert _style_at(bottom, 1) == render.style(f"{render.usage_style(0.5)} on grey15")
    # The quarter used fills half the bottom cell; the cached quarter above it shows as its background.
    assert _style_at(bottom, 2) == render.style(f"{render.usage_style(0.25)} on {render.CACHED}")
    # Without a cached map (a server that does not publish it) the map is the used share alone.
    assert [line.plain for line in render.occupancy_map((0.0, 0.5, 0.25), 3, 2)] == ["   ", "·█▄"]


def test_plain_snapshot_shows_the_states_figures(final):
    text = render_plain(final, width=110)
    kv = final.views[0].kv
    assert f"{fmt.count(kv.slots_used)} / {fmt.count(kv.slots_total)} used" in text
    assert f"running     {fmt.count(final.views[1].running)}" in text
    assert "stock vLLM exposes only vllm:kv_cache_usage_perc" in text
    assert "DOWN since" in text
    assert "N/A: no GPU readable through NVML" in text  # recorded on a host without a GPU


def test_gpu_lines_show_na_and_real_fields():
    from proxima.gpu import GpuSnapshot

    assert "N/A" in render.gpu_lines((), 80)[0].plain
    assert "local only" in render.gpu_lines(None, 80)[0].plain
    g = GpuSnapshot(0, "NVIDIA H200", 30 * 2**30, 140 * 2**30, 55.0, None)
    line = render.gpu_lines((g,), 100)[0].plain
    assert "30.0 GiB / 140.0 GiB" in line and "util  55%" in line and "power N/A" in line


def test_empty_dashboard_needs_a_url():
    with pytest.raises(ValueError):
        DashboardState.empty([])


def test_frame_with_wrong_server_count_is_refused(recording):
    state = DashboardState.empty(recording.urls)
    with pytest.raises(ValueError, match="3"):
        state.advance(Frame(1.0, (ServerSnapshot(url="x", taken_at=1.0, ok=False),), None))
