"""What `proxima serve` checks before anything imports vLLM: the model is there, the port is free,
and the KV dtype is one the chosen allocator's attention serves on this build of vLLM.

Layer: the `proxima serve` supervisor (no vLLM, no torch: these answer in milliseconds, where
vLLM would find the same mistakes after importing itself and loading the model, 29 s and 39 s
later on a CPU host). Each returns None or one line naming the problem and the fix.
"""

from __future__ import annotations

import errno
import re
import socket
from collections.abc import Sequence
from pathlib import Path

from proxima.engine.compat import PER_TOKEN_HEAD_KV_CACHE_DTYPES
from proxima.installed import cpu_build_of_vllm

# vLLM's default --port (vllm/entrypoints/openai/cli_args.py).
DEFAULT_PORT = 8000
# A Hugging Face repository id: `name` or `owner/name`, letters, digits, `-`, `_` and `.`.
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]{0,95}(/[\w.-]{1,96})?$")


def model_problem(model: str) -> str | None:
    """None when `model` is an existing path or could be a hub id; else why it cannot be served."""
    path = Path(model).expanduser()
    if path.exists():
        if path.is_dir() and not any((path / name).exists() for name in ("config.json", "params.json")):
            return (f"model directory {model} has no config.json; point at the directory that holds the "
                    "model's config.json and weights")
        return None
    looks_local = model.startswith(("/", ".", "~")) or model.count("/") > 1
    if looks_local or not _HUB_ID.match(model) or ".." in model:
        return (f"model {model!r}: no such file or directory (and not a Hugging Face model id such as "
                "meta-llama/Llama-3.1-8B-Instruct); check the path")
    return None


def has_flag(args: Sequence[str], flag: str) -> bool:
    """`flag` is in vLLM's argument list, as `--flag` or `--flag=V`."""
    return any(a == flag or a.startswith(flag + "=") for a in args)


def flag_value(args: Sequence[str], flag: str) -> str | None:
    """The value of `flag` in vLLM's argument list (`--flag V` or `--flag=V`), or None."""
    for k, a in enumerate(args):
        if a == flag and k + 1 < len(args):
            return args[k + 1]
        if a.startswith(flag + "="):
            return a.split("=", 1)[1]
    return None


def bind_error(host: str, port: int) -> OSError | None:
    """What vLLM's server would meet binding (host, port) now, or None: bound the way its
    `create_server_socket` binds (SO_REUSEADDR, so a port a stopped server left in TIME_WAIT is
    free; the host's address family), then closed."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    try:
        with socket.socket(family, socket.SOCK_STREAM) as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind((host, port))
    except OSError as err:
        return err
    return None


def port_problem(args: list[str]) -> str | None:
    """None when the address vLLM will listen on (its --host and --port) can be bound now; else
    one line (`bind_error`)."""
    if flag_value(args, "--uds") is not None:
        return None  # a Unix socket: no port
    host = flag_value(args, "--host") or ""
    text = flag_value(args, "--port")
    try:
        port = int(text) if text is not None else DEFAULT_PORT
    except ValueError:
        return None  # vLLM's own parser names a port that is not a number
    if not 0 <= port <= 65535:
        return f"--port {port} is not a port number (0-65535)"
    err = bind_error(host, port)
    if err is not None:
        where = f"{host}:{port}" if host else f"port {port} (every interface)"
        if err.errno == errno.EADDRINUSE:
            return f"{where} is already in use (another server?); stop it or pass --port PORT"
        if err.errno == errno.EACCES:
            return f"{where} needs privileges to listen on; pass --port 1024 or above"
        if err.errno in (errno.EADDRNOTAVAIL, errno.EAFNOSUPPORT) or isinstance(err, socket.gaierror):
            return f"--host {host}: not an address of this machine; pass --host 127.0.0.1 or 0.0.0.0"
        return f"cannot listen on {where}: {err.strerror or err}"
    return None


def kv_dtype_problem(args: Sequence[str], allocator: str) -> str | None:
    """None unless `args` ask for a per-token-head KV dtype that stock vLLM's attention, which the
    `block` and `stock` allocators run, cannot serve here; else one line. vLLM 0.26 serves these
    with TRITON_ATTN on a GPU only: its CPU backend fails at start with a tensor-shape error, while
    Proxima's token slots serve them on CPU through their torch path."""
    dtype = flag_value(args, "--kv-cache-dtype")
    if allocator not in ("block", "stock") or dtype not in PER_TOKEN_HEAD_KV_CACHE_DTYPES:
        return None
    if not cpu_build_of_vllm():
        return None
    return (f"--kv-cache-dtype {dtype}: vLLM's CPU backend does not serve it (it fails at start), so the "
            f"{allocator} allocator cannot run it on this CPU build of vLLM; use the token allocator, "
            "which serves it on CPU, or run this server on a GPU (stock serves it with TRITON_ATTN)")
