"""Engines in child processes: a fresh interpreter that runs the caller's functions.

Layer: tools. Why a child: vLLM fixes a process's attention registry with its first engine (see
engine.py), measurements want an interpreter no earlier run has warmed or fragmented, and the
engine's log should not mix with a benchmark's table. `EngineProcess` keeps one child for a
series of calls (the tests run every engine of one kind in one child: start-up, about a minute
on the loaded CI machine, is paid once); `run_isolated` is one call in a child of its own.

A call names a module-level function (of an importable module, or of a script run as __main__,
which the child loads by path, with the script's folder on sys.path as when it runs itself);
arguments and the result travel pickled. The child's environment is this one's without PROXIMA_*
(the engine's own come from its EngineSpec) and with `env` on top. Its output goes to a log
file, whose tail any failure carries.
"""

from __future__ import annotations

import contextlib
import importlib
import os
import pickle
import select
import struct
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

_HEADER = struct.Struct("<Q")
OVERRUN_GRACE_S = 10.0  # a child that overran a call: SIGTERM, then SIGKILL this much later


class EngineProcessError(RuntimeError):
    """The child failed the call, died or overran; the message carries its error and log tail."""


class EngineProcess:
    def __init__(self, env: Mapping[str, str] | None = None, log_path: Path | None = None,
                 name: str = "engine") -> None:
        self.name = name
        self._env = dict(env or {})
        self._own_log = log_path is None
        self.log_path = Path(log_path) if log_path else None
        self._proc: subprocess.Popen | None = None
        self._replies: int | None = None

    def start(self) -> EngineProcess:
        if self._proc is not None:
            return self
        if self.log_path is None:
            fd, path = tempfile.mkstemp(prefix=f"proxima-{self.name}-", suffix=".log")
            os.close(fd)
            self.log_path = Path(path)
        env = {k: v for k, v in os.environ.items() if not k.startswith("PROXIMA_")}
        env.update(self._env)
        read_end, write_end = os.pipe()
        with open(self.log_path, "ab") as log:
            self._proc = subprocess.Popen(
                [sys.executable, "-c", f"from proxima.harness.process import serve; serve({write_end})"],
                stdin=subprocess.PIPE, stdout=log, stderr=subprocess.STDOUT, env=env,
                pass_fds=(write_end,))
        os.close(write_end)
        self._replies = read_end
        return self

    def call(self, fn: Callable[..., Any], *args: Any, timeout: float | None = None, **kwargs: Any) -> Any:
        """fn(*args, **kwargs) in the child; its result, or EngineProcessError."""
        self.start()
        assert self._proc is not None and self._proc.stdin is not None
        request = pickle.dumps((_locate(fn), args, kwargs))
        try:
            self._proc.stdin.write(_HEADER.pack(len(request)) + request)
            self._proc.stdin.flush()
            ok, payload = pickle.loads(self._read_reply(timeout))
        except (BrokenPipeError, EOFError) as err:
            self.close()
            raise EngineProcessError(f"{self.name} process died during {fn.__name__} "
                                     f"({err or 'no reply'})\n{self.log_tail()}") from None
        if not ok:
            raise EngineProcessError(f"{fn.__name__} failed in the {self.name} process:\n{payload}"
                                     f"\nlog tail:\n{self.log_tail()}")
        return payload

    def _read_reply(self, timeout: float | None) -> bytes:
        header = self._read(_HEADER.size, timeout)
        return self._read(_HEADER.unpack(header)[0], timeout)

    def _read(self, n: int, timeout: float | None) -> bytes:
        deadline = None if timeout is None else time.monotonic() + timeout
        chunks, left = [], n
        while left:
            wait = None if deadline is None else max(0.0, deadline - time.monotonic())
            if not select.select([self._replies], [], [], wait)[0]:
                self.close(OVERRUN_GRACE_S, overran=True)
                raise EngineProcessError(f"{self.name} process: no reply within {timeout:.0f} s\n"
                                         f"{self.log_tail()}")
            chunk = os.read(self._replies, min(left, 1 << 20))
            if not chunk:
                raise EOFError
            chunks.append(chunk)
            left -= len(chunk)
        return b"".join(chunks)

    def log_tail(self, chars: int = 6000) -> str:
        if self.log_path is None or not self.log_path.exists():
            return "(no log)"
        return self.log_path.read_text(errors="replace")[-chars:]

    def close(self, timeout: float = 60.0, *, overran: bool = False) -> None:
        """Let the child finish (its engines shut down as it exits); kill it if it will not.

        A child that overran a call is still inside it and reads the closed stdin only when the
        call ends, which may be never (a hung engine): it is sent SIGTERM at once, then SIGKILL
        after `timeout`, instead of being waited for."""
        proc, self._proc = self._proc, None
        if proc is not None:
            with contextlib.suppress(BrokenPipeError, OSError):
                proc.stdin.close()
            if overran:
                proc.terminate()
            try:
                proc.wait(timeout)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        if self._replies is not None:
            os.close(self._replies)
            self._replies = None

    def remove_log(self) -> None:
        if self._own_log and self.log_path is not None:
            self.log_path.unlink(missing_ok=True)

    def __enter__(self) -> EngineProcess:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.close()
        if exc[0] is None:
            self.remove_log()


def run_isolated(fn: Callable[..., Any], *args: Any, env: Mapping[str, str] | None = None,
                 timeout: float | None = None, log_path: Path | None = None, **kwargs: Any) -> Any:
    """fn(*args, **kwargs) in a fresh child process of its own; its result."""
    with EngineProcess(env, log_path, name=getattr(fn, "__name__", "call")) as child:
        return child.call(fn, *args, timeout=timeout, **kwargs)


def _locate(fn: Callable[..., Any]) -> tuple[str, str | None, str]:
    """(module name, the module's file, qualified name): enough for the child to import it."""
    module = sys.modules[fn.__module__]
    return fn.__module__, getattr(module, "__file__", None), fn.__qualname__


def _resolve(module_name: str, path: str | None, qualname: str) -> Callable[..., Any]:
    if path is not None:
        file = Path(path).resolve()
        if module_name == "__main__":  # a script: importable by its stem from its own folder
            module_name, root = file.stem, file.parent
        else:  # a.b.c in ROOT/a/b/c.py: ROOT on the path
            root = file.parents[module_name.count(".")]
        if str(root) not in sys.path:
            sys.path.insert(0, str(root))
    target: Any = importlib.import_module(module_name)
    for part in qualname.split("."):
        target = getattr(target, part)
    return target


def serve(reply_fd: int) -> None:
    """The child: run each request read from stdin, answer on `reply_fd`, until stdin closes."""
    requests = sys.stdin.buffer
    with os.fdopen(reply_fd, "wb") as replies:
        while header := requests.read(_HEADER.size):
            (target, args, kwargs) = pickle.loads(requests.read(_HEADER.unpack(header)[0]))
            try:
                reply = (True, _resolve(*target)(*args, **kwargs))
            except BaseException:  # noqa: BLE001 (the parent raises it, with this traceback)
                reply = (False, traceback.format_exc())
            data = pickle.dumps(reply)
            replies.write(_HEADER.pack(len(data)) + data)
            replies.flush()
