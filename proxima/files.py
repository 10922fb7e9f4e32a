"""Files the project writes (results, workloads, charts, models, logs): whole or not at all, and
never through a link someone planted.

Layer: below everything that writes (bench, the tiny model, scripts); imports nothing of Proxima.
Every file is written to a fresh temporary file that `tempfile.mkstemp` creates in the target's
own directory (O_CREAT|O_EXCL with a random name: nothing planted in advance can be followed,
and two writers into one directory never share it), then moved over the target with
`os.replace`, which replaces a symlink standing at the target itself, never the file it points
to. A failed write removes its temporary file and leaves the target as it was. Appended files
(server logs) are opened with O_NOFOLLOW.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import IO

_umask_lock = threading.Lock()


def _umask() -> int:
    """The process's umask, read without changing it where Linux allows (/proc), else by the
    set-and-restore dance under a lock."""
    with contextlib.suppress(OSError, ValueError):
        with open("/proc/self/status", encoding="ascii") as status:
            for line in status:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    with _umask_lock:
        mask = os.umask(0o022)
        os.umask(mask)
    return mask


@contextlib.contextmanager
def atomic_output(path: str | os.PathLike, mode: str = "w") -> Iterator[IO]:
    """A file object (`mode` "w" text, UTF-8, or "wb") whose contents replace `path` when the
    block ends without an exception; see the module docstring."""
    if mode not in ("w", "wb"):
        raise ValueError(f"atomic_output writes whole files: mode 'w' or 'wb', not {mode!r}")
    target = Path(path)
    fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.", suffix=".tmp")
    try:
        # mkstemp makes the file 0600; a result file gets the permissions open() would give it.
        os.fchmod(fd, 0o666 & ~_umask())
        with os.fdopen(fd, mode, **({} if "b" in mode else {"encoding": "utf-8"})) as f:
            fd = -1  # owned by the file object from here
            yield f
        os.replace(tmp, target)
    except BaseException:
        if fd >= 0:
            os.close(fd)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


def write_atomic(path: str | os.PathLike, data: str | bytes) -> None:
    """`data` as the whole new contents of `path` (text as UTF-8)."""
    with atomic_output(path, "wb" if isinstance(data, bytes) else "w") as f:
        f.write(data)


def open_append(path: str | os.PathLike) -> IO[bytes]:
    """`path` opened to append bytes, created if missing; a symlink there is refused (ELOOP), not
    followed."""
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o666)
    return os.fdopen(fd, "ab")
