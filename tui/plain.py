"""`proxima top --once`: one plain-text snapshot of the dashboard (also used when stdout is a pipe).

Layer: rendering. The same `render.py` lines as the panels, without colour, so a log or a CI job
sees exactly the figures the terminal UI would show.
"""

from __future__ import annotations

from rich.text import Text

from proxima import fmt
from proxima.tui import render
from proxima.tui.state import DashboardState


def _section(title: str, lines: list[Text], indent: str = "  ") -> list[str]:
    return [title, *(indent + line.plain.rstrip() for line in lines)]


def render_plain(state: DashboardState, width: int = 100) -> str:
    inner = width - 2
    plural = "s" if len(state.urls) != 1 else ""
    out = [f"proxima top · {fmt.clock(state.now)} · {len(state.urls)} server{plural}"]
    for view in state.views:
        out.append("")
        out.append("== " + render.server_title(view).plain)
        out += [f"  ! {alert}" for alert in view.alerts]
        if view.kind == "unknown":
            continue
        out += _section("KV memory", render.kv_lines(view, inner))
        out += _section("Serving", render.serving_lines(view))
    if len(state.views) > 1 and state.aggregate is not None:
        out.append("")
        out += _section("== all servers", render.servers_lines(state.views, state.aggregate, inner), "")
    out.append("")
    out += _section("GPU", render.gpu_lines(state.gpus, inner))
    return "\n".join(out) + "\n"
