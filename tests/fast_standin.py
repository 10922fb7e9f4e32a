"""A vLLM-shaped server cheap enough that a load generator, not it, is what saturates.

Raw asyncio HTTP/1.1 with keep-alive, one event loop: `/v1/completions` streams SSE chunks as
vLLM 0.26 does (one chunk a token, a usage chunk, `[DONE]`), each answer built once per
`max_tokens` and written whole unless `itl_s` spaces the tokens; `/v1/models`, `/tokenize`
(one token a word, plus one) and `/metrics` (a real Proxima page at rest, its finished count
following the completions served, so bench's counters settle at once). It records every
prompt it is sent, for tests that count requests. Not for misbehaviour: `standin_servers.py`.

Run alone (scripts/bench_client.py does): `python -m tests.fast_standin --port 8011 [--itl-ms 1]`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import threading
from collections import Counter
from typing import Self

from tests.standin_servers import MODEL, metrics_page, sse, token_chunk

MAX_HEADER_BYTES = 64 << 10


class FastStandIn:
    def __init__(self, itl_s: float = 0.0, record: bool = True) -> None:
        self.itl_s, self.record = itl_s, record
        self.prompts: Counter[str] = Counter()
        self.num_served = 0
        self._bodies: dict[int, bytes] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._server: asyncio.Server | None = None
        self.port = 0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def start(self, port: int = 0) -> None:
        self._server = await asyncio.start_server(self._connection, "127.0.0.1", port, backlog=1024)
        self.port = self._server.sockets[0].getsockname()[1]

    # -- in a thread of a test process
    def __enter__(self) -> Self:
        ready = threading.Event()

        def serve() -> None:
            self._loop = asyncio.new_event_loop()
            self._loop.run_until_complete(self.start())
            ready.set()
            self._loop.run_forever()

        threading.Thread(target=serve, daemon=True).start()
        ready.wait(10)
        return self

    def __exit__(self, *exc) -> None:
        if self._loop is not None and self._server is not None:
            self._loop.call_soon_threadsafe(self._server.close)
            self._loop.call_soon_threadsafe(self._loop.stop)

    # -- HTTP
    async def _connection(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                if len(head) > MAX_HEADER_BYTES:
                    return
                lines = head.decode("latin-1").split("\r\n")
                method, path, _ = lines[0].split(" ", 2)
                fields = (ln.partition(":") for ln in lines[1:] if ln)
                headers = {k.strip().lower(): v.strip() for k, _, v in fields}
                body = await reader.readexactly(int(headers.get("content-length", 0)))
                await self._answer(method, path.split("?")[0], body, writer)
        except (asyncio.IncompleteReadError, ConnectionError, ValueError, asyncio.LimitOverrunError):
            pass
        finally:
            writer.close()

    async def _answer(self, method: str, path: str, body: bytes, writer: asyncio.StreamWriter) -> None:
        request = json.loads(body) if body else {}
        if path == "/v1/completions" and method == "POST":
            await self._completion(request, writer)
        elif path == "/v1/models":
            _send(writer, 200, json.dumps({"object": "list", "data": [
                {"id": MODEL, "object": "model", "max_model_len": 4096}]}).encode())
        elif path == "/tokenize":
            count = 1 + len(str(request.get("prompt", "")).split())
            answer = {"count": count, "max_model_len": 4096, "tokens": [0] * count}
            _send(writer, 200, json.dumps(answer).encode())
        elif path == "/metrics":
            _send(writer, 200, metrics_page(self.num_served), "text/plain")
        else:
            _send(writer, 404, b"not found", "text/plain")
        await writer.drain()

    async def _completion(self, request: dict, writer: asyncio.StreamWriter) -> None:
        n = int(request.get("max_tokens") or 16)
        if self.record:
            self.prompts[request.get("prompt", "")] += 1
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
                     b"Transfer-Encoding: chunked\r\n\r\n")
        if self.itl_s:
            for k in range(n):
                await asyncio.sleep(self.itl_s)
                _chunk(writer, sse(token_chunk(finish="length" if k == n - 1 else None)))
                await writer.drain()
            _chunk(writer, self._tail(n))
        else:
            _chunk(writer, self._body(n))
        writer.write(b"0\r\n\r\n")
        self.num_served += 1

    def _body(self, n: int) -> bytes:
        if n not in self._bodies:
            tokens = sse(*(token_chunk(finish="length" if k == n - 1 else None) for k in range(n)))
            self._bodies[n] = tokens + self._tail(n)
        return self._bodies[n]

    @staticmethod
    def _tail(n: int) -> bytes:
        usage = {"id": "cmpl-1", "choices": [], "usage": {"prompt_tokens": 5, "completion_tokens": n,
                                                          "total_tokens": 5 + n}}
        return sse(usage, b"[DONE]")


def _send(writer: asyncio.StreamWriter, status: int, body: bytes, content_type: str = "application/json",
          ) -> None:
    head = f"HTTP/1.1 {status} X\r\nContent-Type: {content_type}\r\nContent-Length: {len(body)}\r\n\r\n"
    writer.write(head.encode() + body)


def _chunk(writer: asyncio.StreamWriter, data: bytes) -> None:
    writer.write(b"%x\r\n%s\r\n" % (len(data), data))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--itl-ms", type=float, default=0.0, help="spacing of the tokens of one answer")
    args = parser.parse_args()

    async def serve() -> None:
        server = FastStandIn(args.itl_ms / 1e3, record=False)
        await server.start(args.port)
        print(server.url, flush=True)
        await asyncio.Event().wait()

    asyncio.run(serve())


if __name__ == "__main__":
    main()
