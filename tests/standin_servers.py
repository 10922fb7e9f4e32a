"""Loopback HTTP servers that misbehave on purpose, for faults no real vLLM server can be made to
show: a /metrics that trickles, a /v1/models of another shape, completions that fail with a
message full of brackets. Everything else in these tests talks to them over real HTTP."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Self


class _Server(ThreadingHTTPServer):
    daemon_threads = True

    def handle_error(self, request, client_address) -> None:
        pass  # clients that give up mid-answer are what these tests provoke


class StandInServer:
    """Routes GET/POST paths to (status, body bytes); `trickle_s` sends /metrics a byte at a time."""

    def __init__(self, routes: dict[str, tuple[int, bytes]], trickle_s: float = 0.0,
                 on_post: Callable[[str], None] | None = None) -> None:
        self.routes, self.trickle_s, self.on_post = routes, trickle_s, on_post
        self.hits: dict[str, int] = {}
        self._server: ThreadingHTTPServer | None = None

    @property
    def url(self) -> str:
        assert self._server is not None
        return f"http://127.0.0.1:{self._server.server_address[1]}"

    def __enter__(self) -> Self:
        owner = self

        class Handler(BaseHTTPRequestHandler):
            def _answer(self) -> None:
                path = self.path.split("?")[0]
                owner.hits[path] = owner.hits.get(path, 0) + 1
                if self.command == "POST":
                    self.rfile.read(int(self.headers.get("content-length", 0)))
                    if owner.on_post is not None:
                        owner.on_post(path)
                status, body = owner.routes.get(path, (404, b"not found"))
                self.send_response(status)
                self.send_header("Content-Type", "application/json" if body[:1] in b"[{" else "text/plain")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                if owner.trickle_s and path == "/metrics":
                    for k in range(len(body)):
                        self.wfile.write(body[k:k + 1])
                        self.wfile.flush()
                        time.sleep(owner.trickle_s)
                else:
                    self.wfile.write(body)

            do_GET = do_POST = _answer

            def log_message(self, *args) -> None:
                pass

        self._server = _Server(("127.0.0.1", 0), Handler)
        threading.Thread(target=self._server.serve_forever, daemon=True).start()
        return self

    def __exit__(self, *exc) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()


def json_body(value) -> bytes:
    return json.dumps(value).encode()
