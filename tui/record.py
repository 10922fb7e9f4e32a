"""Record and replay `top` sessions as JSONL, for post-mortems and deterministic tests.

Format (one JSON object per line, UTF-8):
  line 1  {"format": "proxima-top-recording", "version": 1, "urls": [...], "interval_s": 0.5,
           "started_at": <unix time>}
  line n  {"t": <unix time>, "servers": [<ServerSnapshot>...], "gpus": null | [<GpuSnapshot>...]}
A snapshot is its dataclass fields as a JSON object (nested dataclasses likewise, tuples as
lists); non-finite floats are the strings "+Inf", "-Inf", "NaN" so that the file stays strict
JSON (a histogram's last bucket bound is +Inf). `servers[i]` belongs to `urls[i]`.

Writing is incremental: each frame is one `write` of a whole line, then a flush, so a recording
is useful up to the moment the monitor (or the machine) died. For the same reason the loader
forgives one thing: a last line without its newline that does not parse (the write the crash
interrupted) is dropped and reported. Anything else malformed is an error naming the line.

The loader rebuilds the frozen dataclasses from their field annotations (`typing.get_type_hints`),
so a field added to a snapshot is recorded and replayed without a change here; unknown keys (a
newer writer) are ignored.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import math
import os
import types
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO, Union, get_args, get_origin, get_type_hints

from proxima.gpu import GpuSnapshot
from proxima.scrape import ServerSnapshot
from proxima.tui.model import Frame

FORMAT = "proxima-top-recording"
VERSION = 1
_NON_FINITE = {"+Inf": math.inf, "-Inf": -math.inf, "NaN": math.nan}


class RecordingError(Exception):
    """A recording cannot be written or read; the message names the file and line."""


@dataclass(frozen=True, slots=True)
class Recording:
    path: str
    urls: tuple[str, ...]
    interval_s: float
    started_at: float
    frames: tuple[Frame, ...]
    truncated_last_line: bool = False


# ---------------------------------------------------------------- writing

def _encode(value: Any) -> Any:
    if dataclasses.is_dataclass(value):
        return {f.name: _encode(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, (tuple, list)):
        return [_encode(v) for v in value]
    if isinstance(value, dict):
        return {str(k): _encode(v) for k, v in value.items()}
    if isinstance(value, float) and not math.isfinite(value):
        return "NaN" if math.isnan(value) else ("+Inf" if value > 0 else "-Inf")
    return value


def frame_to_line(frame: Frame) -> str:
    payload = {"t": frame.taken_at, "servers": _encode(frame.servers),
               "gpus": None if frame.gpus is None else _encode(frame.gpus)}
    return json.dumps(payload, separators=(",", ":"), allow_nan=False) + "\n"


class Recorder:
    """Appends frames to a JSONL file as they are collected (opened at once: a bad path fails early)."""

    def __init__(self, path: str | os.PathLike, urls: tuple[str, ...], interval_s: float,
                 started_at: float) -> None:
        self.path = str(path)
        self.frames_written = 0
        try:
            # Held open for the whole session on purpose: one flushed line per frame. "x": an
            # existing file (yesterday's post-mortem, perhaps) is never truncated.
            self._fh: TextIO | None = open(path, "x", encoding="utf-8")  # noqa: SIM115
        except FileExistsError:
            if Path(path).is_dir():
                raise RecordingError(f"cannot write recording {self.path}: it is a directory; "
                                     "choose a writable file path") from None
            raise RecordingError(f"recording {self.path} already exists; choose a new file name "
                                 "(or remove the old recording first)") from None
        except OSError as err:
            raise RecordingError(f"cannot write recording {self.path}: {err.strerror or err}; "
                                 "choose a writable file path") from None
        header = {"format": FORMAT, "version": VERSION, "urls": list(urls), "interval_s": interval_s,
                  "started_at": started_at}
        self._write(json.dumps(header) + "\n")

    def _write(self, line: str) -> None:
        if self._fh is None:
            raise RecordingError(f"recording {self.path} is closed")
        try:
            self._fh.write(line)
            self._fh.flush()
        except OSError as err:
            self.close()
            raise RecordingError(f"writing {self.path} failed: {err.strerror or err}") from None

    def write(self, frame: Frame) -> None:
        self._write(frame_to_line(frame))
        self.frames_written += 1

    def close(self) -> None:
        if self._fh is not None:
            # Every frame was flushed when written; a failing close cannot lose more than that.
            with contextlib.suppress(OSError):
                self._fh.close()
            self._fh = None


# ---------------------------------------------------------------- reading

class _Bad(ValueError):
    """A value does not fit its field; carries the field path for the error message."""


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _type_name(ann: Any) -> str:
    return ann.__name__ if isinstance(ann, type) and not get_args(ann) else str(ann)


def _decode(ann: Any, value: Any, where: str) -> Any:
    """`value` as the annotated type `ann` (resolved by `typing.get_type_hints`), or _Bad naming
    the field; the JSON side is only what `_encode` writes."""
    if get_origin(ann) in (Union, types.UnionType):
        options = get_args(ann)
        if value is None and type(None) in options:
            return None
        (ann,) = [o for o in options if o is not type(None)]
    origin, args = get_origin(ann), get_args(ann)
    if ann is float:
        if isinstance(value, str) and value in _NON_FINITE:
            return _NON_FINITE[value]
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            try:
                return float(value)
            except OverflowError:
                raise _Bad(f"{where}: number too large ({len(str(value))} digits)") from None
        raise _Bad(f"{where}: expected a number, got {_short(value)}")
    if ann is int:
        if isinstance(value, int) and not isinstance(value, bool):
            if abs(value) >= 1 << 63:
                raise _Bad(f"{where}: integer too large ({len(str(value))} digits)")
            return value
        if isinstance(value, float) and value.is_integer():
            return int(value)
        raise _Bad(f"{where}: expected an integer, got {_short(value)}")
    if ann in (str, bool):
        if type(value) is not ann:
            wanted = "a string" if ann is str else "true/false"
            raise _Bad(f"{where}: expected {wanted}, got {_short(value)}")
        return value
    if isinstance(ann, type) and dataclasses.is_dataclass(ann):
        return build(ann, value, where)
    if origin is tuple:
        if not isinstance(value, list):
            raise _Bad(f"{where}: expected a list, got {_short(value)}")
        if len(args) == 2 and args[1] is Ellipsis:
            return tuple(_decode(args[0], v, f"{where}[{k}]") for k, v in enumerate(value))
        if len(value) != len(args):
            raise _Bad(f"{where}: expected {len(args)} items, got {len(value)}")
        return tuple(_decode(a, v, f"{where}[{k}]") for k, (a, v) in enumerate(zip(args, value)))
    if origin is dict and args[:1] == (str,):
        if not isinstance(value, dict):
            raise _Bad(f"{where}: expected an object, got {_short(value)}")
        return {k: _decode(args[1], v, f"{where}.{k}") for k, v in value.items()}
    raise _Bad(f"{where}: this version cannot read a field of type {_type_name(ann)}")


@functools.cache
def _field_types(cls: type) -> dict[str, Any]:
    """A snapshot class's field annotations as types (they are strings under PEP 563)."""
    return get_type_hints(cls)


def build(cls: type, data: Any, where: str = "") -> Any:
    """Rebuild frozen dataclass `cls` from its JSON object (missing fields take their defaults)."""
    if not isinstance(data, dict):
        raise _Bad(f"{where or cls.__name__}: expected an object, got {_short(data)}")
    kwargs = {}
    for f in dataclasses.fields(cls):
        path = f"{where}.{f.name}" if where else f.name
        if f.name not in data:
            if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
                raise _Bad(f"{path}: missing")
            continue
        kwargs[f.name] = _decode(_field_types(cls)[f.name], data[f.name], path)
    return cls(**kwargs)


def _no_constant(name: str) -> Any:
    raise _Bad(f'{name} is not JSON (non-finite numbers are written as the strings "+Inf", "-Inf", "NaN")')


def _loads(text: str) -> Any:
    """Strict JSON: NaN/Infinity literals refused (the writer never emits them)."""
    return json.loads(text, parse_constant=_no_constant)


def _finite_time(value: Any, where: str) -> float:
    t = _decode(float, value, where)
    if not math.isfinite(t):
        raise _Bad(f"{where}: a time must be a finite number, got {value!r}")
    return t


def frame_from_line(text: str, num_servers: int) -> Frame:
    data = _loads(text)
    if not isinstance(data, dict) or "t" not in data or "servers" not in data:
        raise _Bad('expected a frame object with "t" and "servers"')
    servers = _decode(tuple[ServerSnapshot, ...], data["servers"], "servers")
    if len(servers) != num_servers:
        raise _Bad(f"servers: {len(servers)} snapshots, the header names {num_servers} URLs")
    gpus = _decode(tuple[GpuSnapshot, ...] | None, data.get("gpus"), "gpus")
    return Frame(_finite_time(data["t"], "t"), servers, gpus)


def load_recording(path: str | os.PathLike) -> Recording:
    """Read a whole recording; RecordingError names the file and line of the first problem."""
    name = str(path)
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as err:
        reason = err.strerror if isinstance(err, OSError) and err.strerror else str(err)
        raise RecordingError(f"cannot read recording {name}: {reason}") from None
    lines = text.split("\n")
    ends_cleanly = lines[-1] == ""
    if ends_cleanly:
        lines.pop()
    if not lines or not lines[0].strip():
        raise RecordingError(f"{name}, line 1: empty; not a proxima top recording (make one with --record)")
    try:
        header = _loads(lines[0])
    except (ValueError, RecursionError):  # not JSON, a NaN literal, or nested past the parser's limit
        header = None
    if not isinstance(header, dict) or header.get("format") != FORMAT:
        raise RecordingError(f"{name}, line 1: not a proxima top recording header "
                             f'(expected {{"format": "{FORMAT}", ...}}; make one with --record)')
    if header.get("version") != VERSION:
        raise RecordingError(f"{name}, line 1: recording version {header.get('version')!r}; "
                             f"this proxima reads version {VERSION}")
    urls = header.get("urls")
    if not isinstance(urls, list) or not urls or not all(isinstance(u, str) for u in urls):
        raise RecordingError(f'{name}, line 1: "urls" must be a non-empty list of strings')
    try:
        interval = _decode(float, header.get("interval_s", 0.5), "interval_s")
        started = _finite_time(header.get("started_at", 0.0), "started_at")
    except (_Bad, OverflowError) as err:
        raise RecordingError(f"{name}, line 1: {err}") from None
    frames: list[Frame] = []
    numbers: list[int] = []
    truncated = False
    for number, line in enumerate(lines[1:], start=2):
        if not line.strip():
            continue
        try:
            frames.append(frame_from_line(line, len(urls)))
            numbers.append(number)
        except json.JSONDecodeError as err:
            if number == len(lines) and not ends_cleanly:
                truncated = True  # the write an abrupt end interrupted; everything before it is sound
                break
            raise RecordingError(f"{name}, line {number}: not valid JSON ({err.msg})") from None
        except _Bad as err:
            raise RecordingError(f"{name}, line {number}: {err}") from None
        except RecursionError:
            raise RecordingError(f"{name}, line {number}: nested too deeply to be a frame") from None
        except (TypeError, ValueError, OverflowError) as err:
            # A dataclass refusing the rebuilt arguments, a number too large for a float, ...
            raise RecordingError(f"{name}, line {number}: {type(err).__name__}: {err}") from None
    for k in range(1, len(frames)):
        if frames[k].taken_at < frames[k - 1].taken_at:
            raise RecordingError(f"{name}, line {numbers[k]}: time goes backwards (frames must be in order)")
    return Recording(name, tuple(urls), interval if interval > 0 else 0.5, started, tuple(frames), truncated)
