"""`ManagedServer` against a real vLLM start: a port taken between its choice and vLLM's bind.

`free_port()` binds port 0 and lets it go; vLLM binds the port seconds later. Holding the chosen
port open before the start makes that race happen every time instead of once in a while."""

from __future__ import annotations

import socket

import httpx
import pytest

from proxima.server_process import ManagedServer, ServerSpec, ServerStartError
from tests.conftest import SERVER_ARGS


def _hold(port: int) -> socket.socket:
    holder = socket.socket()
    holder.bind(("127.0.0.1", port))
    holder.listen()
    return holder


@pytest.mark.engine
def test_a_port_taken_before_the_bind_is_started_again_elsewhere_but_a_named_one_is_not(
        tiny_model, server_logs):
    # A port the caller named, held by someone else: no second start, the error says why.
    named = ServerSpec(model=tiny_model, variant="stock", args=SERVER_ARGS,
                      log_path=server_logs / "port-named.log")
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        named.port = probe.getsockname()[1]
    with _hold(named.port):
        server = ManagedServer(named)
        with pytest.raises(ServerStartError, match="Address already in use"):
            server.start(timeout=300)
        server.stop()
    assert "starting again" not in named.log_path.read_text()

    # A port ManagedServer chose, taken before vLLM bound it: one more start, on a fresh port.
    spec = ServerSpec(model=tiny_model, variant="stock", args=SERVER_ARGS,
                      log_path=server_logs / "port-race.log")
    server = ManagedServer(spec)
    taken = spec.port
    with _hold(taken):
        server.start(timeout=600)
    try:
        assert spec.port != taken and server.url.endswith(f":{spec.port}")
        assert httpx.get(server.url + "/health", timeout=10).status_code == 200
        log = spec.log_path.read_text()
        assert log.count(f"starting again on port {spec.port}") == 1
        assert "Address already in use" in log.split("starting again")[0]
    finally:
        server.stop()
    assert not server.alive()


def test_a_server_without_a_named_log_keeps_its_lines_until_stopped(tmp_path):
    """The lines a start wrote are what tells a port race; with no log named, a temporary one holds
    them, and stop() removes it."""
    spec = ServerSpec(model=str(tmp_path / "no-such-model"), variant="stock", args=("--port-typo",))
    server = ManagedServer(spec)
    with pytest.raises(ServerStartError) as err:
        server.start(timeout=120)
    log = spec.log_path
    assert log is not None and log.exists() and "--port-typo" in str(err.value)
    server.stop()
    assert not log.exists() and spec.log_path is None
