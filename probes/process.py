"""The server's processes on this machine, when the URL points here: their resident memory.

Layer: local collector. Under `proxima serve` the server's `/metrics` runs in Prometheus
multiprocess mode, which does not export process memory, and the engine core is a child process
anyway; so the doctor reads the memory of the process listening on the URL's port plus all its
children. Never raises: a remote server, a process of another user or no psutil yields None.
"""

from __future__ import annotations

import ipaddress
import logging
import socket
from urllib.parse import urlsplit

logger = logging.getLogger(__name__)


def _is_local(host: str) -> bool:
    if host in ("localhost", ""):
        return True
    try:
        return ipaddress.ip_address(host).is_loopback or host in _own_addresses()
    except ValueError:
        return False


def _own_addresses() -> set[str]:
    try:
        return {info[4][0] for info in socket.getaddrinfo(socket.gethostname(), None)}
    except OSError:
        return set()


def find_server_pid(url: str) -> int | None:
    """PID of the local process listening on the URL's port (None if remote or not visible)."""
    parts = urlsplit(url)
    port = parts.port or (443 if parts.scheme == "https" else 80)
    if not _is_local(parts.hostname or ""):
        return None
    try:
        import psutil  # a vLLM dependency, so present wherever the server runs on this machine
    except ImportError:
        return None
    try:
        for conn in psutil.net_connections(kind="tcp"):
            if conn.status == psutil.CONN_LISTEN and conn.laddr and conn.laddr.port == port and conn.pid:
                return int(conn.pid)
    except (psutil.Error, OSError) as err:  # access denied: no local memory readings, by design
        logger.debug("cannot find the server process for %s: %s", url, err)
    return None


def process_tree_rss(pid: int | None) -> int | None:
    """Resident memory of `pid` and all its descendants, in bytes."""
    if pid is None:
        return None
    try:
        import psutil
    except ImportError:
        return None
    try:
        root = psutil.Process(pid)
        procs = [root, *root.children(recursive=True)]
    except (psutil.Error, OSError) as err:  # the process ended or is not ours
        logger.debug("cannot read memory of pid %s: %s", pid, err)
        return None
    total = 0
    for proc in procs:
        try:
            total += proc.memory_info().rss
        except (psutil.Error, OSError):  # a child that exited between listing and reading
            continue
    return total
