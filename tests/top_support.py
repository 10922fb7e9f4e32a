"""Test support for `proxima top`: a real /metrics endpoint on loopback, and the screen as text.

`MetricsServer` serves a fixed exposition (captured from a real vLLM server) over real HTTP and
can be stopped and started again on the same port, which is how tests show a server going down
and coming back without starting vLLM. `screen_text` reads the screen through Textual's private
compositor, which is why it lives here and not in the installed `proxima.tui`.
"""

from __future__ import annotations

import io
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Self

from rich.console import Console


class _Server(ThreadingHTTPServer):
    daemon_threads = True

    def handle_error(self, request, client_address) -> None:
        # A scraper that gives up (timeout, app quitting) closes mid-response: normal here.
        if not isinstance(sys.exc_info()[1], ConnectionError):
            super().handle_error(request, client_address)


class MetricsServer:
    def __init__(self, text: str, port: int = 0) -> None:
        self.text = text
        self.port = port
        self.requests = 0
        self._server: ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> Self:
        owner = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                owner.requests += 1
                if self.path.startswith("/metrics"):
                    body, status = owner.text.encode(), 200
                elif self.path.startswith("/health"):
                    body, status = b"", 200
                else:
                    body, status = b"not found", 404
                self.send_response(status)
                self.send_header("Content-Type", "text/plain; version=0.0.4")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, format: str, *args) -> None:
                pass  # keep test output clean; requests are counted instead

        self._server = _Server(("127.0.0.1", self.port), Handler)
        self.port = self._server.server_address[1]
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None
        if self._thread is not None:
            self._thread.join(5)
            self._thread = None

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def screen_text(app) -> str:
    """What a running Textual app shows, as plain text (what a user would read)."""
    width, height = app.size
    console = Console(width=width, height=height, file=io.StringIO(), force_terminal=True, record=True,
                      legacy_windows=False)
    # The same render path as App.export_screenshot, exported as text instead of SVG.
    console.print(app.screen._compositor.render_update(full=True, screen_stack=app._background_screens))
    return console.export_text()
