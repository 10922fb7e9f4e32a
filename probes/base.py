"""The probe contract: what a check receives (`ProbeContext`) and what it returns (`ProbeResult`).

Layer: probes (between the scrape/GPU collectors and the `doctor` command, which only renders).
A probe is a module with `async def run(ctx: ProbeContext) -> ProbeResult`. Invariants:
  - server metrics come only from `proxima.scrape` snapshots; GPU readings only from
    `proxima.gpu.read_gpus()`;
  - traffic goes only to `ctx.url` and `ctx.compare_url`, through `ctx.load`, and every load a
    probe starts is cancelled before `run` returns;
  - a server's condition is a verdict, never an exception: `run` raises only on a bug, and the
    runner turns that into status "error".
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import TYPE_CHECKING

import httpx

if TYPE_CHECKING:
    from proxima.probes.load import LoadDriver

    from proxima.scrape import ServerSnapshot

Evidence = dict[str, float | int | str | None]


class Status(str, Enum):
    OK = "ok"
    WARN = "warn"
    FAIL = "fail"
    SKIP = "skip"
    ERROR = "error"


@dataclass(frozen=True, slots=True)
class ProbeResult:
    check: str
    status: Status
    summary: str
    evidence: Evidence = field(default_factory=dict)
    runbook: str | None = None
    advice: tuple[str, ...] = ()

    def to_dict(self) -> dict:
        return {
            "check": self.check,
            "status": self.status.value,
            "summary": self.summary,
            "evidence": dict(self.evidence),
            "runbook": self.runbook,
            "advice": list(self.advice),
        }

    @classmethod
    def from_dict(cls, data: dict) -> ProbeResult:
        return cls(data["check"], Status(data["status"]), data["summary"], dict(data.get("evidence") or {}),
                   data.get("runbook"), tuple(data.get("advice") or ()))


@dataclass(frozen=True, slots=True)
class DoctorOptions:
    """What the operator may tell the doctor that the server does not expose."""

    window_s: float = 10.0
    compare_url: str | None = None
    typical_tokens: int | None = None  # prompt + generation tokens of a typical request
    max_num_seqs: int | None = None  # not in /metrics: vLLM does not export its scheduler config


@dataclass(slots=True)
class ProbeContext:
    url: str
    client: httpx.AsyncClient
    options: DoctorOptions
    load: LoadDriver
    # The server as the doctor found it, before any probe sent traffic: the user's own history.
    baseline: ServerSnapshot | None = None
    model: str | None = None
    max_model_len: int | None = None
    server_error: str | None = None  # set when the server could not be reached at all
    server_pid: int | None = None  # local process listening on the URL's port, when there is one

    @property
    def window_s(self) -> float:
        return self.options.window_s

    @property
    def compare_url(self) -> str | None:
        return self.options.compare_url

    @property
    def sample_interval_s(self) -> float:
        # ~20 samples per window, but at most 4 scrapes a second: a scrape costs the server ~30 ms.
        return min(2.0, max(0.25, self.window_s / 20))


def fmt_bytes(n: float | None) -> str:
    if n is None:
        return "N/A"
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


def pct(x: float | None) -> str:
    return "N/A" if x is None else f"{100 * x:.1f}%"
