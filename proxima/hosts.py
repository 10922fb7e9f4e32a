"""Where a server runs: the one rule for whether a URL is on this host, and, for one that is, the
process serving it and that process tree's memory.

Layer: local collectors, for `top`, `doctor`, `bench` and `proxima serve`. NVML, psutil and the
process table see this machine only, so a tool reads them for a server only when
`is_this_host(url)`: a remote server's GPUs and processes are not these. `is_loopback` is the
narrower question `proxima serve` asks of a bind address (does it answer this machine only?),
and the first half of the rule.

Never raises: a name that does not resolve, a process of another user or no psutil is "not
here" or None.
"""

from __future__ import annotations

import functools
import ipaddress
import logging
import socket
from urllib.parse import urlsplit

logger = logging.getLogger(__name__)

LOOPBACK_NAMES = frozenset({"localhost", "localhost.localdomain", "ip6-localhost"})


def is_loopback(host: str) -> bool:
    """True for a loopback name or address: a server bound there answers this machine only."""
    host = host.strip("[]").lower()
    if host in LOOPBACK_NAMES:
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def is_this_host(url: str) -> bool:
    """True when `url`'s server runs on this machine: a loopback host, the unspecified address
    (0.0.0.0 or ::, which connect here), no host at all, or this machine's own name or address."""
    try:
        host = (urlsplit(url).hostname or "").lower()
    except ValueError:  # e.g. an unclosed IPv6 bracket: not a URL of any host
        return False
    if not host or is_loopback(host):
        return True
    try:
        if ipaddress.ip_address(host).is_unspecified:
            return True
    except ValueError:
        pass  # a name, not an address
    return host in _own_names_and_addresses()


@functools.cache
def _own_names_and_addresses() -> frozenset[str]:
    """This machine's host name, fully qualified name and the addresses that name resolves to
    (looked up once per process: a resolver can take seconds)."""
    names = {socket.gethostname().lower()}
    try:
        names.add(socket.getfqdn().lower())
        names.update(str(info[4][0]).lower() for info in socket.getaddrinfo(socket.gethostname(), None))
    except OSError as err:  # no resolver: the name alone identifies this host
        logger.debug("cannot resolve this host's addresses: %s", err)
    return frozenset(names)


def find_server_pid(url: str) -> int | None:
    """PID of the process on this host listening on the URL's port (None if remote or not visible)."""
    if not is_this_host(url):
        return None
    parts = urlsplit(url)
    port = parts.port or (443 if parts.scheme == "https" else 80)
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
    """Resident memory of `pid` and all its descendants, in bytes.

    Under `proxima serve` the server's `/metrics` runs in Prometheus multiprocess mode, which
    does not export process memory, and the engine core is a child process anyway: so the
    doctor reads the memory of the listening process plus all its children.
    """
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
