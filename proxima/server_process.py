"""Start, health-check and stop a vLLM OpenAI-compatible server as a child process.

Used by `proxima demo`, `proxima bench --launch` and the integration tests, so there is one way
to bring up a server for each engine variant:
  token  `proxima serve` with Proxima's slot allocator
  block  `proxima serve --proxima-allocator block` (stock allocation, Proxima telemetry)
  stock  plain vLLM (`python -m vllm.entrypoints.openai.api_server`), no Proxima at all
Stopping sends SIGTERM to the whole process group, then SIGKILL: no orphaned engine processes.

A port is chosen by binding port 0 and letting it go; vLLM binds it (and, with data parallelism,
ports of its own chosen the same way) seconds later, and another process can take it in between.
A start that dies of that (EADDRINUSE in the lines it wrote to its log) is started once more, on a
fresh port when this module chose the first.
"""

from __future__ import annotations

import contextlib
import errno
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from proxima.files import open_append
from proxima.serve_checks import bind_error

VARIANTS = ("token", "block", "stock")
ADDRESS_IN_USE = ("EADDRINUSE", "Address already in use")


class ServerStartError(RuntimeError):
    """The server exited or did not become healthy; the message carries the log's tail."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass(slots=True)
class ServerSpec:
    model: str
    variant: str = "token"
    port: int = 0
    host: str = "127.0.0.1"
    args: tuple[str, ...] = ()
    env: dict[str, str] = field(default_factory=dict)
    log_path: Path | None = None

    def command(self) -> list[str]:
        if self.variant not in VARIANTS:
            raise ValueError(f"unknown server variant {self.variant!r}; use one of {', '.join(VARIANTS)}")
        common = ["--host", self.host, "--port", str(self.port), *self.args]
        if self.variant == "stock":
            return [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", self.model,
                    *common]
        return [sys.executable, "-m", "proxima.cli.main", "serve", self.model,
                "--proxima-allocator", self.variant, *common]


class ManagedServer:
    def __init__(self, spec: ServerSpec, address_retries: int = 1) -> None:
        self._own_port = spec.port == 0
        if self._own_port:
            spec.port = free_port()
        self.spec = spec
        self.url = f"http://{spec.host}:{spec.port}"
        self._proc: subprocess.Popen | None = None
        self._log = None
        self._own_log: Path | None = None  # a temporary log when the spec names none, removed at stop
        self._log_start = 0  # where this start's lines begin in the log
        self._address_retries = address_retries

    def start(self, timeout: float = 300.0) -> ManagedServer:
        """Spawn the server and wait until it answers /health."""
        return self.spawn().wait_ready(timeout)

    def spawn(self) -> ManagedServer:
        """Start the process without waiting (several servers can then start side by side).

        A port the caller named that something holds now is refused here, before the seconds
        vLLM's imports take to find it out."""
        if not self._port_can_be_had():
            raise ServerStartError(f"{self.spec.host}:{self.spec.port} is in use (Address already in use): "
                                   "choose a free port (--port) or stop what holds it")
        if self.spec.log_path is None:  # the start's own lines are what tells a port race
            fd, name = tempfile.mkstemp(prefix=f"proxima-{self.spec.variant}-server-", suffix=".log")
            os.close(fd)
            self._own_log = self.spec.log_path = Path(name)
        self._log = open_append(self.spec.log_path)
        self._log_start = self._log.seek(0, os.SEEK_END)
        env = {**os.environ, **self.spec.env}
        env.pop("PROMETHEUS_MULTIPROC_DIR", None)  # each server gets its own (proxima serve makes it)
        self._proc = subprocess.Popen(
            self.spec.command(), stdout=self._log, stderr=subprocess.STDOUT, env=env,
            start_new_session=True,
        )
        return self

    def wait_ready(self, timeout: float = 300.0) -> ManagedServer:
        assert self._proc is not None, "spawn() first"
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                if self._address_retries > 0 and self._lost_a_port_race() and self._port_can_be_had():
                    self._start_again()
                    deadline = time.monotonic() + timeout
                    continue
                raise ServerStartError(
                    f"{self.spec.variant} server exited with code {self._proc.returncode}\n{self.log_tail()}"
                )
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return self
            time.sleep(0.5)
        tail = self.log_tail()  # before stop() removes a temporary log
        self.stop()
        raise ServerStartError(f"{self.spec.variant} server not healthy after {timeout:.0f}s\n{tail}")

    def _lost_a_port_race(self) -> bool:
        with open(self.spec.log_path, "rb") as log:
            log.seek(self._log_start)
            lines = log.read().decode(errors="replace")
        return any(mark in lines for mark in ADDRESS_IN_USE)

    def _port_can_be_had(self) -> bool:
        """A port the caller named that something holds now will not be free on a second start
        (any other bind error is vLLM's to report)."""
        if self._own_port:
            return True
        err = bind_error(self.spec.host, self.spec.port)
        return err is None or err.errno != errno.EADDRINUSE

    def _start_again(self) -> None:
        self._address_retries -= 1
        old_port = self.spec.port
        if self._own_port:
            self.spec.port = free_port()
            self.url = f"http://{self.spec.host}:{self.spec.port}"
        self._log.write(f"proxima: the start on port {old_port} found an address in use (a port chosen "
                        f"free was taken before it was bound); starting again on port {self.spec.port}\n"
                        .encode())
        self._close_log()
        with contextlib.suppress(ProcessLookupError):  # children the dead server left, if any
            os.killpg(self._proc.pid, signal.SIGKILL)
        self.spawn()

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc else None

    def alive(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def log_tail(self, lines: int = 40) -> str:
        if self.spec.log_path is None or not self.spec.log_path.exists():
            return "(no log file)"
        return "\n".join(self.spec.log_path.read_text(errors="replace").splitlines()[-lines:])

    def stop(self, timeout: float = 30.0) -> None:
        proc, self._proc = self._proc, None
        if proc is not None and proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        self._close_log()
        if self._own_log is not None:
            self._own_log.unlink(missing_ok=True)
            self._own_log = self.spec.log_path = None

    def _close_log(self) -> None:
        if self._log is not None:
            self._log.close()
            self._log = None

    def __enter__(self) -> ManagedServer:
        return self.start() if self._proc is None else self

    def __exit__(self, *exc) -> None:
        self.stop()
