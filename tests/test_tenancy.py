"""The tenant cache-salt middleware on its own: a stand-in app records what vLLM would receive."""

from __future__ import annotations

import asyncio
import json

import pytest

from proxima import tenancy
from proxima.engine.settings import ProximaConfigError
from proxima.serve_command import build_serve_command


class Recorder:
    """An ASGI app that reads the body the middleware hands on and answers 200."""

    def __init__(self) -> None:
        self.bodies: list[bytes] = []
        self.headers: list[dict] = []

    async def __call__(self, scope, receive, send) -> None:
        body = b""
        while True:
            message = await receive()
            body += message.get("body", b"")
            if not message.get("more_body"):
                break
        self.bodies.append(body)
        self.headers.append(dict(scope["headers"]))
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"ok"})


def call(app, body: bytes, headers: dict[bytes, bytes], path: str = "/v1/completions",
         method: str = "POST", chunks: int = 1) -> tuple[int, bytes]:
    step = max(1, len(body) // chunks)
    parts = [body[i:i + step] for i in range(0, len(body), step)] or [b""]
    messages = [{"type": "http.request", "body": p, "more_body": i < len(parts) - 1}
                for i, p in enumerate(parts)]
    sent = []

    async def receive():
        return messages.pop(0) if messages else {"type": "http.disconnect"}

    async def send(message):
        sent.append(message)

    scope = {"type": "http", "method": method, "path": path, "headers": list(headers.items())}
    asyncio.run(app(scope, receive, send))
    return sent[0]["status"], b"".join(m.get("body", b"") for m in sent[1:])


@pytest.fixture
def app(monkeypatch):
    def make(mode: str):
        monkeypatch.setenv(tenancy.MODE_ENV, mode)
        monkeypatch.setenv(tenancy.SECRET_ENV, "s" * 64)
        inner = Recorder()
        return tenancy.TenantCacheSalt(inner), inner
    return make


def salt_of(inner: Recorder, k: int = -1) -> str:
    return json.loads(inner.bodies[k])["cache_salt"]


def test_each_api_key_gets_its_own_salt_and_a_client_salt_stays_behind_it(app):
    mw, inner = app("api-key")
    body = json.dumps({"model": "m", "prompt": "hi"}).encode()
    a, b = {b"authorization": b"Bearer key-of-a"}, {b"authorization": b"Bearer key-of-b"}
    for key in (a, a, b):
        assert call(mw, body, key, chunks=3)[0] == 200
    assert salt_of(inner, 0) == salt_of(inner, 1) != salt_of(inner, 2)
    assert "key-of-a" not in inner.bodies[0].decode()  # the key itself never travels on
    call(mw, json.dumps({"prompt": "hi", "cache_salt": salt_of(inner, 2)}).encode(), a)
    assert salt_of(inner) != salt_of(inner, 2)  # a cannot join b's cache by sending b's salt
    assert salt_of(inner).startswith(salt_of(inner, 0) + "|")
    assert inner.headers[-1][b"content-length"] == str(len(inner.bodies[-1])).encode()


def test_header_mode_refuses_a_request_without_the_header(app):
    mw, inner = app("header:X-Tenant")
    body = json.dumps({"prompt": "hi"}).encode()
    status, answer = call(mw, body, {})
    assert status == 400 and b"x-tenant" in answer and inner.bodies == []
    assert call(mw, body, {b"x-tenant": b"acme"})[0] == 200
    assert call(mw, body, {b"x-tenant": b"globex"})[0] == 200
    assert salt_of(inner, 0) != salt_of(inner, 1)


@pytest.mark.parametrize("body, status", [
    (b"not json", 400), (b"[1, 2]", 400), (b'{"prompt": "x", "cache_salt": 5}', 400),
    (b'{"prompt": "x", "cache_salt": ""}', 400),
])
def test_bodies_that_cannot_be_salted_never_reach_the_engine(app, body, status):
    mw, inner = app("api-key")
    assert call(mw, body, {b"authorization": b"Bearer a"})[0] == status
    assert inner.bodies == []


def test_an_oversized_body_is_refused_and_other_paths_pass_untouched(app, monkeypatch):
    mw, inner = app("api-key")
    monkeypatch.setattr(tenancy, "MAX_BODY_BYTES", 10)
    assert call(mw, b'{"prompt": "far too long"}', {}, chunks=4)[0] == 413
    body = b'{"text": "hi"}'
    assert call(mw, body, {}, path="/tokenize")[0] == 200 and inner.bodies[-1] == body
    assert call(mw, b"", {}, path="/v1/models", method="GET")[0] == 200


def test_proxima_serve_wires_the_middleware_and_refuses_api_key_mode_without_keys():
    cmd = build_serve_command("m", "token", ["--api-key", "a", "b"], cuda=False, available_bytes=8 << 30,
                              tenant_salt="api-key")
    assert tenancy.MIDDLEWARE in cmd.argv and len(cmd.env[tenancy.SECRET_ENV]) == 64
    with pytest.raises(ProximaConfigError, match="needs --api-key"):
        build_serve_command("m", "token", [], cuda=False, available_bytes=8 << 30, tenant_salt="api-key")
    with pytest.raises(ProximaConfigError, match="header:NAME"):
        build_serve_command("m", "token", [], cuda=False, available_bytes=8 << 30, tenant_salt="cookie")
