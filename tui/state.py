"""Dashboard state: the one immutable picture every panel draws from (collect → state → render).

Layer: pure data, no I/O, no Textual. `DashboardState.advance(frame)` folds one `Frame` into a
new state and leaves the old one untouched; replaying a recording rebuilds exactly the states
that live collection built.

Invariants:
- `frames` is ordered by time and bounded by `Settings.history_s` and `Settings.max_frames`
  (memory stays flat however long `top` runs); `series[k]` holds one `Point` per frame.
- `views[i]`, `tracks[i]` and `series[i]` belong to `urls[i]`; `series[-1]` is the aggregate.
- Every figure derives from frames alone, never from the wall clock: a recording renders the same
  on every replay, which is what makes the SVG snapshot tests deterministic.
"""

from __future__ import annotations

from bisect import bisect_right
from dataclasses import dataclass

from proxima.gpu import GpuSnapshot
from proxima.tui.model import Frame, Point, ServerView, Settings, Track
from proxima.tui.views import aggregate_view, point_of, server_view


@dataclass(frozen=True, slots=True)
class DashboardState:
    urls: tuple[str, ...]
    settings: Settings = Settings()
    frames: tuple[Frame, ...] = ()
    times: tuple[float, ...] = ()
    tracks: tuple[Track, ...] = ()
    series: tuple[tuple[Point, ...], ...] = ()
    views: tuple[ServerView, ...] = ()
    aggregate: ServerView | None = None
    frames_seen: int = 0

    @classmethod
    def empty(cls, urls: tuple[str, ...] | list[str], settings: Settings | None = None) -> DashboardState:
        urls = tuple(urls)
        if not urls:
            raise ValueError("a dashboard needs at least one server URL")
        return cls(
            urls, settings or Settings(),
            tracks=tuple(Track() for _ in urls),
            series=tuple(() for _ in range(len(urls) + 1)),
            views=tuple(ServerView(url=u, kind="unknown", ok=False, error="not scraped yet") for u in urls),
        )

    @property
    def now(self) -> float | None:
        """Time of the latest frame: the dashboard's clock (the recording's, in a replay)."""
        return self.times[-1] if self.times else None

    @property
    def gpus(self) -> tuple[GpuSnapshot, ...] | None:
        return self.frames[-1].gpus if self.frames else None

    @property
    def all_down(self) -> bool:
        return bool(self.frames) and not any(s.ok for s in self.frames[-1].servers)

    def view(self, index: int | None) -> ServerView:
        """Server `index`'s view, or the aggregate for None."""
        if index is None:
            return self.aggregate or aggregate_view(self.views)
        return self.views[index]

    def points(self, index: int | None) -> tuple[Point, ...]:
        return self.series[-1 if index is None else index]

    def advance(self, frame: Frame) -> DashboardState:
        if len(frame.servers) != len(self.urls):
            raise ValueError(f"frame has {len(frame.servers)} servers, dashboard watches {len(self.urls)}")
        frames, times = self.frames + (frame,), self.times + (frame.taken_at,)
        # Keep one frame older than the history span so a full-span window still has a baseline.
        cut = max(bisect_right(times, frame.taken_at - self.settings.history_s) - 1,
                  len(frames) - self.settings.max_frames, 0)
        frames, times = frames[cut:], times[cut:]
        tracks = tuple(t.after(s) for t, s in zip(self.tracks, frame.servers))
        views = tuple(server_view(i, frames, times, tracks[i], self.settings) for i in range(len(self.urls)))
        aggregate = aggregate_view(views)
        points = (point_of(v, frame.taken_at) for v in (*views, aggregate))
        series = tuple((s + (p,))[cut:] for s, p in zip(self.series, points))
        return DashboardState(self.urls, self.settings, frames, times, tracks, series, views, aggregate,
                              self.frames_seen + 1)
