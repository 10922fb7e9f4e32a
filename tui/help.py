"""The `?` overlay: keys, and what each panel's figures mean (where they come from)."""

from __future__ import annotations

from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import VerticalScroll
from textual.screen import ModalScreen
from textual.widgets import Static

HELP = """\
[b]Keys[/b]
  [b]?[/b]          this help (any of ? esc q closes it)
  [b]p[/b]          pause / resume the display (live: collection and recording go on)
  [b]tab[/b] / [b]s[/b]    next server   [b]shift+tab[/b] previous server   [b]1[/b]-[b]9[/b] server by number
  [b]a[/b]          all servers: one row each, totals, every occupancy map
  [b]+[/b] / [b]-[/b]      refresh faster / slower (replay: play faster / slower)
  [b]←[/b] / [b]→[/b]      replay, paused: one frame back / forward   [b]home[/b]/[b]end[/b] first/last frame
  [b]q[/b]          quit

[b]KV memory[/b]  (Proxima's engine metrics; stock vLLM exposes only its block-level usage)
  slots       three kinds: [b]used[/b] (█) by running requests · [b]cached[/b] ([blue]▒[/]) prefix entries no
              request references, evicted on demand · [b]free[/b] (░) empty. /metrics'
              proxima_kv_slots_free counts cached + free: all that a new request may take
  map         the cache's slots in 64 equal segments, resampled to the width: share used by requests
              from the bottom, cached stacked above it ([blue]▒[/]); "free run": longest run of free slots
  tokens      live tokens against capacity, and what 16-token blocks would use for the same requests
  fragment.   allocated-but-unused share of the used slots (and under 16-token blocks)
  headroom    (free + cached) slots / mean tokens per running request (none running: recent finished)
  allocator   allocate / free / per-step time, p50/p99 over the latency window

[b]Serving[/b]  (vLLM's own metrics)
  rates over the last 5 s; TTFT / ITL / E2E quantiles from histogram deltas over the sliding
  window (--window, 60 s by default; shorter while the history is)

[b]Colours[/b]  yellow: KV ≥ 85% or preempting;  red: KV ≥ 95% with requests waiting, or server down
[b]GPU[/b]  NVML readings, for servers on this host only; N/A where nothing can be read
"""


class HelpScreen(ModalScreen[None]):
    BINDINGS = [
        Binding("escape", "close", "close"),
        Binding("question_mark", "close", "close"),
        Binding("q", "close", "close"),
    ]

    def compose(self) -> ComposeResult:
        with VerticalScroll(id="help"):
            yield Static(HELP, markup=True)

    def action_close(self) -> None:
        self.dismiss(None)
