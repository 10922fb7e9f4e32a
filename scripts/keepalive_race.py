"""The keep-alive race behind the soak's rare client errors: a request sent on a pooled connection
in the instant the server closes it for idleness fails with ReadError or RemoteProtocolError.

vLLM's server closes connections idle for 5 s (VLLM_HTTP_TIMEOUT_KEEP_ALIVE) and httpx keeps them
5 s by default. This runs uvicorn (vLLM's server) with a short keep-alive, sends bursts of
requests after idle gaps just under it, and counts failures with the client's keep-alive expiry
equal to the server's, then at the ratio Proxima's clients use (proxima.fetch.KEEPALIVE_EXPIRY_S
against vLLM's VLLM_HTTP_TIMEOUT_KEEP_ALIVE).

  python scripts/keepalive_race.py --trials 150
"""

from __future__ import annotations

import argparse
import asyncio
import random
import threading
import time

import httpx
import uvicorn
from vllm import envs

from proxima.fetch import KEEPALIVE_EXPIRY_S
from proxima.server_process import free_port


async def _app(scope, receive, send) -> None:
    if scope["type"] != "http":
        return
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/plain")]})
    await send({"type": "http.response.body", "body": b"ok"})


async def _trials(url: str, expiry: float, keep_alive: float, trials: int, streams: int) -> dict[str, int]:
    failures: dict[str, int] = {}
    async with httpx.AsyncClient(limits=httpx.Limits(keepalive_expiry=expiry)) as http:
        for _ in range(trials):
            await asyncio.sleep(keep_alive + random.uniform(-0.01, 0.005))  # idle right at the edge
            results = await asyncio.gather(*(http.get(url) for _ in range(streams)), return_exceptions=True)
            for r in results:
                if isinstance(r, Exception):
                    failures[type(r).__name__] = failures.get(type(r).__name__, 0) + 1
    return failures


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--trials", type=int, default=150)
    p.add_argument("--streams", type=int, default=16, help="requests per burst (pooled connections)")
    p.add_argument("--keep-alive", type=float, default=1.0, help="the server's keep-alive, seconds")
    args = p.parse_args()
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(_app, port=port, timeout_keep_alive=args.keep_alive,
                                           log_level="error"))
    threading.Thread(target=server.run, daemon=True).start()
    while not server.started:
        time.sleep(0.05)
    url = f"http://127.0.0.1:{port}/"
    ratio = KEEPALIVE_EXPIRY_S / envs.VLLM_HTTP_TIMEOUT_KEEP_ALIVE
    for name, expiry in (("httpx default (equal to the server's)", args.keep_alive),
                         (f"Proxima's ratio ({ratio:.2f} of the server's)", args.keep_alive * ratio)):
        random.seed(0)
        failures = asyncio.run(_trials(url, expiry, args.keep_alive, args.trials, args.streams))
        total = args.trials * args.streams
        print(f"client expiry {expiry:.2f} s, server keep-alive {args.keep_alive:.2f} s, {name}: "
              f"{sum(failures.values())} of {total} requests failed {failures or ''}", flush=True)
    server.should_exit = True


if __name__ == "__main__":
    main()
