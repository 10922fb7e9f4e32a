"""`ManagedServer` against a real vLLM start: a port taken between its choice and vLLM's bind.

`free_port()` binds port 0 and lets it go; vLLM binds the port seconds later. Holding the chosen
port open before the start makes that race happen every time instead of once in a while."""

from __future__ import annotations

import socket

import httpx
import pytest

from proxima.serve_checks import bind_error
from proxima.server_process import ManagedServer, ServerSpec, ServerStartError
from tests.conftest import SERVER_ARGS


def _hold(port: int) -> socket.socket:
    holder = socket.socket()
    holder.bind(("127.0.0.1", port))
    holder.listen()
    return holder


def test_a_named_port_in_use_is_refused_before_anything_starts(tmp_path):
    with _hold(0) as holder:
        spec = ServerSpec(model=str(tmp_path), variant="stock", port=holder.getsockname()[1],
                          log_path=tmp_path / "server.log")
        with pytest.raises(ServerStartError, match=f"127.0.0.1:{spec.port} is in use"):
            ManagedServer(spec).spawn()
    assert not spec.log_path.exists()  # nothing was started


def test_a_port_in_time_wait_is_not_in_use_as_vllms_bind_sees_it():
    """vLLM binds with SO_REUSEADDR, which takes a port a closed connection left in TIME_WAIT (a
    server stopped a moment ago): the check must not refuse what vLLM would take."""
    with socket.socket() as listener:  # as vLLM's server listens: with SO_REUSEADDR (Linux wants it on both)
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        port = listener.getsockname()[1]
        with socket.create_connection(("127.0.0.1", port)) as client:
            accepted, _ = listener.accept()
            accepted.close()  # the server's side closes first: its port goes to TIME_WAIT
            client.recv(1)
    with socket.socket() as plain, pytest.raises(OSError):
        plain.bind(("127.0.0.1", port))  # without SO_REUSEADDR the port is still taken
    assert bind_error("127.0.0.1", port) is None


def test_a_named_address_that_is_not_taken_is_left_to_vllm(tmp_path):
    """Only a taken port is refused before the start: other bind errors (here an address on no
    interface, TEST-NET-1) are vLLM's to report, with its own words."""
    spec = ServerSpec(model=str(tmp_path), variant="stock", host="192.0.2.123", port=8000)
    assert bind_error(spec.host, spec.port) is not None
    assert ManagedServer(spec)._port_can_be_had()


@pytest.mark.engine
def test_a_port_taken_before_the_bind_is_started_again_elsewhere_but_a_named_one_is_not(
        tiny_model, server_logs):
    # A port the caller named, free at the check and taken before vLLM binds it: no second start,
    # the error says why.
    named = ServerSpec(model=tiny_model, variant="stock", args=SERVER_ARGS,
                      log_path=server_logs / "port-named.log")
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        named.port = probe.getsockname()[1]
    server = ManagedServer(named).spawn()  # vLLM binds after seconds of imports
    with _hold(named.port):
        with pytest.raises(ServerStartError, match="Address already in use"):
            server.wait_ready(timeout=300)
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
    # proxima serve refuses a missing model before it imports vLLM: a start that fails in a second.
    spec = ServerSpec(model=str(tmp_path / "no-such-model"), variant="token")
    server = ManagedServer(spec)
    with pytest.raises(ServerStartError) as err:
        server.start(timeout=120)
    log = spec.log_path
    assert log is not None and log.exists() and "no-such-model': no such file" in str(err.value)
    server.stop()
    assert not log.exists() and spec.log_path is None
