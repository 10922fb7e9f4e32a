"""The dashboard's panels: each draws only from the immutable data the app hands it.

Layer: rendering. A panel never scrapes, never reads NVML, never looks at the clock: the app
calls `show(...)` with views derived from the latest `DashboardState` and the panel redraws from
them (at its current width, so the occupancy map and sparklines reflow on resize). Drawing code
itself lives in `render.py`, shared with `--once`.
"""

from __future__ import annotations

from typing import Any

from rich.text import Text
from textual.widget import Widget

from proxima import fmt
from proxima.tui import render
from proxima.tui.model import ServerView
from proxima.tui.state import DashboardState


class Panel(Widget):
    """A box whose content is `lines(data, width)`; `show` swaps the data and redraws."""

    def __init__(self, title: str = "", *, id: str | None = None) -> None:
        super().__init__(id=id)
        self.border_title = title
        self._data: Any = None

    def show(self, data: Any, level: str | None = None) -> None:
        for name in ("ok", "warn", "danger"):
            self.set_class(level == name, f"-{name}")
        if data is self._data or data == self._data:
            return  # views are immutable values: equal data draws the same, so skip the render
        self._data = data
        self.refresh()

    def lines(self, data: Any, width: int) -> list[Text]:
        raise NotImplementedError

    def render(self) -> Text:
        if self._data is None:
            return Text("waiting for the first scrape…", style=render.DIM)
        return Text("\n").join(self.lines(self._data, self.content_size.width))


class KvPanel(Panel):
    def lines(self, view: ServerView, width: int) -> list[Text]:
        return render.kv_lines(view, width)


class ServersPanel(Panel):
    def lines(self, state: DashboardState, width: int) -> list[Text]:
        return render.servers_lines(state.views, state.view(None), width)


class ServingPanel(Panel):
    def lines(self, view: ServerView, width: int) -> list[Text]:
        return render.serving_lines(view)


class GpuPanel(Panel):
    def lines(self, gpus, width: int) -> list[Text]:
        return render.gpu_lines(gpus, width)


class HistoryPanel(Panel):
    def lines(self, data: tuple, width: int) -> list[Text]:
        points, history_s = data
        return render.history_lines(points, width, history_s, self.content_size.height)


class Bar(Widget):
    """A one-line bar (server tabs, alerts, status) showing a prepared `Text`."""

    def __init__(self, *, id: str | None = None) -> None:
        super().__init__(id=id)
        self._text = Text()

    def show(self, text: Text) -> None:
        if text != self._text:
            self._text = text
            self.refresh()

    def render(self) -> Text:
        return self._text


def tabs_text(state: DashboardState, selected: int | None) -> Text:
    text = Text(" proxima top ", style="bold reverse")
    for n, view in enumerate(state.views, start=1):
        mark, style = ("●", "green") if view.ok else ("✕", "bold red")
        text.append("  ")
        text.append(mark, style=style)
        text.append(f" {n} {fmt.short_url(view.url)} ", style="reverse bold" if selected == n - 1 else "")
    text.append("  ")
    text.append(" a all servers ", style="reverse bold" if selected is None else "")
    return text


def alerts_text(view: ServerView) -> Text:
    if not view.alerts:
        return Text(" no alerts", style=render.DIM)
    level_style = render.LEVEL_STYLE[view.level]
    text = Text(" ⚠ " if view.level != "ok" else " ℹ ", style=level_style)
    text.append(" · ".join(view.alerts), style=level_style if view.level != "ok" else "")
    return text
