"""Loopback HTTP servers that misbehave on purpose, for faults no real vLLM server can be made to
show: a /metrics that trickles, a /v1/models of another shape, completions that fail with a
message full of brackets, answers that never end. Everything else in these tests talks to them
over real HTTP.

`StandInServer` routes paths to answers: a `(status, body)` pair, a `Reply` (which can trickle,
never end or be cut short), or a function of the request's JSON body returning either.
`vllm_routes()` is a server that answers like vLLM on every endpoint the tools read; a test
replaces one route with a misbehaving one.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Self


class _Server(ThreadingHTTPServer):
    daemon_threads = True

    def handle_error(self, request, client_address) -> None:
        pass  # clients that give up mid-answer are what these tests provoke


@dataclass(frozen=True)
class Reply:
    """One answer. `trickle_s`: one byte per `trickle_s` seconds. `endless`: after `body`, these
    bytes again and again until the client leaves (no length). `truncate_at`: the headers promise
    the whole body, the connection closes after this many bytes."""

    status: int = 200
    body: bytes = b""
    trickle_s: float = 0.0
    endless: bytes | None = None
    truncate_at: int | None = None
    content_type: str | None = None


Route = tuple[int, bytes] | Reply | Callable[[object], "tuple[int, bytes] | Reply"]


class StandInServer:
    """Routes GET/POST paths to answers; `trickle_s` sends /metrics a byte at a time. With
    `api_key`, /v1 paths answer 401 to a request without that bearer key, as vLLM's --api-key."""

    def __init__(self, routes: dict[str, Route], trickle_s: float = 0.0,
                 on_post: Callable[[str], None] | None = None, api_key: str | None = None) -> None:
        self.routes, self.trickle_s, self.on_post, self.api_key = routes, trickle_s, on_post, api_key
        self.hits: dict[str, int] = {}
        self.refused = 0  # requests answered 401 for want of the key
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
                request = None
                if self.command == "POST":
                    raw = self.rfile.read(int(self.headers.get("content-length", 0)))
                    try:
                        request = json.loads(raw)
                    except ValueError:
                        request = None
                    if owner.on_post is not None:
                        owner.on_post(path)
                route = owner.routes.get(path, (404, b"not found"))
                if owner.api_key and path.startswith("/v1") and \
                        self.headers.get("Authorization") != f"Bearer {owner.api_key}":
                    owner.refused += 1
                    route = (401, json_body({"error": "Unauthorized"}))
                reply = route(request) if callable(route) else route
                if not isinstance(reply, Reply):
                    status, body = reply
                    reply = Reply(status, body, trickle_s=owner.trickle_s if path == "/metrics" else 0.0)
                self._send(reply)

            def _send(self, reply: Reply) -> None:
                body = reply.body
                self.send_response(reply.status)
                self.send_header("Content-Type", reply.content_type or (
                    "application/json" if body[:1] in b"[{" else "text/plain"))
                if reply.endless is None:
                    self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                if reply.truncate_at is not None:
                    self.wfile.write(body[:reply.truncate_at])
                    self.wfile.flush()
                    self.close_connection = True
                    return
                if reply.trickle_s:
                    for k in range(len(body)):
                        self.wfile.write(body[k:k + 1])
                        self.wfile.flush()
                        time.sleep(reply.trickle_s)
                else:
                    self.wfile.write(body)
                while reply.endless is not None:  # until the client hangs up (BrokenPipe ends it)
                    self.wfile.write(reply.endless)

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


# ------------------------------------------------------------------ a vLLM-shaped stand-in

MODEL = "standin"
# A real Proxima server's /metrics at rest (tests/data/top, with nothing running), its finished
# count following the completions this stand-in has served (so bench's counters settle at once).
_METRICS = (Path(__file__).parent / "data" / "top" / "proxima_metrics.txt").read_text().replace(
    'vllm:num_requests_running{engine="0",model_name="/tmp/top-tiny"} 41.0',
    'vllm:num_requests_running{engine="0",model_name="/tmp/top-tiny"} 0.0')
_FINISHED = 'vllm:request_success_total{engine="0",finished_reason="length",model_name="/tmp/top-tiny"} 693.0'
METRICS_AT_REST = _METRICS


def metrics_page(num_served: int) -> bytes:
    """The page at rest, its finished count moved on by the completions a stand-in has served."""
    return _METRICS.replace(_FINISHED, _FINISHED.replace("693.0", f"{693 + num_served}.0")).encode()


def sse(*events: object) -> bytes:
    """Server-sent events as vLLM streams them (each a JSON object, or raw bytes as they are)."""
    return b"".join(b"data: " + (e if isinstance(e, bytes) else json.dumps(e).encode()) + b"\n\n"
                    for e in events)


def token_chunk(text: str = " tok", finish: str | None = None) -> dict:
    return {"id": "cmpl-1", "object": "text_completion", "model": MODEL,
            "choices": [{"index": 0, "text": text, "finish_reason": finish}]}


def vllm_routes() -> dict[str, Route]:
    """Every endpoint the tools read, answered as vLLM 0.26 answers it."""
    served = [0]

    def metrics(_request) -> tuple[int, bytes]:
        return 200, metrics_page(served[0])

    def tokenize(request) -> tuple[int, bytes]:
        prompt = request.get("prompt", "") if isinstance(request, dict) else ""
        count = 1 + len(str(prompt).split())
        return 200, json_body({"count": count, "max_model_len": 1024, "tokens": list(range(count))})

    def completions(request) -> tuple[int, bytes]:
        request = request if isinstance(request, dict) else {}
        n = int(request.get("max_tokens") or 16)
        served[0] += 1
        if request.get("stream"):
            chunks = [token_chunk(finish="length" if k == n - 1 else None) for k in range(n)]
            usage = {"id": "cmpl-1", "choices": [], "usage": {"prompt_tokens": 5, "completion_tokens": n,
                                                              "total_tokens": 5 + n}}
            return 200, sse(*chunks, usage, b"[DONE]")
        return 200, json_body({"id": "cmpl-1", "object": "text_completion", "model": MODEL,
                               "choices": [{"index": 0, "text": " tok" * n, "token_ids": [7] * n,
                                            "finish_reason": "length"}],
                               "usage": {"prompt_tokens": 5, "completion_tokens": n, "total_tokens": 5 + n}})

    return {
        "/v1/models": (200, json_body({"object": "list", "data": [{"id": MODEL, "object": "model",
                                                                    "max_model_len": 1024}]})),
        "/tokenize": tokenize,
        "/v1/completions": completions,
        "/metrics": metrics,
        "/version": (200, json_body({"version": "0.26.0"})),
        "/health": (200, b""),
    }
