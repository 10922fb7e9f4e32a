"""Load clients retire idle connections before vLLM's server closes them (its keep-alive is 5 s),
so no request is sent on a connection the server is closing (scripts/keepalive_race.py shows the
failures that race gives): checked against a real uvicorn server, vLLM's HTTP server."""

from __future__ import annotations

import asyncio
import threading
import time

import uvicorn
from vllm import envs

from proxima.fetch import KEEPALIVE_EXPIRY_S
from proxima.load import new_http_client
from proxima.server_process import free_port


def test_idle_connection_is_retired_before_the_server_would_close_it():
    server_keep_alive = envs.VLLM_HTTP_TIMEOUT_KEEP_ALIVE
    assert KEEPALIVE_EXPIRY_S < server_keep_alive - 1  # a margin for a loaded client
    peers: list[tuple[str, int]] = []

    async def app(scope, receive, send):
        if scope["type"] == "http":
            peers.append(tuple(scope["client"]))
            await send({"type": "http.response.start", "status": 200, "headers": []})
            await send({"type": "http.response.body", "body": b"ok"})

    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, port=port, timeout_keep_alive=server_keep_alive,
                                           log_level="error"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 10
        while not server.started and time.monotonic() < deadline:
            time.sleep(0.05)

        async def go():
            async with new_http_client(10.0) as http:
                url = f"http://127.0.0.1:{port}/"
                await http.get(url)
                await http.get(url)  # at once: the same connection
                await asyncio.sleep(KEEPALIVE_EXPIRY_S + 0.5)  # idle, still open on the server
                await http.get(url)  # retired by the client: a new connection

        asyncio.run(go())
    finally:
        server.should_exit = True
        thread.join(timeout=10)
    assert peers[0] == peers[1] and peers[2] != peers[1], peers
