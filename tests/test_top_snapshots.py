"""SVG snapshots of `proxima top` (pytest-textual-snapshot), 120x40, from a recorded session.

Deterministic by construction: the app replays tests/data/top/session.jsonl (real servers, see its
README) from its last frame, every figure and clock derives from the recording, and clocks are
shown in UTC here. Update after an intended change with:
    python -m pytest tests/test_top_snapshots.py --snapshot-update
and look at the SVGs (tests/snapshots/) before committing them.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from pytest_textual_snapshot import SVGImageExtension

from proxima.tui.app import TopApp
from proxima.tui.record import load_recording

DATA = Path(__file__).parent / "data" / "top"
SIZE = (120, 40)


class _TopSnapshots(SVGImageExtension):
    @classmethod
    def dirname(cls, *, test_location) -> str:
        return str(Path(test_location.filepath).parent / "snapshots")


@pytest.fixture
def snapshot(snapshot):
    """Keep the SVGs in tests/snapshots/: snap_compare asks for its SVG extension; give it ours."""
    original = type(snapshot).use_extension
    snapshot.use_extension = lambda extension_class=None: original(snapshot, _TopSnapshots)
    return snapshot


@pytest.fixture(autouse=True)
def utc_clock(monkeypatch):
    monkeypatch.setenv("TZ", "UTC")
    time.tzset()
    yield
    monkeypatch.undo()
    time.tzset()


def _app() -> TopApp:
    return TopApp.replay(load_recording(DATA / "session.jsonl"), start=-1)


def test_proxima_server(snap_compare):
    """The Proxima server: occupancy map, slots, fragmentation, headroom, allocator latency."""
    assert snap_compare(_app(), terminal_size=SIZE)


def test_stock_server_in_danger(snap_compare):
    """The stock server with a full cache, a queue and preemptions: red, and what stock vLLM cannot show."""
    assert snap_compare(_app(), press=["2"], terminal_size=SIZE)


def test_all_servers(snap_compare):
    """The aggregate view: one row per server (one down), totals, every occupancy strip."""
    assert snap_compare(_app(), press=["a"], terminal_size=SIZE)


def test_help_overlay(snap_compare):
    assert snap_compare(_app(), press=["question_mark"], terminal_size=SIZE)
