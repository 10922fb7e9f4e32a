"""`proxima top`'s Textual app: timer → collection worker → message → state → panels.

Flow and ownership:
- Live: a timer fires every `interval`; if no collection is in flight it starts the `collect`
  worker (async, on the app's loop), which awaits `Collector.collect()` and posts `FrameCollected`.
  A slow server therefore delays ticks instead of piling requests up.
- Replay: a timer moves a playhead over a `Recording`'s frames at their recorded pace × speed;
  no I/O at all.
- Either way, the message handler (on the app's loop) folds the frame into a new immutable
  `DashboardState` and, unless paused, hands panels the views they draw. Workers never touch
  widgets; panels never touch I/O.
"""

from __future__ import annotations

import logging
from bisect import bisect_left
from pathlib import Path

from rich.text import Text
from textual import work
from textual.app import App, ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal
from textual.css.query import NoMatches
from textual.message import Message
from textual.timer import Timer
from textual.widgets import ContentSwitcher, Footer

from proxima import fmt
from proxima.tui import render
from proxima.tui.collector import Collector, scrape_timeout
from proxima.tui.help import HelpScreen
from proxima.tui.model import Frame, Settings
from proxima.tui.panels import (
    Bar,
    GpuPanel,
    HistoryPanel,
    KvPanel,
    ServersPanel,
    ServingPanel,
    alerts_text,
    tabs_text,
)
from proxima.tui.record import Recorder, Recording, RecordingError
from proxima.tui.state import DashboardState

logger = logging.getLogger(__name__)

INTERVALS = (0.1, 0.2, 0.25, 0.5, 1.0, 2.0, 5.0, 10.0)
SPEEDS = (0.125, 0.25, 0.5, 1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0)
REPLAY_TICK_S = 0.1


def _step(options: tuple[float, ...], current: float, direction: int) -> float:
    """The next option up (+1) or down (-1) from `current`, which need not be one of them."""
    if direction > 0:
        return next((o for o in options if o > current + 1e-9), options[-1])
    return next((o for o in reversed(options) if o < current - 1e-9), options[0])


class TopApp(App[None]):
    CSS_PATH = "top.tcss"
    TITLE = "proxima top"
    ENABLE_COMMAND_PALETTE = False
    BINDINGS = [
        Binding("question_mark", "help", "help"),
        Binding("p", "pause", "pause"),
        Binding("tab", "next_server(1)", "next server", priority=True),
        Binding("s", "next_server(1)", "next server", show=False),
        Binding("shift+tab", "next_server(-1)", "previous server", show=False, priority=True),
        Binding("a", "aggregate", "all servers"),
        Binding("plus,equals_sign", "rate(1)", "faster", key_display="+"),
        Binding("minus", "rate(-1)", "slower", key_display="-"),
        Binding("left", "step(-1)", "back", show=False),
        Binding("right", "step(1)", "forward", show=False),
        Binding("home", "jump(0)", "first frame", show=False),
        Binding("end", "jump(-1)", "last frame", show=False),
        *(Binding(str(n), f"select({n - 1})", show=False) for n in range(1, 10)),
        Binding("q", "quit", "quit"),
    ]

    class FrameCollected(Message):
        def __init__(self, frame: Frame) -> None:
            super().__init__()
            self.frame = frame

    class CollectFailed(Message):
        def __init__(self, error: str) -> None:
            super().__init__()
            self.error = error

    def __init__(self, urls: tuple[str, ...], *, collector: Collector | None = None,
                 recording: Recording | None = None, settings: Settings | None = None,
                 interval: float = 0.5, recorder: Recorder | None = None, replay_start: int = 0) -> None:
        super().__init__()
        if (collector is None) == (recording is None):
            raise ValueError("TopApp needs exactly one of a collector (live) or a recording (replay)")
        self.state = DashboardState.empty(urls, settings)
        self.collector, self.recording, self.recorder = collector, recording, recorder
        self.interval = interval
        self.speed = 1.0
        self.paused = False
        self.selected: int | None = 0
        self._last_selected = 0
        self._timer: Timer | None = None
        self._in_flight = False
        self._shutting_down = False
        self.ticks_skipped = 0
        self.collect_error: str | None = None
        self.record_error: str | None = None
        # Replay: frames applied so far, and the playhead on the recording's clock.
        self.position = 0
        self._playhead = 0.0
        self._replay_start = replay_start

    @classmethod
    def live(cls, collector: Collector, *, interval: float = 0.5, settings: Settings | None = None,
             recorder: Recorder | None = None) -> TopApp:
        return cls(collector.urls, collector=collector, interval=interval, settings=settings,
                   recorder=recorder)

    @classmethod
    def replay(cls, recording: Recording, *, settings: Settings | None = None, start: int = 0) -> TopApp:
        """Play `recording` with its first `start` frames already shown (-1: all of them, at the end)."""
        return cls(recording.urls, recording=recording, settings=settings, interval=recording.interval_s,
                   replay_start=start)

    # ------------------------------------------------------------------ layout and drawing

    def compose(self) -> ComposeResult:
        yield Bar(id="tabs")
        yield Bar(id="server")
        yield Bar(id="alerts")
        with Horizontal(id="main"):
            with ContentSwitcher(initial="kv", id="left"):
                yield KvPanel("KV memory", id="kv")
                yield ServersPanel("All servers", id="servers")
            yield ServingPanel("Serving", id="serving")
        yield GpuPanel("GPU (this host)", id="gpu")
        yield HistoryPanel("History", id="history")
        yield Bar(id="status")
        yield Footer()

    def redraw(self) -> None:
        try:
            self._draw()
        except NoMatches:
            # The panels are composed once and never removed, so this happens only to a frame that
            # lands while the app is quitting and its screen is already gone: nothing to draw on.
            logger.debug("frame arrived after the panels were removed; not drawn")

    def _draw(self) -> None:
        state, index = self.state, self.selected
        view = state.view(index)
        self.query_one("#tabs", Bar).show(tabs_text(state, index))
        title = (Text(f" all {len(state.urls)} servers", style="bold") if index is None
                 else Text(" ") + render.server_title(view))
        self.query_one("#server", Bar).show(title)
        self.query_one("#alerts", Bar).show(alerts_text(view))
        self.query_one("#left", ContentSwitcher).current = "servers" if index is None else "kv"
        if index is None:
            self.query_one("#servers", ServersPanel).show(state, view.level)
        else:
            self.query_one("#kv", KvPanel).show(view, view.level)
        serving = self.query_one("#serving", ServingPanel)
        serving.display = index is not None  # the servers table has the totals and wants the width
        serving.show(view, view.level)
        self.query_one("#gpu", GpuPanel).show(state.gpus)
        points = state.points(index)
        history = self.query_one("#history", HistoryPanel)
        span = render.history_span(points, state.settings.history_s)
        history.border_title = f"History · last {fmt.duration(span)}"
        history.show((points, state.settings.history_s))
        self.query_one("#status", Bar).show(self.status_text())

    def status_text(self) -> Text:
        state = self.state
        text = Text()
        if self.recording is not None:
            text.append(f" ▶ replay {Path(self.recording.path).name} · frame {self.position}/"
                        f"{len(self.recording.frames)} · {fmt.clock(state.now)} · speed {self.speed:g}x")
            if self.position >= len(self.recording.frames):
                text.append(" · end of recording", style="bold")
            if self.recording.truncated_last_line:
                text.append(" · last line was cut off (ignored)", style="yellow")
        elif state.now is None:
            text.append(" ● connecting…")
        else:
            down = sum(not v.ok for v in state.views)
            text.append(f" ● last scrape {fmt.clock(state.now)} · every {self.interval:g}s "
                        f"({1 / self.interval:g} Hz) · {len(state.urls)} server"
                        f"{'s' if len(state.urls) > 1 else ''}")
            text.append(f", {down} down" if down else "", style="bold red")
        errors = sum(v.scrape_errors for v in state.views)
        text.append(f" · scrape errors {errors}", style="red" if errors else "")
        if self.recorder is not None:
            text.append(f" · ● rec {self.recorder.path} ({self.recorder.frames_written} frames)", style="red")
        for problem in (self.record_error, self.collect_error):
            if problem:
                text.append(f" · {problem}", style="bold red")
        if self.paused:
            text.append("  PAUSED ", style="bold reverse yellow")
        return text

    # ------------------------------------------------------------------ frames in

    def on_mount(self) -> None:
        if self.recording is not None:
            n = len(self.recording.frames)
            start = self._replay_start if self._replay_start >= 0 else n + 1 + self._replay_start
            self._seek(max(1, min(n, start)) if n else 0)
            self._timer = self.set_interval(REPLAY_TICK_S, self._replay_tick)
        else:
            self._timer = self.set_interval(self.interval, self._live_tick)
            self._live_tick()
        self.redraw()

    def _live_tick(self) -> None:
        if self._in_flight:
            self.ticks_skipped += 1  # the previous scrape is still running: never pile requests up
            return
        self._in_flight = True
        self.collect()

    @work(group="collect", exit_on_error=False)
    async def collect(self) -> None:
        assert self.collector is not None
        try:
            frame = await self.collector.collect(scrape_timeout(self.interval))
        except Exception as err:  # scrape never raises; anything here is a bug to show, not a crash
            logger.exception("collection failed")
            self.post_message(self.CollectFailed(f"collection failed: {type(err).__name__}: {err}"))
            return
        self.post_message(self.FrameCollected(frame))

    def on_top_app_frame_collected(self, message: FrameCollected) -> None:
        if self._shutting_down:
            return  # a scrape that finished while quitting: nothing left to record or draw on
        self._in_flight = False
        self.collect_error = None
        self.apply(message.frame)

    def on_top_app_collect_failed(self, message: CollectFailed) -> None:
        if self._shutting_down:
            return
        self._in_flight = False
        self.collect_error = message.error
        self.redraw()

    def apply(self, frame: Frame, draw: bool = True) -> None:
        self.state = self.state.advance(frame)
        if self.recorder is not None:
            try:
                self.recorder.write(frame)
            except RecordingError as err:
                self.record_error = f"recording stopped: {err}"
                self.recorder = None
        if draw and not self.paused:
            self.redraw()

    def _replay_tick(self) -> None:
        assert self.recording is not None
        frames = self.recording.frames
        if self.paused or self.position >= len(frames):
            return
        self._playhead += REPLAY_TICK_S * self.speed
        applied = False
        while self.position < len(frames) and frames[self.position].taken_at <= self._playhead:
            self.apply(frames[self.position], draw=False)
            self.position += 1
            applied = True
        if applied:
            self.redraw()

    def _seek(self, position: int) -> None:
        """Replay: rebuild the state as it was after `position` frames (folding only the history)."""
        assert self.recording is not None
        frames = self.recording.frames
        state = DashboardState.empty(self.state.urls, self.state.settings)
        if position > 0:
            times = [f.taken_at for f in frames]
            horizon = frames[position - 1].taken_at - state.settings.history_s - state.settings.window_s
            for frame in frames[max(0, bisect_left(times, horizon)):position]:
                state = state.advance(frame)
        self.state, self.position = state, position
        self._playhead = frames[position - 1].taken_at if position > 0 else (
            frames[0].taken_at if frames else 0.0)

    # ------------------------------------------------------------------ keys

    def check_action(self, action: str, parameters: tuple[object, ...]) -> bool | None:
        if action in ("step", "jump"):
            return self.recording is not None
        return True

    def action_help(self) -> None:
        if not isinstance(self.screen, HelpScreen):
            self.push_screen(HelpScreen())

    def action_pause(self) -> None:
        self.paused = not self.paused
        self.redraw()

    def action_next_server(self, direction: int) -> None:
        n = len(self.state.urls)
        current = self._last_selected if self.selected is None else self.selected
        self.selected = self._last_selected = (current + direction) % n
        self.redraw()

    def action_select(self, index: int) -> None:
        if index < len(self.state.urls):
            self.selected = self._last_selected = index
            self.redraw()

    def action_aggregate(self) -> None:
        self.selected = self._last_selected if self.selected is None else None
        self.redraw()

    def action_rate(self, direction: int) -> None:
        if self.recording is not None:
            self.speed = _step(SPEEDS, self.speed, direction)
        else:
            self.interval = _step(INTERVALS, self.interval, -direction)
            if self._timer is not None:
                self._timer.stop()
            self._timer = self.set_interval(self.interval, self._live_tick)
        self.redraw()

    def action_step(self, delta: int) -> None:
        if self.recording is None:
            return
        self.paused = True
        target = max(1, min(len(self.recording.frames), self.position + delta))
        if delta > 0 and target == self.position + 1:
            self.apply(self.recording.frames[self.position], draw=False)
            self.position = target
            self._playhead = self.recording.frames[target - 1].taken_at
        elif target != self.position:
            self._seek(target)
        self.redraw()

    def action_jump(self, where: int) -> None:
        if self.recording is not None:
            self._seek(len(self.recording.frames) if where < 0 else min(1, len(self.recording.frames)))
            self.redraw()

    async def on_unmount(self) -> None:
        self._shutting_down = True
        if self._timer is not None:
            self._timer.stop()
        recorder, self.recorder = self.recorder, None
        if recorder is not None:
            recorder.close()
        if self.collector is not None:
            await self.collector.aclose()
