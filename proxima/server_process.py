"""Start, health-check and stop a vLLM OpenAI-compatible server as a child process.

Used by `proxima demo`, `proxima bench --launch` and the integration tests, so there is one way
to bring up a server for each engine variant:
  token  `proxima serve` with Proxima's slot allocator
  block  `proxima serve --proxima-allocator block` (stock allocation, Proxima telemetry)
  stock  plain vLLM (`python -m vllm.entrypoints.openai.api_server`), no Proxima at all
Stopping sends SIGTERM to the whole process group, then SIGKILL: no orphaned engine processes.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from proxima.files import open_append

VARIANTS = ("token", "block", "stock")


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
    def __init__(self, spec: ServerSpec) -> None:
        if spec.port == 0:
            spec.port = free_port()
        self.spec = spec
        self.url = f"http://{spec.host}:{spec.port}"
        self._proc: subprocess.Popen | None = None
        self._log = None

    def start(self, timeout: float = 300.0) -> ManagedServer:
        """Spawn the server and wait until it answers /health."""
        return self.spawn().wait_ready(timeout)

    def spawn(self) -> ManagedServer:
        """Start the process without waiting (several servers can then start side by side)."""
        log_path = self.spec.log_path or Path(os.devnull)
        self._log = open_append(log_path)
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
                raise ServerStartError(
                    f"{self.spec.variant} server exited with code {self._proc.returncode}\n{self.log_tail()}"
                )
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return self
            time.sleep(0.5)
        self.stop()
        raise ServerStartError(f"{self.spec.variant} server not healthy after {timeout:.0f}s\n"
                               f"{self.log_tail()}")

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
        if self._log is not None:
            self._log.close()
            self._log = None

    def __enter__(self) -> ManagedServer:
        return self.start() if self._proc is None else self

    def __exit__(self, *exc) -> None:
        self.stop()
