"""The one rule for "is this URL's server on this machine", and the bind-address rule under it."""

from __future__ import annotations

import socket

import pytest

from proxima.hosts import find_server_pid, is_loopback, is_this_host


@pytest.mark.parametrize("url", [
    "http://127.0.0.1:8000", "http://127.0.0.2:8000", "http://localhost:8000", "http://LOCALHOST",
    "http://localhost.localdomain:1", "http://[::1]:8000", "http://0.0.0.0:8000", "http://[::]:8000",
    "http://:8000", f"http://{socket.gethostname()}:8000",
])
def test_urls_on_this_host(url):
    assert is_this_host(url)


@pytest.mark.parametrize("url", ["http://example.org:8000", "http://192.0.2.1:8000", "http://[::1"])
def test_urls_elsewhere_or_unreadable(url):
    assert not is_this_host(url)


def test_a_bind_address_is_private_only_on_loopback():
    assert all(is_loopback(h) for h in ("127.0.0.1", "localhost", "::1", "[::1]", "ip6-localhost"))
    assert not any(is_loopback(h) for h in ("0.0.0.0", "::", "", "example.org", socket.gethostname()))


def test_no_process_is_looked_up_for_a_remote_server():
    assert find_server_pid("http://192.0.2.1:8000") is None
