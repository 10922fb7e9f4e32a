"""`proxima top`: a live terminal dashboard of KV memory and serving health (like nvitop).

The CLI parses and dispatches; collection, state, rendering and recording live in `proxima.tui`.
"""

from __future__ import annotations

import shutil
import sys
import time
from pathlib import Path

import typer

from proxima.cli.errors import fail

DEFAULT_URL = "http://127.0.0.1:8000"


def top(
    urls: list[str] = typer.Argument(
        None, metavar="URL", help=f"Servers to watch, Proxima or stock vLLM (default {DEFAULT_URL})."
    ),
    interval: float = typer.Option(0.5, "--interval", help="Seconds between scrapes (0.5 = 2 Hz)."),
    once: bool = typer.Option(
        False, "--once",
        help="Print one plain-text snapshot and exit (automatic when stdout is not a terminal).",
    ),
    record: Path | None = typer.Option(None, "--record", metavar="FILE",
                                       help="Save every snapshot to FILE (JSONL), as it is collected."),
    replay: Path | None = typer.Option(None, "--replay", metavar="FILE",
                                       help="Show a session saved with --record, offline."),
    window: float = typer.Option(60.0, "--window",
                                 help="Seconds of the sliding window for latency quantiles."),
    api_key: str | None = typer.Option(None, "--api-key", help="Bearer key sent with each scrape, for a "
                                       "/metrics behind one (default: $VLLM_API_KEY, else $OPENAI_API_KEY)."),
) -> None:
    """Live terminal dashboard of KV memory and serving health."""
    from proxima.fetch import api_key_from, normalize_url
    from proxima.tui.model import Settings

    if not 0.05 <= interval <= 60:
        fail(f"--interval {interval:g} is out of range; use 0.05 to 60 seconds")
    if window <= 0:
        fail("--window must be a positive number of seconds")
    if replay is not None and (urls or record is not None):
        fail("--replay shows a recording offline; drop the server URLs and --record")
    try:
        urls = [normalize_url(u) for u in (urls or [DEFAULT_URL])]
    except ValueError as err:
        fail(str(err))
    if len(set(urls)) != len(urls):
        fail("a server URL is given twice; list each server once")
    plain = once or not sys.stdout.isatty()
    width = max(80, min(160, shutil.get_terminal_size((100, 24)).columns))

    if replay is not None:
        _replay(replay, plain, width, Settings(window_s=window, since_start=plain))
        return
    _live(urls, interval, record, plain, width, Settings(window_s=window, since_start=plain),
          api_key_from(api_key))


def _why_down(state) -> str:
    """One line for `--once` when no server gave a usable /metrics: each server's own reason."""
    servers = state.frames[-1].servers
    reasons = "; ".join(f"{s.url}: {s.error}" for s in servers)
    if all((s.error or "").startswith("connection refused") for s in servers):
        return f"no server answered ({reasons}); start one with `proxima serve MODEL` or pass its URL"
    return f"no usable /metrics ({reasons})"


def _replay(path: Path, plain: bool, width: int, settings) -> None:
    from proxima.tui.record import RecordingError, load_recording

    try:
        recording = load_recording(path)
    except RecordingError as err:
        fail(str(err))
    if not recording.frames:
        fail(f"{path} holds no snapshots (only a header); record a session for longer")
    if plain:
        from proxima.tui.plain import render_plain
        from proxima.tui.state import DashboardState

        # The recording's own window: quantiles as the live dashboard showed them at the end.
        state = DashboardState.empty(recording.urls, type(settings)(window_s=settings.window_s))
        for frame in recording.frames:
            state = state.advance(frame)
        typer.echo(render_plain(state, width), nl=False)
        return
    from proxima.tui.app import TopApp

    TopApp.replay(recording, settings=settings).run()


def _live(urls: list[str], interval: float, record: Path | None, plain: bool, width: int, settings,
          api_key: str | None) -> None:
    import asyncio

    from proxima.tui.collector import Collector, look_once
    from proxima.tui.record import Recorder, RecordingError

    recorder = None
    if record is not None:
        try:
            recorder = Recorder(record, tuple(urls), interval, time.time())
        except RecordingError as err:
            fail(str(err))
    collector = Collector(urls, api_key=api_key)
    if plain:
        from proxima.tui.plain import render_plain

        try:
            state = asyncio.run(look_once(collector, interval, settings,
                                          on_frame=recorder.write if recorder else None))
        except RecordingError as err:
            fail(str(err))
        finally:
            if recorder is not None:
                recorder.close()
        typer.echo(render_plain(state, width), nl=False)
        if state.all_down:
            typer.secho(f"proxima: error: {_why_down(state)}", fg=typer.colors.RED, err=True)
            raise typer.Exit(1)
        return
    from proxima.tui.app import TopApp

    app = TopApp.live(collector, interval=interval, settings=settings, recorder=recorder)
    app.run()
    if app.record_error:
        fail(app.record_error, code=1)
