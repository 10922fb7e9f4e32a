"""Tenant isolation of the prefix cache without client changes: a cache salt the server derives.

Layer: vLLM's API server process (an ASGI middleware `proxima serve` installs with vLLM's own
`--middleware` flag); no engine code, no vLLM import. vLLM keeps one prefix cache per
`cache_salt` (and Proxima one radix tree per salt), so two requests with different salts never
share KV and neither can learn from hit figures or timing what the other cached. Clients rarely
send a salt; this middleware sets one on every JSON request body under vLLM's API prefixes,
derived from who is asking:

  api-key        the bearer token of the request (one tenant per `--api-key` key)
  header:NAME    the value of header NAME, set by a gateway the operator trusts (a request without
                 it is refused with 400: failing open would put it in everybody's cache)

The derived salt is an HMAC of the tenant under a secret `proxima serve` draws at start-up and
hands every API-server process (PROXIMA_TENANT_SECRET), so it never reveals the key in logs and
no client can forge another tenant's salt. A salt the client sent is kept, after the tenant's:
requests of one tenant still separate themselves as they choose. Requests of one tenant share
token-exactly, as before.

Bodies are read whole (vLLM reads them whole too) up to MAX_BODY_BYTES; larger ones get 413.
A POST under the prefixes that is not a JSON object gets 400 here rather than reaching vLLM
unsalted. Bodies that are not JSON (multipart uploads, e.g. audio transcription) pass through
unchanged: their endpoints serve encoder-decoder models, which Proxima's allocator refuses.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import secrets
from dataclasses import dataclass

MODE_ENV = "PROXIMA_TENANT_SALT"
SECRET_ENV = "PROXIMA_TENANT_SECRET"
MIDDLEWARE = "proxima.tenancy.TenantCacheSalt"
# The prefixes vLLM guards with --api-key: every generation endpoint lives under one of them.
API_PREFIXES = ("/v1", "/v2", "/inference")
MAX_BODY_BYTES = 64 << 20


class TenancyConfigError(ValueError):
    """A tenant-salt setting that cannot work; the message names the fix."""


@dataclass(frozen=True, slots=True)
class TenantSource:
    mode: str  # "api-key" or "header"
    header: str = ""  # lower-case header name, for mode "header"

    @classmethod
    def parse(cls, value: str) -> TenantSource:
        value = value.strip()
        if value == "api-key":
            return cls("api-key")
        if value.startswith("header:") and value[len("header:"):].strip():
            return cls("header", value[len("header:"):].strip().lower())
        raise TenancyConfigError(
            f"--proxima-tenant-salt {value!r}: use api-key (one tenant per --api-key key) or "
            "header:NAME (the tenant in header NAME, set by your gateway)"
        )

    def tenant(self, headers: dict[bytes, bytes]) -> bytes | None:
        """Who asks, or None when the request does not say (mode header only)."""
        if self.mode == "api-key":
            scheme, _, token = headers.get(b"authorization", b"").partition(b" ")
            return token.strip() if scheme.lower() == b"bearer" else b""
        return headers.get(self.header.encode("latin-1"))


def derive_salt(secret: bytes, tenant: bytes, client_salt: str | None) -> str:
    digest = hmac.new(secret, tenant, hashlib.sha256).hexdigest()[:32]
    return f"tenant-{digest}" + (f"|{client_salt}" if client_salt else "")


def new_secret() -> str:
    return secrets.token_hex(32)


class TenantCacheSalt:
    """Pure ASGI middleware (vLLM's `--middleware` adds classes with `app.add_middleware`)."""

    def __init__(self, app) -> None:
        self.app = app
        self.source = TenantSource.parse(os.environ.get(MODE_ENV, ""))
        secret = os.environ.get(SECRET_ENV, "")
        if not secret:
            raise TenancyConfigError(f"{SECRET_ENV} is not set; start the server with proxima serve")
        self.secret = secret.encode()

    async def __call__(self, scope, receive, send) -> None:
        if (scope["type"] != "http" or scope.get("method") != "POST"
                or not scope["path"].removeprefix(scope.get("root_path", "")).startswith(API_PREFIXES)):
            await self.app(scope, receive, send)
            return
        headers = dict(scope.get("headers") or ())
        content_type = headers.get(b"content-type", b"application/json").split(b";")[0].strip().lower()
        if content_type not in (b"application/json", b""):
            await self.app(scope, receive, send)
            return
        tenant = self.source.tenant(headers)
        if tenant is None:
            await _reply(send, 400, f"this server isolates tenants by the {self.source.header!r} header, "
                                    "which the request does not carry")
            return
        body, tail = await _read_body(receive)
        if body is None:
            await _reply(send, 413, f"request body larger than {MAX_BODY_BYTES} bytes")
            return
        try:
            request = json.loads(body)
        except (ValueError, RecursionError):
            request = None
        if not isinstance(request, dict):
            await _reply(send, 400, "the request body is not a JSON object")
            return
        client_salt = request.get("cache_salt")
        if client_salt is not None and (not isinstance(client_salt, str) or not client_salt):
            await _reply(send, 400, "cache_salt must be a non-empty string when given")
            return
        request["cache_salt"] = derive_salt(self.secret, tenant, client_salt)
        salted = json.dumps(request).encode()
        scope = dict(scope)
        scope["headers"] = [(k, v) for k, v in scope.get("headers", ()) if k != b"content-length"]
        scope["headers"].append((b"content-length", str(len(salted)).encode()))
        await self.app(scope, _replay(salted, tail, receive), send)


async def _read_body(receive) -> tuple[bytes | None, list[dict]]:
    """The whole body (None past the limit), and any non-body message read meanwhile."""
    chunks, size = [], 0
    while True:
        message = await receive()
        if message["type"] != "http.request":
            return b"".join(chunks), [message]
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > MAX_BODY_BYTES:
            return None, []
        chunks.append(chunk)
        if not message.get("more_body", False):
            return b"".join(chunks), []


def _replay(body: bytes, tail: list[dict], receive):
    sent = False

    async def replayed():
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        if tail:
            return tail.pop(0)
        return await receive()
    return replayed


async def _reply(send, status: int, message: str) -> None:
    payload = json.dumps({"error": {"message": message, "type": "BadRequestError", "code": status}}).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"),
                            (b"content-length", str(len(payload)).encode())]})
    await send({"type": "http.response.body", "body": payload})
